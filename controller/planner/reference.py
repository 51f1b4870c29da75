"""The planner's reference search: the original, simpler pipelined search that the product's fast search
(:mod:`e3.controller.planner.search`) must agree with. Not used for planning: it is the tests' oracle
(``tests/test_planner.py``, ``tests/test_split_forms.py``) and ``benchmarks/planning_time.py --reference``
times it, so it lives here rather than in ``tests/`` (nothing outside ``tests/`` imports from there).

Per B0 (visited by an upper bound on its throughput), :func:`solve_b0` binary-searches the smallest cycle
bound that a plan meets: first with the latency-free boolean DP, then, where latency binds, with the latency
DP itself. It shares the DPs with the product (they are checked against brute force separately), not the
search. Its tables choose every split candidate's form by brute force (:func:`oracle_tables`: each form
priced alone, the smaller stage time kept, tie: constant, in plain loops) instead of the product's
vectorised :func:`e3.core.cost.form_table`; the exit-wrapper's ramps are the product's (a pure function,
tested on its own).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from e3.controller.planner.dp import (Found, best_cell, cost_grid, feasible_ignoring_latency, latency_dp,
                                      lower_bound_cycle, result_of)
from e3.controller.planner.ramps import wrap_for_devices
from e3.controller.planner.result import REL, PlannerError, PlannerResult, PlanOptions, better
from e3.controller.planner.search import plan_context
from e3.controller.planner.tables import Tables
from e3.core.cost import FORM_TIE_REL, effective_reach, fill_ms, stage_table
from e3.core.plan import FORMS

__all__ = ["reference_best_plan", "solve_b0", "oracle_tables"]


def reference_best_plan(latency, batch, devices, options: PlanOptions) -> PlannerResult:
    """:func:`e3.controller.planner.best_plan` (pipelined) through the reference search."""
    ctx, cands, res = plan_context(latency, batch, devices, dataclasses.replace(options, pipelined=True))
    reach = np.asarray(batch.reach, dtype=float)
    tables = {b0: oracle_tables(latency, reach, res, int(b0), ctx) for b0 in cands}
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
        found = solve_b0(t, ctx.latency_budget_ms - fill_ms(b0, options.rate_rps), ctx.cost_bound, max_bound)
        if found is None:
            continue
        r = result_of(t, found, ctx)
        if best is None or better(r, best):
            best = r
    if best is None:
        raise PlannerError("no plan meets the constraints (reference search)")
    return best


def oracle_tables(latency, reach, devices, b0, ctx) -> Tables:
    """One B0's table with every candidate's form chosen by brute force: each form of ``ctx.forms`` priced
    on its own (:func:`e3.core.cost.stage_table`), then, cell by cell, the one with the smaller stage time
    (compact only when faster by more than FORM_TIE_REL; tie: constant)."""
    ramps, verdicts = ctx.ramp_blocks, ()
    if ctx.exit_wrapper:
        ramps, verdicts = wrap_for_devices(latency, reach, list(devices), b0=b0, ramps=ramps)
    Bk = b0 * effective_reach(reach, ramps)
    L, bmax = latency.num_blocks, float(latency.batch_sizes[-1])
    configs = list(devices)
    T_l, tx_l, f_l = [], [], []
    for c in configs:
        M = devices[c]
        priced = {f: stage_table(latency, c, Bk, max_instances=M, ramps=ramps, form=f) for f in ctx.forms}
        T, tx, form = np.full((L, L, M), np.inf), np.zeros((L, L, M)), np.zeros((L, L, M), dtype=np.int8)
        for a in range(L):
            for j in range(a, L):
                for mi in range(M):
                    m = mi + 1
                    if m > max(1, math.ceil(Bk[a] - 1e-9)) or Bk[a] / m > bmax + 1e-9:
                        continue                                   # illegal: inf, as in the product
                    pick = None
                    for f in FORMS:
                        if f not in priced:
                            continue
                        t_f = priced[f][0][a, j, mi]
                        if pick is None or t_f < pick[1] - FORM_TIE_REL * max(1.0, abs(pick[1])):
                            pick = (f, t_f)
                    f, t_f = pick
                    T[a, j, mi], tx[a, j, mi], form[a, j, mi] = t_f, priced[f][1][a, mi], FORMS.index(f)
        T_l.append(T)
        tx_l.append(tx)
        f_l.append(form)
    prices = np.array([latency.devices[c].price for c in configs], dtype=float)
    return Tables(int(b0), configs, [devices[c] for c in configs], prices, T_l, tx_l, f_l,
                  [np.maximum(T, tx) for T, tx in zip(T_l, tx_l)], [T + tx for T, tx in zip(T_l, tx_l)], Bk,
                  tuple(ramps), tuple(verdicts))


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
    got = best_cell(t, f, grid, cost_ok=cost_ok, budget=budget)
    if got is not None:
        return Found(float(cands[lo]), f, *got)
    # latency binds: search the bounds above with the latency DP
    f_top = latency_dp(t, float(cands[-1]))
    got_top = best_cell(t, f_top, grid, cost_ok=cost_ok, budget=budget)
    if got_top is None:
        return None
    lo, hi, best = lo + 1, cands.size - 1, Found(float(cands[-1]), f_top, *got_top)
    while lo < hi:
        mid = (lo + hi) // 2
        f = latency_dp(t, float(cands[mid]))
        got = best_cell(t, f, grid, cost_ok=cost_ok, budget=budget)
        if got is not None:
            hi, best = mid, Found(float(cands[mid]), f, *got)
        else:
            lo = mid + 1
    if best.bound != float(cands[lo]):
        f = latency_dp(t, float(cands[lo]))
        best = Found(float(cands[lo]), f, *best_cell(t, f, grid, cost_ok=cost_ok, budget=budget))
    return best

