"""`e3` verbs over models and their repository: export, profile, plan, admission, train, evaluate, workload, models,
clean. `--data FILE` (a .npz of the model's inputs and labels, e3.models.user_data) works with any model."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from e3.cli.control import _planning_args
from e3.core.names import ee_name, router_name, served_name, stock_name
from e3.paths import artifacts_dir, default_repository

# Deferred imports: `e3 --help` and the light verbs must start fast, without torch, numpy or the model, export and
# profiling rooms, so each verb imports what it needs inside its function.


def _export(args) -> int:
    from e3.core.plan import Plan
    from e3.export.repository import ExportSettings, all_ranges, export_repository
    from e3.models.zoo import resolve_model
    plan = Plan.from_json(Path(args.plan).read_text()) if args.plan else None
    extra = all_ranges(resolve_model(args.model).card.num_blocks) if args.all_ranges else ()
    plan = export_repository(args.model, args.cuts, Path(args.repo), settings=ExportSettings(
        target=args.target, batch_size=args.batch_size, split_instances=args.instances,
        router_instances=args.router_instances, format=args.format, fp16=args.fp16,
        split_queue_policy=args.split_queue_policy, max_queue_inputs=args.max_queue_inputs, gpus=args.gpus,
        baselines=not args.no_baselines),
        plan=plan, extra_ranges=extra)
    if extra:
        print(f"pre-exported every block range ({len(extra)} split models) beside the plan's")
    print(f"exported {args.model} into {args.repo}:")
    for s in plan.splits:
        print(f"  {s.model:28s} blocks {s.first_block}-{s.last_block}  ramps {list(s.enabled_ramps) or '-'}  "
              f"batch {s.batch_size}  instances {s.instances}  {s.form}")
    m = plan.model
    door = f"{m} (text) -> {router_name(m)}" if (Path(args.repo) / m / "config.pbtxt").exists() else router_name(m)
    baselines = "no baselines" if args.no_baselines else f"baselines {stock_name(m)} and {ee_name(m)}"
    print(f"  front door {door}, {baselines}; exit rule {plan.exit_rule}")
    if plan.on_device:
        print(f"  the device form: every split runs inside {router_name(m)} on its instance's device (the model's "
              f"weights beside it); no split models")
    return 0


def _profile(args) -> int:
    from e3.core.profile import LatencyProfile, ProfileError
    from e3.models.zoo import resolve_architecture, resolve_model
    from e3.profiling.modelled_profile import parse_prices
    from e3.profiling.profiler import (ProfileSettings, default_profile_path, format_table, merge_profiles,
                                       parse_batch_sizes, profile_model)
    try:
        if args.modelled and args.cuda:
            raise ValueError("--modelled models GPUs, --cuda measures this host's GPU: choose one")
        if args.data and (args.cuda or args.modelled):
            raise ValueError("--data times the blocks on your inputs with ONNX Runtime here; not with --cuda or --modelled")
        if (args.eager or args.fp32 or args.untrained or args.hops or args.torch_device) and not args.cuda:
            raise ValueError("--eager, --fp32, --untrained, --hops and --torch-device go with --cuda")
        build = resolve_architecture if args.untrained else resolve_model
        batches = parse_batch_sizes(args.batch_sizes, build(args.model).card.max_batch_size)
        if args.cuda:
            from e3.profiling.cuda_profile import CudaSettings, bls_from_run, profile_cuda
            prices = parse_prices(args.price)
            if len(prices) > 1:
                raise ValueError("--cuda measures one GPU: give at most one --price GPU=USD")
            on_cpu = args.torch_device == "cpu"   # the same executors, eager in FP32: the path checked without a GPU
            profile = profile_cuda(args.model, CudaSettings(
                batch_sizes=tuple(batches), repeats=args.repeats if on_cpu else max(args.repeats, 50),
                warmup=args.warmup if on_cpu else max(args.warmup, 5),
                precision="fp32" if args.fp32 or on_cpu else "fp16", graphs=not (args.eager or on_cpu),
                price=next(iter(prices.values()), 1.0), torch_device=args.torch_device or "cuda",
                bls_ms=bls_from_run(args.hops, args.model) if args.hops else ()), untrained=args.untrained)
        elif args.modelled:
            from e3.profiling.modelled_profile import model_modelled_profile
            gpus = [g.strip().lower() for g in args.modelled.split(",") if g.strip()]
            profile = model_modelled_profile(args.model, gpus, batches, prices=parse_prices(args.price))
        else:
            profile = profile_model(args.model, ProfileSettings(
                batch_sizes=tuple(batches), repeats=args.repeats, warmup=args.warmup, tx=not args.no_tx),
                tritonserver=args.tritonserver, data=args.data)
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
    from e3.controller.planner import PlanOptions, PlannerError, best_plan, cheapest_plan, parse_devices, parse_forms
    from e3.controller.report import planner_result_lines
    from e3.core.files import write_atomic
    from e3.core.profile import BatchProfile, LatencyProfile, ProfileError
    try:
        latency = LatencyProfile.load(args.latency_profile)
        if args.data:
            if not args.model:
                raise ValueError("--data needs --model: the model is run on the data to measure its exits")
            from e3.models.workload import data_batch_profile
            batch = data_batch_profile(args.model, args.data, limit=args.limit)
        elif args.batch_profile:
            batch = BatchProfile.load(args.batch_profile)
        elif args.reach:
            batch = BatchProfile(model=latency.model, batch_size=latency.batch_sizes[-1],
                                 reach=[float(r) for r in args.reach.split(",") if r.strip()], source="--reach")
            batch.validate()
        else:
            raise ValueError("give --batch-profile B.json (e3 workload writes them), --reach 1,0.35,... or "
                             "--model M --data FILE")
        devices = parse_devices(args.devices)
        from e3.controller.model_facts import planning_facts
        card = None
        if args.model:
            from e3.models.zoo import resolve_model
            card = resolve_model(args.model).card
        facts = planning_facts(latency, batch, card=card, tau_nats=args.tau_nats)
        common = dict(slo_ms=args.slo_ms, slack=args.slack, pipelined=not args.no_pipelining,
                      forms=parse_forms(args.forms), exit_wrapper=not args.no_exit_wrapper,
                      ramp_blocks=facts.planner_ramps, relies_on=facts.relies_on)
        if args.min_goodput is not None:
            result = cheapest_plan(latency, batch, devices, PlanOptions(goodput_rps=args.min_goodput,
                                                                        rate_rps=args.rate_rps, **common))
        else:
            if args.rate_rps is None:
                raise PlannerError("--rate-rps is needed (or --min-goodput for the cheapest plan reaching a goodput)")
            result = best_plan(latency, batch, devices, PlanOptions(rate_rps=args.rate_rps, alpha=args.alpha, **common))
        plan = result.to_plan(model=latency.model, num_blocks=latency.num_blocks, exit_rule=facts.exit_rule,
                              ramp_blocks=list(facts.ramp_blocks), slo_ms=args.slo_ms, slack=args.slack)
    except (ProfileError, PlannerError, ValueError) as err:
        print(f"e3 plan: error: {err}", file=sys.stderr)
        return 2
    if args.data:
        print(f"batch profile from {args.data}: reach {[round(r, 3) for r in batch.reach]} (measured for "
              f"{len(batch.reach_by_ramps)} sets of ramps)")
    for line in planner_result_lines(result, plan, latency, devices=devices, slo_ms=args.slo_ms, slack=args.slack):
        print(line)
    if result.compared:   # both kinds of plan were weighed: say which won and by how much
        rps = dict(result.compared)
        print(f"  chosen: {'the device form (every split inside the router, on one ' + result.splits[0].device + ')' if result.on_device else 'constant/compact splits'}; "
              + ", ".join(f"best {kind} plan {v:.1f} inputs/s" for kind, v in rps.items()))
    if args.out:
        write_atomic(args.out, plan.to_json())
        print(f"wrote {args.out}")
    if args.batch_profile_out and args.data:
        batch.save(args.batch_profile_out)
        print(f"wrote {args.batch_profile_out}")
    return 0


def _admission(args) -> int:
    from e3.export.repository import ExportError
    from e3.serving.ebird.repository import profile_served_model, stage_policy, workers_name, write_admission
    repo = Path(args.repo)
    try:
        if args.max_workers is None:     # more workers than processes would only queue for one
            args.max_workers = args.worker_processes or 4
        if args.qos_ms <= 0 or args.max_workers < 1 or args.worker_processes < 0:
            raise ValueError("--qos-ms must be > 0, --max-workers >= 1 and --worker-processes >= 0")
        profile = profile_served_model(repo, args.model, args.qos_ms, max_workers=args.max_workers)
        one = {int(b): round(ms, 3) for b, ms in profile["latency_ms"].items()}
        print(f"one worker (ms per batch): {one}; MaxBS for p99 <= {args.qos_ms:g} ms: {profile['max_bs']}")
        if args.policy != "n-ebird":
            print(f"E-Ebird's best worker set per TotalBS: {profile['confs']}")
        policy = stage_policy(args.policy, profile)
        name = write_admission(repo, args.model, policy, name=args.name,
                               worker_processes=args.worker_processes or None, answering=args.answering)
    except (ValueError, ExportError) as err:
        print(f"e3 admission: error: {err}", file=sys.stderr)
        return 2
    models = f"{name},{workers_name(name)}" if args.worker_processes else name
    print(f"wrote {repo / name} ({policy['kind']}, workers {policy.get('engine') or profile['engine']}, answering "
          f"{args.answering}); "
          f"load it with `e3 serve --models {models}` or Triton's load API, and send requests to {name}")
    return 0


def _train(args) -> int:
    from e3.models.recipes import train
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
    from e3.models.evaluate import evaluate, format_evaluation, save_evaluation
    for name in args.models:
        ev = evaluate(name, limit=args.limit, data=args.data)
        print(format_evaluation(ev))
        js, png = save_evaluation(ev, Path(args.out) if args.out else artifacts_dir() / "results")
        print(f"  wrote {js} and {png}\n")
    return 0


def _workload(args) -> int:
    from e3.models.workload import build_workloads, load_workload
    out = Path(args.out) if args.out else artifacts_dir() / "workloads" / (
        served_name(args.model) if ":" in args.model else args.model)
    for path in build_workloads(args.model, out, count=args.count, rate_rps=args.rate_rps, seed=args.seed,
                                data=args.data):
        _, meta = load_workload(path)
        hard = float(meta["hard"].mean())
        print(f"wrote {path} ({meta['count']} inputs, {100 * (1 - hard):.0f}% easy / {100 * hard:.0f}% hard; "
              f"phases: {', '.join(p['mix'] for p in meta['phases'])})")
    return 0


def _models(args) -> int:
    from e3.models.zoo import ZOO
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


def add_export(sub, repo_help: str) -> None:
    """`e3 export`'s arguments."""
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
    e.add_argument("--gpus", type=int, default=0, metavar="N",
                   help="with --target ngc: the splits and the stock model run as KIND_GPU instances spread over "
                        "the pod's GPUs 0..N-1, one instance group per GPU (default 0: CPU instances for ONNX, GPU 0 "
                        "for TensorRT plans)")
    e.add_argument("--split-queue-policy", action="store_true",
                   help="give the splits Triton's queue policy that rejects calls whose deadline expired in their "
                        "queue (off by default: it stops Triton's batcher prefetching; measured p99 4x worse)")
    e.add_argument("--max-queue-inputs", type=int, default=None, metavar="N",
                   help="bound the router: refuse at once (HTTP 503, counted in e3_rejected_total) a request that "
                        "would take the inputs it holds (admitted, not yet answered) past N (default: no bound)")
    e.add_argument("--no-baselines", action="store_true",
                   help="write the E3 path only (no <m>_stock and <m>_ee: e.g. when the stock checkpoint is not "
                        "trained)")
    e.set_defaults(func=_export)


def add_profile(sub, repo_help: str) -> None:
    """`e3 profile`'s arguments."""
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
                    help="measure on this host's NVIDIA GPU with the serving executors (FP16, one CUDA graph per "
                         "batch bucket); the device is named after the GPU (h100, a100, ...); see docs/profiling.md")
    pr.add_argument("--eager", action="store_true", help="with --cuda: eager kernel launches, no CUDA graphs")
    pr.add_argument("--fp32", action="store_true", help="with --cuda: FP32 weights instead of FP16 (model.half())")
    pr.add_argument("--torch-device", default=None, choices=["cuda", "cpu"],
                    help="with --cuda: where the serving executors run (default cuda); cpu runs the same path "
                         "eagerly in FP32, a check of it on a host without a GPU (the device is cpu-eager-fp32)")
    pr.add_argument("--untrained", action="store_true",
                    help="with --cuda: time the architecture with random weights (no trained checkpoint needed; "
                         "latency does not depend on the weights)")
    pr.add_argument("--hops", default=None, metavar="RUN_DIR",
                    help="with --cuda: Tx from the BLS hops a GPU side-by-side run measured inside Triton on this "
                         "GPU (benchmarks/gpu_side_by_side.py's folder), instead of the copies + an assumed 0.2 ms")
    pr.add_argument("--add", action="append", default=[], metavar="PROFILE",
                    help="merge this latency profile file's devices into the output (repeatable)")
    pr.add_argument("--no-tx", action="store_true", help="skip the Tx measurement (no tritonserver; Tx = 0)")
    pr.add_argument("--data", default=None, metavar="FILE",
                    help="time the blocks on states computed from your inputs (.npz of the model's inputs, see "
                         "docs/own-model.md) instead of the model's random example inputs")
    pr.add_argument("--tritonserver", default=None, help="tritonserver binary for the Tx measurement")
    pr.set_defaults(func=_profile)


def add_plan(sub, repo_help: str) -> None:
    """`e3 plan`'s arguments."""
    pl = sub.add_parser("plan", help="plan cuts, instances per split, device configurations and input batch "
                                     "(E3's DP) from a latency profile and a batch profile")
    _planning_args(pl, rate_required=False)
    pl.add_argument("--batch-profile", "--exits", dest="batch_profile", default=None,
                    help="batch profile JSON: share of inputs reaching every block (e3 workload writes one per "
                         "mix); --exits is an old alias. Or --data with --model")
    pl.add_argument("--data", default=None, metavar="FILE",
                    help="measure the batch profile from your data instead (.npz of the model's inputs, see "
                         "docs/own-model.md); needs --model; the exit-wrapper then prices every set "
                         "of ramps with the exits the rule really gives on the data")
    pl.add_argument("--limit", type=int, default=None, help="with --data: the first N inputs only")
    pl.add_argument("--batch-profile-out", default=None, metavar="B.json",
                    help="with --data: also write the measured batch profile here")
    pl.add_argument("--min-goodput", type=float, default=None,
                    help="instead: the cheapest plan whose throughput reaches this many inputs/s (E3 §5.3)")
    pl.add_argument("--no-pipelining", action="store_true", help="splits run one after another (E3 §3.2.1)")
    pl.add_argument("--reach", default=None, metavar="R1,R2,...",
                    help="instead of --batch-profile: the share of inputs reaching every block, e.g. "
                         "1,0.35,0.25,0.22,0.21,0.21 (bert-ee's 80:20 mix)")
    pl.add_argument("--forms", default="constant,compact,device",
                    help="forms to choose from: constant (own Triton model, constant batch), compact (run in the "
                         "router, rows leave between blocks), per split the faster; device (every split inside the "
                         "router on one accelerator, docs/design.md §2b: weighed as a whole plan against the others on every "
                         "configuration that is not a CPU and whose profile has check_ms); default all three")
    pl.add_argument("--no-exit-wrapper", action="store_true",
                    help="keep every ramp (default: disable ramps that cost more than their exits save, E3 §3.4; "
                         "a dependent rule's ramps are re-priced from measured exits, or kept where another ramp "
                         "relies on them)")
    pl.add_argument("--model", default=None, help="zoo model (or module:factory) whose ramps and exit rule the "
                                                  "written plan uses (recommended with --out)")
    pl.add_argument("--tau-nats", type=float, default=0.5,
                    help="entropy threshold (nats) written into the plan without --model (default 0.5)")
    pl.add_argument("--out", default=None, help="write the plan JSON here (atomically)")
    pl.set_defaults(func=_plan)


def add_admission(sub, repo_help: str) -> None:
    """`e3 admission`'s arguments."""
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
    ad.add_argument("--answering", choices=["continuous", "inline"], default="continuous",
                    help="continuous (default: execute submits and returns, arrivals are staged while workers "
                         "compute) or inline (the fallback: each execute runs its own requests out)")
    ad.add_argument("--name", default=None, help="the stage's Triton name (default <model>_admission)")
    ad.set_defaults(func=_admission)


def add_train(sub, repo_help: str) -> None:
    """`e3 train`'s arguments."""
    t = sub.add_parser("train", help="train zoo models on their data (cached checkpoints under artifacts/)")
    t.add_argument("models", nargs="+", help="bert-ee, bert-stock, pabee, resnet-ee, resnet-stock")
    t.add_argument("--quick", action="store_true", help="a few hundred examples: checks the pipeline in seconds")
    t.add_argument("--retune", action="store_true", help="resnet-ee: keep the weights, choose τ again")
    t.set_defaults(func=_train)


def add_evaluate(sub, repo_help: str) -> None:
    """`e3 evaluate`'s arguments."""
    ev = sub.add_parser("evaluate", help="accuracy and exits against the threshold, compute saved vs stock")
    ev.add_argument("models", nargs="+", help="bert-ee, pabee, resnet-ee, or package.module:factory with --data")
    ev.add_argument("--limit", type=int, default=None, help="evaluate the first N test inputs only")
    ev.add_argument("--data", default=None, metavar="FILE",
                    help="evaluate on your data: a .npz with one array per model input (named as the model card "
                         "names them) and 'labels' (int64 [N]); any model (docs/own-model.md)")
    ev.add_argument("--out", default=None, metavar="FOLDER",
                    help="folder for <m>.evaluation.json and .png (default artifacts/results)")
    ev.set_defaults(func=_evaluate)


def add_workload(sub, repo_help: str) -> None:
    """`e3 workload`'s arguments."""
    w = sub.add_parser("workload", help="easy/hard mixes 80:20, 50:50, 20:80 and a switching stream")
    w.add_argument("model", help="bert-ee, pabee, resnet-ee, or package.module:factory with --data")
    w.add_argument("--data", default=None, metavar="FILE",
                   help="bin your data's inputs instead of a zoo test split (.npz of the model's inputs and "
                        "'labels'; docs/own-model.md)")
    w.add_argument("--count", type=int, default=1000, help="inputs per mix (default 1000)")
    w.add_argument("--rate-rps", type=float, default=50.0, help="nominal arrival rate for the stream's phase times")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--out", default=None, help="folder (default artifacts/workloads/MODEL)")
    w.set_defaults(func=_workload)


def add_models(sub, repo_help: str) -> None:
    """`e3 models`'s arguments."""
    m = sub.add_parser("models", help="list the model zoo")
    m.set_defaults(func=_models)


def add_clean(sub, repo_help: str) -> None:
    """`e3 clean`'s arguments."""
    c = sub.add_parser("clean", help="remove artifacts/ and the generated model repository")
    c.add_argument("--repo", default=str(default_repository()), help=repo_help)
    c.set_defaults(func=_clean)
