"""The planner's reference search, kept as the tests' oracle (and for ``benchmarks/planning_time.py
--reference``): the original, simpler pipelined search that the product's fast search must agree with.

Per B0 (visited by an upper bound on its throughput), :func:`solve_b0` binary-searches the smallest cycle
bound that a plan meets: first with the latency-free boolean DP, then, where latency binds, with the latency
DP itself. It shares the DPs and tables with the product (they are checked against brute force separately),
not the search.
"""

from __future__ import annotations

import math

import numpy as np

from e3.controller.planner.dp import (Found, best_cell, cost_grid, feasible_ignoring_latency, latency_dp,
                                      lower_bound_cycle, result_of)
from e3.controller.planner.result import REL, PlannerError, PlannerResult, better
from e3.controller.planner.search import plan_context
from e3.controller.planner.tables import Tables, build_tables
from e3.core.cost import fill_ms

__all__ = ["reference_best_plan", "solve_b0"]


def reference_best_plan(latency, batch, devices, *, slo_ms, rate_rps, slack=0.2, alpha=1.0,
                        shrink_in_split=False, b0s=None, cost_bound=None) -> PlannerResult:
    """:func:`e3.controller.planner.best_plan` (pipelined) through the reference search."""
    ctx, cands, res = plan_context(latency, batch, devices, slo_ms=slo_ms, rate_rps=rate_rps, slack=slack,
                                   alpha=alpha, pipelined=True, b0s=b0s, cost_bound=cost_bound)
    reach = np.asarray(batch.reach, dtype=float)
    tables = {b0: build_tables(latency, reach, res, int(b0), shrink_in_split=shrink_in_split) for b0 in cands}
    bound_of = {b0: lower_bound_cycle(t) for b0, t in tables.items()}
    order = sorted(cands, key=lambda b: -(b / bound_of[b]) if bound_of[b] > 0 else -math.inf)
    best = None
    for b0 in order:
        t = tables[b0]
        max_bound = math.inf
        if best is not None:
            max_bound = 1e3 * b0 / best.throughput_rps * (1 + 1e-9)
            if bound_of[b0] > max_bound:
                continue
        found = solve_b0(t, ctx.latency_budget_ms - fill_ms(b0, rate_rps), ctx.cost_bound, max_bound)
        if found is None:
            continue
        r = result_of(t, found, ctx)
        if best is None or better(r, best):
            best = r
    if best is None:
        raise PlannerError("no plan meets the constraints (reference search)")
    return best


def solve_b0(t: Tables, budget: float, cost_bound: float | None, max_bound: float) -> Found | None:
    """Smallest cycle bound <= max_bound that a plan meets for this B0 (pipelined): binary search over the
    candidate bounds, latency ignored first, then the latency DP."""
    grid = cost_grid(t)
    cost_ok = np.ones_like(grid, dtype=bool) if cost_bound is None else grid <= cost_bound * (1 + REL) + 1e-12
    cands = np.unique(np.concatenate([s[np.isfinite(s)] for s in t.stage]))
    cands = cands[(cands >= lower_bound_cycle(t) * (1 - 1e-12)) & (cands <= max_bound)]
    if cands.size == 0 or not feasible_ignoring_latency(t, float(cands[-1]), cost_ok):
        return None
    lo, hi = 0, cands.size - 1                      # smallest feasible index, latency ignored
    while lo < hi:
        mid = (lo + hi) // 2
        if feasible_ignoring_latency(t, float(cands[mid]), cost_ok):
            hi = mid
        else:
            lo = mid + 1
    f = latency_dp(t, float(cands[lo]))
    got = best_cell(t, f, grid, cost_ok, budget)
    if got is not None:
        return Found(float(cands[lo]), f, *got)
    # latency binds: search the bounds above with the latency DP
    f_top = latency_dp(t, float(cands[-1]))
    got_top = best_cell(t, f_top, grid, cost_ok, budget)
    if got_top is None:
        return None
    lo, hi, best = lo + 1, cands.size - 1, Found(float(cands[-1]), f_top, *got_top)
    while lo < hi:
        mid = (lo + hi) // 2
        f = latency_dp(t, float(cands[mid]))
        got = best_cell(t, f, grid, cost_ok, budget)
        if got is not None:
            hi, best = mid, Found(float(cands[mid]), f, *got)
        else:
            lo = mid + 1
    if best.bound != float(cands[lo]):
        f = latency_dp(t, float(cands[lo]))
        best = Found(float(cands[lo]), f, *best_cell(t, f, grid, cost_ok, budget))
    return best

