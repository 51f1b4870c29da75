"""E²bird's offline phase for the stage served through Triton (``benchmarks/admission_triton.py``), measured with the
very executors the stage's workers run (:mod:`e3.serving.device.executor`: a CUDA graph per worker on its own
stream on a GPU; eager PyTorch on the CPU), and **the rule that turns it into MaxBS, MaxInf and the QoS target**,
fixed here before any run through Triton (commit of this file; the runner records it beside every figure):

1. One worker's latency per batch ``b`` in ``batches`` (median of ``repeats``; on a GPU from a start event to the
   worker's end event).
2. **Compute budget** = ``qos_factor`` (2.5) x one worker's latency at batch 32 (the largest profiled batch at or
   below 32). **MaxBS** = the largest batch with ``2 x latency(b) <= budget`` (a batch waits at most one batch like
   it: :func:`e3.serving.admission.max_batch_for_qos`).
3. Every set of at most ``max_workers`` (4) power-of-two workers, none above MaxBS, summing to a TotalBS of 4, 8,
   16, 32, 64 (those up to MaxBS, the paper's loads) or 2, 3, 4 x MaxBS, launched at once (on their own streams);
   per set the mean latency over its inputs and its slowest worker's. **E-Ebird's configurations** = the set with
   the lowest mean per TotalBS (:func:`~e3.serving.admission.best_worker_sets`); **E-Ebird's MaxInf** = the largest
   TotalBS whose chosen set's slowest worker ends within half the budget, at least MaxBS
   (:func:`~e3.serving.admission.max_inflight_for_qos`; this cap was itself chosen after the first emulated H200
   run, disclosed in ``docs/admission.md``; it is fixed before this runner's first run). **N-Ebird**: the paper's
   engine for MaxBS (:func:`~e3.serving.admission.naive_engine`) and MaxInf = MaxBS.
4. **The QoS target** (set by the runner once the server is up) = the p99 of NO_Wait's requests at a light load
   through the same server (what the front door and one small batch cost there) + the compute budget.

On the CPU (``--cpu``: a smoke run, not a measurement) workers have no streams: a set's workers run one after
another, each ending at the sum of the latencies before it.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from e3.serving.admission import (best_worker_sets, engine_for, max_batch_for_qos, max_inflight_for_qos, naive_engine,
                                  worker_sets)

__all__ = ["OfflineRule", "offline_phase", "policies", "RULE_TEXT"]

RULE_TEXT = ("budget = qos_factor x latency(32); MaxBS = max b with 2 x latency(b) <= budget; E-Ebird: best set by "
             "mean latency per TotalBS, MaxInf = max TotalBS with 2 x slowest worker <= budget (>= MaxBS); N-Ebird: "
             "engine naive_engine(MaxBS), MaxInf = MaxBS; QoS = NO_Wait's p99 at a light load + budget")


@dataclass(frozen=True)
class OfflineRule:
    batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)   # one worker's profiled batches
    qos_factor: float = 2.5                               # the compute budget, in latencies of a batch of 32
    totals: tuple[int, ...] = (4, 8, 16, 32, 64)          # TotalBS up to MaxBS (the paper's, and 64)
    max_workers: int = 4                                  # workers in a profiled set; multiples of MaxBS up to it
    repeats: int = 20


def _timer(workers, *, cuda: bool):
    """``run(set) -> (per-worker latency ms)``: the workers of a set (slot i runs ``workers[i][b]``) launched at once."""
    import torch
    streams = [torch.cuda.Stream() for _ in workers] if cuda else None

    def run(sizes: Sequence[int], feeds) -> list[float]:
        if not cuda:
            took, t0 = [], time.perf_counter()
            for i, b in enumerate(sizes):
                workers[i][b].run([feeds[b]], b)
                took.append((time.perf_counter() - t0) * 1e3)
            return took
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        ends = []
        for i, b in enumerate(sizes):
            with torch.cuda.stream(streams[i]):
                streams[i].wait_event(start)
                workers[i][b].run([feeds[b]], b)
                end = torch.cuda.Event(enable_timing=True)
                end.record(streams[i])
            ends.append(end)
        torch.cuda.synchronize()
        return [start.elapsed_time(e) for e in ends]
    return run


def offline_phase(model, settings, rule: OfflineRule = OfflineRule(), *, echo=print) -> dict:
    """The profile and what the rule makes of it (module docstring). ``model`` on ``settings``' device."""
    import torch

    from e3.serving.device.executor import make_executor
    L = model.card.num_blocks
    batches = list(rule.batches)

    def executor(b: int):
        return make_executor(model, 1, L, ramps=(L,), settings=dataclasses.replace(settings, max_batch=b, buckets=(b,)))
    float_dtype = torch.float16 if settings.precision == "fp16" else torch.float32
    example = model.example_inputs(max(batches), seed=0)
    feeds = {b: tuple((t[:b].to(float_dtype) if t.is_floating_point() else t[:b]).to(settings.device) for t in example)
             for b in batches}

    def measure(slots, sets) -> dict[tuple[int, ...], tuple[float, float]]:
        run = _timer(slots, cuda=settings.cuda)
        out = {}
        with torch.inference_mode():
            for sizes in sets:
                took = [run(sizes, feeds) for _ in range(rule.repeats + 2)][2:]
                means = [sum(ms * b for ms, b in zip(t, sizes)) / sum(sizes) for t in took]
                out[tuple(sizes)] = (float(np.median(means)), float(np.median([max(t) for t in took])))
        return out

    with torch.inference_mode():
        one = [{b: executor(b) for b in batches}]
    latency = {b: measure(one, [(b,)])[(b,)][0] for b in batches}
    ref = max(b for b in batches if b <= 32)
    budget = rule.qos_factor * latency[ref]
    max_bs = max_batch_for_qos(latency, budget)
    totals = sorted({t for t in rule.totals if t <= max_bs} | {k * max_bs for k in range(2, rule.max_workers + 1)})
    sets = [w for t in totals for w in worker_sets(t, rule.max_workers, largest=max_bs)]
    with torch.inference_mode():
        slots = [{b: executor(b) for b in sorted({w[i] for w in sets if len(w) > i})} for i in range(rule.max_workers)]
    measured = measure(slots, sets)
    del one, slots
    confs = best_worker_sets({w: mean for w, (mean, _) in measured.items()})
    max_inflight = max_inflight_for_qos({w: slow for w, (_, slow) in measured.items()}, confs, budget, max_bs=max_bs)
    confs = {t: w for t, w in confs.items() if t <= max_inflight}
    echo(f"  offline: one worker (ms) { {b: round(v, 3) for b, v in latency.items()} }; budget {budget:.3f} ms; "
         f"MaxBS {max_bs}; E-Ebird sets {confs}, MaxInf {max_inflight}")
    return {"rule": RULE_TEXT, "rule_settings": dataclasses.asdict(rule), "latency_ms": {str(b): v for b, v in latency.items()},
            "budget_ms": budget, "max_bs": max_bs, "max_inflight": max_inflight,
            "sets_ms": {",".join(map(str, w)): v[0] for w, v in measured.items()},
            "sets_slowest_ms": {",".join(map(str, w)): v[1] for w, v in measured.items()},
            "confs": {str(t): list(w) for t, w in confs.items()}, "engine": list(engine_for(confs)),
            "timed_by": "CUDA events, sets on their own streams" if settings.cuda else "wall clock, sets one after another"}


def policies(offline: dict) -> dict[str, dict]:
    """The two stages' policy documents from the offline phase (the rule, step 3)."""
    max_bs = offline["max_bs"]
    return {"N-Ebird": {"kind": "n-ebird", "engine": naive_engine(max_bs), "max_inflight": max_bs},
            "E-Ebird": {"kind": "e-ebird", "confs": offline["confs"], "max_inflight": offline["max_inflight"]}}
