"""`e3 bench admission --cuda`: the E²bird analogues (Figs. 13 and 14) on a real NVIDIA GPU, emulated in one
process outside Triton.

**Why outside Triton.** On a GPU the admission stage's workers would run as Triton instances of the native
ONNX Runtime (CUDA) or TensorRT backends of an NGC image, or Python-backend instances calling ONNX Runtime's
CUDA provider. The GPU hosts this project was lent have PyTorch with CUDA but none of those, and their
wheels could not be brought there (the embedded server's own wheel neither). What E²bird claims is a
property of the GPU: batches of different sizes running at once on one GPU finish sooner than the same
inputs in one batch after another, so an admission stage that launches several small batches beats a
batcher that waits for, or serialises, big ones. That needs a GPU, not Triton, to be shown; so the
serving loop is emulated here:

* **one host thread** for every system alike: it stages the arrivals (in arrival order), asks the
  system which batches to launch, launches each as a CUDA graph replay (:func:`e3.profiling.cuda_profile.
  compile_call`: FP16, one graph per call, as a TensorRT engine) on the stream of the instance or worker
  that runs it, and polls the batches' completion events. An input's latency is from its arrival to the
  poll that saw its batch done.
* **the decisions are the real ones**: N-Ebird and E-Ebird are :mod:`e3.serving.ebird.policy`'s policies
  (the same objects the Triton stage runs); the baselines follow Triton's dynamic batcher
  (:func:`e3.serving.ebird.policy.dynamic_batch`: preferred = max batch = MaxBS; NO_Wait with no delay,
  OPT_Wait with the delay of a sweep that gave the most throughput at the target, and ``instances``
  instances with no delay, each instance its own stream, as Triton's instances of one GPU are).
* **the offline phase is measured on the GPU**: one worker's latency per batch, MaxBS for the QoS
  target (:func:`~e3.serving.ebird.policy.max_batch_for_qos`), and every worker set of at most
  ``max_workers`` workers per TotalBS launched at once on their own streams (mean latency over the
  inputs), the best set per TotalBS (E-Ebird's configurations). E-Ebird's cap on inputs in flight
  (MaxInf) comes from the same profile, with totals above MaxBS (2, 3, 4 x MaxBS of workers no larger
  than MaxBS) whose sets end within the target (:func:`~e3.serving.ebird.policy.max_inflight_for_qos`:
  the paper's MaxInf = MaxBS rests on an equal-sharing hypothesis E-Ebird exists to replace; measured
  here, a first run with MaxInf = MaxBS held E-Ebird to NO_Wait's throughput while four instances of
  the same batch cap sustained 1.5x it). N-Ebird keeps the paper's MaxBS.
* **not emulated**: HTTP/gRPC and the client (the same for every system), and the inputs' copy to the
  GPU: every system's inputs are already on the GPU (a bert input is 768 bytes; E²bird's memory pool
  copies each on arrival, overlapped with compute, which is what pre-staged inputs amount to). The
  answers are not read back (``tests/test_admission.py`` checks the real stage's answers).

The QoS target defaults to ``qos_factor`` x one worker's latency at batch 32 (at least ``qos_floor_ms``).
Rates are fractions of NO_Wait's capacity, measured by offering it ``overload`` x what the offline profile
says it sustains. Glue over the pure parts: the serving loop :func:`serve` takes a ``launch`` function, so
its bookkeeping is tested on the CPU (``tests/test_admission_gpu.py``).
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Protocol, Sequence

import numpy as np
import torch

from e3.benchmarks.admission_report import (Phase, RatePoint, burst_rows, burst_schedule, meets, phase_latencies,
                                            shown_system, sweep_label, throughput_at_qos, verdict)
from e3.benchmarks.report import commit, replace_between
from e3.core.files import write_atomic, write_json_atomic
from e3.export.onnx_export import split_inputs
from e3.models.api import SplitModule
from e3.models.zoo import resolve_architecture
from e3.paths import artifacts_dir, project_root
from e3.profiling.cuda_profile import CudaSettings, compile_call, cuda_available, device_label
from e3.serving.batcher import dynamic_batch
from e3.serving.ebird.offline import OfflineRule, offline_phase
from e3.serving.ebird.policy import PROFILED_TOTALS, ElasticPolicy, make_policy, naive_engine

__all__ = ["GpuAdmissionSettings", "TritonBatcher", "Ebird", "serve", "poisson", "run_gpu_admission",
           "gpu_admission_markdown", "write_gpu_admission"]

GPU_BEGIN, GPU_END = "<!-- admission-gpu:begin -->", "<!-- admission-gpu:end -->"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GpuAdmissionSettings:
    models: tuple[str, ...] = ("bert-stock", "resnet-stock")
    batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)   # one worker's profiled batches
    qos_ms: float | None = None          # None: qos_factor x one worker's latency at batch 32
    qos_factor: float = 2.5
    qos_floor_ms: float = 1.0
    totals: tuple[int, ...] = (*PROFILED_TOTALS, 64)
    max_workers: int = 4                 # workers of a profiled set; also the `instances` baseline's count
    delays_us: tuple[int, ...] = (200, 500)   # OPT_Wait's sweep (0 is NO_Wait)
    rate_fractions: tuple[float, ...] = (0.3, 0.5, 0.7, 0.85, 1.0, 1.15, 1.3, 1.5)
    burst_fractions: tuple[float, float] = (0.3, 1.0)
    run_s: float = 1.0                   # one rate of the sweep
    phase_s: float = 1.0                 # one phase of the burst
    overload: float = 3.0                # capacity probe: this x the profile's NO_Wait throughput
    repeats: int = 20                    # offline timings per batch / set
    drain_s: float = 5.0                 # after the last arrival, inputs not done by then count as failed
    seed: int = 0

    def shortened(self) -> "GpuAdmissionSettings":
        """``--quick``: five rates, half-second runs and phases."""
        return replace(self, rate_fractions=(0.5, 0.85, 1.0, 1.2, 1.5), run_s=0.5, phase_s=0.5)


class System(Protocol):
    executors: list[list[int]]           # per executor (a stream): the batch sizes it runs

    def plan(self, staged: int, wait_us: Callable[[int], float], idle: Sequence[int]) -> list[tuple[int, int]]: ...

    def done(self, executor: int) -> None: ...


@dataclass
class TritonBatcher:
    """Triton's dynamic batcher on ``instances`` instances (streams) of one GPU."""
    instances: int
    max_batch: int
    delay_us: float = 0.0
    executors: list[list[int]] = field(init=False)

    def __post_init__(self) -> None:
        self.executors = [list(range(1, self.max_batch + 1)) for _ in range(self.instances)]

    def plan(self, staged, wait_us, idle):
        out, taken = [], 0
        for e in idle:
            if taken >= staged:
                break
            b = dynamic_batch(staged - taken, wait_us(taken), self.max_batch, delay_us=self.delay_us)
            if b == 0:
                break
            out.append((e, b))
            taken += b
        return out

    def done(self, executor: int) -> None:
        pass


@dataclass
class Ebird:
    """N-Ebird or E-Ebird: one executor per worker of the policy's engine, at the worker's batch."""
    policy: ElasticPolicy
    executors: list[list[int]] = field(init=False)

    def __post_init__(self) -> None:
        self.executors = [[b] for b in self.policy.engine]

    def plan(self, staged, wait_us, idle):
        return self.policy.launch(staged)

    def done(self, executor: int) -> None:
        self.policy.done(executor)


def poisson(rate: float, duration_s: float, seed: int) -> np.ndarray:
    """Arrival times (s) of a Poisson process at ``rate`` per second over ``duration_s``."""
    return burst_schedule([Phase("run", rate, duration_s)], seed)[0]


def serve(system: System, launch: Callable[[int, int], object], arrivals: np.ndarray, *, drain_s: float,
          clock: Callable[[], float] = time.perf_counter) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Run the serving loop over ``arrivals`` (s, increasing): stage, plan, ``launch(executor, batch)``
    (a handle whose ``query()`` says it is done), poll. Returns each input's latency (ms, NaN where not
    done by ``drain_s`` after the last arrival), the failed mask, and the batch sizes launched."""
    n = len(arrivals)
    done_at = np.full(n, np.nan)
    head, finished, batches = 0, 0, []
    running: dict[int, tuple[object, int, int]] = {}
    deadline = (arrivals[-1] if n else 0.0) + drain_s
    t0 = clock()
    while finished < n:
        now = clock() - t0
        if now > deadline:
            break
        for e, (handle, a, b) in list(running.items()):
            if handle.query():
                done_at[a:b] = now
                finished += b - a
                del running[e]
                system.done(e)
        arrived = int(np.searchsorted(arrivals, now, side="right"))
        staged = arrived - head
        if staged > 0:
            idle = [e for e in range(len(system.executors)) if e not in running]
            if idle:
                base = head
                for e, b in system.plan(staged, lambda i, base=base: (now - arrivals[base + i]) * 1e6, idle):
                    if e in running or b not in system.executors[e] or head + b > arrived:
                        raise RuntimeError(f"the system launched executor {e} with {b} inputs: not idle, not its "
                                           f"batch, or more than are staged ({arrived - head})")
                    running[e] = (launch(e, b), head, head + b)
                    batches.append(b)
                    head += b
    latency = (done_at - arrivals) * 1e3
    return latency, np.isnan(done_at), batches


# ---- the GPU side (needs CUDA) -------------------------------------------------------------------------

class _Executors:
    """CUDA graphs of the stock model per (executor, batch), each executor on a stream of its own."""

    def __init__(self, module, inputs_of: Callable[[int], tuple], executors: list[list[int]], cuda_settings):
        self.streams = [torch.cuda.Stream() for _ in executors]
        self.calls = [{b: compile_call(module, inputs_of(b), cuda_settings) for b in sizes} for sizes in executors]

    def launch(self, e: int, b: int):
        with torch.cuda.stream(self.streams[e]):
            self.calls[e][b]()
            event = torch.cuda.Event()
            event.record(self.streams[e])
        return event


def _offline(module, inputs_of, settings: GpuAdmissionSettings, cuda_settings, echo) -> dict:
    """The offline phase on the GPU (module docstring): E²bird's one offline phase
    (:func:`e3.serving.ebird.offline.offline_phase`) over this emulation's CUDA-graph executors, a set's workers
    on their own streams from one start event, each timed to its end event; E-Ebird's MaxInf from totals above
    MaxBS (:func:`e3.serving.ebird.policy.max_inflight_for_qos`)."""

    def timer_for(slots: list[list[int]]):
        execs = _Executors(module, inputs_of, slots, cuda_settings)

        def run(sizes) -> list[float]:
            torch.cuda.synchronize()
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            ends = []
            for i, b in enumerate(sizes):
                s = execs.streams[i]
                s.wait_event(start)
                with torch.cuda.stream(s):
                    execs.calls[i][b]()
                    end = torch.cuda.Event(enable_timing=True)
                    end.record(s)
                ends.append(end)
            torch.cuda.synchronize()
            return [start.elapsed_time(end) for end in ends]
        return run

    rule = OfflineRule(batches=tuple(settings.batches), qos_factor=settings.qos_factor, qos_floor_ms=settings.qos_floor_ms,
                       totals=tuple(settings.totals), max_workers=settings.max_workers, repeats=settings.repeats)
    doc = offline_phase(timer_for, rule, qos_ms=settings.qos_ms, echo=echo)
    return {**doc, "qos_ms": round(doc["budget_ms"], 2)}


def _point(latency: np.ndarray, failed: np.ndarray, arrivals: np.ndarray, rate: float) -> RatePoint:
    ok = ~failed
    span = float(arrivals[-1]) if len(arrivals) else 1.0
    return RatePoint(rate, float(ok.sum()) / span, float(np.percentile(latency[ok], 99)) if ok.any() else float("nan"),
                     int(failed.sum()))


def _bench_model(name: str, settings: GpuAdmissionSettings, echo) -> dict:

    model = resolve_architecture(name).to("cuda")
    module = SplitModule(model, 1, model.card.num_blocks, ())
    cache: dict[int, tuple] = {}

    def inputs_of(b: int) -> tuple:
        if b not in cache:
            cache[b] = split_inputs(module, b, settings.seed, device="cuda")
        return cache[b]

    cuda = CudaSettings()
    offline = _offline(module, inputs_of, settings, cuda, echo)
    qos, max_bs = offline["qos_ms"], offline["max_bs"]
    k = settings.max_workers

    def make(label: str) -> System:
        if label == "NO_Wait":
            return TritonBatcher(1, max_bs)
        if label.startswith("wait "):
            return TritonBatcher(1, max_bs, float(label.split()[1]))
        if label.startswith("instances"):
            return TritonBatcher(k, max_bs)
        if label == "N-Ebird":
            return Ebird(make_policy("n-ebird", engine=naive_engine(max_bs), max_inflight=max_bs))
        return Ebird(make_policy("e-ebird", confs=offline["confs"], max_inflight=offline["max_inflight"]))

    labels = ["NO_Wait", *(f"wait {d} us" for d in settings.delays_us), f"instances ({k})", "N-Ebird", "E-Ebird"]
    execs: dict[tuple, _Executors] = {}
    for label in labels:   # graphs captured before any timing; systems of the same executors share them
        key = tuple(map(tuple, make(label).executors))
        if key not in execs:
            execs[key] = _Executors(module, inputs_of, make(label).executors, cuda)

    def run(label: str, arrivals: np.ndarray):
        system = make(label)
        gc.collect()
        gc.disable()       # a collection inside the loop would be a pause no serving process has
        try:
            return serve(system, execs[tuple(map(tuple, system.executors))].launch, arrivals, drain_s=settings.drain_s)
        finally:
            gc.enable()

    estimate = max_bs / float(offline["latency_ms"][str(max_bs)]) * 1e3
    probe = poisson(settings.overload * estimate, settings.run_s, settings.seed)
    lat, failed, _ = run("NO_Wait", probe)
    done = np.sort((lat[~failed] / 1e3 + probe[~failed]))
    capacity = (len(done) - 1) / float(done[-1] - done[0]) if len(done) > 1 else 0.0
    echo(f"[capacity] NO_Wait offered {settings.overload:g} x the profile's {estimate:.0f} inputs/s: answered "
         f"{capacity:.0f} inputs/s")
    rates = [round(f * capacity, 1) for f in settings.rate_fractions]
    sweep = {label: [] for label in labels}
    batches_seen = {label: [] for label in labels}
    for i, rate in enumerate(rates):
        arrivals = poisson(rate, settings.run_s, settings.seed + i)
        for label in labels:
            lat, failed, batches = run(label, arrivals)
            sweep[label].append(_point(lat, failed, arrivals, rate))
            batches_seen[label].append(float(np.mean(batches)) if batches else 0.0)
        echo(f"[rate {rate:.0f}/s] " + "; ".join(f"{lb} p99 {sweep[lb][-1].p99_ms:.2f} ms" for lb in labels))
    tput = {label: throughput_at_qos(sweep[label], qos) for label in labels}
    delays = {0: "NO_Wait", **{d: f"wait {d} us" for d in settings.delays_us}}
    opt_delay = max(delays, key=lambda d: tput[delays[d]])
    config = {"NO_Wait": f"1 instance, delay 0, max batch {max_bs}",
              delays[opt_delay]: f"1 instance, delay {opt_delay} us, max batch {max_bs}",
              f"instances ({k})": f"{k} instances (streams), delay 0, max batch {max_bs}",
              "N-Ebird": f"workers {make('N-Ebird').policy.engine}, <= {max_bs} in flight",
              "E-Ebird": f"workers {offline['engine']}, sets {offline['confs']}, <= {offline['max_inflight']} in flight"}
    shown = {"NO_Wait": "NO_Wait", f"OPT_Wait ({opt_delay} us)": delays[opt_delay], f"instances ({k})": f"instances ({k})",
             "N-Ebird": "N-Ebird", "E-Ebird": "E-Ebird"}
    table = [{"system": s, "throughput_rps": tput[lb], "config": config[lb],
              "mean_batch": batches_seen[lb]} for s, lb in shown.items()]
    low, high = (round(f * capacity, 1) for f in settings.burst_fractions)
    phases = [Phase("low", low, settings.phase_s), Phase("high", high, settings.phase_s),
              Phase("low", low, settings.phase_s)]
    arrivals, phase = burst_schedule(phases, settings.seed + 100)
    burst = []
    for s, lb in shown.items():
        lat, failed, _ = run(lb, arrivals)
        burst += [{"system": s, **r} for r in phase_latencies(lat, phase, failed, phases=phases, qos_ms=qos)]
    echo("; ".join(f"{r['system']} {r['phase']} p99 {r['p99_ms']:.2f}" for r in burst))
    return {"stock": name, "device": torch.cuda.get_device_name(), "device_label": device_label(torch.cuda.get_device_name()),
            "qos_ms": qos, "offline": offline, "capacity_ips": capacity, "rates": rates,
            "sweep": {lb: [p.__dict__ for p in pts] for lb, pts in sweep.items()},
            "throughput": table, "burst": burst, "met": {lb: [meets(p, qos) for p in pts] for lb, pts in sweep.items()},
            "budget": f"one {torch.cuda.get_device_name()}; every system's batches on it as FP16 CUDA graphs; one host "
                      f"thread stages, schedules and polls for every system alike"}


def run_gpu_admission(settings: GpuAdmissionSettings = GpuAdmissionSettings(), echo=print) -> dict:
    """Run the GPU analogue for every model; returns the results document."""
    if not cuda_available():
        raise ValueError("e3 bench admission --cuda needs an NVIDIA GPU that PyTorch can use (none here); "
                           "`e3 bench admission` runs the CPU analogue on Triton")
    doc = {"commit": commit(), "settings": {k: v for k, v in settings.__dict__.items()}, "models": {}}
    for name in settings.models:
        doc["models"][name] = _bench_model(name, settings, echo)
    return doc


def gpu_admission_markdown(doc: dict, command: str) -> str:
    """docs/RESULTS.md's section for the GPU analogue: per model, throughput at the target and the burst."""
    out = [f"## Elastic admission (E²bird) on a real GPU, emulated outside Triton (`{command}`)", "",
           f"Commit {doc.get('commit', 'unknown')}. One process: the real N-Ebird / E-Ebird policies and Triton's "
           "dynamic-batcher rule, each batch a CUDA graph (FP16) of the stock model with random weights on the "
           "stream of its worker or instance, open-loop Poisson arrivals of single-input requests, inputs "
           "pre-staged on the GPU for every system (why and what is not emulated: `benchmarks/admission_gpu.py`, "
           "`docs/admission.md`). JSON: `artifacts/results/admission_gpu.json`."]
    for name, m in doc["models"].items():
        qos, off = m["qos_ms"], m["offline"]
        out += ["", f"### {name} on {m['device']}: QoS target p99 <= {qos:g} ms, MaxBS {off['max_bs']}", "",
                f"Budget: {m['budget']}. Offline, measured on the GPU: one worker's latency per batch (ms) "
                f"{off['latency_ms']}; E-Ebird's best worker set per TotalBS {off['confs']}, MaxInf "
                f"{off.get('max_inflight', off['max_bs'])}. NO_Wait's capacity "
                f"{m['capacity_ips']:.0f} inputs/s (offered more than it sustains); the rates are fractions of it.",
                "", "Throughput at the QoS target (Fig. 14 analogue):", "",
                "| system | inputs/s at the target | vs OPT_Wait | mean batch | configuration |",
                "| --- | --- | --- | --- | --- |"]
        opt = next((r["throughput_rps"] for r in m["throughput"] if r["system"].startswith("OPT_Wait")), None)
        for r in m["throughput"]:
            ratio = f"{r['throughput_rps'] / opt:.2f}x" if opt else "-"
            mean_b = np.mean([b for b in r.get("mean_batch", []) if b]) if r.get("mean_batch") else float("nan")
            label = sweep_label(r["system"])
            bound = "≥ " if label in m.get("met", {}) and all(m["met"][label]) else ""
            out.append(f"| {shown_system(r['system'])} | {bound}{r['throughput_rps']:.0f} | {ratio} | {mean_b:.1f} | {r['config']} |")
        out += ["", "≥: the target was met at every rate tried, up to "
                f"{max(m['rates']):.0f}/s ({max(m['rates']) / m['capacity_ips']:.1f} x NO_Wait's capacity): a lower "
                "bound. Mean batch: inputs per launched batch, over the sweep's rates."]
        out += ["", "Latency through a low -> high -> low burst (Fig. 13 analogue):", "",
                *burst_rows(m["burst"], digits=3), "", verdict(m)]
    return "\n".join(out)


def write_gpu_admission(doc: dict, out=None, command: str = "e3 bench admission --cuda", *, results_md=None) -> None:
    """Write the run's JSON (default ``artifacts/results/admission_gpu.json``) and its section of
    ``docs/RESULTS.md`` (between its own markers; the rest of the file is left alone)."""
    out = Path(out) if out else artifacts_dir() / "results" / "admission_gpu.json"
    write_json_atomic(out, doc, indent=1, default=float)
    path = Path(results_md) if results_md else project_root() / "docs" / "RESULTS.md"
    text = path.read_text() if path.exists() else "# Measured results\n"
    write_atomic(path, replace_between(text, GPU_BEGIN, GPU_END, section=gpu_admission_markdown(doc, command),
                                       name="admission gpu"))
    print(f"wrote {out} and the GPU admission section of {path}")
