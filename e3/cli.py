"""The `e3` command line: one verb per job, no logic of its own.

    e3 export MODEL --cuts 2      write a Triton model repository (splits, router, baselines)
    e3 serve                      run tritonserver on that repository until Ctrl-C
    e3 infer MODEL                send a few inputs, print prediction, exit ramp, latency
    e3 profile MODEL              measure (or --modelled GPU: model) per-block latency and Tx
    e3 train MODEL                train a zoo model (checkpoints under artifacts/)
    e3 evaluate MODEL             accuracy/exits vs threshold, compute saved vs stock (table + PNG)
    e3 workload MODEL             easy/hard workload mixes and a switching stream
    e3 plan                       plan cuts, instances, devices, input batch (E3's DP) under an SLO
    e3 demo                       export + serve + side-by-side load + table
    e3 bench side-by-side         E3 vs <m>_stock and <m>_ee at equal cores, per mix and request size
    e3 bench simulator            the discrete-event simulator against the side-by-side's real runs
    e3 bench gpu                  GPU clusters by simulation (MODELLED profiles): goodput vs batch, cost
    e3 bench admission            E²bird's elastic admission vs Triton's dynamic batcher under a QoS target
    e3 bench generate             early-exit generation (SmolLM2): speed and quality vs the full model
    e3 export-generate MODEL      write a generation model's splits and routers into the model repository
    e3 export-helios MODELS...    HELIOS over early-exit LLM candidates: their splits and helios_generate
    e3 bench helios               HELIOS against each candidate alone, under one memory budget
    e3 plan-generate [MODEL]      ExeGPT: profile the decoder, schedule under latency bounds (B&B vs grid)
    e3 bench exegpt               ExeGPT's RRA/WAA on Triton: the schedule per latency bound, vs static and continuous
    e3 admission MODEL --qos-ms Q add an elastic admission stage (N-Ebird / E-Ebird) in front of MODEL
    e3 load SERVED_MODEL          closed/open-loop load or a workload replay; goodput under an SLO
    e3 control --model M ...      every window: telemetry -> forecast -> plan -> apply to a running Triton
    e3 status --model M           live plan, loaded splits, forecast vs observed, plan history
    e3 perf -- -m MODEL ...       run perf_analyzer with its libraries found
    e3 models                     list the model zoo
    e3 clean                      remove generated artifacts
"""

from __future__ import annotations

import argparse
import logging
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

from e3.paths import artifacts_dir, default_repository

__all__ = ["main"]


def _export(args) -> int:
    from e3.core.names import ee_name, router_name, stock_name
    from e3.core.plan import Plan
    from e3.export.repository import ExportSettings, all_ranges, export_repository
    from e3.export.zoo import resolve_model
    plan = Plan.from_json(Path(args.plan).read_text()) if args.plan else None
    extra = all_ranges(resolve_model(args.model).card.num_blocks) if args.all_ranges else ()
    plan = export_repository(args.model, args.cuts, Path(args.repo), ExportSettings(
        target=args.target, batch_size=args.batch_size, split_instances=args.instances,
        router_instances=args.router_instances, format=args.format, fp16=args.fp16,
        split_queue_policy=args.split_queue_policy, max_queue_inputs=args.max_queue_inputs),
        plan=plan, extra_ranges=extra)
    if extra:
        print(f"pre-exported every block range ({len(extra)} split models) beside the plan's")
    print(f"exported {args.model} into {args.repo}:")
    for s in plan.splits:
        print(f"  {s.model:28s} blocks {s.first_block}-{s.last_block}  ramps {list(s.enabled_ramps) or '-'}  "
              f"batch {s.batch_size}  instances {s.instances}  {s.form}")
    m = plan.model
    door = f"{m} (text) -> {router_name(m)}" if (Path(args.repo) / m / "config.pbtxt").exists() else router_name(m)
    print(f"  front door {door}, baselines {stock_name(m)} and {ee_name(m)}; exit rule {plan.exit_rule}")
    return 0


def _serve(args) -> int:
    from e3.controller.triton_api import api_key_headers
    from e3.deploy.guard import Guard
    from e3.deploy.server import ServerError, TritonServer, free_port, port_taken
    from e3.deploy.supervisor import GaveUp, Supervisor
    models = args.models.split(",") if args.models else None
    headers = api_key_headers()
    if headers is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        raise ServerError(f"--host {args.host} makes the server reachable by others: set E3_API_HEADER and "
                          "E3_API_KEY so that model control, model configs and shared memory need the key")
    guarded = not args.no_guard
    if guarded and port_taken(args.host, args.http_port):
        raise ServerError(f"HTTP port {args.http_port} on {args.host} is already in use; "
                          "choose another with --http-port")
    server = TritonServer(args.repo, models, host=args.host, http_port=free_port() if guarded else args.http_port,
                          http_host="127.0.0.1" if guarded else None, grpc_port=args.grpc_port,
                          metrics_port=args.metrics_port, tritonserver=args.tritonserver, echo_logs=True,
                          api_key=next(iter(headers.items())) if headers else None)
    supervisor = Supervisor(server, headers=headers, start_timeout_s=args.timeout)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    server.start(timeout_s=args.timeout)
    guard = None
    code = 0
    try:
        if guarded:
            guard = Guard(server.http_url, host=args.host, port=args.http_port,
                          unhealthy=lambda: supervisor.unhealthy).start()
            supervisor.on_stub_death = guard.abort
        http = guard.url if guard else server.http_url
        print(f"serving {args.repo}: HTTP {http}{' (guarded)' if guard else ''}, gRPC {server.grpc_url}, "
              f"metrics {server.metrics_url}{'' if args.no_restart else ', restarted if it dies'} (Ctrl-C stops)",
              flush=True)
        if args.no_restart:
            while not stop.is_set() and server.alive():
                stop.wait(0.5)
        else:
            supervisor.run(stop)
    except GaveUp as err:
        print(f"e3 serve: {err}", file=sys.stderr)
        code = 1
    finally:
        if guard:
            guard.stop()
        exit_code = server.stop()
    print(f"tritonserver stopped (exit code {exit_code})")
    return code


def _infer(args) -> int:
    from e3.client.sdk import E3Client
    from e3.core.names import router_name, served_name
    from e3.export.zoo import resolve_model
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


def _profile(args) -> int:
    from e3.core.profile import LatencyProfile, ProfileError
    from e3.export.modelled_profile import parse_prices
    from e3.export.profiler import (ProfileSettings, default_profile_path, format_table, merge_profiles,
                                    parse_batch_sizes, profile_model)
    from e3.export.zoo import resolve_architecture, resolve_model
    try:
        if args.modelled and args.cuda:
            raise ValueError("--modelled models GPUs, --cuda measures this host's GPU: choose one")
        if (args.eager or args.fp32 or args.untrained) and not args.cuda:
            raise ValueError("--eager, --fp32 and --untrained go with --cuda")
        build = resolve_architecture if args.untrained else resolve_model
        batches = parse_batch_sizes(args.batch_sizes, build(args.model).card.max_batch_size)
        if args.cuda:
            from e3.export.cuda_profile import CudaSettings, profile_model_cuda
            prices = parse_prices(args.price)
            if len(prices) > 1:
                raise ValueError("--cuda measures one GPU: give at most one --price GPU=USD")
            profile = profile_model_cuda(args.model, CudaSettings(
                batch_sizes=tuple(batches), repeats=max(args.repeats, 50), warmup=max(args.warmup, 5),
                precision="fp32" if args.fp32 else "fp16", graphs=not args.eager,
                price=next(iter(prices.values()), 1.0)), untrained=args.untrained)
        elif args.modelled:
            from e3.export.modelled_profile import model_modelled_profile
            gpus = [g.strip().lower() for g in args.modelled.split(",") if g.strip()]
            profile = model_modelled_profile(args.model, gpus, batches, parse_prices(args.price))
        else:
            profile = profile_model(args.model, ProfileSettings(
                batch_sizes=tuple(batches), repeats=args.repeats, warmup=args.warmup, tx=not args.no_tx),
                tritonserver=args.tritonserver)
        if args.add:
            profile = merge_profiles([profile, *(LatencyProfile.load(p) for p in args.add)])
        out = Path(args.out) if args.out else default_profile_path(
            args.model, list(profile.devices), modelled=all(d.modelled for d in profile.devices.values()))
        profile.save(out)
    except (ProfileError, ValueError) as err:
        print(f"e3 profile: error: {err}", file=sys.stderr)
        return 2
    print(format_table(profile), end="")
    print(f"wrote {out}" + (" (contains MODELLED devices: not measured)" if profile.modelled else ""))
    return 0


def _plan(args) -> int:
    from e3.controller.planner import PlannerError, best_plan, cheapest_plan, parse_devices, parse_forms
    from e3.controller.report import planner_result_lines
    from e3.core.files import write_atomic
    from e3.core.profile import BatchProfile, LatencyProfile, ProfileError
    try:
        latency, batch = LatencyProfile.load(args.latency_profile), BatchProfile.load(args.batch_profile)
        devices = parse_devices(args.devices)
        if args.model:  # the model's own ramps and exit rule
            from e3.export.zoo import resolve_model
            card = resolve_model(args.model).card
            ramps, rule = list(card.ramp_blocks), dict(card.exit_rule)
        else:  # without the model: the ramps the latency profile measured
            ramps, rule = latency.ramp_blocks(), {"kind": "entropy", "tau_nats": args.tau_nats}
        common = dict(slo_ms=args.slo_ms, slack=args.slack, pipelined=not args.no_pipelining,
                      forms=parse_forms(args.forms), exit_wrapper=not args.no_exit_wrapper,
                      ramp_blocks=ramps if args.model else None)
        if args.min_goodput is not None:
            result = cheapest_plan(latency, batch, devices, goodput_rps=args.min_goodput, rate_rps=args.rate_rps,
                                   **common)
        else:
            if args.rate_rps is None:
                raise PlannerError("--rate-rps is needed (or --min-goodput for the cheapest plan reaching a goodput)")
            result = best_plan(latency, batch, devices, rate_rps=args.rate_rps, alpha=args.alpha, **common)
        plan = result.to_plan(model=latency.model, num_blocks=latency.num_blocks, exit_rule=rule, ramp_blocks=ramps,
                              slo_ms=args.slo_ms, slack=args.slack)
    except (ProfileError, PlannerError, ValueError) as err:
        print(f"e3 plan: error: {err}", file=sys.stderr)
        return 2
    for line in planner_result_lines(result, plan, latency, devices, args.slo_ms, args.slack):
        print(line)
    if args.out:
        write_atomic(args.out, plan.to_json())
        print(f"wrote {args.out}")
    return 0


def _bench_generate(args) -> int:
    from e3.benchmarks.generation import GenerateBenchSettings, run_generate_bench
    try:
        taus = tuple(float(t) for t in args.taus.split(","))
        run_generate_bench(GenerateBenchSettings(model=args.model, prompts=args.prompts, new_tokens=args.new_tokens,
                                                 taus=taus, tau=args.tau, fast_tau=args.fast_tau,
                                                 draft_tokens=args.draft_tokens,
                                                 out=Path(args.out) if args.out else None,
                                                 write_docs=not args.no_docs))
    except (ValueError, FileNotFoundError) as err:
        print(f"e3 bench generate: error: {err}", file=sys.stderr)
        return 2
    return 0


def _bench_exegpt(args) -> int:
    from e3.benchmarks.exegpt import ExegptBenchSettings, run_exegpt_bench
    kw = {"model": args.model, "write_docs": not args.no_docs, "out": Path(args.out) if args.out else None}
    if args.factors:
        try:
            kw["factors"] = tuple(float(f) for f in args.factors.split(","))
        except ValueError:
            print(f"e3 bench exegpt: error: --factors must be numbers, got {args.factors!r}", file=sys.stderr)
            return 2
    try:
        run_exegpt_bench(ExegptBenchSettings.quick_form(**kw) if args.quick else ExegptBenchSettings(**kw))
    except (ValueError, FileNotFoundError, RuntimeError) as err:
        print(f"e3 bench exegpt: error: {err}", file=sys.stderr)
        return 2
    return 0


def _plan_generate(args) -> int:
    from e3.generation.exegpt.cli import run
    return run(args)


def _export_generate(args) -> int:
    from e3.generation.repository import export_generation_repository
    from e3.paths import default_repository
    repo = Path(args.repo) if args.repo else default_repository()
    try:
        spec = export_generation_repository(args.model, repo, max_active=args.max_active)
    except (ValueError, FileNotFoundError) as err:
        print(f"e3 export-generate: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {spec.model}_split_* / _kvfill_* / _generate{{,_naive,_stream}} to {repo}")
    return 0


def _export_helios(args) -> int:
    from e3.generation.repository import export_helios_repository
    from e3.paths import default_repository
    repo = Path(args.repo) if args.repo else default_repository()
    try:
        doors = export_helios_repository(args.models, repo, memory_mb=args.memory_mb, tau=args.tau,
                                         eval_prompts=args.eval_prompts, ri=args.ri, cbc_max=args.cbc_max,
                                         window=args.window, switch_gain=args.switch_gain)
    except (ValueError, FileNotFoundError) as err:
        print(f"e3 export-helios: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote the candidates' split models and {', '.join(doors)} to {repo}; serve the front doors only "
          f"(e3 serve --models {doors[0]}): HELIOS loads the split models it needs itself")
    return 0


def _bench_helios(args) -> int:
    from e3.benchmarks.helios import HeliosBenchSettings, run_helios_bench
    kw = {k: v for k, v in dict(prompts=args.prompts, new_tokens=args.new_tokens, clients=args.clients,
                                memory_mb=args.memory_mb).items() if v is not None}
    if args.taus:
        kw["taus"] = tuple(float(t) for t in args.taus.split(","))
    kw.update(models=tuple(args.models.split(",")), write_docs=not args.no_docs,
              out=Path(args.out) if args.out else None)
    try:
        run_helios_bench(HeliosBenchSettings.quick(**kw) if args.quick else HeliosBenchSettings(**kw))
    except (ValueError, FileNotFoundError) as err:
        print(f"e3 bench helios: error: {err}", file=sys.stderr)
        return 2
    return 0


def _bench_side_by_side(args) -> int:
    from e3.benchmarks.side_by_side import BenchSettings, run_side_by_side
    from e3.benchmarks.side_by_side_report import parse_batches, parse_mixes
    try:
        settings = BenchSettings(model=args.model, mixes=tuple(parse_mixes(args.mixes)),
                                 batches=tuple(parse_batches(args.batches)), cores=args.cores,
                                 concurrency=args.concurrency, inputs_per_run=args.inputs, repeats=args.repeats,
                                 out=Path(args.out) if args.out else None)
        if settings.cores < 1 or settings.repeats < 1:
            raise ValueError(f"--cores and --repeats must be >= 1, got {settings.cores} and {settings.repeats}")
        run_side_by_side(settings)
    except ValueError as err:
        print(f"e3 bench side-by-side: error: {err}", file=sys.stderr)
        return 2
    return 0


def _admission(args) -> int:
    import numpy as np
    from e3.export.admission import naive_engine, profile_admission, workers_name, write_admission
    from e3.export.repository import ExportError
    from e3.export.triton_config import parse_config
    from e3.core.spec import NUMPY_DTYPES, dtype_from_config
    from tritonclient.grpc import model_config_pb2 as mc
    repo = Path(args.repo)
    try:
        if args.max_workers is None:     # more workers than processes would only queue for one
            args.max_workers = args.worker_processes or 4
        if args.qos_ms <= 0 or args.max_workers < 1 or args.worker_processes < 0:
            raise ValueError("--qos-ms must be > 0, --max-workers >= 1 and --worker-processes >= 0")
        config_file = repo / args.model / "config.pbtxt"
        if not config_file.exists():
            raise ExportError(f"{config_file} does not exist: name a model of {repo} (e3 export writes them)")
        cfg = parse_config(config_file.read_text())
        # latency does not depend on the values: zeros of the model's shapes (token 0 is padding)
        example = {t.name: np.zeros((32, *t.dims), NUMPY_DTYPES[dtype_from_config(mc.DataType.Name(t.data_type))])
                   for t in cfg.input}
        profile = profile_admission(repo / args.model / "1" / "model.onnx", example, args.qos_ms,
                                    max_workers=args.max_workers)
        max_bs = profile["max_bs"]
        print(f"one worker (ms per batch): {profile['latency_ms']}; MaxBS for p99 <= {args.qos_ms:g} ms: {max_bs}")
        if args.policy == "n-ebird":
            policy = {"kind": "n-ebird", "engine": naive_engine(max_bs), "max_inflight": max_bs}
        else:
            print(f"E-Ebird's best worker set per TotalBS: {profile['confs']}")
            policy = {"kind": "e-ebird", "confs": profile["confs"], "max_inflight": max_bs}
        name = write_admission(repo, args.model, policy, name=args.name,
                               worker_processes=args.worker_processes or None)
    except (ValueError, ExportError) as err:
        print(f"e3 admission: error: {err}", file=sys.stderr)
        return 2
    models = f"{name},{workers_name(name)}" if args.worker_processes else name
    print(f"wrote {repo / name} ({policy['kind']}, workers {policy.get('engine') or profile['engine']}); "
          f"load it with `e3 serve --models {models}` or Triton's load API, and send requests to {name}")
    return 0


def _refusing(command: str, run) -> int:
    """Run ``run()``: a ValueError is the user's input, printed as ``<command>: error: ...`` (exit 2)."""
    try:
        run()
    except ValueError as err:
        print(f"{command}: error: {err}", file=sys.stderr)
        return 2
    return 0


def _bench_all(args) -> int:
    from e3.benchmarks.side_by_side import run_evaluation
    return _refusing("e3 bench", lambda: run_evaluation(quick=args.quick, model=args.model))


def _bench_simulator(args) -> int:
    from e3.benchmarks.side_by_side import run_simulator_validation
    return _refusing("e3 bench simulator", lambda: run_simulator_validation(
        Path(args.measured) if args.measured else None, Path(args.out) if args.out else None))


def _bench_perf(args) -> int:
    from e3.benchmarks.side_by_side import PerfSettings, run_perf_check

    def run():
        if min(args.batch, args.concurrency, args.inputs, args.repeats) < 1:
            raise ValueError("--batch, --concurrency, --inputs and --repeats must be >= 1")
        easy, _, hard = args.mix.partition("-")
        if not (easy.isdigit() and hard.isdigit()):
            raise ValueError(f"--mix takes EASY-HARD, e.g. 80-20; got {args.mix!r}")
        run_perf_check(PerfSettings(model=args.model, mix=(int(easy), int(hard)), batch=args.batch,
                                    concurrency=args.concurrency, inputs=args.inputs, repeats=args.repeats))
    return _refusing("e3 bench perf", run)


def _bench_gpu(args) -> int:
    from e3.benchmarks.gpu_sim import run_gpu_bench, run_measured_gpu_bench
    if args.measured:
        return _refusing("e3 bench gpu", lambda: run_measured_gpu_bench(
            Path(args.measured), quick=args.quick, model=args.model, beside=tuple(Path(p) for p in args.beside),
            docs=not args.no_docs))
    if args.beside:
        print("e3 bench gpu: error: --beside goes with --measured", file=sys.stderr)
        return 2
    return _refusing("e3 bench gpu", lambda: run_gpu_bench(quick=args.quick, model=args.model,
                                                           out=Path(args.out) if args.out else None,
                                                           docs=not args.no_docs))


def _bench_admission(args) -> int:
    from e3.benchmarks.admission import AdmissionBenchSettings, run_admission_bench
    if args.cuda or args.report:
        return _bench_admission_gpu(args)

    def run():
        models = _names(args.models, AdmissionBenchSettings.models)
        if not models or args.cores < 1 or (args.qos_ms is not None and args.qos_ms <= 0):
            raise ValueError("give at least one model, --cores >= 1 and a positive --qos-ms")
        run_admission_bench(AdmissionBenchSettings(models=models, cores=args.cores, qos_ms=args.qos_ms,
                                                   out=Path(args.out) if args.out else None, quick=args.quick))
    return _refusing("e3 bench admission", run)


def _names(text: str | None, default: tuple[str, ...]) -> tuple[str, ...]:
    """``--models a,b`` as a tuple (``default`` when not given)."""
    return default if text is None else tuple(m.strip() for m in text.split(",") if m.strip())


def _bench_admission_gpu(args) -> int:
    import json

    from e3.benchmarks.admission_gpu import GpuAdmissionSettings, run_gpu_admission, write_gpu_admission
    if args.report and not args.cuda:
        print("e3 bench admission: error: --report goes with --cuda", file=sys.stderr)
        return 2

    def run():
        if args.report:
            try:
                doc = json.loads(Path(args.report).read_text())
            except (OSError, json.JSONDecodeError) as err:
                raise ValueError(f"cannot read the saved run {args.report}: {err}") from None
            if not isinstance(doc, dict) or not isinstance(doc.get("models"), dict):
                raise ValueError(f"{args.report} is not a saved `e3 bench admission --cuda` run (no models)")
        else:
            models = _names(args.models, GpuAdmissionSettings.models)
            if not models or (args.qos_ms is not None and args.qos_ms <= 0):
                raise ValueError("give at least one model and a positive --qos-ms")
            settings = GpuAdmissionSettings(models=models, qos_ms=args.qos_ms)
            doc = run_gpu_admission(settings.shortened() if args.quick else settings)
        write_gpu_admission(doc, Path(args.out) if args.out else None,
                            "e3 bench admission --cuda" + (" --quick" if args.quick else ""))
    return _refusing("e3 bench admission", run)


def _demo(args) -> int:
    from e3.demo import DemoSettings, run_demo
    run_demo(Path(args.repo), DemoSettings(model=args.model, cuts=args.cuts, requests=args.requests,
                                           concurrency=args.concurrency, batch=args.batch, protocol=args.protocol,
                                           cores=args.cores))
    return 0


def _perf(args) -> int:
    import subprocess
    from e3.deploy.tools import perf_analyzer_binary, tool_env
    extra = args.args[1:] if args.args[:1] == ["--"] else args.args
    return subprocess.call([perf_analyzer_binary(), *extra], env=tool_env())


def _train(args) -> int:
    from e3.export.recipes import train
    for name in args.models:
        report = train(name, quick=args.quick, retune=args.retune)
        meta = report.meta
        print(f"{name}: trained in {report.seconds / 60:.1f} min"
              f"{' (QUICK: a few hundred examples, for tests only)' if args.quick else ''}")
        if meta.get("test"):
            t = meta["test"]
            print(f"  exit rule {meta['exit_rule']}: test accuracy {100 * t['accuracy']:.1f}%, "
                  f"blocks executed {100 * t['blocks_fraction']:.1f}%")
        elif "test_accuracy" in meta:
            print(f"  test accuracy {100 * meta['test_accuracy']:.1f}%")
    return 0


def _evaluate(args) -> int:
    from e3.export.evaluate import evaluate, format_evaluation, save_evaluation
    for name in args.models:
        ev = evaluate(name, limit=args.limit)
        print(format_evaluation(ev))
        js, png = save_evaluation(ev, artifacts_dir() / "results")
        print(f"  wrote {js} and {png}\n")
    return 0


def _workload(args) -> int:
    from e3.export.workload import build_workloads, load_workload
    out = Path(args.out) if args.out else artifacts_dir() / "workloads" / args.model
    for path in build_workloads(args.model, out, count=args.count, rate_rps=args.rate_rps, seed=args.seed):
        _, meta = load_workload(path)
        hard = float(meta["hard"].mean())
        print(f"wrote {path} ({meta['count']} inputs, {100 * (1 - hard):.0f}% easy / {100 * hard:.0f}% hard; "
              f"phases: {', '.join(p['mix'] for p in meta['phases'])})")
    return 0


def _load(args) -> int:
    from e3.client.loadgen import closed_loop, open_loop, replay_workload
    from e3.client.report import format_table
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
        from e3.export.zoo import resolve_model
        from e3.core.names import zoo_name_of
        from e3.export.zoo import ZOO
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
        print(f"exit ramps differing from the workload's reference: {result.exit_mismatches} of {result.inputs}")
    if not args.closed and result.max_send_lag_ms > 50:
        print(f"note: arrivals waited up to {result.max_send_lag_ms:.0f} ms for a free client worker "
              "(counted in latency); raise --workers if the client, not the server, is the limit")
    for message, count in result.error_messages.most_common(5):
        print(f"  {count} x {message}")
    return 1 if result.errors else 0


def _control(args) -> int:
    from e3.controller.applier import ControlError
    from e3.controller.forecast import make_forecaster
    from e3.controller.loop import Controller, ProfilePlanner
    from e3.controller.planner import parse_devices
    from e3.controller.report import describe_report
    from e3.controller.settings import ControlSettings
    from e3.controller.telemetry import TelemetryReader
    from e3.controller.triton_applier import TritonApplier
    from e3.core.names import served_name
    from e3.core.plan import Plan
    from e3.core.profile import LatencyProfile
    from e3.deploy.server import metrics_url_for
    from e3.export.zoo import resolve_model
    card = resolve_model(args.model).card
    m = served_name(args.model)
    latency = LatencyProfile.load(args.latency_profile)
    pinned = Plan.from_json(Path(args.pin).read_text()) if args.pin else None
    settings = ControlSettings(model=m, devices=parse_devices(args.devices), slo_ms=args.slo_ms,
                               rate_rps=args.rate_rps, slack=args.slack, window_s=args.window_s, margin=args.margin,
                               drift_threshold=args.drift, straggler_factor=args.straggler_factor or None,
                               dry_run=args.dry_run)
    metrics_url = args.metrics_url or metrics_url_for(args.url)
    # --repo "": the repository is not visible here (e.g. written inside each Triton pod); Triton's load decides
    applier = TritonApplier(args.url, metrics_url=metrics_url, repo=Path(args.repo) if args.repo else None,
                            zoo_model=args.model)
    planner = ProfilePlanner(latency, exit_rule=card.exit_rule, ramp_blocks=card.ramp_blocks, slo_ms=args.slo_ms,
                             rate_rps=args.rate_rps, slack=args.slack, alpha=args.alpha)
    if args.kubernetes and not args.pools:
        print("e3 control: error: --kubernetes scales pools: give --pools POOLS.json too", file=sys.stderr)
        return 2
    if args.pools:   # several Triton servers (pools): plans placed on them, pods scaled on Kubernetes
        applier, planner, pinned = _pooled(args, applier, planner, pinned)
    controller = Controller(settings, telemetry=TelemetryReader(metrics_url, m, window_s=args.window_s,
                                                                num_blocks=card.num_blocks),
                            forecaster=make_forecaster(args.forecaster), planner=planner, view=applier,
                            control=None if args.dry_run else applier, pinned=pinned,
                            on_report=lambda rep: print(describe_report(rep), flush=True))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        running = applier.current_plan(settings.router)
        print(f"controlling {settings.router} at {args.url} (metrics {metrics_url}), window {args.window_s:g} s"
              + (", DRY RUN" if args.dry_run else "") + (f", pinned to {pinned.plan_id}" if pinned else "")
              + f"; running plan {running.plan_id if running else 'none'}", flush=True)
        controller.run(stop, max_windows=1 if args.once else None)
    except ControlError as err:
        print(f"e3 control: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:   # urllib's URLError too: an address with nothing listening, a wrong port
        print(f"e3 control: error: cannot reach the server ({err}); Triton at {args.url}, its metrics at "
              f"{metrics_url} (give --metrics-url if they are elsewhere)", file=sys.stderr)
        return 2
    finally:
        applier.close()
    return 0


def _pooled(args, router_applier, planner, pinned):
    """The controller's applier, planner and pinned plan over the pools of ``--pools``."""
    from e3.controller.pooled_applier import PlacingPlanner, PooledApplier
    from e3.controller.triton_applier import TritonApplier
    from e3.core.names import served_name
    from e3.deploy.pools import PoolError, load_pools, place
    from e3.deploy.server import metrics_url_for
    try:
        pools = load_pools(args.pools)
        pinned = place(pinned, pools) if pinned is not None else None
    except PoolError as err:
        raise SystemExit(f"e3 control: error: {err}") from None
    scaler = None
    if args.kubernetes:
        from e3.controller.k8s_scaler import KubernetesScaler
        scaler = KubernetesScaler(pools)
    servers = {p.grpc_url: TritonApplier(p.http_url, metrics_url=p.metrics_url or metrics_url_for(p.http_url))
               for p in pools.pools if not p.router}
    applier = PooledApplier(f"{served_name(args.model)}_router", router_applier, servers, pools=pools, scaler=scaler)
    return applier, PlacingPlanner(planner, pools), pinned


def _status(args) -> int:
    from e3.controller.report import status_lines
    from e3.controller.triton_applier import TritonApplier
    from e3.core.names import served_name
    applier = TritonApplier(args.url)
    try:
        for line in status_lines(applier, served_name(args.model), args.state_dir, args.history):
            print(line)
    finally:
        applier.close()
    return 0


def _models(args) -> int:
    from e3.export.zoo import ZOO
    for entry in ZOO.values():
        print(f"{entry.name:12s} {entry.summary}")
    return 0


def _clean(args) -> int:
    repo = Path(args.repo)
    removed = []
    if artifacts_dir().exists():
        shutil.rmtree(artifacts_dir())
        removed.append(str(artifacts_dir()))
    if repo.is_dir():
        for child in repo.iterdir():
            if child.name != "README.md":
                shutil.rmtree(child) if child.is_dir() else child.unlink()
        removed.append(f"{repo}/* (kept README.md)")
    print("removed " + ", ".join(removed) if removed else "nothing to remove")
    return 0


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


def build_parser() -> argparse.ArgumentParser:
    from e3.deploy.server import DEFAULT_METRICS_PORT
    p = argparse.ArgumentParser(prog="e3", description="E3 on Triton: serve early-exit models split, "
                                "re-batched and planned, on NVIDIA Triton Inference Server.")
    p.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    repo_help = "model repository (default: ./model_repository)"

    e = sub.add_parser("export", help="write a Triton model repository: splits, router, baselines")
    e.add_argument("model", help="zoo name (see `e3 models`) or package.module:factory")
    e.add_argument("--cuts", default=None, help="cut after these blocks, e.g. 2,4 (default: no cut)")
    e.add_argument("--repo", default=str(default_repository()), help=repo_help)
    e.add_argument("--target", choices=["embedded", "ngc"], default="embedded",
                   help="embedded: Python-backend models running ONNX Runtime (the wheel's server); "
                        "ngc: native onnxruntime backend of an NGC Triton image")
    e.add_argument("--batch-size", type=int, default=8, help="preferred batch size of every split (default 8)")
    e.add_argument("--instances", type=int, default=1, help="Triton instances per split (default 1)")
    e.add_argument("--router-instances", type=int, default=None,
                   help="router instances (default: what the plan needs: 1 when a split is constant, so that one "
                        "scheduler sees every request; for compact splits only, one per worker set)")
    e.add_argument("--plan", default=None, help="a plan JSON file (e.g. from `e3 plan --out`) instead of --cuts")
    e.add_argument("--all-ranges", action="store_true",
                   help="also pre-export every contiguous block range, so a controller can switch cuts at once")
    e.add_argument("--format", choices=["onnx", "tensorrt"], default="onnx",
                   help="split and stock model files: onnx (default), or tensorrt engines (model.plan, built "
                        "here with the optional `gpu` extra on an NVIDIA GPU; needs --target ngc)")
    e.add_argument("--fp16", action="store_true", help="with --format tensorrt: allow FP16 kernels")
    e.add_argument("--split-queue-policy", action="store_true",
                   help="give the splits Triton's queue policy that rejects calls whose deadline expired in their "
                        "queue (off by default: it stops Triton's batcher prefetching; measured p99 4x worse)")
    e.add_argument("--max-queue-inputs", type=int, default=None, metavar="N",
                   help="bound the router: refuse at once (HTTP 503, counted in e3_rejected_total) a request that "
                        "would take the inputs it holds (admitted, not yet answered) past N (default: no bound)")
    e.set_defaults(func=_export)

    pr = sub.add_parser("profile", help="measure per-block latency (with/without ramp) and Tx; write a "
                                        "latency profile for the planner")
    pr.add_argument("model", help="zoo name or package.module:factory")
    pr.add_argument("--batch-sizes", default=None, help="e.g. 1,2,4 (default 1,2,4,... up to the max batch)")
    pr.add_argument("--repeats", type=int, default=20, help="timed calls per block and batch size (default 20)")
    pr.add_argument("--warmup", type=int, default=3, help="untimed calls first (default 3)")
    pr.add_argument("--out", default=None,
                    help="latency profile file (default artifacts/profiles/<m>.<devices>[.modelled].json)")
    pr.add_argument("--modelled", default=None, metavar="GPU[,GPU...]",
                    help="do not measure: MODEL a latency profile of v100, t4, a100, a30, a10, k80 from public "
                         "whole-model figures (labelled modelled); several GPUs go into one file")
    pr.add_argument("--price", action="append", default=[], metavar="GPU=USD",
                    help="with --modelled: price per device-hour (a30 has no public price); with --cuda: the "
                         "measured GPU's (default 1, relative units)")
    pr.add_argument("--cuda", action="store_true",
                    help="measure on this host's NVIDIA GPU with PyTorch (FP16, one CUDA graph per call); the "
                         "device is named after the GPU (h100, a100, ...); see docs/profiling.md")
    pr.add_argument("--eager", action="store_true", help="with --cuda: eager kernel launches, no CUDA graphs")
    pr.add_argument("--fp32", action="store_true", help="with --cuda: FP32 instead of FP16 autocast")
    pr.add_argument("--untrained", action="store_true",
                    help="with --cuda: time the architecture with random weights (no trained checkpoint needed; "
                         "latency does not depend on the weights)")
    pr.add_argument("--add", action="append", default=[], metavar="PROFILE",
                    help="merge this latency profile file's devices into the output (repeatable)")
    pr.add_argument("--no-tx", action="store_true", help="skip the Tx measurement (no tritonserver; Tx = 0)")
    pr.add_argument("--tritonserver", default=None, help="tritonserver binary for the Tx measurement")
    pr.set_defaults(func=_profile)

    s = sub.add_parser("serve", help="run tritonserver on a repository until Ctrl-C (restarted if it dies, "
                                     "HTTP behind a guard); off loopback set E3_API_HEADER/E3_API_KEY")
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
                   help="serve Triton's HTTP directly, without the guard that refuses malformed inference bodies "
                        "before Triton parses them (docs/reliability.md)")
    s.add_argument("--no-restart", action="store_true",
                   help="stop when tritonserver dies instead of restarting it and restoring its models and plan")
    s.set_defaults(func=_serve)

    i = sub.add_parser("infer", help="send inputs to a served model; print prediction, exit ramp, latency")
    i.add_argument("model", help="zoo name or package.module:factory (for the inputs and the served name)")
    i.add_argument("--target", default=None, help="served model to call (default <m>_router; try <m>_ee, <m>_stock)")
    i.add_argument("-n", type=int, default=8, help="number of inputs, one request each (default 8)")
    i.add_argument("--seed", type=int, default=0)
    i.add_argument("--url", default="127.0.0.1:8000", help="server address (default 127.0.0.1:8000; gRPC: :8001)")
    i.add_argument("--protocol", choices=["http", "grpc"], default="http")
    i.set_defaults(func=_infer)

    pl = sub.add_parser("plan", help="plan cuts, instances per split, device configurations and input batch "
                                     "(E3's DP) from a latency profile and a batch profile")
    _planning_args(pl, rate_required=False)
    pl.add_argument("--batch-profile", "--exits", dest="batch_profile", required=True,
                    help="batch profile JSON: share of inputs reaching every block (e3 workload writes one per "
                         "mix); --exits is an old alias")
    pl.add_argument("--min-goodput", type=float, default=None,
                    help="instead: the cheapest plan whose throughput reaches this many inputs/s (E3 §5.3)")
    pl.add_argument("--no-pipelining", action="store_true", help="splits run one after another (E3 §3.2.1)")
    pl.add_argument("--forms", default="constant,compact",
                    help="split forms to choose from: constant (own Triton model, constant batch), compact (run "
                         "in the router, rows leave between blocks); default both, per split the faster")
    pl.add_argument("--no-exit-wrapper", action="store_true",
                    help="keep every ramp (default: disable ramps that cost more than their exits save, E3 §3.4)")
    pl.add_argument("--model", default=None, help="zoo model (or module:factory) whose ramps and exit rule the "
                                                  "written plan uses (recommended with --out)")
    pl.add_argument("--tau-nats", type=float, default=0.5,
                    help="entropy threshold (nats) written into the plan without --model (default 0.5)")
    pl.add_argument("--out", default=None, help="write the plan JSON here (atomically)")
    pl.set_defaults(func=_plan)

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

    ad = sub.add_parser("admission", help="add E²bird's elastic admission stage (N-Ebird or E-Ebird) in front of a "
                                          "one-file ONNX model of the repository, after profiling its workers")
    ad.add_argument("model", help="Triton model to front, e.g. bert_ee_stock or bert_ee_split_1-2")
    ad.add_argument("--repo", default=str(default_repository()), help=repo_help)
    ad.add_argument("--policy", choices=["n-ebird", "e-ebird"], default="e-ebird",
                    help="N-Ebird (fixed engine) or E-Ebird (profiled worker sets per load; default)")
    ad.add_argument("--qos-ms", type=float, required=True, help="p99 latency target (ms); sets MaxBS")
    ad.add_argument("--max-workers", type=int, default=None,
                    help="largest worker set profiled per TotalBS (default: --worker-processes, or 4 without them)")
    ad.add_argument("--worker-processes", type=int, default=2,
                    help="Triton instances (processes, 1 intra-op thread each) of <name>_workers that run the "
                         "workers' batches, at most that many at once (default 2, the cores); 0: the workers are "
                         "threads of the stage's own process on one shared session")
    ad.add_argument("--name", default=None, help="the stage's Triton name (default <model>_admission)")
    ad.set_defaults(func=_admission)

    b = sub.add_parser("bench", help="benchmarks: E3 against the stock and early-exit baselines, side by side")
    b.add_argument("--quick", action="store_true", help="without a BENCHMARK: the 80:20 mix, one run per cell, "
                                                        "fewer inputs (minutes)")
    b.add_argument("--model", default="bert-ee", help="without a BENCHMARK: the zoo model (default bert-ee)")
    b.set_defaults(func=_bench_all)
    bsub = b.add_subparsers(dest="bench", required=False, metavar="BENCHMARK",
                            help="one benchmark; none: goodput against batch for E3, stock and naive EE and the "
                                 "simulator's validation and the perf_analyzer check, written into docs/RESULTS.md")
    sbs = bsub.add_parser("side-by-side", help="E3, <m>_stock and <m>_ee on one server at one core budget, per mix "
                                               "and request size; writes artifacts/results/side_by_side.json")
    sbs.add_argument("--model", default="bert-ee", help="zoo model with workload mixes (default bert-ee; trained "
                                                        "when missing)")
    sbs.add_argument("--mixes", default="80-20,50-50,20-80", help="easy-hard mixes (default 80-20,50-50,20-80)")
    sbs.add_argument("--batches", default="1,8", help="inputs per request, comma-separated (default 1,8)")
    sbs.add_argument("--cores", type=int, default=2, help="cores every system gets: instances x threads (default 2)")
    sbs.add_argument("--concurrency", type=int, default=16, help="closed-loop clients (default 16)")
    sbs.add_argument("--inputs", type=int, default=1600, help="inputs per measured run (default 1600)")
    sbs.add_argument("--repeats", type=int, default=3,
                     help="measured runs per system and cell, interleaved; the median is reported (default 3)")
    sbs.add_argument("--out", default=None, help="results JSON (default artifacts/results/side_by_side.json)")
    sbs.set_defaults(func=_bench_side_by_side)
    sim = bsub.add_parser("simulator", help="the discrete-event simulator against real runs: every cell of a "
                                            "side-by-side run simulated with the same profile, plans, configs and "
                                            "load; writes artifacts/results/simulator_validation.json")
    sim.add_argument("--measured", default=None,
                     help="side-by-side results to validate against (default artifacts/results/side_by_side.json)")
    sim.add_argument("--out", default=None, help="validation JSON (default artifacts/results/simulator_validation.json)")
    sim.set_defaults(func=_bench_simulator)
    prf = bsub.add_parser("perf", help="perf_analyzer against the load generator on E3's front door (<m>_router), "
                                       "same concurrency, inputs per request and inputs, alternating runs: agree "
                                       "within 10%%; writes artifacts/results/perf_check.json and perf_analyzer's "
                                       "input data artifacts/results/perf_input_<m>.json")
    prf.add_argument("--model", default="bert-ee", help="zoo model with workload mixes (default bert-ee)")
    prf.add_argument("--mix", default="80-20", help="easy-hard workload mix (default 80-20)")
    prf.add_argument("--batch", type=int, default=8, help="inputs per request (default 8)")
    prf.add_argument("--concurrency", type=int, default=16, help="requests in flight, both tools (default 16)")
    prf.add_argument("--inputs", type=int, default=1600, help="inputs per load-generator run (default 1600)")
    prf.add_argument("--repeats", type=int, default=3, help="runs of each tool, alternating (default 3)")
    prf.set_defaults(func=_bench_perf)
    gpu = bsub.add_parser("gpu", help="GPU clusters by simulation with MODELLED GPU profiles: goodput against "
                                      "inputs per request on 16 V100s for E3, stock and naive EE, heterogeneity at "
                                      "fixed cost, cost at fixed goodput; writes artifacts/results/gpu_sim.json, "
                                      "docs/figures/gpu_goodput_vs_batch.png and a section of docs/RESULTS.md")
    gpu.add_argument("--model", default="bert-ee", help="zoo model with workload mixes (default bert-ee)")
    gpu.add_argument("--quick", action="store_true", help="fewer saturation levels and baseline configurations, "
                                                          "shorter simulations (a few minutes)")
    gpu.add_argument("--out", default=None, help="results JSON (default artifacts/results/gpu_sim.json)")
    gpu.add_argument("--no-docs", action="store_true", help="do not write the plot or docs/RESULTS.md")
    gpu.add_argument("--measured", default=None, metavar="PROFILE",
                     help="instead: simulate 16 GPUs of a MEASURED GPU profile (e3 profile --cuda) and write it "
                          "beside the modelled ones (artifacts/results/gpu_sim_measured.json, its own section)")
    gpu.add_argument("--beside", action="append", default=[], metavar="PROFILE",
                     help="with --measured: more measured profiles for the side-by-side table (repeatable)")
    gpu.set_defaults(func=_bench_gpu)
    adm = bsub.add_parser("admission", help="E²bird's elastic admission stage (N-Ebird, E-Ebird) against Triton's "
                                            "dynamic batcher (no delay, tuned delay, instances) under a QoS target: "
                                            "throughput at the target and latency through a load burst")
    adm.add_argument("--models", default=None,
                     help="zoo models whose stock form is served (default bert-ee,resnet-ee; trained when missing); "
                          "with --cuda the stock models themselves (default bert-stock,resnet-stock)")
    adm.add_argument("--qos-ms", type=float, default=None,
                     help="p99 latency target (default per model: 2.5 x its latency at batch 16 on one thread, "
                          "at least 50 ms)")
    adm.add_argument("--cores", type=int, default=2, help="cores every system gets (default 2)")
    adm.add_argument("--quick", action="store_true", help="fewer rates and shorter runs (a few minutes per model)")
    adm.add_argument("--out", default=None, help="results JSON (default artifacts/results/admission.json, with "
                                                 "--cuda admission_gpu.json)")
    adm.add_argument("--cuda", action="store_true",
                     help="the analogues on this host's NVIDIA GPU, emulated in one process outside Triton (the "
                          "real policies; CUDA graphs on streams); --models then names stock models (default "
                          "bert-stock,resnet-stock)")
    adm.add_argument("--report", default=None, metavar="JSON",
                     help="with --cuda: do not run; write docs/RESULTS.md's GPU section from a saved run (e.g. one "
                          "made by benchmarks/gpu_host.py on a GPU host)")
    adm.set_defaults(func=_bench_admission)
    gen = bsub.add_parser("generate", help="early-exit generation on one server: tokens/s, TTFT, TPOT of the full "
                                           "model, E3 (CALM exits, re-batched), naive early exit and self-speculative "
                                           "decoding; agreement and perplexity against the threshold; writes "
                                           "artifacts/results/generation.json and a section of docs/RESULTS.md")
    gen.add_argument("--model", default="smollm2-ee", help="generation model (default smollm2-ee; its exit heads are "
                                                          "trained on first use, a few minutes)")
    gen.add_argument("--prompts", type=int, default=16, help="held-out prompts (default 16)")
    gen.add_argument("--new-tokens", type=int, default=32, help="tokens generated per prompt (default 32)")
    gen.add_argument("--taus", default="0.1,0.2,0.3,0.5,0.7,0.9", help="thresholds of the quality table")
    gen.add_argument("--tau", type=float, default=0.5, help="threshold of the speed table's early-exit systems")
    gen.add_argument("--fast-tau", type=float, default=0.2, help="an extra, aggressive threshold for E3 in the speed "
                                                                 "table (default 0.2)")
    gen.add_argument("--draft-tokens", type=int, default=4, help="self-speculative draft length (default 4)")
    gen.add_argument("--out", default=None, help="results JSON (default artifacts/results/generation.json)")
    gen.add_argument("--no-docs", action="store_true", help="do not update docs/RESULTS.md")
    gen.set_defaults(func=_bench_generate)
    hel = bsub.add_parser("helios", help="HELIOS against each of its candidates alone, one server, one memory budget: "
                                         "tokens/s, batch reached, TTFT, TPOT, tokens per exit layer, agreement; "
                                         "writes artifacts/results/helios.json and a section of docs/RESULTS.md")
    hel.add_argument("--models", default="smollm2-ee,smollm2-ee-late", help="candidates, comma-separated (default "
                                                                          "smollm2-ee,smollm2-ee-late)")
    hel.add_argument("--prompts", type=int, default=None, help="requests (default 48; --quick 24)")
    hel.add_argument("--new-tokens", type=int, default=None, help="tokens per request (default 32; --quick 16)")
    hel.add_argument("--clients", type=int, default=None, help="concurrent clients (default 24; --quick 12)")
    hel.add_argument("--taus", default=None, help="confidence thresholds, one run each (default 0.2,0.1)")
    hel.add_argument("--memory-mb", type=float, default=None, help="memory budget for weights + KV (default 560)")
    hel.add_argument("--quick", action="store_true", help="a shorter run (a few minutes once exported)")
    hel.add_argument("--out", default=None, help="results JSON (default artifacts/results/helios.json)")
    hel.add_argument("--no-docs", action="store_true", help="do not update docs/RESULTS.md")
    hel.set_defaults(func=_bench_helios)
    exg = bsub.add_parser("exegpt", help="ExeGPT on Triton: the schedule (RRA on one worker or WAA on an encode and "
                                          "a decode worker) <m>_generate_exegpt chooses per latency bound, measured "
                                          "with the best of the other kind, against the best static batch and "
                                          "continuous batching, predicted vs measured (Table 6 / Fig. 6 analogues, "
                                          "the simulator's validation); writes artifacts/results/exegpt_triton.json "
                                          "and a section of docs/RESULTS.md")
    exg.add_argument("--model", default="smollm2-ee", help="generation model (default smollm2-ee; tiny-gen for a "
                                                          "pipeline check in seconds)")
    exg.add_argument("--factors", default=None, help="latency bounds as multiples of a static batch of one's "
                                                     "(default 2,3,5,8; --quick 3,6)")
    exg.add_argument("--quick", action="store_true",
                     help="two bounds, no unbounded row, runs of at most 20 s (12-35 minutes on smollm2-ee on the "
                          "shared 2-core machine; the full form takes about half an hour)")
    exg.add_argument("--out", default=None, help="results JSON (default artifacts/results/exegpt_triton.json)")
    exg.add_argument("--no-docs", action="store_true", help="do not update docs/RESULTS.md")
    exg.set_defaults(func=_bench_exegpt)

    pa = sub.add_parser("perf", help="run Triton's perf_analyzer (from the client wheel) with its libraries "
                                     "found; arguments after -- go to perf_analyzer")
    pa.add_argument("args", nargs=argparse.REMAINDER, help="e.g. -- -m tiny_ee_router -b 4 --input-data zero")
    pa.set_defaults(func=_perf)

    t = sub.add_parser("train", help="train zoo models on their data (cached checkpoints under artifacts/)")
    t.add_argument("models", nargs="+", help="bert-ee, bert-stock, pabee, resnet-ee, resnet-stock")
    t.add_argument("--quick", action="store_true", help="a few hundred examples: checks the pipeline in seconds")
    t.add_argument("--retune", action="store_true", help="resnet-ee: keep the weights, choose τ again")
    t.set_defaults(func=_train)

    ev = sub.add_parser("evaluate", help="accuracy and exits against the threshold, compute saved vs stock")
    ev.add_argument("models", nargs="+", help="bert-ee, pabee, resnet-ee")
    ev.add_argument("--limit", type=int, default=None, help="evaluate the first N test inputs only")
    ev.set_defaults(func=_evaluate)

    w = sub.add_parser("workload", help="easy/hard mixes 80:20, 50:50, 20:80 and a switching stream")
    w.add_argument("model", help="bert-ee, pabee, resnet-ee")
    w.add_argument("--count", type=int, default=1000, help="inputs per mix (default 1000)")
    w.add_argument("--rate-rps", type=float, default=50.0, help="nominal arrival rate for the stream's phase times")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--out", default=None, help="folder (default artifacts/workloads/MODEL)")
    w.set_defaults(func=_workload)

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
    ct.set_defaults(func=_control)

    st = sub.add_parser("status", help="live plan, loaded splits and instances, forecast vs observed, plan history")
    st.add_argument("--model", required=True, help="zoo name of the served model, e.g. tiny-ee")
    st.add_argument("--url", default="127.0.0.1:8000", help="Triton HTTP address (default 127.0.0.1:8000)")
    st.add_argument("--state-dir", default=None, help="controller files (default artifacts/controller)")
    st.add_argument("--history", type=int, default=10, help="plan history entries to show (default 10)")
    st.set_defaults(func=_status)

    eg = sub.add_parser("export-generate", help="write an early-exit generation model (split models, kv-fill models, "
                                                "generation routers) into the model repository")
    eg.add_argument("model", nargs="?", default="smollm2-ee", help="smollm2-ee (default) or tiny-gen")
    eg.add_argument("--repo", default=None, help="model repository (default model_repository/)")
    eg.add_argument("--max-active", type=int, default=16, help="sequences decoded together by <m>_generate (default 16)")
    eg.set_defaults(func=_export_generate)

    eh = sub.add_parser("export-helios", help="HELIOS: write early-exit LLM candidates (split models) and the "
                                              "helios_generate front door that chooses among them")
    eh.add_argument("models", nargs="+", help="candidates sharing a tokenizer, e.g. smollm2-ee smollm2-ee-late")
    eh.add_argument("--repo", default=None, help="model repository (default model_repository/)")
    eh.add_argument("--memory-mb", type=float, default=560.0, help="budget for loaded weights + reserved KV (MiB, "
                                                                  "default 560)")
    eh.add_argument("--tau", type=float, default=0.9, help="confidence threshold (softmax margin, default 0.9)")
    eh.add_argument("--eval-prompts", type=int, default=5, help="Step 2: prompts per candidate (default 5)")
    eh.add_argument("--ri", type=int, default=150, help="re-assessment interval in prompts (default 150)")
    eh.add_argument("--cbc-max", type=int, default=50, help="breaches tolerated ... (default 50)")
    eh.add_argument("--window", type=int, default=100, help="... in this many tokens (default 100)")
    eh.add_argument("--switch-gain", type=float, default=1.25, help="a switch must be predicted this much faster "
                                                                   "than loading the rest (default 1.25)")
    eh.set_defaults(func=_export_helios)

    pg = sub.add_parser("plan-generate", help="ExeGPT: profile the served decoder's layers, then the RRA/WAA "
                                               "schedule with the highest throughput per latency bound (B&B vs grid)")
    from e3.generation.exegpt.cli import add_arguments as _plan_generate_arguments
    _plan_generate_arguments(pg)
    pg.set_defaults(func=_plan_generate)

    m = sub.add_parser("models", help="list the model zoo")
    m.set_defaults(func=_models)

    c = sub.add_parser("clean", help="remove artifacts/ and the generated model repository")
    c.add_argument("--repo", default=str(default_repository()), help=repo_help)
    c.set_defaults(func=_clean)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    from e3.deploy.server import ServerError
    from e3.client.sdk import ClientError
    from e3.export.repository import ExportError
    from e3.export.checkpoints import CheckpointMissing
    try:
        return args.func(args)
    except (ValueError, ServerError, ClientError, ExportError, CheckpointMissing) as err:  # user-facing errors
        print(f"e3 {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
