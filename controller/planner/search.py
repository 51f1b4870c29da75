"""The planner's searches: the best plan (fast and exact), the cheapest plan for a goodput (E3 §5.3) and
the stock baseline that sets Cost_baseline. See the package docstring for why the fast search is exact.

Both searches weigh two kinds of plan under the same SLO, devices and cost bound: plans of constant and
compact splits (the DP) and, where the device form is allowed, all-device plans on one accelerator
(:func:`device_plan`, :mod:`~e3.controller.planner.device`); the better one wins (:func:`better`), and the
result says what the other kind would have given (``PlannerResult.compared``)."""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Iterable, Mapping, Sequence

import numpy as np

from e3.controller.planner.device import best_device_cuts
from e3.controller.planner.dp import (Found, best_cell, cost_grid, cost_ok_grid, feasible_ignoring_latency,
                                      latency_dp, lower_bound_cycle, result_of, solve_unpipelined)
from e3.controller.planner.ramps import candidate_ramps
from e3.controller.planner.result import (DEVICE_KIND, REL, SPLIT_KIND, PlannerError, PlannerResult, PlanOptions,
                                          SearchContext, better, make_result)
from e3.controller.planner.tables import (Tables, b0_candidates, build_tables, check_inputs, parse_forms, plan_ramps,
                                          plan_tables, runs_device_form)
from e3.core.cost import SPLIT_FORMS, StageCost, device_table, effective_reach, fill_ms
from e3.core.names import ranges_from_cuts
from e3.core.plan import CONSTANT, DEVICE, FORMS
from e3.core.profile import BatchProfile, LatencyProfile

__all__ = ["best_plan", "cheapest_plan", "stock_baseline", "plan_context", "device_plan"]

log = logging.getLogger(__name__)


def _mid(cands: np.ndarray, lo: int, hi: int) -> int:
    """A split point in [lo, hi) for bisection over sorted candidates: their geometric middle while they
    span more than a factor 1.5 (low bounds make cheap DPs, and the answer is usually near the bottom of a
    wide range), the middle index after that."""
    a, b = float(cands[lo]), float(cands[hi - 1])
    if a > 0 and b > 1.5 * a:
        return min(hi - 1, max(lo, int(np.searchsorted(cands, math.sqrt(a * b), "left"))))
    return (lo + hi) // 2


class _B0Search:
    """Search state of one B0: cands[:lo] are known infeasible, cands[hi] (when set) known feasible."""

    def __init__(self, t: Tables, budget: float, cost_bound: float | None):
        self.t, self.b0, self.budget = t, t.b0, budget
        self.cost_grid = cost_grid(t)
        self.cost_ok = cost_ok_grid(t, cost_bound)
        cands = np.unique(np.concatenate([s[np.isfinite(s)] for s in t.stage]))
        self.cands = cands[cands >= lower_bound_cycle(t) * (1 - 1e-12)]   # the same set the reference search tries
        self.lo, self.hi, self.found = 0, None, None
        self.refined = self.probed_lo = self.done = False
        self.races = 0

    def ub(self) -> float:
        """Upper bound on this B0's throughput: every bound below cands[lo] is infeasible."""
        return 1e3 * self.b0 / self.cands[self.lo] if self.lo < self.cands.size else 0.0

    def top(self, max_bound: float) -> int:
        """Index of the largest candidate <= max_bound (-1: none)."""
        return int(np.searchsorted(self.cands, max_bound, "right")) - 1

    def probe(self, i: int) -> None:
        """The exact latency DP at cands[i] (the reference's own test)."""
        f = latency_dp(self.t, float(self.cands[i]))
        got = best_cell(self.t, f, self.cost_grid, cost_ok=self.cost_ok, budget=self.budget)
        if got is None:
            self.lo = i + 1
        else:
            self.hi, self.found = i, Found(float(self.cands[i]), f, *got)

    def refine(self, top: int) -> None:
        """Raise lo to an exact lower bound: with one configuration the 1-D latency DP below gives the
        smallest feasible candidate itself; with several, the boolean DP (latency ignored) as in
        the reference search (controller/planner/reference.py). ``top``: the largest candidate index still worth searching."""
        self.refined = True
        if top < self.lo:
            return
        test = self._feasible_1d if len(self.t.configs) == 1 else \
            (lambda b: feasible_ignoring_latency(self.t, b, self.cost_ok))
        lo, hi = self.lo, top + 1          # hi: feasible, or top + 1 = nothing feasible up to top (yet)
        while lo < hi:
            mid = _mid(self.cands, lo, hi)
            if test(float(self.cands[mid])):
                hi = mid
            else:
                lo = mid + 1
        self.lo = lo

    def _feasible_1d(self, bound: float) -> bool:
        """One configuration: the latency DP of :func:`latency_dp` on its 1-D grid, as one gather per
        prefix over the (split start, instances) pairs whose stage fits the bound. It adds the same two
        numbers per transition and takes the same minima, so it gives the same f to the last bit (dropping
        "useless" instance counts there only drops sums that are >= a kept one)."""
        if not hasattr(self, "_ent"):
            t, L = self.t, self.t.T[0].shape[0]
            M = t.caps[0]
            self._W = W = M + M + 1                 # M cells of inf padding, then u = 0..M
            self._ent = []
            for j in range(L):
                st, la = t.stage[0][: j + 1, j, :], t.lat[0][: j + 1, j, :]
                a0, mi = np.nonzero(np.isfinite(st))
                o = np.argsort(st[a0, mi], kind="stable")
                a0, mi = a0[o], mi[o]
                base = a0 * W + M - (mi + 1)        # cell (a0, u - m) of f (see latency_dp) sits at a0 * W + M + u - m
                self._ent.append((st[a0, mi], base[:, None] + np.arange(M + 1)[None, :],
                                  la[a0, mi][:, None]))
        L, W, M = len(self._ent), self._W, self.t.caps[0]
        f = np.full((L + 1) * W, np.inf)
        f[M:W] = 0.0
        for j, (st, idx, la) in enumerate(self._ent):
            k = int(np.searchsorted(st, bound, "right"))
            if k:
                f[(j + 1) * W + M:(j + 2) * W] = (f[idx[:k]] + la[:k]).min(axis=0)
        fL = f[L * W + M:(L + 1) * W]
        return bool((self.cost_ok & (fL <= self.budget)).any())


def _lowest_reach(batch: BatchProfile) -> np.ndarray:
    """The batch profile's reach, or, with measured reach per set of ramps, the lowest share of each block
    over every set (a dependent rule may exit more with fewer ramps: the cheap bound must hold for all)."""
    reach = np.asarray(batch.reach, dtype=float)
    for v in batch.reach_by_ramps.values():
        reach = np.minimum(reach, np.asarray(v, dtype=float))
    return reach


def _cheap_cycle_bound(latency: LatencyProfile, reach: np.ndarray, res: Mapping[str, int],
                       ramps: Iterable[int]) -> float:
    """A lower bound on the pipelined cycle of every plan, for every B0, without building tables: block k
    runs in some split at some batch in (0, max batch], and P(k, c, x) there is at least the least measured
    value of its block row plus, for a ramp every plan pays (``ramps``), that of its ramp row (linear
    interpolation between measured batches, P(1) below the smallest); checks and the router's work only
    add to a stage. 0 when some block is reached by no input (it may then cost nothing). With ramps
    disabled, reach only grows (:func:`e3.core.cost.effective_reach`), so the test on ``reach`` holds."""
    if not (np.asarray(reach) > 0).all():
        return 0.0
    paid = {int(k) for k in ramps}
    lb = 0.0
    for k in range(latency.num_blocks):
        per_c = [min(latency.block_ms[c][k]) + (min(latency.ramp_ms[c][k]) if k + 1 in paid else 0.0)
                 for c in res]
        lb = max(lb, min(per_c))
    return max(0.0, lb * (1 - 1e-9))


def _search(build, b0s: list[int], cheap_lb: float, ctx: SearchContext) -> PlannerResult | None:
    """Pipelined best plan over all B0, with the answer of the reference search (controller/planner/reference.py) (see the module doc).

    Best-first: the live B0 with the highest throughput upper bound gets the next piece of work (first an
    exact lower bound, then exact latency-DP probes). A probe is placed where it decides the race with the
    runner-up (the bound at which this B0's throughput equals the runner-up's upper bound), else as in
    the reference search of ``controller/planner/reference.py`` (lowest candidate first, then the top, then bisection). A B0 is finished when its
    smallest feasible candidate is pinned (lo == hi) and dropped once its lowest open candidate exceeds
    the bound that the best plan found so far leaves it, exactly as the reference's ``max_bound``.
    """
    pending = {int(b0): (1e3 * b0 / cheap_lb if cheap_lb > 0 else math.inf) for b0 in b0s}  # no tables yet
    states: list[_B0Search] = []
    best: PlannerResult | None = None

    def top(st: _B0Search) -> int:
        mb = math.inf if best is None else 1e3 * st.b0 / best.throughput_rps * (1 + 1e-9)
        tp = st.top(mb)
        if st.hi is not None and st.hi > tp:
            st.hi, st.found = None, None    # its feasible bound no longer beats the best plan
        return tp if st.hi is None else min(tp, st.hi)

    while True:
        for st in states:                  # pinned: cands[lo] is this B0's smallest feasible bound
            if not st.done and st.hi is not None and st.hi == st.lo:
                r = result_of(st.t, st.found, ctx)
                if best is None or better(r, best):
                    best = r
                st.done = True
        live = []
        for st in states:
            if not st.done and st.lo <= top(st):
                live.append(st)
            else:
                st.done = True
        if pending and best is not None:   # B0s whose cheap bound cannot reach the best plan: never built
            pending = {b0: ub for b0, ub in pending.items() if ub >= best.throughput_rps * (1 - 1e-9)}
        if pending:
            b_next = max(pending, key=lambda b: (pending[b], b))
            if not live or pending[b_next] >= max(s.ub() for s in live):
                del pending[b_next]
                states.append(_B0Search(build(b_next), ctx.latency_budget_ms - fill_ms(b_next, ctx.rate_rps),
                                        ctx.cost_bound))
                continue
        if not live:
            return best
        live.sort(key=lambda s: -s.ub())
        st, tp = live[0], top(live[0])
        if not st.refined:
            st.refine(tp)
            if st.lo <= tp:                 # the exact DP at the refined bound: with one configuration it is
                st.probed_lo = True         # the answer; it finishes a B0 early and bounds the others
                st.probe(st.lo)
            continue
        if not st.probed_lo:
            st.probed_lo = True
            st.probe(st.lo)
            continue
        upper = st.hi if st.hi is not None else tp
        target = max(live[1].ub() if len(live) > 1 else 0.0, max(pending.values(), default=0.0),
                     best.throughput_rps if best is not None else 0.0)
        race = int(np.searchsorted(st.cands, 1e3 * st.b0 / target, "right")) - 1 if target > 0 else -1
        if st.races < 3 and st.lo <= race < upper:
            st.races += 1
            st.probe(race)
        elif st.hi is None:
            st.probe(tp)
        else:
            st.probe(_mid(st.cands, st.lo, st.hi))


# ----------------------------------------------------------------------------------------------------------
# public entry points

def stock_baseline(latency: LatencyProfile, devices: Mapping[str, int], options: PlanOptions) -> PlannerResult | None:
    """Cost_baseline's plan: the cheapest one-split plan of the *stock* model (no ramps, no exits) on one
    configuration with instances whose throughput reaches ``rate_rps`` within SLO*(1-slack); if none reaches
    it, the one with the highest throughput (ties: cheaper); None if no stock plan meets the latency budget.
    Reads ``options``' slo_ms, rate_rps, slack and b0s."""
    slo_ms, rate_rps, slack, b0s = options.slo_ms, options.rate_rps, options.slack, options.b0s
    res = check_inputs(latency, None, devices, slo_ms=slo_ms, slack=slack, rate_rps=rate_rps)
    ctx = SearchContext(rate_rps=rate_rps, latency_budget_ms=slo_ms * (1 - slack))
    reach = np.ones(latency.num_blocks)
    L = latency.num_blocks
    best, best_key = None, None
    for b0 in (b0s if b0s is not None else b0_candidates(latency, res, rate_rps, latency_budget_ms=ctx.latency_budget_ms)):
        t = build_tables(latency, reach, res, b0=int(b0), ramps=(), forms=(CONSTANT,), router=False)
        for ci, c in enumerate(t.configs):
            T = t.T[ci][0, L - 1]                          # [m-1]
            for mi in np.nonzero(np.isfinite(T))[0]:
                stage = StageCost(1, L, c, int(mi + 1), float(b0 / (mi + 1)), float(T[mi]), 0.0)
                r = make_result((stage,), int(b0), {c: float(t.prices[ci])}, ctx=ctx)
                if r.latency_ms > ctx.latency_budget_ms * (1 + 1e-12):
                    continue
                meets = r.throughput_rps >= rate_rps * (1 - REL)
                key = (0, r.cost, -r.throughput_rps, r.latency_ms) if meets else \
                    (1, -r.throughput_rps, r.cost, r.latency_ms)
                if best_key is None or key < best_key:
                    best_key, best = key, r
    return best


def best_plan(latency: LatencyProfile, batch: BatchProfile, devices: Mapping[str, int],
              options: PlanOptions) -> PlannerResult:
    """The plan with the highest throughput (inputs/s) under SLO*(1-slack), the devices and
    cost <= alpha * Cost_baseline (``alpha=None``: no cost bound; ``cost_bound`` sets the bound directly).

    latency: P(k, c, B) and Tx per configuration; batch: share of inputs reaching every block;
    devices: configuration -> device count, e.g. ``{"v100": 6, "t4": 8}``; options (:class:`PlanOptions`):
    rate_rps: R, the offered rate;
    forms: the forms to choose from (``("constant",)`` forces E3's form; with ``"device"``, an all-device plan
    on each accelerator, :func:`device_plan`, is weighed against the plans of the other forms and the result's
    ``compared`` and notes say what each kind gives); exit_wrapper: disable the
    ramps that cost more than they save at each B0 (:mod:`~e3.controller.planner.ramps`); ramp_blocks:
    the model's ramps (None: :func:`~e3.controller.planner.ramps.candidate_ramps`); relies_on: the exit
    rule's dependencies (:meth:`e3.core.exits.ExitRule.relies_on`; None: independent), which the
    exit-wrapper respects where the batch profile holds no measured reach (``reach_by_ramps``) to re-price
    the ramps it disables. Raises :class:`PlannerError` when no plan fits.
    """
    if options.rate_rps is None:
        raise PlannerError("best_plan needs the offered rate (options.rate_rps, inputs/s)")
    ctx, cands, res = plan_context(latency, batch, devices, options)
    split = _best_split_plan(latency, batch, res, cands, ctx) if ctx.forms else None
    device = device_plan(latency, np.asarray(batch.reach, dtype=float), res, cands, ctx) if ctx.device_form else None
    best = _pick(split, device, ctx)
    if best is None:
        raise PlannerError(f"no plan meets latency <= {ctx.latency_budget_ms:.1f} ms (SLO {options.slo_ms:g} ms, slack "
                           f"{options.slack:g}) at {options.rate_rps:g} inputs/s with {res}" +
                           (f" and cost <= {ctx.cost_bound:.4g}" if ctx.cost_bound is not None else "") +
                           f" (forms {', '.join(ctx.all_forms)})")
    return best


def _best_split_plan(latency: LatencyProfile, batch: BatchProfile, res: Mapping[str, int], cands: list[int],
                     ctx: SearchContext) -> PlannerResult | None:
    """The best plan of constant and compact splits (E3's DP, the package docstring); None: none fits."""
    def build(b0: int) -> Tables:
        return plan_tables(latency, np.asarray(batch.reach, dtype=float), res, b0=int(b0), ctx=ctx)

    if ctx.pipelined:
        paid = () if ctx.exit_wrapper else ctx.ramp_blocks
        return _search(build, cands, _cheap_cycle_bound(latency, _lowest_reach(batch), res, paid), ctx)
    best = None
    for b0 in cands:
        t = build(b0)
        max_cycle = math.inf if best is None else 1e3 * b0 / best.throughput_rps * (1 + 1e-9)
        found = solve_unpipelined(t, ctx.latency_budget_ms - fill_ms(b0, ctx.rate_rps), ctx.cost_bound,
                                  max_cycle=max_cycle)
        if found is not None:
            r = result_of(t, found, ctx)
            if best is None or better(r, best):
                best = r
    return best


def device_plan(latency: LatencyProfile, reach: np.ndarray, res: Mapping[str, int], cands: Iterable[int],
                ctx: SearchContext, *, configs: Iterable[str] | None = None) -> PlannerResult | None:
    """The best all-device plan (docs/design.md §2b): on one device of an accelerator configuration
    (:func:`~e3.controller.planner.tables.runs_device_form`; ``configs``: only these), every split one instance
    at the batch B0 (a candidate no larger than the largest measured batch), cut after a subset of the ramps
    the exit-wrapper keeps on that configuration at that B0; the cuts with the least cycle whose latency fits
    SLO x (1 - slack) less the fill time (:func:`~e3.controller.planner.device.best_device_cuts`), priced by
    :func:`e3.core.cost.device_table`; the device's price within the cost bound. None: no such plan fits."""
    bmax = float(latency.batch_sizes[-1])
    best = None
    for c in (res if configs is None else configs):
        price = latency.devices[c].price
        if not runs_device_form(latency, c) or res.get(c, 0) < 1:
            continue
        if ctx.cost_bound is not None and price > ctx.cost_bound * (1 + REL) + 1e-12:
            continue
        for b0 in cands:
            budget = ctx.latency_budget_ms - fill_ms(b0, ctx.rate_rps)
            if b0 > bmax + 1e-9 or budget <= 0:
                continue
            ramps, verdicts = plan_ramps(latency, reach, [c], b0=int(b0), ctx=ctx)
            batch_in = b0 * effective_reach(reach, ramps, ctx.exact_reach)
            T, runs = device_table(latency, c, batch_in, batch=float(b0), ramps=ramps)
            got = best_device_cuts(T, runs, ramps, budget_ms=budget)
            if got is None:
                continue
            stages = [StageCost(a, b, c, 1, float(b0), float(T[a - 1, b - 1]), 0.0, DEVICE, float(runs[a - 1]))
                      for a, b in ranges_from_cuts(list(got.cuts), latency.num_blocks)]
            r = make_result(stages, int(b0), {c: price}, ctx=ctx, enabled_ramps=ramps, ramp_verdicts=verdicts)
            if best is None or better(r, best):
                best = r
    return best


def _pick(split: PlannerResult | None, device: PlannerResult | None, ctx: SearchContext) -> PlannerResult | None:
    """The better of the two kinds (ties: the plan of constant and compact splits), with what each gives
    (``compared``) and a note saying why, when both kinds were searched."""
    if split is None or device is None or better(device, split):
        chosen = device if device is not None else split
    else:
        chosen = split
    if chosen is None or not (ctx.forms and ctx.device_form):
        return chosen
    rps = {kind: (r.throughput_rps if r is not None else 0.0) for kind, r in ((DEVICE_KIND, device), (SPLIT_KIND, split))}
    if device is None:
        why = "no all-device plan fits (no accelerator configuration, or none within the latency and cost bounds)"
    elif split is None:
        why = "no plan of constant or compact splits fits"
    else:
        lead = "pays" if chosen is device else "does not pay"
        why = (f"the device form {lead}: {device.throughput_rps:.1f} inputs/s predicted on {device.splits[0].device} "
               f"(B0 {device.input_batch_size}, cuts {device.cuts}) against {split.throughput_rps:.1f} for the best "
               f"plan of constant and compact splits (B0 {split.input_batch_size}, cuts {split.cuts})")
    return dataclasses.replace(chosen, compared=tuple(rps.items()), notes=chosen.notes + (why,))


def plan_context(latency: LatencyProfile, batch: BatchProfile, devices: Mapping[str, int],
                 options: PlanOptions) -> tuple[SearchContext, list[int], dict[str, int]]:
    """The search context (cost bound from alpha x the stock baseline unless given; forms, exit-wrapper and
    ramps as given), the B0 candidates and the checked devices
    (:func:`~e3.controller.planner.tables.check_inputs`)."""
    o = options
    slo_ms, rate_rps, slack, alpha, cost_bound = o.slo_ms, o.rate_rps, o.slack, o.alpha, o.cost_bound
    ramp_blocks, b0s = o.ramp_blocks, o.b0s
    res = check_inputs(latency, batch, devices, slo_ms=slo_ms, slack=slack, rate_rps=rate_rps)
    forms = parse_forms(o.forms)
    if forms == (DEVICE,) and not any(runs_device_form(latency, c) for c in res):
        raise PlannerError(f"the device form runs on an accelerator whose latency profile prices its exit check "
                           f"(check_ms); none of {sorted(res)} is one (allow constant or compact splits, e.g. "
                           f"--forms constant,compact)")
    ramps = candidate_ramps(latency, batch) if ramp_blocks is None else tuple(sorted({int(k) for k in ramp_blocks}))
    budget = slo_ms * (1 - slack)
    cands = list(b0s) if b0s is not None else b0_candidates(latency, res, rate_rps, latency_budget_ms=budget)
    notes: list[str] = []
    baseline_cost = None
    if cost_bound is None and alpha is not None:
        base = stock_baseline(latency, res, dataclasses.replace(o, b0s=cands))
        if base is None:
            notes.append("no stock plan meets the latency budget: cost bound dropped")
            log.warning("planner: %s", notes[-1])
        else:
            baseline_cost = base.cost
            cost_bound = alpha * base.cost
            if base.throughput_rps < rate_rps * (1 - REL):
                notes.append(f"no stock plan reaches {rate_rps:g} inputs/s; Cost_baseline is the fastest stock "
                             f"plan's ({base.throughput_rps:.1f} inputs/s)")
                log.info("planner: %s", notes[-1])
    return SearchContext(rate_rps=rate_rps, latency_budget_ms=budget, pipelined=o.pipelined, cost_bound=cost_bound,
                         cost_baseline=baseline_cost, notes=tuple(notes),
                         forms=tuple(f for f in forms if f in SPLIT_FORMS),
                         device_form=DEVICE in forms and any(runs_device_form(latency, c) for c in res),
                         exit_wrapper=bool(o.exit_wrapper), ramp_blocks=ramps,
                         exact_reach=dict(batch.reach_by_ramps) or None if batch is not None else None,
                         relies_on=o.relies_on), cands, res


def cheapest_plan(latency: LatencyProfile, batch: BatchProfile, devices: Mapping[str, int],
                  options: PlanOptions) -> PlannerResult:
    """The converse (E3 §5.3): the cheapest plan whose throughput reaches ``goodput_rps`` under
    SLO*(1-slack) and the devices; ties go to the higher throughput. ``options.goodput_rps`` is required;
    ``options.rate_rps`` (fill time) defaults to the goodput; alpha and cost_bound are not read; the rest as
    for :func:`best_plan`. Raises :class:`PlannerError` when no plan reaches it."""
    goodput_rps, pipelined = options.goodput_rps, options.pipelined
    if goodput_rps is None or not goodput_rps > 0:
        raise PlannerError(f"cheapest_plan needs options.goodput_rps > 0, got {goodput_rps}")
    rate = goodput_rps if options.rate_rps is None else options.rate_rps
    asked = dataclasses.replace(options, rate_rps=rate, alpha=None, cost_bound=None)
    ctx, cands, res = plan_context(latency, batch, devices, asked)
    budget = ctx.latency_budget_ms
    reach = np.asarray(batch.reach, dtype=float)
    cheapest = math.inf
    if ctx.device_form:   # one device of the cheapest accelerator whose all-device plan reaches the goodput
        for c in res:
            r = device_plan(latency, reach, res, cands, ctx, configs=[c])
            if r is not None and r.throughput_rps >= goodput_rps * (1 - REL):
                cheapest = min(cheapest, r.cost)
    for b0 in cands if ctx.forms else ():
        t = plan_tables(latency, reach, res, b0=int(b0), ctx=ctx)
        cycle = 1e3 * b0 / goodput_rps * (1 + 1e-12)
        f = latency_dp(t, cycle if pipelined else np.inf)
        ok = f[-1] <= budget - fill_ms(b0, rate) + 1e-9 * budget
        if not pipelined:
            ok &= f[-1] <= cycle
        if ok.any():
            cheapest = min(cheapest, float(cost_grid(t)[ok].min()))
    if not math.isfinite(cheapest):
        raise PlannerError(f"no plan reaches {goodput_rps:g} inputs/s within {budget:.1f} ms with {res}")
    return best_plan(latency, batch, res, dataclasses.replace(asked, b0s=cands, cost_bound=cheapest,
                                                              forms=ctx.all_forms, ramp_blocks=ctx.ramp_blocks))
