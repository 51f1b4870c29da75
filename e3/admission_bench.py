"""`e3 bench admission`: E²bird's elastic admission stage against Triton's own dynamic batcher, on one
server, at one core budget (E²bird Figs. 13 and 14 analogues).

For each model (its stock form, ``<m>_stock``, one input per request):

1. **Offline phase** (in this process, before the server starts): one worker's latency per batch,
   MaxBS for the QoS target, and E-Ebird's best worker set per TotalBS
   (:func:`e3.export.admission.profile_admission`). The QoS target defaults to
   ``qos_factor`` x the latency of a batch of 16 alone on one thread (at least ``qos_floor_ms``), so
   that MaxBS is about 16.
2. **Systems** on the same server and cores:

   - ``NO_Wait``: Triton's dynamic batcher, no delay, 1 instance x ``cores`` threads;
   - ``OPT_Wait``: the same with the delay that gave the most throughput at the QoS target in a
     sweep (``delays_us``);
   - ``instances``: ``cores`` instances x 1 thread, no delay;
   - ``N-Ebird`` and ``E-Ebird``: the admission stage, workers of 1 thread each on the same cores,
     at most MaxBS inputs in flight.

   Every Triton baseline's batch is capped at MaxBS (its ``max_batch_size``), as the stage's is.
3. **Fig. 14 analogue**: open-loop Poisson runs at rising rates (fractions of NO_Wait's
   closed-loop capacity); throughput at the QoS target per system
   (:func:`e3.client.admission_report.throughput_at_qos`).
4. **Fig. 13 analogue**: a low -> high -> low burst (``burst_fractions`` of that capacity: the high
   phase offers what NO_Wait sustains in a closed loop, which Poisson arrivals turn into a queue); p50 /
   p99 per phase per system, and a plot of latency over time.

**What a CPU cannot show, and is not emulated.** E²bird's memory pool overlaps the host-to-GPU copy of
each input with compute. Here inputs land in host memory that ONNX Runtime reads directly: a bert
input is 768 bytes (a 28x28 image 3 KiB), which PCIe 3 x16 would move in well under a microsecond,
< 0.01% of a batch's compute; emulating that copy would change no figure, so none is added. The
staging itself (answering nothing until a worker takes the input, no batch-forming wait) is real, and
the client, on the server's machine, hands every system its inputs through Triton's system shared memory
(``shm``, on by default, for all systems alike).

Glue only: the policies live in :mod:`e3.serving.admission`, the figures in
:mod:`e3.client.admission_report`.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from e3.client.admission_report import (Phase, RatePoint, admission_markdown, burst_schedule, format_burst,
                                        format_throughput, meets, phase_latencies, throughput_at_qos)
from e3.core.files import write_json_atomic
from e3.core.names import served_name, stock_name
from e3.paths import artifacts_dir

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
    workers: int = 96                    # client threads (open loop)
    shm: bool = True                     # inputs through system shared memory, for every system alike
    out: Path | None = None              # default artifacts/results/admission.json
    quick: bool = False
    results_md: Path | None = DOCS / "RESULTS.md"   # None: leave docs alone

    def shortened(self) -> "AdmissionBenchSettings":
        """``--quick``: fewer rates, shorter runs, one OPT_Wait delay."""
        return AdmissionBenchSettings(self.models, self.cores, self.qos_ms, self.qos_factor, self.qos_floor_ms,
                                      (0.5, 0.85, 1.0, 1.2, 1.4), self.burst_fractions, 3.0, 4.0, (4000,),
                                      self.workers, self.shm, self.out, True, self.results_md)


def run_admission_bench(settings: AdmissionBenchSettings = AdmissionBenchSettings(), echo=print) -> dict:
    """Run the benchmark for every model; returns the results document (also written to ``settings.out``)."""
    if settings.quick:
        settings = settings.shortened()
    from e3.bench import _commit
    from e3.client.bench_report import replace_section
    from e3.core.files import write_atomic
    out = settings.out or artifacts_dir() / "results" / "admission.json"
    doc = {"cores": settings.cores, "commit": _commit(), "quick": settings.quick, "models": {}}
    for name in settings.models:
        doc["models"][name] = _bench_model(name, settings, echo)
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
    from e3.controller.triton_api import TritonControl
    from e3.deploy.server import TritonServer
    from e3.export.admission import naive_engine, profile_admission, write_admission
    from e3.export.recipes import missing_checkpoints, train
    from e3.export.repository import ExportSettings, export_repository
    from e3.export.zoo import resolve_model
    for missing in missing_checkpoints(name):
        echo(f"[setup] {missing} is not trained yet: training it now (once; cached under artifacts/checkpoints)")
        train(missing)
    m = served_name(name)
    stock = stock_name(m)
    repo = artifacts_dir() / "admission-repo" / m
    if not (repo / stock / "1" / "model.onnx").exists():
        echo(f"[setup] exporting {name} into {repo}")
        export_repository(name, None, repo, ExportSettings(baseline_instances=1), progress=False)
    pool = resolve_model(name).example_arrays(256, seed=0)
    onnx = repo / stock / "1" / "model.onnx"
    qos_ms = settings.qos_ms
    if qos_ms is None:
        alone = profile_admission(onnx, pool, 1e9, batches=(16,), totals=(), repeats=3, progress=False)
        qos_ms = max(settings.qos_floor_ms, round(settings.qos_factor * alone["latency_ms"]["16"], -1))
    echo(f"[offline] {stock}: profiling workers for a QoS target of {qos_ms:.0f} ms (p99)")
    profile = profile_admission(onnx, pool, qos_ms)
    max_bs = profile["max_bs"]
    echo(f"[offline] latency of one worker (ms): {profile['latency_ms']}; MaxBS {max_bs}; "
         f"E-Ebird sets per TotalBS: {profile['confs']}")
    stages = {"N-Ebird": write_admission(repo, stock, {"kind": "n-ebird", "engine": naive_engine(max_bs),
                                                       "max_inflight": max_bs}, name=f"{stock}_nebird"),
              "E-Ebird": write_admission(repo, stock, {"kind": "e-ebird", "confs": profile["confs"],
                                                       "max_inflight": max_bs}, name=f"{stock}_eebird")}
    budget = (f"{settings.cores} cores: Triton baselines instances x threads = {settings.cores}; "
              f"E²bird workers of 1 thread each on the same cores, <= {max_bs} inputs in flight")
    log_file = artifacts_dir() / "logs" / "bench-admission-tritonserver.log"
    result = {"stock": stock, "qos_ms": qos_ms, "offline": profile, "budget": budget}
    with TritonServer.on_free_ports(repo, [stock, *stages.values()], log_file=log_file) as server, \
            TritonControl(server.http_url) as control:
        url = server.http_url
        base = copy.deepcopy(control.model_config(stock))

        def configure(instances: int, threads: int, delay_us: int) -> str:
            config = copy.deepcopy(base)
            config["max_batch_size"] = max_bs
            config["instance_group"] = [{"count": instances, "kind": "KIND_CPU"}]
            config.setdefault("parameters", {})["intra_op_threads"] = {"string_value": str(threads)}
            config["dynamic_batching"] = {"max_queue_delay_microseconds": delay_us}
            control.load(stock, config)
            return f"{instances} inst x {threads} thr, delay {delay_us} us, max batch {max_bs}"

        from e3.client.loadgen import closed_loop
        configure(1, settings.cores, 0)
        capacity = closed_loop(url, stock, pool, concurrency=2 * max_bs, batch=1, requests=40 * max_bs,
                               warmup=1, shm=settings.shm).throughput_ips
        echo(f"[capacity] NO_Wait closed loop: {capacity:.1f} inputs/s; rates are fractions of it")
        rates = [round(f * capacity, 1) for f in settings.rate_fractions]

        systems = [("NO_Wait", stock, lambda: configure(1, settings.cores, 0)),
                   (f"instances ({settings.cores}x1)", stock, lambda: configure(settings.cores, 1, 0))]
        systems += [(f"wait {d} us", stock, (lambda d=d: configure(1, settings.cores, d))) for d in settings.delays_us]
        systems += [(k, model, (lambda k=k: f"workers {_engine_of(profile, k, max_bs)} x 1 thr"))
                    for k, model in stages.items()]
        sweep = {}
        for label, model, setup in systems:
            config = setup()
            points = _sweep(url, model, pool, rates, qos_ms, settings, echo, label)
            sweep[label] = {"config": config, "points": [p.__dict__ for p in points],
                            "throughput_rps": throughput_at_qos(points, qos_ms)}
        # OPT_Wait: the delay (0 included: NO_Wait's run) with the most throughput at the target
        delays = {0: "NO_Wait", **{d: f"wait {d} us" for d in settings.delays_us}}
        opt_delay = max(delays, key=lambda d: sweep[delays[d]]["throughput_rps"])
        table = [{"system": "NO_Wait", **_pick(sweep["NO_Wait"])},
                 {"system": f"OPT_Wait ({opt_delay} us)", **_pick(sweep[delays[opt_delay]])},
                 {"system": f"instances ({settings.cores}x1)", **_pick(sweep[f"instances ({settings.cores}x1)"])},
                 {"system": "N-Ebird", **_pick(sweep["N-Ebird"])}, {"system": "E-Ebird", **_pick(sweep["E-Ebird"])}]
        echo(format_throughput(table, qos_ms, budget))

        low, high = (round(f * capacity, 1) for f in settings.burst_fractions)
        phases = [Phase("low", low, settings.phase_s), Phase("high", high, settings.phase_s),
                  Phase("low", low, settings.phase_s)]
        schedule, which = burst_schedule(phases, seed=1)
        burst, traces = [], {}
        burst_systems = [("NO_Wait", stock, lambda: configure(1, settings.cores, 0)),
                         (f"OPT_Wait ({opt_delay} us)", stock, lambda: configure(1, settings.cores, opt_delay)),
                         (f"instances ({settings.cores}x1)", stock, lambda: configure(settings.cores, 1, 0)),
                         ("N-Ebird", stages["N-Ebird"], lambda: ""), ("E-Ebird", stages["E-Ebird"], lambda: "")]
        for label, model, setup in burst_systems:
            setup()
            lat, failed, at = _burst(url, model, pool, schedule, settings)
            for row in phase_latencies(lat, which, failed, phases, qos_ms):
                burst.append({"system": label, **row})
            traces[label] = (at.tolist(), lat.tolist())
        echo(format_burst(burst, qos_ms, budget))
        plot = _plot_burst(traces, phases, qos_ms, m)
    result.update(capacity_ips=capacity, rates=rates, sweep=sweep, throughput=table, burst=burst,
                  burst_figure=f"figures/{plot.name}" if plot else None)
    return result


def _engine_of(profile: dict, kind: str, max_bs: int) -> list[int]:
    from e3.export.admission import naive_engine
    return naive_engine(max_bs) if kind == "N-Ebird" else profile["engine"]


def _pick(entry: dict) -> dict:
    return {"throughput_rps": entry["throughput_rps"], "config": entry["config"]}


def _sweep(url, model, pool, rates, qos_ms, settings, echo, label) -> list[RatePoint]:
    """Rising rates until the first that misses the target (that one is kept: it bounds the figure); past
    the listed rates, 15% more each step (up to 4x the last listed), so no system's figure is capped by
    the ladder."""
    from e3.client.loadgen import open_loop
    points = []
    ladder = list(rates)
    while ladder[-1] < 4 * rates[-1]:
        ladder.append(round(ladder[-1] * 1.15, 1))
    run_s = max(settings.run_s, 4 * qos_ms / 1e3)   # long enough for a falling-behind queue to show in p99
    for rate in ladder:
        r = open_loop(url, model, pool, rate_rps=rate, duration_s=run_s, batch=1,
                      workers=settings.workers, seed=int(rate), shm=settings.shm)
        point = RatePoint(rate, (r.requests - r.errors) / run_s, r.percentile_ms(99), r.errors)
        points.append(point)
        echo(f"[sweep] {label:<20} offered {rate:7.1f}/s answered {point.answered_rps:7.1f}/s "
             f"p99 {point.p99_ms:8.1f} ms {'ok' if meets(point, qos_ms) else 'MISSED'}")
        if not meets(point, qos_ms):
            break
    return points


def _burst(url, model, pool, schedule, settings):
    from e3.client.loadgen import scheduled_records
    records, _ = scheduled_records(url, model, pool, schedule, batch=1, workers=settings.workers, shm=settings.shm)
    records.sort(key=lambda r: r.index)
    lat = np.array([r.latency_ms for r in records])
    failed = np.array([r.error is not None for r in records])
    at = np.array([r.scheduled_s for r in records])
    return lat, failed, at


def _plot_burst(traces: dict, phases, qos_ms: float, m: str) -> Path | None:
    """Latency of every request against its arrival time, per system, with the QoS target."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
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
