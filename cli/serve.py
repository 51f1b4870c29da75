"""`e3` verbs that run or call a server: serve, infer, demo, perf, load."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from pathlib import Path

from e3.core.names import router_name, served_name, zoo_name_of
from e3.paths import default_repository

# Deferred imports: `e3 --help` and the light verbs must start fast, without torch, numpy, subprocess or the serving
# and client rooms, so each verb imports what it needs inside its function.


def _api_key() -> dict[str, str] | None:
    """The user's key header: E3_API_HEADER with E3_API_KEY_FILE (a file only its owner reads; nothing in any
    process's environment then) or E3_API_KEY (in e3 serve's own environment, which only its user and root
    read; Triton's environment never gets it)."""
    from e3.controller.triton_api import api_key_headers
    name, path = os.environ.get("E3_API_HEADER"), os.environ.get("E3_API_KEY_FILE")
    if name and path:
        key = Path(path).read_text().strip()
        if not key:
            raise SystemExit(f"e3 serve: E3_API_KEY_FILE {path} is empty; write the key in it")
        return {name: key}
    return api_key_headers()


def _serve(args) -> int:
    from e3.deploy.serve import guard_until_stopped, serve_until_stopped
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    if args.guard_only:
        if not (args.triton_http and args.triton_grpc):
            raise SystemExit("e3 serve: --guard-only needs --triton-http and --triton-grpc (unix:/path of Triton's "
                             "endpoints)")
        return guard_until_stopped(args.triton_http, args.triton_grpc, stop, host=args.host,
                                   http_port=args.http_port, grpc_port=args.grpc_port, headers=_api_key(),
                                   echo=lambda text: print(text, flush=True))
    return serve_until_stopped(
        args.repo, args.models.split(",") if args.models else None, stop, host=args.host, http_port=args.http_port,
        grpc_port=args.grpc_port, metrics_port=args.metrics_port, tritonserver=args.tritonserver,
        timeout_s=args.timeout, headers=_api_key(), guarded=not args.no_guard, restart=not args.no_restart,
        echo=lambda text: print(text, flush=True), complain=lambda text: print(text, file=sys.stderr))


def _infer(args) -> int:
    from e3.client.sdk import E3Client
    from e3.models.zoo import resolve_model
    model = resolve_model(args.model)
    target = args.target or router_name(served_name(args.model))
    inputs = model.example_arrays(args.n, seed=args.seed)
    with E3Client(args.url, args.protocol) as client:
        print(f"{'input':>5}  {'label':>5}  {'exit ramp':>9}  {'p(label)':>8}  {'latency ms':>10}")
        for i in range(args.n):
            start = time.perf_counter()
            answers = client.infer(target, {k: v[i:i + 1] for k, v in inputs.items()})
            ms = (time.perf_counter() - start) * 1e3
            label = int(answers.label[0])
            print(f"{i:>5}  {label:>5}  {int(answers.exit_ramp[0]):>9}  {answers.probs[0, label]:>8.3f}  {ms:>10.2f}")
    return 0


def _demo(args) -> int:
    from e3.cli.demo import DemoSettings, run_demo
    run_demo(Path(args.repo), DemoSettings(model=args.model, cuts=args.cuts, requests=args.requests,
                                           concurrency=args.concurrency, batch=args.batch, protocol=args.protocol,
                                           cores=args.cores))
    return 0


def _perf(args) -> int:
    import subprocess
    from e3.deploy.tools import perf_analyzer_binary, tool_env
    extra = args.args[1:] if args.args[:1] == ["--"] else args.args
    return subprocess.call([perf_analyzer_binary(), *extra], env=tool_env())


def _load(args) -> int:
    from e3.client.loadgen import closed_loop, open_loop, replay_workload
    from e3.client.report import exit_comparison, format_table
    common = dict(batch=args.batch, slo_ms=args.slo_ms, protocol=args.protocol)
    if args.closed and args.rate_rps is not None:
        raise ValueError("--closed and --rate-rps exclude each other: a closed loop has no arrival rate")
    if args.workload and args.shm:
        raise ValueError("--shm is for generated inputs; a workload replay sends its inputs in the request body")
    if args.workload:
        result = replay_workload(args.url, args.model, args.workload, rate_rps=args.rate_rps,
                                 concurrency=args.concurrency if args.closed else None, seed=args.seed,
                                 workers=args.workers, **common)
    else:
        from e3.models.zoo import ZOO, resolve_model
        zoo = args.inputs_from or zoo_name_of(args.model, ZOO)
        model = resolve_model(zoo)
        pool = model.example_arrays(args.pool, seed=args.seed)
        if args.closed:
            result = closed_loop(args.url, args.model, pool, concurrency=args.concurrency, requests=args.requests,
                                 warmup=1, shm=args.shm, **common)
        else:
            if args.rate_rps is None:
                raise ValueError("give --rate-rps R (open loop, Poisson) or --closed --concurrency N")
            result = open_loop(args.url, args.model, pool, rate_rps=args.rate_rps, duration_s=args.duration_s,
                               seed=args.seed, workers=args.workers, shm=args.shm, **common)
    kind = (f"closed loop, {args.concurrency} clients" if args.closed else
            f"open loop, Poisson {result.offered_rps:g} requests/s, {args.workers} workers")
    print(f"{args.model}: {kind}, {args.batch} input(s) per request"
          + (f", SLO {args.slo_ms:g} ms" if args.slo_ms is not None else "")
          + (f", workload {args.workload}" if args.workload else ""))
    print(format_table([result, *result.phases]))
    if result.labelled:
        print(exit_comparison(result))
    if not args.closed and result.max_send_lag_ms > 50:
        print(f"note: arrivals waited up to {result.max_send_lag_ms:.0f} ms for a free client worker "
              "(counted in latency); raise --workers if the client, not the server, is the limit")
    for message, count in result.error_messages.most_common(5):
        print(f"  {count} x {message}")
    return 1 if result.errors else 0


def add_serve(sub, repo_help: str) -> None:
    """`e3 serve`'s arguments."""
    from e3.deploy.server import DEFAULT_METRICS_PORT
    s = sub.add_parser("serve", help="run tritonserver on a repository until Ctrl-C (restarted if it dies, "
                                     "HTTP and gRPC behind guards); off loopback set E3_API_HEADER and "
                                     "E3_API_KEY_FILE (or E3_API_KEY)")
    s.add_argument("--repo", default=str(default_repository()), help=repo_help)
    s.add_argument("--models", default=None, help="comma-separated models to load (default: the current plan's "
                                                  "splits, router and baselines, from the repository manifest)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default loopback)")
    s.add_argument("--http-port", type=int, default=8000)
    s.add_argument("--grpc-port", type=int, default=8001)
    s.add_argument("--metrics-port", type=int, default=DEFAULT_METRICS_PORT)
    s.add_argument("--tritonserver", default=None,
                   help="tritonserver binary (default: $E3_TRITONSERVER, else the nvidia-pytriton wheel's)")
    s.add_argument("--timeout", type=float, default=180, help="seconds to wait for readiness (default 180)")
    s.add_argument("--no-guard", action="store_true",
                   help="serve Triton's HTTP and gRPC directly, without the guards that refuse malformed requests "
                        "before Triton parses them (docs/reliability.md)")
    s.add_argument("--guard-only", action="store_true",
                   help="run only the HTTP and gRPC guards in front of a tritonserver run elsewhere (the Helm "
                        "chart's guard container): --triton-http and --triton-grpc name its endpoints")
    s.add_argument("--triton-http", default=None, metavar="unix:PATH", help="--guard-only: Triton's HTTP endpoint")
    s.add_argument("--triton-grpc", default=None, metavar="unix:PATH", help="--guard-only: Triton's gRPC endpoint")
    s.add_argument("--no-restart", action="store_true",
                   help="stop when tritonserver dies instead of restarting it and restoring its models and plan")
    s.set_defaults(func=_serve)


def add_infer(sub, repo_help: str) -> None:
    """`e3 infer`'s arguments."""
    i = sub.add_parser("infer", help="send inputs to a served model; print prediction, exit ramp, latency")
    i.add_argument("model", help="zoo name or package.module:factory (for the inputs and the served name)")
    i.add_argument("--target", default=None, help="served model to call (default <m>_router; try <m>_ee, <m>_stock)")
    i.add_argument("-n", type=int, default=8, help="number of inputs, one request each (default 8)")
    i.add_argument("--seed", type=int, default=0)
    i.add_argument("--url", default="127.0.0.1:8000", help="server address (default 127.0.0.1:8000; gRPC: :8001)")
    i.add_argument("--protocol", choices=["http", "grpc"], default="http")
    i.set_defaults(func=_infer)


def add_demo(sub, repo_help: str) -> None:
    """`e3 demo`'s arguments."""
    d = sub.add_parser("demo", help="export, serve, load router and baselines side by side, print a table")
    d.add_argument("--model", default="bert-ee", help="zoo model (default bert-ee, trained on first use; "
                                                      "tiny-ee needs no training)")
    d.add_argument("--cuts", default=None, help="default: one cut in the middle")
    d.add_argument("--repo", default=str(default_repository()), help=repo_help)
    d.add_argument("--requests", type=int, default=300, help="requests per served model (default 300)")
    d.add_argument("--concurrency", type=int, default=8)
    d.add_argument("--batch", type=int, default=4, help="inputs per request (default 4)")
    d.add_argument("--protocol", choices=["http", "grpc"], default="http")
    d.add_argument("--cores", type=int, default=2,
                   help="compute cores every system gets, as instances x 1 thread (default 2, the machine's)")
    d.set_defaults(func=_demo)


def add_perf(sub, repo_help: str) -> None:
    """`e3 perf`'s arguments."""
    pa = sub.add_parser("perf", help="run Triton's perf_analyzer (from the client wheel) with its libraries "
                                     "found; arguments after -- go to perf_analyzer")
    pa.add_argument("args", nargs=argparse.REMAINDER, help="e.g. -- -m tiny_ee_router -b 4 --input-data zero")
    pa.set_defaults(func=_perf)


def add_load(sub, repo_help: str) -> None:
    """`e3 load`'s arguments."""
    lo = sub.add_parser("load", help="drive a served model: closed loop, open loop (Poisson) or a workload "
                                     "replay; print throughput, goodput under an SLO, p50/p99, errors")
    lo.add_argument("model", help="served model to call, e.g. tiny_ee_router, tiny_ee_ee, tiny_ee_stock")
    lo.add_argument("--url", default="127.0.0.1:8000", help="server address (default 127.0.0.1:8000; gRPC: :8001)")
    lo.add_argument("--protocol", choices=["http", "grpc"], default="http")
    lo.add_argument("--closed", action="store_true", help="closed loop: --concurrency clients back to back")
    lo.add_argument("--concurrency", type=int, default=8, help="closed loop: clients (default 8)")
    lo.add_argument("--requests", type=int, default=300, help="closed loop without --workload: requests (default 300)")
    lo.add_argument("--rate-rps", type=float, default=None,
                    help="open loop: Poisson arrivals, requests/s (with --workload: default its nominal rate)")
    lo.add_argument("--duration-s", type=float, default=10.0, help="open loop: seconds of arrivals (default 10)")
    lo.add_argument("--workers", type=int, default=32, help="open loop: client threads, the bound on requests "
                                                             "in flight (default 32)")
    lo.add_argument("--batch", type=int, default=1, help="inputs per request (default 1)")
    lo.add_argument("--slo-ms", type=float, default=None, help="latency objective per request: report goodput")
    lo.add_argument("--workload", default=None, metavar="FILE.npz",
                    help="replay this workload (e3 workload) once, in order; per-phase results for a stream")
    lo.add_argument("--inputs-from", default=None, metavar="MODEL",
                    help="zoo model whose example inputs to send (default: from the served name)")
    lo.add_argument("--pool", type=int, default=512, help="distinct example inputs cycled through (default 512)")
    lo.add_argument("--seed", type=int, default=0, help="seeds the inputs and the arrival schedule")
    lo.add_argument("--shm", action="store_true", help="inputs through Triton's system shared memory (a client on "
                                                       "the server's machine; numeric inputs, not with --workload)")
    lo.set_defaults(func=_load)
