"""`e3 bench ...`: parse, call the driver in `e3.benchmarks`, print its errors."""

from __future__ import annotations

# Deferred imports: every verb loads its own benchmark's room when it runs (the CLI starts without them).

import sys
from pathlib import Path


def _refusing(command: str, run) -> int:
    """Run ``run()``: a ValueError is the user's input, printed as ``<command>: error: ...`` (exit 2)."""
    try:
        run()
    except ValueError as err:
        print(f"{command}: error: {err}", file=sys.stderr)
        return 2
    return 0


def _names(text: str | None, default: tuple[str, ...]) -> tuple[str, ...]:
    """``--models a,b`` as a tuple (``default`` when not given)."""
    return default if text is None else tuple(m.strip() for m in text.split(",") if m.strip())


def parse_forced_baselines(text: str | None, cores: int = 2):
    """``--baselines 1x2,2x1`` -> those configurations (instances x threads, no queue delay), each using all
    ``cores``; None -> None (calibrate)."""
    if text is None:
        return None
    from e3.benchmarks.side_by_side_report import BaselineConfig   # numpy stays out of `e3 --help`
    out = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        inst, _, thr = part.partition("x")
        if not (inst.isdigit() and thr.isdigit()) or int(inst) < 1 or int(thr) < 1:
            raise ValueError(f"--baselines takes INSTANCESxTHREADS, comma-separated, e.g. 1x2,2x1; got {part!r}")
        if int(inst) * int(thr) != cores:
            raise ValueError(f"--baselines {part}: instances x threads must use the {cores} cores every system gets")
        out.append(BaselineConfig(int(inst), int(thr), 0))
    if not out:
        raise ValueError("--baselines names no configuration, e.g. 1x2,2x1")
    return tuple(out)


def _bench_all(args) -> int:
    from e3.benchmarks.side_by_side import run_evaluation
    return _refusing("e3 bench", lambda: run_evaluation(quick=args.quick, model=args.model,
                                                        baselines=parse_forced_baselines(args.baselines)))


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


def _bench_simulator(args) -> int:
    from e3.benchmarks.side_by_side import run_simulator_validation
    return _refusing("e3 bench simulator", lambda: run_simulator_validation(
        Path(args.measured) if args.measured else None, Path(args.out) if args.out else None, docs=args.docs,
        profile=Path(args.profile) if args.profile else None, speed=Path(args.speed) if args.speed else None))


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


def _bench_machine_speed(args) -> int:
    from e3.benchmarks.machine_speed import SpeedSettings, run_machine_speed
    return _refusing("e3 bench machine-speed", lambda: run_machine_speed(SpeedSettings(
        model=args.model, seconds=args.seconds, batch=args.batch, calls=args.calls,
        out=Path(args.out) if args.out else None)))


def _bench_repeatability(args) -> int:
    from e3.benchmarks.repeatability import run_repeatability
    return _refusing("e3 bench repeatability", lambda: run_repeatability(Path(args.a), Path(args.b)))


def _bench_gpu(args) -> int:
    from e3.benchmarks.gpu_sim import run_gpu_bench, run_measured_gpu_bench
    from e3.benchmarks import gpu_side_by_side_report as sbs
    if args.measured and sbs.is_side_by_side(args.measured):   # a run of benchmarks/gpu_side_by_side.py
        def render():
            print(sbs.render_side_by_side(sbs.load_side_by_side(args.measured)) if args.no_docs else
                  sbs.write_side_by_side_section(Path(args.measured)), end="")
        return _refusing("e3 bench gpu", render)
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
    if args.measured:
        from e3.benchmarks.admission_triton_report import write_admission_triton_section
        from e3.paths import project_root

        def render():
            try:
                write_admission_triton_section(args.measured, project_root() / "docs" / "RESULTS.md")
            except FileNotFoundError as err:
                raise ValueError(str(err)) from None
            print(f"wrote the section of docs/RESULTS.md from {args.measured}")
        return _refusing("e3 bench admission", render)
    if args.cuda or args.report:
        return _bench_admission_gpu(args)

    def run():
        models = _names(args.models, AdmissionBenchSettings.models)
        if not models or args.cores < 1 or (args.qos_ms is not None and args.qos_ms <= 0):
            raise ValueError("give at least one model, --cores >= 1 and a positive --qos-ms")
        run_admission_bench(AdmissionBenchSettings(models=models, cores=args.cores, qos_ms=args.qos_ms,
                                                   out=Path(args.out) if args.out else None, quick=args.quick))
    return _refusing("e3 bench admission", run)


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


def _bench_generate(args) -> int:
    from e3.benchmarks.generation import GenerateBenchSettings, run_generate_bench
    from e3.benchmarks.generation_frontier import FrontierSettings, run_frontier
    try:
        floats = lambda text: tuple(float(t) for t in text.split(",") if t)
        if not args.frontier_only:
            run_generate_bench(GenerateBenchSettings(
                model=args.model, prompts=args.prompts, new_tokens=args.new_tokens, targets=floats(args.min_agreement),
                taus=floats(args.taus), draft_tokens=args.draft_tokens, rounds=args.rounds,
                lossless_prompts=args.lossless_prompts, extra_systems=args.extra_systems,
                out=Path(args.out) if args.out else None, write_docs=not args.no_docs))
        run_frontier(FrontierSettings(model=args.model, new_tokens=args.new_tokens, rounds=args.frontier_rounds,
                                      point_rounds=args.frontier_rounds,
                                      concurrent=args.concurrent, draft_tokens=args.draft_tokens,
                                      write_docs=not args.no_docs))
    except (ValueError, FileNotFoundError) as err:
        print(f"e3 bench generate: error: {err}", file=sys.stderr)
        return 2
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


def _model_flag(p, note: str = "") -> None:
    """``--model``: the zoo model whose workload mixes a bench runs."""
    p.add_argument("--model", default="bert-ee", help=f"zoo model with workload mixes (default bert-ee{note})")


def _verb(bsub, name: str, func, help: str, *, model_note: str | None = None):
    """One ``e3 bench`` sub-verb: its parser, its handler and (``model_note`` given) its ``--model`` flag."""
    p = bsub.add_parser(name, help=help)
    p.set_defaults(func=func)
    if model_note is not None:
        _model_flag(p, model_note)
    return p


def _closed_loop_flags(p, concurrency: str, inputs: str, repeats: str) -> None:
    """A closed-loop bench's clients, inputs per run and runs (the same flags and defaults, each bench's help)."""
    p.add_argument("--concurrency", type=int, default=16, help=concurrency)
    p.add_argument("--inputs", type=int, default=1600, help=inputs)
    p.add_argument("--repeats", type=int, default=3, help=repeats)


def add_bench(sub, repo_help: str) -> None:
    """`e3 bench`'s arguments."""
    b = sub.add_parser("bench", help="benchmarks: E3 against the stock and early-exit baselines, side by side")
    b.add_argument("--quick", action="store_true", help="without a BENCHMARK: the 80:20 mix, 5 runs per cell, "
                                                        "fewer inputs (minutes)")
    b.add_argument("--model", default="bert-ee", help="without a BENCHMARK: the zoo model (default bert-ee)")
    b.add_argument("--baselines", default=None, metavar="IxT,...",
                   help="without a BENCHMARK: measure every baseline in each of these configurations (instances x "
                        "threads, no queue delay, e.g. 1x2,2x1) instead of calibrating, and validate the simulator "
                        "on all of them; its own JSON files and section of docs/RESULTS.md, no perf_analyzer check")
    b.set_defaults(func=_bench_all)
    bsub = b.add_subparsers(dest="bench", required=False, metavar="BENCHMARK",
                            help="one benchmark; none: goodput against batch for E3, stock and naive EE and the "
                                 "simulator's validation and the perf_analyzer check, written into docs/RESULTS.md")
    sbs = _verb(bsub, "side-by-side", _bench_side_by_side, "E3, <m>_stock and <m>_ee on one server at one core budget, per mix "
                                               "and request size; writes artifacts/results/side_by_side.json", model_note="; trained when missing")
    sbs.add_argument("--mixes", default="80-20,50-50,20-80", help="easy-hard mixes (default 80-20,50-50,20-80)")
    sbs.add_argument("--batches", default="1,8", help="inputs per request, comma-separated (default 1,8)")
    sbs.add_argument("--cores", type=int, default=2, help="cores every system gets: instances x threads (default 2)")
    _closed_loop_flags(sbs, "closed-loop clients (default 16)", "inputs per measured run (default 1600)",
                       "measured runs per system and cell, interleaved; a cell reports their rate together and the median "
                       "of their p50 and p99 (default 3)")
    sbs.add_argument("--out", default=None, help="results JSON (default artifacts/results/side_by_side.json)")
    sim = _verb(bsub, "simulator", _bench_simulator, "the discrete-event simulator against real runs: every run of a "
                                            "side-by-side (its cells, forced configurations and calibration runs) "
                                            "simulated with the same profile, plans, configs and load; writes "
                                            "artifacts/results/simulator_validation.json")
    sim.add_argument("--measured", default=None,
                     help="side-by-side results to validate against (default artifacts/results/side_by_side.json)")
    sim.add_argument("--out", default=None, help="validation JSON (default artifacts/results/simulator_validation.json)")
    sim.add_argument("--profile", default=None, help="the latency profile to price the runs with (default the "
                                                     "model's, artifacts/profiles/<model>.cpu.json; it warns where "
                                                     "that is not the profile the runs were made with)")
    sim.add_argument("--speed", default=None, metavar="TRACE",
                     help="a trace of `e3 bench machine-speed`: simulate the machine's two speeds in spells "
                          "(default one speed)")
    sim.add_argument("--docs", action="store_true", help="also rewrite the measured run's section of docs/RESULTS.md "
                                                         "with this validation (as `e3 bench` does after measuring)")
    prf = _verb(bsub, "perf", _bench_perf, "perf_analyzer against the load generator on E3's front door (<m>_router), "
                                       "same concurrency, inputs per request and inputs, alternating runs: agree "
                                       "within 10%%; writes artifacts/results/perf_check.json and perf_analyzer's "
                                       "input data artifacts/results/perf_input_<m>.json", model_note="")
    prf.add_argument("--mix", default="80-20", help="easy-hard workload mix (default 80-20)")
    prf.add_argument("--batch", type=int, default=8, help="inputs per request (default 8)")
    _closed_loop_flags(prf, "requests in flight, both tools (default 16)", "inputs per load-generator run (default 1600)",
                       "runs of each tool, alternating (default 3)")
    spd = _verb(bsub, "machine-speed", _bench_machine_speed, "how this machine's speed moves with nothing else "
                "running: the model's stock graph on 1 thread timed back to back, its fast and slow spells; writes "
                "artifacts/results/machine_speed.json", model_note="")
    spd.add_argument("--seconds", type=float, default=150.0, help="how long to trace (default 150)")
    spd.add_argument("--batch", type=int, default=8, help="rows per call of the stock graph (default 8)")
    spd.add_argument("--calls", type=int, default=8, help="calls per reading (default 8)")
    spd.add_argument("--out", default=None, help="trace JSON (default artifacts/results/machine_speed.json)")
    rep = _verb(bsub, "repeatability", _bench_repeatability, "two side-by-side runs against each other with the "
                "simulator's bar: how far the machine itself moves between benches (the cells both measured)")
    rep.add_argument("a", metavar="A", help="a results JSON of `e3 bench` or `e3 bench side-by-side`")
    rep.add_argument("b", metavar="B", help="another, of the same model")
    gpu = _verb(bsub, "gpu", _bench_gpu, "GPU clusters by simulation with MODELLED GPU profiles: goodput against "
                                      "inputs per request on 16 V100s for E3, stock and naive EE, heterogeneity at "
                                      "fixed cost, cost at fixed goodput; writes artifacts/results/gpu_sim.json, "
                                      "docs/figures/gpu_goodput_vs_batch.png and a section of docs/RESULTS.md", model_note="")
    gpu.add_argument("--quick", action="store_true", help="fewer saturation levels and baseline configurations, "
                                                          "shorter simulations (a few minutes)")
    gpu.add_argument("--out", default=None, help="results JSON (default artifacts/results/gpu_sim.json)")
    gpu.add_argument("--no-docs", action="store_true", help="do not write the plot or docs/RESULTS.md")
    gpu.add_argument("--measured", default=None, metavar="PROFILE|RUN_DIR",
                     help="instead: simulate 16 GPUs of a MEASURED GPU profile (e3 profile --cuda) and write it "
                          "beside the modelled ones (artifacts/results/gpu_sim_measured.json, its own section); "
                          "or, given the folder (or side_by_side.json) of benchmarks/gpu_side_by_side.py, render "
                          "that side-by-side run into its section of docs/RESULTS.md")
    gpu.add_argument("--beside", action="append", default=[], metavar="PROFILE",
                     help="with --measured: more measured profiles for the side-by-side table (repeatable)")
    adm = _verb(bsub, "admission", _bench_admission, "E²bird's elastic admission stage (N-Ebird, E-Ebird) against Triton's "
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
    adm.add_argument("--measured", default=None, metavar="RUN",
                     help="do not run: write docs/RESULTS.md's section on the stage through Triton on a GPU from a "
                          "run of benchmarks/admission_triton.py (its folder or admission_triton.json, e.g. "
                          "docs/data/h200/admission_triton.json)")
    adm.add_argument("--report", default=None, metavar="JSON",
                     help="with --cuda: do not run; write docs/RESULTS.md's GPU section from a saved run (e.g. one "
                          "made by benchmarks/gpu_host.py on a GPU host)")
    gen = _verb(bsub, "generate", _bench_generate, "early-exit generation on one server: tokens/s (ratio to the full "
                                           "model, interleaved rounds), TTFT, TPOT of the full model, CALM at "
                                           "calibrated --min-agreement targets and lossless speculation; agreement, "
                                           "perplexity, confidence measure, decision and head costs; a lossless check "
                                           "on held-out prompts; writes artifacts/results/generation.json and a "
                                           "section of docs/RESULTS.md")
    gen.add_argument("--model", default="smollm2-ee", help="generation model (default smollm2-ee; its exit heads are "
                                                          "trained on first use, a few minutes)")
    gen.add_argument("--prompts", type=int, default=16, help="held-out prompts (default 16)")
    gen.add_argument("--new-tokens", type=int, default=32, help="tokens generated per prompt (default 32)")
    gen.add_argument("--min-agreement", default="0.9,0.95", help="CALM quality targets of the speed table, "
                                                                  "comma-separated (default 0.9,0.95; calibrated at export)")
    gen.add_argument("--taus", default="0.5,0.9", help="raw softmax thresholds listed in the quality table")
    gen.add_argument("--draft-tokens", type=int, default=4, help="most tokens a speculative round drafts (default 4)")
    gen.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the speed table (default 3)")
    gen.add_argument("--lossless-prompts", type=int, default=50, help="held-out prompts of the lossless check (default 50)")
    gen.add_argument("--extra-systems", action="store_true", help="also KV passed as tensors, naive early exit and "
                                                                  "the full model one at a time")
    gen.add_argument("--out", default=None, help="results JSON (default artifacts/results/generation.json)")
    gen.add_argument("--no-docs", action="store_true", help="do not update docs/RESULTS.md")
    gen.add_argument("--frontier-only", action="store_true", help="only the speed/quality frontier and the plain-call "
                                                                  "check (issue 40), not the tables before it")
    gen.add_argument("--frontier-rounds", type=int, default=5, help="interleaved rounds of the plain-call check "
                                                                    "and of each operating point (default 5)")
    gen.add_argument("--concurrent", type=int, default=8, help="prompts sent at once in the frontier (default 8)")
    hel = _verb(bsub, "helios", _bench_helios, "HELIOS against each of its candidates alone, one server, one memory budget: "
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
    exg = _verb(bsub, "exegpt", _bench_exegpt, "ExeGPT on Triton: the schedule (RRA on one worker or WAA on an encode and "
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
