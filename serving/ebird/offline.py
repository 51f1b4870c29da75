"""E²bird's one offline phase: the workers profiled on the device that will run them, and **the rule that turns
the profile into MaxBS, MaxInf and E-Ebird's worker sets** (for the stage served through Triton,
``benchmarks/admission_triton.py``, fixed here before any run; the runner records it beside every figure).

The device is behind one seam, a *set timer*: ``run(sizes) -> [ms per worker]`` launches one worker per batch
size at once and returns each worker's latency. Three timers use it:

* :func:`torch_timer`: the executors the stage's PyTorch workers run (:mod:`e3.serving.device.executor`: a CUDA
  graph per worker on its own stream, timed by CUDA events from one start event; on the CPU eager PyTorch, the
  workers one after another, each ending at the sum of the latencies before it: a smoke run, not a measurement);
* :func:`onnx_timer`: one ONNX Runtime session called from one thread per worker, as the CPU stage runs them
  (``clock="cpu"`` times each run by its thread's CPU time: what it takes with a core to itself on a shared
  machine);
* ``benchmarks/admission_gpu.py``'s CUDA-graph executors (the in-process emulation), through the same seam.

The rule (:class:`OfflineRule`):

1. One worker's latency per batch ``b`` in ``batches`` (median of ``repeats``, after ``warmups``).
2. **Compute budget** = ``qos_ms`` where the caller fixes the QoS target (``e3 admission``, ``e3 bench
   admission``), else ``qos_factor`` (2.5) x one worker's latency at batch 32 (the largest profiled batch at or
   below 32), at least ``qos_floor_ms``. **MaxBS** = the largest batch with ``2 x latency(b) <= budget`` (a batch
   waits at most one batch like it: :func:`e3.serving.ebird.policy.max_batch_for_qos`).
3. Every set of at most ``max_workers`` (4) power-of-two workers, none above MaxBS, summing to a TotalBS of
   ``totals`` up to MaxBS (the paper's loads) and, with ``above_max_bs``, 2, 3, 4 x MaxBS, launched at once; per set
   the mean latency over its inputs (the paper averages over workers, which favours sets whose small workers
   finish early while most inputs wait in the large one: measured on bert, [8, 4, 2, 2] "beat" [8, 8] by the
   workers' mean while its 8 inputs in the worker of 8 took as long) and its slowest worker's. **E-Ebird's
   configurations** = the set with the lowest mean per TotalBS (:func:`~e3.serving.ebird.policy.best_worker_sets`);
   **E-Ebird's MaxInf** = the largest TotalBS whose chosen set's slowest worker ends within half the budget, at
   least MaxBS (:func:`~e3.serving.ebird.policy.max_inflight_for_qos`; this cap was itself chosen after the first
   emulated H200 run, disclosed in ``docs/admission.md``). **N-Ebird**: the paper's engine for MaxBS
   (:func:`~e3.serving.ebird.policy.naive_engine`) and MaxInf = MaxBS.
4. **The QoS target** through Triton (set by the runner once the server is up) = the p99 of NO_Wait's requests
   at a light load through the same server (what the front door and one small batch cost there) + the budget.

The paper profiles every set (Equation 6); sets of more than ``max_workers`` workers are left out here: on a CPU
of a few cores they only time-slice the same cores, and on a GPU four streams already fill it.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np
from tqdm import tqdm

from e3.core.session import make_session
from e3.serving.ebird.policy import (PROFILED_TOTALS, best_worker_sets, engine_for, max_batch_for_qos,
                                     max_inflight_for_qos, naive_engine, worker_sets)

__all__ = ["OfflineRule", "CPU_RULE", "offline_phase", "policies", "RULE_TEXT", "torch_timer", "onnx_timer", "SetTimer"]

RULE_TEXT = ("budget = qos_factor x latency(32); MaxBS = max b with 2 x latency(b) <= budget; E-Ebird: best set by "
             "mean latency per TotalBS, MaxInf = max TotalBS with 2 x slowest worker <= budget (>= MaxBS); N-Ebird: "
             "engine naive_engine(MaxBS), MaxInf = MaxBS; QoS = NO_Wait's p99 at a light load + budget")

SetTimer = Callable[[Sequence[int]], list]   # batch sizes of a set -> each worker's latency (ms), launched at once


@dataclass(frozen=True)
class OfflineRule:
    batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)   # one worker's profiled batches
    qos_factor: float = 2.5                               # the compute budget, in latencies of a batch of 32
    qos_floor_ms: float = 0.0                             # ... at least this
    totals: tuple[int, ...] = (4, 8, 16, 32, 64)          # TotalBS up to MaxBS (the paper's, and 64)
    max_workers: int = 4                                  # workers in a profiled set; multiples of MaxBS up to it
    above_max_bs: bool = True                             # also profile 2..max_workers x MaxBS (E-Ebird's MaxInf)
    repeats: int = 20                                     # timings per batch / set (the median is kept)
    warmups: int = 2                                      # timings per set dropped first


# The CPU stage's rule (``e3 admission``, ``e3 bench admission``): the caller's QoS target is the budget, the
# paper's loads only, MaxInf = MaxBS (no totals above it), three timings.
CPU_RULE = OfflineRule(batches=(1, 2, 4, 8, 16, 32), totals=PROFILED_TOTALS, above_max_bs=False, repeats=3, warmups=1)


def offline_phase(timer_for: Callable[[list[list[int]]], SetTimer], rule: OfflineRule = OfflineRule(), *,
                  qos_ms: float | None = None, echo: Callable[[str], None] | None = print, progress: bool = False) -> dict:
    """The profile and what the rule makes of it (module docstring). ``timer_for(slots)`` builds a set timer
    whose worker ``i`` can run every batch size in ``slots[i]`` (a device builds one executor per size);
    ``qos_ms``: the compute budget, when the caller fixes the target (else the rule's factor)."""
    batches = list(rule.batches)

    def measure(run: SetTimer, sets: list) -> dict[tuple[int, ...], tuple[float, float]]:
        out = {}
        for sizes in tqdm(sets, desc="E²bird offline phase: worker sets", disable=not progress or len(sets) < 2):
            took = [run(sizes) for _ in range(rule.repeats + rule.warmups)][rule.warmups:]
            means = [sum(ms * b for ms, b in zip(t, sizes)) / sum(sizes) for t in took]
            out[tuple(sizes)] = (float(np.median(means)), float(np.median([max(t) for t in took])))
        return out

    one = timer_for([batches])
    latency = {b: measure(one, [(b,)])[(b,)][0] for b in batches}
    del one
    if qos_ms is None:
        ref = max(b for b in batches if b <= 32)
        budget = max(rule.qos_floor_ms, rule.qos_factor * latency[ref])
    else:
        budget = qos_ms
    max_bs = max_batch_for_qos(latency, budget)
    above = range(2, rule.max_workers + 1) if rule.above_max_bs else ()
    totals = sorted({t for t in rule.totals if t <= max_bs} | {k * max_bs for k in above})
    sets = [w for t in totals for w in worker_sets(t, rule.max_workers, largest=max_bs)]
    slots = [sorted({w[i] for w in sets if len(w) > i}) for i in range(rule.max_workers)]
    measured = measure(timer_for(slots), sets) if sets else {}
    confs = best_worker_sets({w: mean for w, (mean, _) in measured.items()})
    max_inflight = max_inflight_for_qos({w: slow for w, (_, slow) in measured.items()}, confs, budget, max_bs=max_bs)
    confs = {t: w for t, w in confs.items() if t <= max_inflight}
    if echo is not None:
        echo(f"  offline: one worker (ms) { {b: round(v, 3) for b, v in latency.items()} }; budget {budget:.3f} ms; "
             f"MaxBS {max_bs}; E-Ebird sets {confs}, MaxInf {max_inflight}")
    return {"rule": RULE_TEXT, "rule_settings": dataclasses.asdict(rule), "latency_ms": {str(b): v for b, v in latency.items()},
            "budget_ms": budget, "max_bs": max_bs, "max_inflight": max_inflight, "max_workers": rule.max_workers,
            "sets_ms": {",".join(map(str, w)): v[0] for w, v in measured.items()},
            "sets_slowest_ms": {",".join(map(str, w)): v[1] for w, v in measured.items()},
            "confs": {str(t): list(w) for t, w in confs.items()}, "engine": list(engine_for(confs)) if confs else []}


def policies(offline: Mapping) -> dict[str, dict]:
    """The two stages' policy documents from the offline phase (the rule, step 3)."""
    max_bs = offline["max_bs"]
    return {"N-Ebird": {"kind": "n-ebird", "engine": naive_engine(max_bs), "max_inflight": max_bs},
            "E-Ebird": {"kind": "e-ebird", "confs": offline["confs"], "max_inflight": offline["max_inflight"]}}


def torch_timer(model, settings) -> Callable[[list[list[int]]], SetTimer]:
    """Set timers over the stage's PyTorch executors of ``model`` on ``settings``' device (module docstring)."""
    # deferred: torch only for a device's timers (the CPU stage's offline phase times ONNX Runtime, no torch)
    import torch
    from e3.serving.device.executor import make_executor
    L = model.card.num_blocks
    float_dtype = torch.float16 if settings.precision == "fp16" else torch.float32
    feeds: dict[int, tuple] = {}

    def feed(b: int) -> tuple:
        if b not in feeds:   # a latency does not depend on the values
            feeds[b] = tuple((t.to(float_dtype) if t.is_floating_point() else t).to(settings.device)
                             for t in model.example_inputs(b, seed=0))
        return feeds[b]

    def timer_for(slots: list[list[int]]) -> SetTimer:
        with torch.inference_mode():
            workers = [{b: make_executor(model, 1, L, ramps=(L,),
                                         settings=dataclasses.replace(settings, max_batch=b, buckets=(b,)))
                        for b in sizes} for sizes in slots]
        streams = [torch.cuda.Stream() for _ in slots] if settings.cuda else None

        @torch.inference_mode()
        def run(sizes: Sequence[int]) -> list[float]:
            if not settings.cuda:
                took, t0 = [], time.perf_counter()
                for i, b in enumerate(sizes):
                    workers[i][b].run([feed(b)], b)
                    took.append((time.perf_counter() - t0) * 1e3)
                return took
            torch.cuda.synchronize()
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            ends = []
            for i, b in enumerate(sizes):
                with torch.cuda.stream(streams[i]):
                    streams[i].wait_event(start)
                    workers[i][b].run([feed(b)], b)
                    end = torch.cuda.Event(enable_timing=True)
                    end.record(streams[i])
                ends.append(end)
            torch.cuda.synchronize()
            return [start.elapsed_time(e) for e in ends]
        return run
    return timer_for


def onnx_timer(onnx_file: str | Path, example: Mapping[str, np.ndarray], *, intra_op_threads: int = 1,
               clock: str = "wall") -> Callable[[list[list[int]]], SetTimer]:
    """Set timers over one ONNX Runtime session of ``onnx_file``, one thread per worker (as the CPU stage runs
    its workers); ``example``: name -> [n, ...] inputs, n >= the largest batch timed. ``clock``: ``"wall"``, or
    ``"cpu"`` (each run's thread CPU time: its compute when the session has one intra-op thread, ONNX Runtime
    then computing on the calling thread; it does not see two workers slowing each other through shared caches
    or memory bandwidth, nor more workers than cores)."""
    if clock not in ("wall", "cpu"):
        raise ValueError(f"clock must be 'wall' or 'cpu', got {clock!r}")
    if clock == "cpu" and intra_op_threads != 1:
        raise ValueError("clock='cpu' times the calling thread: it needs intra_op_threads=1")
    timer = time.thread_time if clock == "cpu" else time.perf_counter
    session = make_session(str(onnx_file), intra_op_threads)
    outputs = [o.name for o in session.get_outputs()]
    rows = len(next(iter(example.values())))

    def run(sizes: Sequence[int]) -> list[float]:
        if max(sizes) > rows:
            raise ValueError(f"the example holds {rows} rows, a worker of {max(sizes)} was asked for")
        feeds = [{k: np.ascontiguousarray(v[:b]) for k, v in example.items()} for b in sizes]
        took = [0.0] * len(sizes)

        def one(i: int) -> None:
            t = timer()
            session.run(outputs, feeds[i])
            took[i] = (timer() - t) * 1e3

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(sizes))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return took
    return lambda slots: run
