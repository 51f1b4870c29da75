"""Is the plan in force healthy? Straggling splits and dead Python stubs, from Triton's own counters (pure).

Decisions (where the paper and docs/design.md are silent)
-------------------------------------------------
* **Stragglers** (E3 §3.3): Triton's per-model statistics are per model, not
  per instance, and on one CPU machine the instances of a split share the same
  cores. So a split whose measured per-batch latency over the window
  (``compute_infer`` ns / executions, at the window's mean executed batch) is
  above ``straggler_factor`` x its profiled latency at that batch
  (:func:`e3.core.cost.stage_cost`) counts as one slow instance, and the next
  plan is made with one device fewer of that split's configuration (never
  below one). Detection needs at least ``min_executions`` executions in the
  window.
* **Dead Python stubs** (docs/design.md §6): detected from Triton's failed-request
  counter ``nv_inference_request_failure`` (per model, on the metrics port):
  when it rose in the window for the router or a split of the plan in force,
  that model is probed with one tiny request; if the probe fails with "Stub
  process ... is not healthy" (:func:`e3.deploy.stubs.is_dead_stub`), the model is reloaded (a
  load with its live config as override, which Triton treats as a new
  version). The counter is the cheap trigger (no request per window); the
  probe keeps deadline drops and bad client input, which also count as
  failures, from causing reloads.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterable, Mapping

from e3.core.cost import stage_cost
from e3.core.plan import Plan
from e3.core.profile import LatencyProfile
from e3.core.telemetry import metric_samples

__all__ = ["SplitStats", "find_stragglers", "exclude_stragglers", "failed_requests",
           "REQUEST_FAILURE"]

log = logging.getLogger(__name__)

REQUEST_FAILURE = "nv_inference_request_failure"   # Triton's failed-request counter (per model)


@dataclass(frozen=True)
class SplitStats:
    """Cumulative Triton statistics of one model (``/v2/models/<name>/stats``)."""
    executions: int          # execution_count: batches executed
    inferences: int          # inference_count: inputs executed
    compute_infer_ns: int    # inference_stats.compute_infer.ns: time inside execute (ns)


def find_stragglers(before: Mapping[str, SplitStats], after: Mapping[str, SplitStats], plan: Plan,
                    *, latency: LatencyProfile, factor: float, min_executions: int = 5) -> dict[str, float]:
    """Splits of ``plan`` whose measured per-batch latency over the window is > ``factor`` x the profiled one.

    Measured: delta compute_infer / delta executions (ms per batch), at the
    window's mean executed batch (delta inferences / delta executions);
    profiled: the split's stage time at that batch per instance, ramps
    included (:func:`e3.core.cost.stage_cost`). Returns split name ->
    measured / profiled. Splits with fewer than ``min_executions`` executions,
    without stats, whose counters went down (a reload), whose device is not in
    the latency profile, or of a plan for another number of blocks are skipped.
    """
    if plan.num_blocks != latency.num_blocks:
        return {}
    every_block = [1.0] * latency.num_blocks   # the measured batch is what entered the split: no exits before it
    out = {}
    for s in plan.splits:
        a, b = before.get(s.model), after.get(s.model)
        if a is None or b is None or s.device not in latency.devices:
            continue
        runs = b.executions - a.executions
        if runs < min_executions or b.inferences < a.inferences or b.compute_infer_ns < a.compute_infer_ns:
            continue
        measured_ms = (b.compute_infer_ns - a.compute_infer_ns) / runs / 1e6
        batch = (b.inferences - a.inferences) / runs
        profiled_ms = stage_cost(latency, every_block, batch, first=s.first_block, last=s.last_block, device=s.device, instances=1).stage_ms
        if profiled_ms > 0 and measured_ms > factor * profiled_ms:
            out[s.model] = measured_ms / profiled_ms
    return out


def exclude_stragglers(devices: Mapping[str, int], plan: Plan, stragglers: Iterable[str]) -> dict[str, int]:
    """The devices for the next plan: one device fewer of a straggling split's configuration (never < 1)."""
    out = dict(devices)
    device_of = {s.model: s.device for s in plan.splits}
    for name in stragglers:
        dev = device_of.get(name)
        if dev is None or dev not in out:
            continue
        if out[dev] > 1:
            out[dev] -= 1
        else:
            log.warning("straggler %s: only one %s device left; it cannot be left out", name, dev)
    return out


def failed_requests(metrics_text: str) -> dict[str, float]:
    """Model -> Triton's cumulative ``nv_inference_request_failure`` (summed over its other labels)."""
    out: dict[str, float] = {}
    for name, labels, value in metric_samples(metrics_text):
        if name == REQUEST_FAILURE and "model" in labels:
            out[labels["model"]] = out.get(labels["model"], 0.0) + value
    return out


