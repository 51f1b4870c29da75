"""Text for people: a plan, a planner's result (``e3 plan``), a window's report (``e3 control``), the status
(``e3 status``). Only formatting; every number comes from the caller."""

from __future__ import annotations

import json
import time
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Sequence

from e3.controller.applier import ControlError, ServerView
from e3.controller.history import HistoryError, PlanHistory
from e3.controller.settings import history_path, state_path
from e3.core.names import router_name
from e3.core.plan import Plan

if TYPE_CHECKING:
    from e3.controller.loop import StepReport
    from e3.controller.planner import PlannerResult
    from e3.core.profile import LatencyProfile

__all__ = ["format_reach", "plan_lines", "planner_result_lines", "describe_report", "status_lines",
           "controller_status_lines"]


def format_reach(reach: Sequence[float] | None) -> str:
    """A batch profile's reach as ``[1.00, 0.42, ...]`` ("-" for none)."""
    return "-" if reach is None else "[" + ", ".join(f"{r:.2f}" for r in reach) + "]"


def plan_lines(plan: Plan, indent: str = "  ") -> list[str]:
    """One line per split (blocks, device x instances, split batch, queue delay, ramps), then the predictions."""
    lines = [f"{indent}{s.model:24s} blocks {s.first_block}-{s.last_block}  {s.device} x{s.instances}  "
             f"batch {s.batch_size}  queue delay {s.queue_delay_us} us  ramps {list(s.enabled_ramps) or '-'}"
             for s in plan.splits]
    if plan.predicted:
        p = plan.predicted
        lines.append(f"{indent}predicted throughput {p.get('throughput_rps', float('nan')):.1f} inputs/s, "
                     f"worst-case latency {p.get('latency_ms', float('nan')):.1f} ms, B0 "
                     f"{p.get('input_batch_size', float('nan')):.0f}")
    return lines


def planner_result_lines(result: PlannerResult, plan: Plan, latency: LatencyProfile, *, devices: Mapping[str, int],
                         slo_ms: float, slack: float) -> list[str]:
    """What ``e3 plan`` prints: every split's form, instances, batch per instance, stage and hop time, then B0,
    cycle, predicted throughput, goodput, worst-case latency against its budget, cost, the ramps the
    exit-wrapper disabled (what each would save and cost) and the planner's notes."""
    kind = "MODELLED" if latency.modelled else "measured"
    lines = [f"plan for {latency.model} ({kind} latency profile), devices {dict(devices)}, SLO {slo_ms:g} ms "
             f"- slack {slack:g}:"]
    for s, split in zip(result.splits, plan.splits):
        lines.append(f"  {split.model:28s} blocks {s.first_block}-{s.last_block}  {s.form:8s} {s.device} "
                     f"x{s.instances}  batch/instance {s.batch_per_instance:.1f}  stage {s.stage_ms:.2f} ms  "
                     f"hop {s.tx_ms:.2f} ms")
    lines.append(f"  input batch B0 {result.input_batch_size}, cycle {result.cycle_ms:.2f} ms")
    lines.append(f"  predicted throughput {result.throughput_rps:.1f} inputs/s, goodput {result.goodput_rps:.1f} "
                 f"inputs/s at {result.rate_rps:g} inputs/s offered, worst-case latency {result.latency_ms:.1f} ms "
                 f"(budget {result.latency_budget_ms:.1f}), cost {result.cost:g}"
                 + (f" (bound {result.cost_bound:g})" if result.cost_bound is not None else ""))
    disabled = [v for v in result.ramp_verdicts if not v.kept]
    if result.ramp_verdicts:
        lines.append("  exit-wrapper: " + (f"disabled ramps {[v.block for v in disabled]}" if disabled else
                                           "every ramp pays for itself"))
        lines += [f"    {v.describe()}" for v in disabled]
    lines += [f"  note: {note}" for note in result.notes]
    return lines


def describe_report(rep: StepReport) -> str:
    """A window's report as text (what ``e3 control`` prints)."""
    lines = [f"window {rep.window}: {rep.inputs:.0f} inputs, observed reach {format_reach(rep.observed)}, "
             f"forecast for it {format_reach(rep.forecast_for_window)}{' (DRIFT)' if rep.drift else ''}"]
    if rep.offered_rps is not None:
        lines.append(f"  offered {rep.offered_rps:.1f} inputs/s, dropped {rep.dropped_rps or 0.0:.1f} inputs/s; "
                     f"planned for {rep.planned_rps:.1f} inputs/s")
    if rep.error:
        lines.append(f"  error: {rep.error}")
    if rep.stragglers:
        lines.append(f"  stragglers (measured/profiled): {rep.stragglers}; planned with devices {rep.devices}")
    if rep.candidate is not None:
        def rps(x: float | None) -> str:
            return "-" if x is None else f"{x:.1f}"
        lines.append(f"  next window forecast {format_reach(rep.forecast)}; planner's plan "
                     f"({rps(rep.candidate_rps)} inputs/s; running plan {rps(rep.current_rps)} under the same "
                     f"forecast):")
        lines += plan_lines(Plan.from_dict(rep.candidate), "    ")
        lines.append("  diff vs running plan: " + ("; ".join(rep.diff) or "none"))
    lines.append(f"  {'APPLIED' if rep.applied else 'kept'}: {rep.decision}")
    if rep.reloaded:
        lines.append(f"  reloaded (dead Python stub): {rep.reloaded}")
    return "\n".join(lines)


def status_lines(view: ServerView, model: str, state_dir: str | Path | None = None,
                 *, history_entries: int = 10) -> list[str]:
    """What ``e3 status`` prints for served model ``model``: the live plan, loaded splits, the controller's
    last forecast vs observed, and the last ``history_entries`` applied plans."""
    router = router_name(model)
    lines = []
    try:
        plan = view.current_plan(router)
        if plan is None:
            lines.append(f"{router} is not loaded")
        else:
            lines.append(f"plan in force on {router}: {plan.plan_id} (SLO {plan.slo_ms:g} ms, "
                         f"slack {plan.slack:g}, exit rule {plan.exit_rule})")
            lines += plan_lines(plan)
        loaded = view.loaded_splits(model)
        lines.append("loaded splits: " + (", ".join(f"{n} x{c}" for n, c in sorted(loaded.items())) or "none"))
    except ControlError as err:
        lines.append(f"server: {err}")
    state_file = state_path(model, state_dir)
    if state_file.exists():
        try:
            state = json.loads(state_file.read_text())
            rep = state["report"]
            lines.append(f"controller's last window ({rep['window']}, {time.ctime(state['updated_at'])}): "
                         f"observed {format_reach(rep['observed'])} vs forecast "
                         f"{format_reach(rep['forecast_for_window'])}{' DRIFT' if rep['drift'] else ''}; "
                         f"next forecast {format_reach(rep['forecast'])}")
            lines.append(f"  decision: {'applied' if rep['applied'] else 'kept'} ({rep['decision']})"
                         + (f"; pinned {state['pinned']}" if state.get("pinned") else "")
                         + (f"; {state['failures']} refused applies" if state.get("failures") else ""))
        except (OSError, ValueError, KeyError, TypeError) as err:
            lines.append(f"controller state {state_file} unreadable: {err}")
    else:
        lines.append(f"no controller state yet ({state_file})")
    try:
        history = PlanHistory(history_path(model, state_dir), model)
    except HistoryError as err:
        lines.append(str(err))
        return lines
    lines.append(f"plan history ({len(history.entries)} applied, last {history_entries}):")
    for e in history.entries[-history_entries:]:
        plan = Plan.from_dict(e["plan"])
        cuts = " | ".join(f"{s.first_block}-{s.last_block} x{s.instances}" for s in plan.splits)
        lines.append(f"  {time.ctime(e['applied_at'])}  {plan.plan_id}  {cuts}  ({e['reason']})")
    return lines


def controller_status_lines(status: Mapping, url: str) -> list[str]:
    """What ``e3 status --url`` prints for a controller's ``/status`` answer (``ControllerMetrics.status``):
    its health, the plan it wants in force, the pods per pool, and its last window as ``e3 control`` printed it."""
    from e3.controller.loop import StepReport   # deferred: an import cycle (the loop imports this module)
    yes = {True: "yes", False: "no"}
    last = status.get("last_window_unix_s")
    lines = [f"controller at {url}: ready {yes[bool(status['ready'])]}, healthy {yes[bool(status['healthy'])]}; "
             f"{status['windows']} windows ({status['window_errors']} failed), {status['plans_applied']} plans "
             f"applied; last window {time.ctime(last) if last else 'none yet'}"]
    wanted = status.get("wanted_plan")
    if wanted is None:
        lines.append("plan it wants in force: none (the router's plan not known yet)")
    else:
        plan = Plan.from_dict(wanted)
        lines.append(f"plan it wants in force: {plan.plan_id} (SLO {plan.slo_ms:g} ms, slack {plan.slack:g}, "
                     f"exit rule {plan.exit_rule})")
        lines += plan_lines(plan)
    pods = status.get("desired_replicas") or {}
    if pods:
        lines.append("pods each pool should run: " + ", ".join(f"{p} {n}" for p, n in pods.items()))
    if status.get("last_report"):
        lines.append("last window:")
        known = {f.name for f in fields(StepReport)}   # a newer controller's extra fields are not an error
        rep = StepReport(**{k: v for k, v in status["last_report"].items() if k in known})
        lines += ["  " + line for line in describe_report(rep).splitlines()]
    return lines
