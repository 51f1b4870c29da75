"""`e3` verbs of the control plane: control, status (`e3 plan` is in cli/models.py, beside the verbs that make its
inputs).

`e3 control` needs no checkpoint: the model's block count, ramps and exit rule come from the repository's
manifest, a plan, or the router's running plan (:mod:`e3.controller.model_facts`), and plans come from the
latency profile."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from pathlib import Path

from e3.core.names import served_name
from e3.paths import default_repository

# Deferred imports: `e3 --help` and the light verbs must start fast, without torch, numpy, urllib's HTTP stack or the
# controller's rooms, so each verb imports what it needs inside its function.


def _planning_args(p: argparse.ArgumentParser, rate_required: bool) -> None:
    """The planner's inputs, shared by `e3 plan` and `e3 control`."""
    p.add_argument("--latency-profile", "--profile", dest="latency_profile", required=True,
                   help="latency profile JSON (e3 profile); --profile is an old alias")
    p.add_argument("--devices", required=True,
                   help="devices per device configuration, CONFIG:COUNT,... e.g. cpu:2 or v100:6,t4:8,k80:15; "
                        "each device runs one instance of a split")
    p.add_argument("--slo-ms", type=float, required=True, help="latency objective per request (ms)")
    p.add_argument("--rate-rps", type=float, required=rate_required, default=None,
                   help="offered request rate R (inputs/s)")
    p.add_argument("--slack", type=float, default=0.2, help="share of the SLO kept in reserve (default 0.2)")
    p.add_argument("--alpha", type=_alpha, default=1.0,
                   help="cost <= alpha x the cheapest stock one-split plan reaching R (default 1.0; none: no bound)")


def _alpha(text: str) -> float | None:
    if text.lower() == "none":
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes a number or none, got {text!r}") from None


def _control(args) -> int:
    from e3.controller.applier import ControlError
    from e3.controller.forecast import make_forecaster
    from e3.controller.loop import Controller, ProfilePlanner
    from e3.controller.planner import parse_devices
    from e3.controller.report import describe_report
    from e3.controller.settings import ControlSettings
    from e3.controller.telemetry import TelemetryReader
    from e3.controller.triton_applier import TritonApplier
    from e3.core.plan import Plan
    from e3.core.profile import LatencyProfile, ProfileError
    from e3.deploy.server import metrics_url_for
    m = served_name(args.model)
    try:
        latency = LatencyProfile.load(args.latency_profile)
    except (OSError, ProfileError) as err:
        print(f"e3 control: error: latency profile {args.latency_profile}: {err}", file=sys.stderr)
        return 2
    pinned = Plan.from_json(Path(args.pin).read_text()) if args.pin else None
    settings = ControlSettings(model=m, devices=parse_devices(args.devices), slo_ms=args.slo_ms,
                               rate_rps=args.rate_rps, slack=args.slack, window_s=args.window_s, margin=args.margin,
                               drift_threshold=args.drift, straggler_factor=args.straggler_factor or None,
                               dry_run=args.dry_run, follow_traffic=args.follow_traffic,
                               state_dir=Path(args.state_dir) if args.state_dir else None)
    if args.kubernetes and not args.pools:
        print("e3 control: error: --kubernetes scales pools: give --pools POOLS.json too", file=sys.stderr)
        return 2
    metrics_url = args.metrics_url or metrics_url_for(args.url)
    # --repo "": the repository is not visible here (e.g. written inside each Triton pod); Triton's load decides
    applier = TritonApplier(args.url, metrics_url=metrics_url, repo=Path(args.repo) if args.repo else None,
                            zoo_model=args.model)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    metrics = None
    try:
        # The model's facts come from the repository's card or a plan, never from its checkpoint.
        facts = _model_facts(args, latency, applier, settings.router, stop)
        if facts is None:
            return 0   # stopped while waiting for the router
        planner = ProfilePlanner(latency, exit_rule=facts.exit_rule, ramp_blocks=facts.ramp_blocks,
                                 slo_ms=args.slo_ms, rate_rps=args.rate_rps, slack=args.slack, alpha=args.alpha)
        pools = None
        if args.pools:   # several Triton servers (pools): plans placed on them, pods scaled on Kubernetes
            applier, planner, pinned, pools = _pooled(args, applier, planner, pinned)
        if args.metrics_port is not None:
            from e3.controller.metrics import ControllerMetrics
            from e3.controller.pooled_applier import POD_READY_TIMEOUT_S
            # liveness waits out an apply's wait for new pods (Kubernetes) before it calls the loop wedged
            metrics = ControllerMetrics(pools=pools, window_s=args.window_s,
                                        pod_wait_s=POD_READY_TIMEOUT_S if args.kubernetes else 0.0)
            port = metrics.serve(args.metrics_port)
            print(f"controller metrics and probes on port {port} (/metrics, /healthz, /readyz)", flush=True)
        controller = Controller(settings, telemetry=TelemetryReader(metrics_url, m, window_s=args.window_s,
                                                                    num_blocks=facts.num_blocks),
                                forecaster=make_forecaster(args.forecaster), planner=planner, view=applier,
                                control=None if args.dry_run else applier, pinned=pinned)

        def report(rep) -> None:
            print(describe_report(rep), flush=True)
            if metrics is not None:
                metrics.observe(rep, controller.wanted_plan)
        controller.on_report = report
        running = applier.current_plan(settings.router)
        controller.plan_in_force = running
        print(f"controlling {settings.router} at {args.url} (metrics {metrics_url}), window {args.window_s:g} s"
              + (", DRY RUN" if args.dry_run else "") + (f", pinned to {pinned.plan_id}" if pinned else "")
              + f"; running plan {running.plan_id if running else 'none'}; model facts from {facts.source}"
              + (f"; following traffic, at least {args.rate_rps:g} inputs/s" if args.follow_traffic else ""),
              flush=True)
        if metrics is not None:
            metrics.started(running)
        controller.run(stop, max_windows=1 if args.once else None)
    except ControlError as err:
        print(f"e3 control: error: {err}", file=sys.stderr)
        return 2
    except ValueError as err:   # the model's facts: what is missing or inconsistent, and what to give
        print(f"e3 control: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:   # urllib's URLError too: an address with nothing listening, a wrong port
        print(f"e3 control: error: cannot reach the server ({err}); Triton at {args.url}, its metrics at "
              f"{metrics_url} (give --metrics-url if they are elsewhere)", file=sys.stderr)
        return 2
    finally:
        applier.close()
        if metrics is not None:
            metrics.close()
    return 0


# How often a controller started before its router retries reading the router's plan (s).
ROUTER_WAIT_POLL_S = 5.0


def _model_facts(args, latency, applier, router: str, stop: threading.Event):
    """The served model's block count, ramps and exit rule (:func:`e3.controller.model_facts.model_facts`):
    from the repository's manifest, else ``--plan``, else the router's running plan. Without ``--once`` a
    controller started before its router waits for it (a pod started beside Triton); None if stopped."""
    from e3.controller.model_facts import model_facts
    from e3.core.manifest import read_manifest
    from e3.core.plan import Plan
    if args.repo:
        deployment = read_manifest(args.repo).get("deployments", {}).get(served_name(args.model))
        if deployment and deployment.get("card"):
            return model_facts(latency, card=deployment["card"])
    if args.plan:
        return model_facts(latency, plan=Plan.from_json(Path(args.plan).read_text()), plan_source=args.plan)
    waited = False
    while True:
        try:
            running = applier.current_plan(router)
        except OSError:
            running = None
        if running is None and args.once:
            _check_live(args.url)   # OSError (the caller says "cannot reach") before "no plan"
        if running is not None or args.once:
            return model_facts(latency, plan=running, plan_source=f"{router}'s running plan")
        if not waited:
            print(f"waiting for {router} at {args.url} to serve a plan (its exit rule is the controller's; or give "
                  "--plan / --repo)", flush=True)
            waited = True
        if stop.wait(ROUTER_WAIT_POLL_S):
            return None


def _check_live(url: str) -> None:
    """Raise OSError when Triton's HTTP endpoint at ``url`` does not answer its liveness route."""
    import urllib.request
    base = url if "://" in url else f"http://{url}"
    with urllib.request.urlopen(f"{base}/v2/health/live", timeout=10):
        pass


def _pooled(args, router_applier, planner, pinned):
    """The controller's applier, planner, pinned plan and pools over the pools of ``--pools``."""
    from e3.controller.planner.placement import place
    from e3.controller.pooled_applier import PlacingPlanner, PooledApplier
    from e3.controller.triton_applier import TritonApplier
    from e3.deploy.pools import PoolError, load_pools
    from e3.deploy.server import metrics_url_for
    try:
        pools = load_pools(args.pools)
        pinned = place(pinned, pools) if pinned is not None else None
    except PoolError as err:
        raise SystemExit(f"e3 control: error: {err}") from None
    scaler = None
    if args.kubernetes:
        from e3.controller.k8s_scaler import AutoscaledPools, KubernetesScaler
        scaler = (AutoscaledPools if args.replicas_owner == "autoscaler" else KubernetesScaler)(pools)
    router_applier.gpus = pools.router.gpus_per_pod
    servers = {p.grpc_url: TritonApplier(p.http_url, metrics_url=p.metrics_url or metrics_url_for(p.http_url),
                                         gpus=p.gpus_per_pod)
               for p in pools.pools if not p.router}
    applier = PooledApplier(f"{served_name(args.model)}_router", router_applier, servers, pools=pools, scaler=scaler)
    return applier, PlacingPlanner(planner, pools), pinned, pools


def _controller_status(url: str, timeout_s: float = 5.0) -> dict | None:
    """The controller's ``/status`` at ``url`` (its --metrics-port), or None where something else answers
    (a Triton server, the guard): what decides which kind of address ``e3 status --url`` was given."""
    import urllib.error
    import urllib.request
    from e3.controller.metrics import STATUS_KIND
    base = url if "://" in url else f"http://{url}"
    try:
        with urllib.request.urlopen(f"{base.rstrip('/')}/status", timeout=timeout_s) as resp:
            status = json.loads(resp.read())
    except urllib.error.HTTPError:
        return None   # Triton and the guard know no /status
    except ValueError:
        return None   # not JSON: not a controller
    return status if isinstance(status, dict) and status.get("kind") == STATUS_KIND else None


def _status(args) -> int:
    from e3.controller.report import controller_status_lines, status_lines
    from e3.controller.triton_applier import TritonApplier
    try:
        status = _controller_status(args.url)
    except OSError as err:   # nothing listening: say where, whichever kind of address it was meant to be
        print(f"e3 status: error: cannot reach {args.url} ({err})", file=sys.stderr)
        return 2
    if status is not None:
        for line in controller_status_lines(status, args.url):
            print(line)
        return 0
    if not args.model:
        print(f"e3 status: error: {args.url} is a Triton server, not a controller: give --model too",
              file=sys.stderr)
        return 2
    applier = TritonApplier(args.url)
    try:
        for line in status_lines(applier, served_name(args.model), args.state_dir, history_entries=args.history):
            print(line)
    finally:
        applier.close()
    return 0


def add_control(sub, repo_help: str) -> None:
    """`e3 control`'s arguments."""
    ct = sub.add_parser("control", help="every window: router telemetry -> forecast -> plan -> apply to the "
                                        "running Triton (load splits, instances, router switch, unload)")
    ct.add_argument("--model", required=True, help="zoo name of the served model, e.g. tiny-ee")
    _planning_args(ct, rate_required=True)
    ct.add_argument("--window-s", type=float, default=120.0, help="seconds per window (default 120, E3's)")
    ct.add_argument("--margin", type=float, default=0.10,
                    help="apply when the new plan's predicted throughput beats the running one by this share "
                         "(default 0.10)")
    ct.add_argument("--drift", type=float, default=0.2,
                    help="|forecast - observed| reach share that counts as drift and forces a re-plan (default 0.2)")
    ct.add_argument("--straggler-factor", type=float, default=2.0,
                    help="a split measured this many times slower than its latency profile is a straggler (default 2; "
                         "0 turns the check off)")
    ct.add_argument("--forecaster", choices=["arima", "last"], default="arima",
                    help="how the next window's batch profile is forecast (default arima, E3's)")
    ct.add_argument("--url", default="127.0.0.1:8000", help="Triton HTTP address (default 127.0.0.1:8000)")
    ct.add_argument("--metrics-url", default=None,
                    help="Triton metrics address (default: the --url host, Triton's default metrics port)")
    ct.add_argument("--repo", default=str(default_repository()),
                    help="model repository, to export split models that are missing (default ./model_repository; "
                         "\"\": none visible here, as in a cluster whose Triton pods export their own)")
    ct.add_argument("--dry-run", action="store_true", help="print the plan and the diff vs the running plan; "
                                                           "apply nothing")
    ct.add_argument("--pin", default=None, metavar="PLAN.json",
                    help="hold this plan (applied once if another runs); the controller then only watches")
    ct.add_argument("--once", action="store_true", help="one window, then exit")
    ct.add_argument("--pools", default=None, metavar="POOLS.json",
                    help="serve over several Triton servers (pools): the Helm chart's pools.json; --url is the "
                         "router's pool (docs/kubernetes.md)")
    ct.add_argument("--kubernetes", action="store_true",
                    help="with --pools: scale the pools' Deployments through the Kubernetes API when a plan "
                         "needs more pods (in-cluster service account, else the local kubeconfig)")
    ct.add_argument("--replicas-owner", choices=["controller", "autoscaler"], default="controller",
                    help="with --kubernetes: who sets the pools' spec.replicas: the controller (patches the scale, "
                         "default) or an autoscaler (HPA/KEDA on e3_controller_desired_replicas; the controller "
                         "only publishes the signal and waits for the pods)")
    ct.add_argument("--plan", default=None, metavar="PLAN.json",
                    help="where the model's exit rule and block count come from when the repository is not "
                         "visible (--repo \"\"): the plan the repository was exported with (default: the router's "
                         "running plan); the controller never needs the model's checkpoint")
    ct.add_argument("--follow-traffic", action="store_true",
                    help="plan every window for the observed rate (inputs taken + dropped per second), with "
                         "--rate-rps as the floor (default: always for --rate-rps)")
    ct.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                    help="serve the controller's Prometheus metrics (e3_controller_desired_replicas, "
                         "e3_controller_dropped_rate, ...) and its probes (/healthz, /readyz) on PORT")
    ct.add_argument("--state-dir", default=None,
                    help="the controller's history and state files (default artifacts/controller; "
                         "E3_ARTIFACTS moves artifacts)")
    ct.set_defaults(func=_control)


def add_status(sub, repo_help: str) -> None:
    """`e3 status`'s arguments."""
    st = sub.add_parser("status", help="live plan, loaded splits and instances, forecast vs observed, plan history")
    st.add_argument("--model", default=None, help="zoo name of the served model, e.g. tiny-ee (needed with a "
                                                    "Triton address)")
    st.add_argument("--url", default="127.0.0.1:8000",
                    help="Triton HTTP address (default 127.0.0.1:8000), or a controller's --metrics-port address "
                         "(in a cluster: kubectl port-forward svc/<release>-e3-controller 9090), whose /status is "
                         "printed instead")
    st.add_argument("--state-dir", default=None, help="controller files (default artifacts/controller)")
    st.add_argument("--history", type=int, default=10, help="plan history entries to show (default 10)")
    st.set_defaults(func=_status)
