"""What a planner search returns (:class:`PlannerResult`) and the context every search step shares."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

from e3.core.cost import SPLIT_FORMS, StageCost, summarise
from e3.core.names import ramps_in_range, split_name
from e3.core.plan import DEVICE, FORMS, Plan, SplitPlan, entry_queue_delay_us

if TYPE_CHECKING:
    from e3.controller.planner.ramps import RampVerdict

__all__ = ["PlannerError", "PlanOptions", "SearchContext", "PlannerResult", "make_result", "better", "DEVICE_KIND", "SPLIT_KIND"]

REL = 1e-9  # relative tolerance when comparing throughputs and costs
DEVICE_KIND = "device"                      # PlannerResult.compared: the best all-device plan
SPLIT_KIND = "constant/compact"             # ... and the best plan of constant and compact splits


class PlannerError(ValueError):
    """Inputs the planner cannot use, or no plan meets the constraints; the message says which."""


@dataclass(frozen=True)
class PlanOptions:
    """What a planning question asks, besides the profiles and the devices: the one options object of the
    planner's entry points (:func:`~e3.controller.planner.search.best_plan`, :func:`~e3.controller.planner.
    search.cheapest_plan`, :func:`~e3.controller.planner.search.stock_baseline`)."""
    slo_ms: float                             # the requests' p99 SLO (ms); plans must fit SLO x (1 - slack)
    rate_rps: float | None = None             # R, the offered rate (inputs/s); cheapest_plan: None = the goodput
    slack: float = 0.2                        # the share of the SLO kept free (E3: 20%)
    alpha: float | None = 1.0                 # cost <= alpha x Cost_baseline (None: no cost bound)
    cost_bound: float | None = None           # the cost bound itself (overrides alpha)
    goodput_rps: float | None = None          # cheapest_plan: the throughput to reach (inputs/s)
    pipelined: bool = True                    # the cycle is the slowest stage (E3 §3.2.2), else their sum
    b0s: Iterable[int] | None = None          # the input batches tried (None: the planner's candidates)
    forms: Sequence[str] = FORMS              # the split forms to choose from ("constant" forces E3's form)
    exit_wrapper: bool = True                 # disable the ramps that cost more than they save (E3 §3.4)
    ramp_blocks: Iterable[int] | None = None  # the model's ramps (None: from the batch profile)
    relies_on: Any = None                     # the exit rule's dependencies (ExitRule.relies_on; None: independent)


@dataclass(frozen=True)
class SearchContext:
    """What every step of one search shares: the constraints and what to report with the result."""
    rate_rps: float                   # R: offered rate the plan is made for (inputs/s)
    latency_budget_ms: float          # SLO * (1 - slack) (ms)
    pipelined: bool = True            # cycle = slowest stage or hop (True) or their sum
    cost_bound: float | None = None   # alpha * Cost_baseline; None: unbounded
    cost_baseline: float | None = None  # cost of the stock baseline plan (see stock_baseline)
    notes: tuple[str, ...] = ()       # anything the caller should know (e.g. fallback baselines)
    forms: tuple[str, ...] = SPLIT_FORMS  # per-split forms the DP may choose (("constant",): force one)
    device_form: bool = False         # also weigh an all-device plan on each accelerator (tables.runs_device_form)
    exit_wrapper: bool = True         # disable ramps that cost more than their exits save (E3 §3.4)
    ramp_blocks: tuple[int, ...] | None = None  # ramps a plan may enable (the wrapper's candidates); None:
                                      # the profile's priced ramps and blocks where inputs exit (candidate_ramps)
    exact_reach: Mapping[str, Sequence[float]] | None = None  # measured reach per set of enabled ramps
                                      # (BatchProfile.reach_by_ramps); None: effective_reach's approximation
    relies_on: Any = None             # the exit rule's dependencies, ExitRule.relies_on (None: independent)

    @property
    def all_forms(self) -> tuple[str, ...]:
        """Every form this search may choose, in FORMS order (what ``forms=`` of a search takes)."""
        return tuple(f for f in FORMS if f in self.forms or (f == DEVICE and self.device_form))


@dataclass(frozen=True)
class PlannerResult:
    """One chosen plan: its splits and the summary numbers of e3.core.cost.summarise for them."""
    splits: tuple[StageCost, ...]     # in block order, each priced by e3.core.cost
    input_batch_size: int             # B0: inputs admitted per cycle
    cycle_ms: float                   # pipelined: slowest stage or hop; else their sum (ms)
    throughput_rps: float             # 1000 * B0 / cycle_ms (inputs/s)
    goodput_rps: float                # min(throughput, R): what the offered rate lets it answer (inputs/s)
    latency_ms: float                 # worst-case latency: fill time + every stage and hop (ms)
    cost: float                       # sum of instances x price
    devices_used: dict[str, int]      # device configuration -> instances used
    rate_rps: float                   # R the plan was made for (inputs/s)
    latency_budget_ms: float          # SLO * (1 - slack)
    cost_bound: float | None = None   # alpha * Cost_baseline, None when unbounded
    cost_baseline: float | None = None  # cost of the stock baseline plan (see stock_baseline)
    pipelined: bool = True
    notes: tuple[str, ...] = field(default=())  # anything the caller should know (e.g. fallback baselines)
    enabled_ramps: tuple[int, ...] = ()  # the ramps this plan was priced with (blocks)
    ramp_verdicts: tuple[RampVerdict, ...] = ()  # the exit-wrapper's verdict per ramp at this B0 (empty: off)
    compared: tuple[tuple[str, float], ...] = ()  # (kind, inputs/s) of the best plan of each kind the search
                                      # weighed: DEVICE_KIND and SPLIT_KIND (0.0: none of that kind fits); empty
                                      # when only one kind was searched

    @property
    def on_device(self) -> bool:
        """Every split is of the device form (docs/design.md §2b)."""
        return bool(self.splits) and self.splits[0].form == DEVICE

    @property
    def cuts(self) -> list[int]:
        """Cut after these blocks (the `--cuts` vocabulary)."""
        return [s.last_block for s in self.splits[:-1]]

    @property
    def disabled_ramps(self) -> tuple[int, ...]:
        """Ramps the exit-wrapper disabled (blocks, ascending)."""
        return tuple(v.block for v in self.ramp_verdicts if not v.kept)

    def to_plan(self, *, model: str, num_blocks: int, exit_rule: Mapping[str, Any], ramp_blocks: Iterable[int],
                slo_ms: float, slack: float) -> Plan:
        """The shared plan document for this result: every split's form, and every ramp of ``ramp_blocks``
        (the model's) inside a split enabled unless the exit-wrapper disabled it.

        ``queue_delay_us`` of each split after the first is one cycle (an instance's batch arrives within
        one cycle in the steady state; waiting longer means the forecast was wrong), capped so that the
        splits' queue delays together stay within the SLO's slack; the first split's (and the router's)
        is :func:`e3.core.plan.entry_queue_delay_us` (0, measured).
        """
        ramps = tuple(sorted(set(int(k) for k in ramp_blocks)))
        enabled = tuple(k for k in ramps if k not in set(self.disabled_ramps))
        slack_us = slo_ms * slack * 1e3 / max(1, len(self.splits))
        delay_us = int(max(0.0, min(self.cycle_ms * 1e3, slack_us)))
        splits = tuple(
            SplitPlan(model=split_name(model, s.first_block, s.last_block), first_block=s.first_block,
                      last_block=s.last_block, batch_size=s.preferred_batch, instances=s.instances,
                      device=s.device,
                      queue_delay_us=entry_queue_delay_us() if s.first_block == 1 else delay_us,
                      enabled_ramps=ramps_in_range(enabled, s.first_block, s.last_block, num_blocks=num_blocks), form=s.form)
            for s in self.splits)
        predicted = {"throughput_rps": self.throughput_rps, "goodput_rps": self.goodput_rps,
                     "latency_ms": self.latency_ms, "cost": self.cost, "cycle_ms": self.cycle_ms,
                     "input_batch_size": float(self.input_batch_size)}
        if self.cost_bound is not None:
            predicted["cost_bound"] = self.cost_bound
        plan = Plan(model=model, num_blocks=num_blocks, exit_rule=dict(exit_rule), splits=splits, slo_ms=slo_ms,
                    slack=slack, predicted=predicted)
        plan.validate(ramps)
        return plan


def make_result(stages: Sequence[StageCost], b0: int, prices: Mapping[str, float], *, ctx: SearchContext,
                enabled_ramps: Iterable[int] = (), ramp_verdicts: Sequence[RampVerdict] = ()) -> PlannerResult:
    """The result for priced ``stages`` at input batch ``b0`` (priced with ``enabled_ramps``, as the
    exit-wrapper's ``ramp_verdicts`` decided): its numbers come from E3's cost model."""
    pc = summarise(stages, b0, ctx.rate_rps, prices=prices, pipelined=ctx.pipelined)
    return PlannerResult(splits=pc.stages, input_batch_size=int(b0), cycle_ms=pc.cycle_ms,
                         throughput_rps=pc.throughput_rps, goodput_rps=min(pc.throughput_rps, ctx.rate_rps),
                         latency_ms=pc.latency_ms, cost=pc.cost, devices_used=pc.devices_used,
                         rate_rps=ctx.rate_rps, latency_budget_ms=ctx.latency_budget_ms, cost_bound=ctx.cost_bound,
                         cost_baseline=ctx.cost_baseline, pipelined=ctx.pipelined, notes=ctx.notes,
                         enabled_ramps=tuple(enabled_ramps), ramp_verdicts=tuple(ramp_verdicts))


def better(r: PlannerResult, best: PlannerResult) -> bool:
    """Is ``r`` better than ``best``: higher throughput; ties go to the lower cost, then the lower latency."""
    if r.throughput_rps > best.throughput_rps * (1 + REL):
        return True
    if r.throughput_rps < best.throughput_rps * (1 - REL):
        return False
    if r.cost < best.cost * (1 - REL) - 1e-12:
        return True
    if r.cost > best.cost * (1 + REL) + 1e-12:
        return False
    return r.latency_ms < best.latency_ms
