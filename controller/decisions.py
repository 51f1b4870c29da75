"""Whether to apply a plan, and what applying it changes: pure functions of plans and forecasts.

Decisions (where the paper and docs/design.md are silent)
-------------------------------------------------
* **"Better by a margin" compares like with like**: the new plan's predicted
  throughput against the *running* plan re-scored under the same forecast
  (:func:`score_plan`: E3's cost model, :func:`e3.core.cost.plan_cost`,
  applied to a fixed plan), not against the running plan's prediction for an
  older mix. A running plan that cannot be scored (device not in the latency
  profile) or that breaks the latency budget under the forecast scores 0.
* **Drift** applies the new plan whatever the margin (E3 §3.1), unless the new
  plan has the same layout (:func:`layout`: splits, instances, batch sizes,
  devices, ramps, forms) as the running one. Nothing is applied while a plan is pinned.
* **Retries** after Triton refuses wait :func:`backoff_delay_s`: exponential,
  capped.
"""

from __future__ import annotations

from dataclasses import dataclass

from e3.core.cost import plan_cost
from e3.core.plan import Plan
from e3.core.profile import BatchProfile, LatencyProfile

__all__ = ["Decision", "layout", "same_layout", "decide", "plan_diff", "score_plan", "devices_used",
           "backoff_delay_s"]

_REL = 1e-9   # relative tolerance: float noise must not turn "equal" into "better" or "over budget"


@dataclass(frozen=True)
class Decision:
    apply: bool       # True: apply the candidate plan
    reason: str       # why, in words (logged, written to the history and the state file)


def layout(plan: Plan) -> tuple:
    """What a plan changes on the server: per split its model, instances, batch size, device, ramps, form and
    server (a split moved to another pool is a change).

    Plan ids, predictions and queue delays are left out: two plans with the same
    layout serve the same way.
    """
    return tuple((s.model, s.instances, s.batch_size, s.device, tuple(s.enabled_ramps), s.form, s.server)
                 for s in plan.splits)


def same_layout(a: Plan | None, b: Plan | None) -> bool:
    """True when both plans exist and serve the same way (:func:`layout`)."""
    return a is not None and b is not None and layout(a) == layout(b)


def decide(*, candidate: Plan, current: Plan | None, candidate_rps: float, current_rps: float | None,
           drift: bool, pinned: bool, margin: float = 0.10, current_fits: bool = True) -> Decision:
    """Apply ``candidate``? ``*_rps``: predicted throughput (inputs/s) of both plans under the same forecast.

    Never while pinned; never when the layout would not change; always when
    nothing runs yet or the running plan cannot be scored (``current_rps`` None);
    always when the running plan uses more devices than the planner was given
    (``current_fits`` False: a straggler was left out); otherwise when the
    candidate beats the running plan by more than ``margin`` (a share, 0.1 =
    10%), or when the observed profile drifted from the forecast.
    """
    if pinned:
        return Decision(False, "pinned: the controller only watches")
    if same_layout(candidate, current):
        return Decision(False, "the planner's plan has the running layout")
    if current is None:
        return Decision(True, "no plan is running")
    if not current_fits:
        return Decision(True, "the running plan uses devices that are left out (stragglers)")
    if current_rps is None or current_rps <= 0:
        return Decision(True, "the running plan cannot be scored under the forecast (or breaks its SLO)")
    gain = candidate_rps / current_rps - 1.0
    if candidate_rps > current_rps * (1.0 + margin) * (1.0 + _REL):   # strictly better, float noise aside
        return Decision(True, f"predicted throughput {candidate_rps:.1f} vs {current_rps:.1f} inputs/s "
                              f"(+{100 * gain:.0f}% > {100 * margin:.0f}% margin)")
    if drift:
        return Decision(True, f"observed batch profile drifted from the forecast (gain {100 * gain:+.0f}%)")
    return Decision(False, f"gain {100 * gain:+.0f}% within the {100 * margin:.0f}% margin and no drift")


def plan_diff(current: Plan | None, new: Plan) -> list[str]:
    """Human-readable changes from ``current`` to ``new``: splits added (+), removed (-), changed (~), kept (=)."""
    if current is None:
        return [f"+ {s.model} x{s.instances} batch {s.batch_size} on {s.device}" for s in new.splits]
    old = {s.model: s for s in current.splits}
    lines = []
    for s in new.splits:
        o = old.pop(s.model, None)
        if o is None:
            lines.append(f"+ {s.model} x{s.instances} batch {s.batch_size} on {s.device}")
            continue
        changes = [f"{what} {a} -> {b}" for what, a, b in (
            ("instances", o.instances, s.instances), ("batch", o.batch_size, s.batch_size),
            ("device", o.device, s.device), ("queue delay us", o.queue_delay_us, s.queue_delay_us),
            ("ramps", list(o.enabled_ramps), list(s.enabled_ramps)), ("form", o.form, s.form),
            ("server", o.server or "router's own", s.server or "router's own")) if a != b]
        lines.append(f"~ {s.model}: " + ", ".join(changes) if changes else f"= {s.model}")
    lines += [f"- {name}" for name in old]
    return lines


def score_plan(latency: LatencyProfile, batch: BatchProfile, plan: Plan, *, rate_rps: float) -> float | None:
    """Predicted throughput (inputs/s) of a fixed ``plan`` under the batch profile ``batch``.

    E3's cost model (:func:`e3.core.cost.plan_cost`, pipelined) on the plan's
    splits in their forms with the plan's enabled ramps, with B0 = the plan's
    predicted ``input_batch_size`` (else its first split's batch x instances)
    and the offered rate ``rate_rps`` (inputs/s).
    Returns 0.0 when the worst-case latency breaks SLO x (1 - slack), None when
    a split's device is not in the latency profile or the plan, the batch
    profile and the latency profile do not have the same number of blocks.
    """
    if plan.num_blocks != latency.num_blocks or len(batch.reach) != latency.num_blocks:
        return None
    if any(s.device not in latency.devices for s in plan.splits):
        return None
    b0 = float(plan.predicted.get("input_batch_size") or plan.splits[0].batch_size * plan.splits[0].instances)
    splits = [(s.first_block, s.last_block, s.device, s.instances, s.form) for s in plan.splits]
    cost = plan_cost(latency, batch.reach, splits, b0=b0, rate_rps=rate_rps, pipelined=True, ramps=plan.enabled_ramps)
    if cost.latency_ms > plan.slo_ms * (1 - plan.slack) * (1 + _REL):
        return 0.0
    return cost.throughput_rps


def devices_used(plan: Plan) -> dict[str, int]:
    """Device configuration -> instances the plan's splits use. A plan of device splits uses one device (the
    router's instance runs every split on it, e3.core.plan), however many splits it has."""
    if plan.on_device:
        return {plan.splits[0].device: 1}
    out: dict[str, int] = {}
    for s in plan.splits:
        out[s.device] = out.get(s.device, 0) + s.instances
    return out


def backoff_delay_s(failures: int, base_s: float = 1.0, max_s: float = 60.0) -> float:
    """Exponential backoff: ``base_s`` after the first failure, doubling, capped at ``max_s`` (s); 0 before any."""
    if failures < 1:
        return 0.0
    return min(max_s, base_s * 2.0 ** (failures - 1))
