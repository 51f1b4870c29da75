"""`e3 bench admission`: E²bird's elastic admission stage against Triton's own dynamic batcher, on one
server, at one core budget (E²bird Figs. 13 and 14 analogues).

For each model (its stock form, ``<m>_stock``, one input per request):

1. **Offline phase** (in this process, before the server starts): one worker's latency per batch,
   MaxBS for the QoS target, and E-Ebird's best worker set per TotalBS
   (:func:`e3.serving.ebird.repository.profile_admission`). The QoS target defaults to
   ``qos_factor`` x the latency of a batch of 16 alone on one thread (at least ``qos_floor_ms``), so
   that MaxBS is about 16.
2. **Systems** on the same server and cores:

   - ``NO_Wait``: Triton's dynamic batcher, no delay, 1 instance x ``cores`` threads;
   - ``OPT_Wait``: the same with the delay that gave the most throughput at the QoS target in a
     sweep (``delays_us``);
   - ``instances``: ``cores`` instances x 1 thread, no delay;
   - ``N-Ebird`` and ``E-Ebird``: the admission stage (one Python process: staging and scheduling, no
     compute) whose workers' batches run on ``cores`` Triton instances x 1 thread of its workers' model
     (processes), at most ``cores`` batches at once and MaxBS inputs in flight; E-Ebird's worker sets
     are profiled with at most ``cores`` workers;
   - ``E-Ebird (threads)``: the same E-Ebird stage with its workers as threads of the stage's own
     process on one shared session (the paper's one copy of the weights), the earlier design, measured
     beside it.

   Every Triton baseline's batch is capped at MaxBS (its ``max_batch_size``), as the stage's is. Each
   baseline is its own copy of the stock model and all systems are loaded at once, so that they take
   turns (the machine may be shared: interleaving spreads a neighbour's load over all systems alike; the
   load average at the start and end is recorded beside the figures).
3. **Fig. 14 analogue**: open-loop Poisson runs at rising rates (fractions of NO_Wait's
   closed-loop capacity), every system in turn at each rate, a miss confirmed by a second run;
   throughput at the QoS target per system (:func:`e3.benchmarks.admission_report.throughput_at_qos`).
4. **Fig. 13 analogue**: a low -> high -> low burst (``burst_fractions`` of that capacity: the high
   phase offers what NO_Wait sustains in a closed loop, which Poisson arrivals turn into a queue),
   ``burst_rounds`` times per system, the systems in turn; p50 / p99 per phase per system over the rounds
   pooled, and a plot of latency over time (the first round).

**What a CPU cannot show, and is not emulated.** E²bird's memory pool overlaps the host-to-GPU copy of
each input with compute. Here inputs land in host memory that ONNX Runtime reads directly: a bert
input is 768 bytes (a 28x28 image 3 KiB), which PCIe 3 x16 would move in well under a microsecond,
< 0.01% of a batch's compute; emulating that copy would change no figure, so none is added. The
staging itself (answering nothing until a worker takes the input, no batch-forming wait) is real, and
the client, on the server's machine, hands every system its inputs through Triton's system shared memory
(``shm``, on by default, for all systems alike).

Glue only: the policies live in :mod:`e3.serving.ebird.policy`, the figures in
:mod:`e3.benchmarks.admission_report`.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from e3.benchmarks.admission_report import (Phase, RatePoint, admission_markdown, burst_schedule, format_burst,
                                        format_throughput, meets, phase_latencies, throughput_at_qos)
from e3.benchmarks.report import commit, replace_section
from e3.client.loadgen import closed_loop, open_loop, scheduled_records
from e3.client.sdk import ClientError
from e3.controller.triton_api import TritonControl
from e3.core.files import write_atomic, write_json_atomic
from e3.core.names import served_name, stock_name
from e3.deploy.server import TritonServer
from e3.export.repository import ExportSettings, export_repository
from e3.models.recipes import missing_checkpoints, train
from e3.models.zoo import resolve_model
from e3.paths import artifacts_dir
from e3.serving.ebird.repository import naive_engine, profile_admission, workers_name, write_admission

__all__ = ["AdmissionBenchSettings", "run_admission_bench"]

DOCS = Path(__file__).resolve().parent.parent / "docs"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AdmissionBenchSettings:
    models: tuple[str, ...] = ("bert-ee", "resnet-ee")
    cores: int = 2
    qos_ms: float | None = None          # None: qos_factor x the latency of a batch of 16 (per model)
    qos_factor: float = 2.5
    qos_floor_ms: float = 50.0           # a default target never below this: the client and HTTP alone take ms
    rate_fractions: tuple[float, ...] = (0.3, 0.5, 0.7, 0.85, 1.0, 1.15, 1.3, 1.5)  # of NO_Wait's capacity
    burst_fractions: tuple[float, float] = (0.3, 1.0)   # low, high (of NO_Wait's closed-loop capacity: open-loop
    #                                                     arrivals at that rate queue behind the untuned batcher)
    run_s: float = 6.0                   # one rate of the sweep
    phase_s: float = 8.0                 # one phase of the burst
    delays_us: tuple[int, ...] = (1000, 4000, 16000)   # OPT_Wait's sweep
    burst_rounds: int = 2                # bursts per system, interleaved; per-phase figures pool them
    profile_clock: str = "cpu"           # the offline phase by thread CPU time: a shared machine's load does
    #                                      not move the QoS target, MaxBS or E-Ebird's sets (export.admission)
    closed_rounds: int = 3               # closed-loop runs per system (capacity, CPU per input), interleaved
    closed_requests_per_bs: int = 40     # requests of one closed-loop run, per input of MaxBS
    workers: int = 96                    # client threads (open loop)
    shm: bool = True                     # inputs through system shared memory, for every system alike
    out: Path | None = None              # default artifacts/results/admission.json
    quick: bool = False
    results_md: Path | None = DOCS / "RESULTS.md"   # None: leave docs alone

    def shortened(self) -> "AdmissionBenchSettings":
        """``--quick``: fewer rates, shorter runs, one OPT_Wait delay."""
        return dataclasses.replace(self, rate_fractions=(0.5, 0.85, 1.0, 1.2, 1.4), run_s=3.0, phase_s=4.0,
                                   delays_us=(4000,), closed_rounds=2, closed_requests_per_bs=20, quick=True)


def run_admission_bench(settings: AdmissionBenchSettings = AdmissionBenchSettings(), echo=print) -> dict:
    """Run the benchmark for every model; returns the results document (also written to ``settings.out``)."""
    if settings.quick:
        settings = settings.shortened()
    out = settings.out or artifacts_dir() / "results" / "admission.json"
    doc = {"cores": settings.cores, "commit": commit(), "quick": settings.quick, "models": {}}
    for name in settings.models:
        try:
            doc["models"][name] = _bench_model(name, settings, echo)
        except ClientError as err:   # the server stopped answering (seen once: a crash under a load average of 9)
            log.error("%s: the benchmark's server failed: %s; the other models go on", name, err)
            echo(f"[failed] {name}: {err} (server log: artifacts/logs/bench-admission-tritonserver.log)")
            doc["models"][name] = {"error": str(err)}
        write_json_atomic(out, doc, indent=1)
    echo(f"[done] results: {out}")
    if settings.results_md is not None:
        command = "e3 bench admission" + (" --quick" if settings.quick else "")
        text = settings.results_md.read_text() if settings.results_md.exists() else "# Measured results\n"
        write_atomic(settings.results_md, replace_section(text, admission_markdown(doc, command),
                                                          name="e3 bench admission"))
        echo(f"[done] wrote the generated section of {settings.results_md}")
    return doc


def _bench_model(name: str, settings: AdmissionBenchSettings, echo) -> dict:
    for missing in missing_checkpoints(name):
        echo(f"[setup] {missing} is not trained yet: training it now (once; cached under artifacts/checkpoints)")
        train(missing)
    m = served_name(name)
    stock = stock_name(m)
    repo = artifacts_dir() / "admission-repo" / m
    if not (repo / stock / "1" / "model.onnx").exists():
        echo(f"[setup] exporting {name} into {repo}")
        export_repository(name, None, repo, settings=ExportSettings(baseline_instances=1), progress=False)
    pool = resolve_model(name).example_arrays(256, seed=0)
    onnx = repo / stock / "1" / "model.onnx"
    qos_ms = settings.qos_ms
    if qos_ms is None:
        alone = profile_admission(onnx, pool, 1e9, batches=(16,), totals=(), repeats=3, progress=False,
                                  clock=settings.profile_clock)
        qos_ms = max(settings.qos_floor_ms, round(settings.qos_factor * alone["latency_ms"]["16"], -1))
    echo(f"[offline] {stock}: profiling workers for a QoS target of {qos_ms:.0f} ms (p99)")
    # sets of at most `cores` workers: the stage runs at most `cores` batches at once (one per process)
    profile = profile_admission(onnx, pool, qos_ms, max_workers=settings.cores, clock=settings.profile_clock)
    max_bs = profile["max_bs"]
    echo(f"[offline] latency of one worker (ms): {profile['latency_ms']}; MaxBS {max_bs}; "
         f"E-Ebird sets per TotalBS: {profile['confs']}")
    eebird = {"kind": "e-ebird", "confs": profile["confs"], "max_inflight": max_bs}
    stages = {"N-Ebird": write_admission(repo, stock, {"kind": "n-ebird", "engine": naive_engine(max_bs),
                                                       "max_inflight": max_bs}, name=f"{stock}_nebird",
                                         worker_processes=settings.cores),
              "E-Ebird": write_admission(repo, stock, eebird, name=f"{stock}_eebird", worker_processes=settings.cores),
              # threads: at most `cores` batches at once too (measured on bert: uncapped, up to 7 runs time-sliced
              # the 2 cores and spent 5-9% more CPU per input)
              "E-Ebird (threads)": write_admission(repo, stock, {**eebird, "slots": settings.cores},
                                                   name=f"{stock}_eebird_threads",
                                                   worker_processes=None)}
    workers = [workers_name(stages["N-Ebird"]), workers_name(stages["E-Ebird"])]
    budget = (f"{settings.cores} cores: Triton baselines instances x threads = {settings.cores}; E²bird's "
              f"batches on {settings.cores} instances x 1 thread of its workers' model (at most {settings.cores} "
              f"at once, <= {max_bs} inputs in flight) plus the stage's process (staging, scheduling, no compute); "
              f"E-Ebird (threads): its workers as threads of 1 intra-op thread each in the stage's process")
    log_file = artifacts_dir() / "logs" / "bench-admission-tritonserver.log"
    result = {"stock": stock, "qos_ms": qos_ms, "offline": profile, "budget": budget}
    load_start = os.getloadavg()[0]   # the machine may be shared: the figures come with its load
    # Every Triton baseline is its own copy of the stock model, all loaded at once, so that the systems
    # take turns at every rate (interleaved: a neighbour's load on the machine falls on all of them alike).
    cores = settings.cores
    baselines = {"NO_Wait": (1, cores, 0), f"instances ({cores}x1)": (cores, 1, 0),
                 **{f"wait {d} us": (1, cores, d) for d in settings.delays_us}}
    copies = {label: _copy_model(repo, stock, f"{stock}_bench_{i}") for i, label in enumerate(baselines)}
    with TritonServer.on_free_ports(repo, [*stages.values(), *workers], log_file=log_file) as server, \
            TritonControl(server.http_url) as control:
        url = server.http_url
        control.load(stock)
        base = copy.deepcopy(control.model_config(stock))
        control.unload(stock)
        configs = {}
        for label, (instances, threads, delay_us) in baselines.items():
            config = copy.deepcopy(base)
            config["name"] = copies[label]
            config["max_batch_size"] = max_bs
            config["instance_group"] = [{"count": instances, "kind": "KIND_CPU"}]
            config.setdefault("parameters", {})["intra_op_threads"] = {"string_value": str(threads)}
            config["dynamic_batching"] = {"max_queue_delay_microseconds": delay_us}
            control.load(copies[label], config)
            configs[label] = f"{instances} inst x {threads} thr, delay {delay_us} us, max batch {max_bs}"
        systems = {label: copies[label] for label in baselines}
        systems.update(stages)
        configs.update({k: f"workers {_engine_of(profile, k, max_bs)} x 1 thr, {_worker_note(k, cores)}"
                        for k in stages})
        for model in systems.values():      # warm-up: first runs allocate, stages' workers connect
            closed_loop(url, model, pool, concurrency=4, batch=1, requests=4 * max_bs, warmup=1, shm=settings.shm)
        closed = _closed_loops(server, systems, pool, max_bs, settings, echo)
        capacity = closed["NO_Wait"]["inputs_per_s"]
        echo(f"[capacity] NO_Wait closed loop: {capacity:.1f} inputs/s; rates are fractions of it")
        rates = [round(f * capacity, 1) for f in settings.rate_fractions]

        points = _sweep(url, systems, pool, rates, qos_ms, settings, echo)
        sweep = {label: {"config": configs[label], "points": [p.__dict__ for p in points[label]],
                         "throughput_rps": throughput_at_qos(points[label], qos_ms)} for label in systems}
        # OPT_Wait: the delay (0 included: NO_Wait's run) with the most throughput at the target
        delays = {0: "NO_Wait", **{d: f"wait {d} us" for d in settings.delays_us}}
        opt_delay = max(delays, key=lambda d: sweep[delays[d]]["throughput_rps"])
        opt = delays[opt_delay]
        table = [{"system": "NO_Wait", **_pick(sweep["NO_Wait"])},
                 {"system": f"OPT_Wait ({opt_delay} us)", **_pick(sweep[opt])},
                 {"system": f"instances ({cores}x1)", **_pick(sweep[f"instances ({cores}x1)"])}]
        table += [{"system": k, **_pick(sweep[k])} for k in stages]
        echo(format_throughput(table, qos_ms, budget))

        low, high = (round(f * capacity, 1) for f in settings.burst_fractions)
        phases = [Phase("low", low, settings.phase_s), Phase("high", high, settings.phase_s),
                  Phase("low", low, settings.phase_s)]
        burst_systems = {"NO_Wait": systems["NO_Wait"], f"OPT_Wait ({opt_delay} us)": systems[opt],
                         f"instances ({cores}x1)": systems[f"instances ({cores}x1)"], **stages}
        burst, traces = _bursts(url, burst_systems, pool, phases, qos_ms, settings, echo)
        echo(format_burst(burst, qos_ms, budget))
        plot = _plot_burst(traces, phases, qos_ms, m)
    result.update(capacity_ips=capacity, closed_loop=closed, rates=rates, sweep=sweep, throughput=table, burst=burst,
                  burst_rounds=settings.burst_rounds, load_avg=[load_start, os.getloadavg()[0]], burst_figure=f"figures/{plot.name}" if plot else None)
    return result


def _engine_of(profile: dict, kind: str, max_bs: int) -> list[int]:
    return naive_engine(max_bs) if kind == "N-Ebird" else profile["engine"]


def _worker_note(kind: str, cores: int) -> str:
    """Where a stage's workers run, for its configuration column."""
    return "threads of the stage" if "threads" in kind else f"on {cores} processes"


def _pick(entry: dict) -> dict:
    return {"throughput_rps": entry["throughput_rps"], "config": entry["config"]}


def _copy_model(repo: Path, stock: str, name: str) -> str:
    """``name``: a copy of model ``stock`` in ``repo`` (its ONNX file hard-linked where the filesystem allows),
    so that each Triton baseline is loaded with its own configuration beside the others."""
    dest = repo / name
    if dest.exists():
        shutil.rmtree(dest)

    def link(src, dst):
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)
    shutil.copytree(repo / stock, dest, copy_function=link, ignore=shutil.ignore_patterns("__pycache__"))
    config = dest / "config.pbtxt"
    config.unlink()   # a hard link: write a new file, not through the link into the stock model's config
    config.write_text((repo / stock / "config.pbtxt").read_text().replace(f'name: "{stock}"', f'name: "{name}"', 1))
    return name


def _closed_loops(server, systems: dict[str, str], pool, max_bs: int, settings, echo) -> dict[str, dict]:
    """Per system, the median over ``settings.closed_rounds`` closed-loop runs (2 x MaxBS clients, the systems
    in turn) of its inputs/s and of the server's CPU milliseconds per input (tritonserver and every stub;
    only the system under load works meanwhile). CPU per input is what a neighbour's load on a shared
    machine disturbs least: at a budget of ``cores``, ``cores x 1000 / (CPU ms per input)`` bounds the
    inputs/s a system can reach."""
    runs: dict[str, list[tuple[float, float]]] = {label: [] for label in systems}
    labels = list(systems)
    requests = settings.closed_requests_per_bs * max_bs
    for r in range(settings.closed_rounds):
        for label in labels[r % len(labels):] + labels[:r % len(labels)]:
            before = server.cpu_s()
            got = closed_loop(server.http_url, systems[label], pool, concurrency=2 * max_bs, batch=1,
                              requests=requests, warmup=1, shm=settings.shm)
            runs[label].append((got.throughput_ips, (server.cpu_s() - before) * 1e3 / requests))
            echo(f"[closed loop] round {r + 1} {label:<20} {got.throughput_ips:7.1f} inputs/s, "
                 f"server CPU {runs[label][-1][1]:.2f} ms per input")
    return {label: {"inputs_per_s": float(np.median([x for x, _ in v])),
                    "cpu_ms_per_input": float(np.median([c for _, c in v]))} for label, v in runs.items()}


def _sweep(url, systems: dict[str, str], pool, rates, qos_ms, settings, echo) -> dict[str, list[RatePoint]]:
    """Rising rates, every system in turn at each rate (the order rotates from one rate to the next), until
    each system's first rate that misses the target (that one is kept: it bounds the figure). A miss is
    run again at once and the better run kept, so one run disturbed by a neighbour's load on the machine
    does not end a system's sweep. Past the listed rates, 15% more each step (up to 4x the last listed),
    so no system's figure is capped by the ladder."""
    ladder = list(rates)
    while ladder[-1] < 4 * rates[-1]:
        ladder.append(round(ladder[-1] * 1.15, 1))
    run_s = max(settings.run_s, 4 * qos_ms / 1e3)   # long enough for a falling-behind queue to show in p99

    def run(model: str, rate: float) -> RatePoint:
        r = open_loop(url, model, pool, rate_rps=rate, duration_s=run_s, batch=1,
                      workers=settings.workers, seed=int(rate), shm=settings.shm)
        return RatePoint(rate, (r.requests - r.errors) / run_s, r.percentile_ms(99), r.errors)

    points: dict[str, list[RatePoint]] = {label: [] for label in systems}
    active = list(systems)
    for i, rate in enumerate(ladder):
        if not active:
            break
        k = i % len(active)
        for label in active[k:] + active[:k]:
            point = run(systems[label], rate)
            if not meets(point, qos_ms):
                again = run(systems[label], rate)
                point = again if meets(again, qos_ms) or again.p99_ms < point.p99_ms else point
            points[label].append(point)
            echo(f"[sweep] {label:<20} offered {rate:7.1f}/s answered {point.answered_rps:7.1f}/s "
                 f"p99 {point.p99_ms:8.1f} ms {'ok' if meets(point, qos_ms) else 'MISSED'}")
            if not meets(point, qos_ms):
                active.remove(label)
    return points


def _bursts(url, systems: dict[str, str], pool, phases, qos_ms, settings, echo):
    """The burst ``settings.burst_rounds`` times for every system, the systems in turn (the order rotates
    each round; each round its own Poisson arrivals, the same for every system); per phase, p50 and p99
    over the rounds pooled. Returns (rows, {label: (arrival s, latency ms) of the first round})."""
    pooled: dict[str, list] = {label: [] for label in systems}
    traces = {}
    labels = list(systems)
    for r in range(settings.burst_rounds):
        schedule, which = burst_schedule(phases, seed=1 + r)
        for label in labels[r % len(labels):] + labels[:r % len(labels)]:
            records, _ = scheduled_records(url, systems[label], pool, schedule=schedule, batch=1, workers=settings.workers,
                                           shm=settings.shm)
            records.sort(key=lambda rec: rec.index)
            lat = np.array([rec.latency_ms for rec in records])
            failed = np.array([rec.error is not None for rec in records])
            pooled[label].append((lat, failed, which))
            if r == 0:
                traces[label] = (np.array([rec.scheduled_s for rec in records]).tolist(), lat.tolist())
            high = which == 1
            echo(f"[burst] round {r + 1} {label:<20} high phase p99 {np.percentile(lat[high], 99):8.1f} ms")
    rows = []
    for label in systems:
        lat, failed, which = (np.concatenate(x) for x in zip(*pooled[label]))
        rows += [{"system": label, **row} for row in phase_latencies(lat, which, failed, phases=phases, qos_ms=qos_ms)]
    return rows, traces


def _plot_burst(traces: dict, phases, qos_ms: float, m: str) -> Path | None:
    """Latency of every request against its arrival time, per system, with the QoS target."""
    # deferred: matplotlib loads only when a figure is drawn, its Agg backend chosen before pyplot
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt   # after the backend is chosen
    fig, ax = plt.subplots(figsize=(8, 4))
    for label, (at, lat) in traces.items():
        ax.plot(at, lat, ".", ms=2, label=label, alpha=0.6)
    ax.axhline(qos_ms, color="k", ls="--", lw=1, label=f"QoS target {qos_ms:.0f} ms")
    start = 0.0
    for p in phases:
        ax.axvspan(start, start + p.duration_s, alpha=0.05 if p.name == "low" else 0.15, color="tab:red")
        start += p.duration_s
    ax.set_xlabel("arrival (s)")
    ax.set_ylabel("latency (ms)")
    ax.set_yscale("log")
    ax.set_title(f"{m}: low -> high -> low burst")
    ax.legend(fontsize=7, markerscale=4)
    path = DOCS / "figures" / f"admission_burst_{m}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
