"""The planner's dynamic programs over (blocks 1..j, devices used), and the backtrack to a plan.

Everything here works on a :class:`~e3.controller.planner.tables.Tables` of one B0 and
never touches a latency profile.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from e3.controller.planner.result import REL, PlannerResult, SearchContext, make_result
from e3.controller.planner.tables import Tables
from e3.core.cost import StageCost
from e3.core.plan import FORMS

__all__ = ["cost_grid", "cost_ok_grid", "feasible_ignoring_latency", "latency_dp", "backtrack", "lower_bound_cycle",
           "Found", "best_cell", "result_of", "solve_unpipelined"]


def shift(c: int, m: int, ndim: int, *, src: bool) -> tuple:
    """Index that moves a grid by m devices along axis c (src: the cells m lower; dst: the cells from m up)."""
    sl = [slice(None)] * ndim
    sl[c] = slice(None, -m) if src else slice(m, None)
    return tuple(sl)


def cost_grid(t: Tables) -> np.ndarray:
    grids = np.meshgrid(*[np.arange(n + 1) for n in t.caps], indexing="ij")
    return sum(p * g for p, g in zip(t.prices, grids))


def feasible_ignoring_latency(t: Tables, bound: float, cost_ok: np.ndarray) -> bool:
    """Is there a plan with every stage and hop <= bound within devices and cost (latency ignored)?

    Boolean DP over (prefix, devices used): with latency ignored the fewest instances that meet the bound
    are always best, so one transition per (split, configuration).
    """
    L, G = t.T[0].shape[0], tuple(n + 1 for n in t.caps)
    F = np.zeros((L + 1,) + G, dtype=bool)
    F[0] = True                                            # "at most u devices" semantics
    nd = len(G)
    for j in range(1, L + 1):
        fj = F[j]
        for c in range(nd):
            ok = t.stage[c][:j, j - 1, :] <= bound        # [a-1, m-1]
            has = ok.any(axis=1)
            mmin = ok.argmax(axis=1) + 1
            for m in np.unique(mmin[has]):
                if m > t.caps[c]:
                    continue
                rows = np.nonzero(has & (mmin == m))[0]
                fj[shift(c, m, nd, src=False)] |= F[rows].any(axis=0)[shift(c, m, nd, src=True)]
    return bool((F[L] & cost_ok).any())


def latency_dp(t: Tables, bound: float) -> np.ndarray:
    """Least pipeline latency per (prefix, devices) with every stage and hop <= bound (inf: none)."""
    L, G = t.T[0].shape[0], tuple(n + 1 for n in t.caps)
    nd = len(G)
    # f[j, u_1..u_C] = least sum of stage and hop times (ms) of a plan for blocks 1..j that uses at most
    #                  u_c devices of configuration c (so N - u are still free) and keeps every stage and
    #                  hop within the cycle bound;
    #                  f[j, u] = min over a <= j, c, m <= u_c of f[a-1, u - m e_c] + T(a..j, c, m) + Tx(a, c, m)
    f = np.full((L + 1,) + G, np.inf)
    f[0] = 0.0
    for j in range(1, L + 1):
        best = f[j]
        for c in range(nd):
            lat = np.where(t.stage[c][:j, j - 1, :] <= bound, t.lat[c][:j, j - 1, :], np.inf)  # [a-1, m-1]
            # an instance more that does not lower the latency is never needed ("at most u" semantics)
            before = np.concatenate([np.full((j, 1), np.inf), np.minimum.accumulate(lat, axis=1)[:, :-1]], axis=1)
            useful = lat < before
            if nd > 1:   # big grid: one shifted copy per instance count, rows = the split starts that use it
                for m0 in np.nonzero(useful.any(axis=0))[0]:
                    rows = np.nonzero(useful[:, m0])[0]
                    add = lat[rows, m0].reshape((-1,) + (1,) * nd)
                    cand = (f[rows][(slice(None),) + shift(c, m0 + 1, nd, src=True)] + add).min(axis=0)
                    dst = best[shift(c, m0 + 1, nd, src=False)]
                    np.minimum(dst, cand, out=dst)
                continue
            a0, mi = np.nonzero(useful)
            if a0.size == 0:
                continue
            # gather f[a-1, u - m e_c] for every useful (a, m) at once, configuration axis last
            M, Gc = t.caps[c], G[c]
            prev = np.moveaxis(f[:j], 1 + c, -1).reshape(j, -1, Gc)
            prev = np.concatenate([np.full(prev.shape[:2] + (M,), np.inf), prev], axis=2)   # u_c - m < 0 -> inf
            rest = np.arange(prev.shape[1])[None, :, None]
            cols = np.arange(Gc)[None, None, :] + M - (mi + 1)[:, None, None]
            add = lat[a0, mi][:, None, None]
            step = max(1, 4_000_000 // (prev.shape[1] * Gc))
            out = np.full((prev.shape[1], Gc), np.inf)
            for s0 in range(0, a0.size, step):
                sl = slice(s0, s0 + step)
                np.minimum(out, (prev[a0[sl, None, None], rest, cols[sl]] + add[sl]).min(axis=0), out=out)
            moved = np.moveaxis(best, c, -1)
            np.minimum(moved, out.reshape(moved.shape), out=moved)
    return f


def backtrack(t: Tables, f: np.ndarray, bound: float, *, u: tuple[int, ...]) -> list[tuple[int, int, int, int]]:
    """Recover the splits (a, j, c, m) of the plan whose value is f[L, u]."""
    L, nd = f.shape[0] - 1, f.ndim - 1
    j, u = L, list(u)
    out = []
    while j > 0:
        target = f[(j, *u)]
        found = None
        for c in range(nd):
            ms = np.arange(1, min(u[c], t.caps[c]) + 1)
            if ms.size == 0:
                continue
            for a0 in range(j):
                idx = [np.full(ms.size, v) for v in u]
                idx[c] = u[c] - ms
                vals = f[(np.full(ms.size, a0), *idx)] + t.lat[c][a0, j - 1, ms - 1]
                hit = (t.stage[c][a0, j - 1, ms - 1] <= bound) & (vals <= target)
                if hit.any():
                    m = int(ms[np.argmax(hit)])
                    found = (a0 + 1, c, m)
                    break
            if found:
                break
        assert found is not None, "backtracking lost the plan"
        a, c, m = found
        out.append((a, j, c, m))
        u[c] -= m
        j = a - 1
    return out[::-1]


def lower_bound_cycle(t: Tables) -> float:
    """Every block lies in some split: the cycle is at least max_k min over splits holding k of its stage."""
    L = t.T[0].shape[0]
    s = np.min(np.stack([st.min(axis=2) for st in t.stage]), axis=0)   # [a-1, j-1]
    lb = 0.0
    for k in range(L):
        lb = max(lb, float(s[: k + 1, k:].min()))
    return lb


@dataclass
class Found:
    bound: float
    f: np.ndarray
    cell: tuple[int, ...]
    cost: float
    latency: float


def best_cell(t: Tables, f: np.ndarray, cost_grid: np.ndarray, *, cost_ok: np.ndarray, budget: float):
    ok = cost_ok & (f[-1] <= budget)
    if not ok.any():
        return None
    cost = np.where(ok, cost_grid, np.inf)
    cmin = cost.min()
    tie = ok & (cost_grid <= cmin * (1 + REL) + 1e-12)
    lat = np.where(tie, f[-1], np.inf)
    cell = tuple(int(i) for i in np.unravel_index(int(np.argmin(lat)), lat.shape))
    return cell, float(cmin), float(lat[cell])



def result_of(t: Tables, found: Found, ctx: SearchContext) -> PlannerResult:
    """The plan whose value is ``found``, priced."""
    stages = [StageCost(a, j, t.configs[c], m, float(t.batch_in[a - 1] / m), float(t.T[c][a - 1, j - 1, m - 1]),
                        float(t.tx[c][a - 1, j - 1, m - 1]), FORMS[int(t.form[c][a - 1, j - 1, m - 1])])
              for a, j, c, m in backtrack(t, found.f, found.bound, u=found.cell)]
    return make_result(stages, t.b0, {c: float(p) for c, p in zip(t.configs, t.prices)}, ctx=ctx,
                       enabled_ramps=t.ramps, ramp_verdicts=t.verdicts)


def cost_ok_grid(t: Tables, cost_bound: float | None) -> np.ndarray:
    """Cells of the device grid whose cost is within ``cost_bound`` (all when None)."""
    grid = cost_grid(t)
    return np.ones_like(grid, dtype=bool) if cost_bound is None else grid <= cost_bound * (1 + REL) + 1e-12


def solve_unpipelined(t: Tables, budget: float, cost_bound: float | None, *, max_cycle: float) -> Found | None:
    """Without pipelining the cycle is the pipeline latency itself: least latency within ``budget`` and
    ``max_cycle``, then least cost."""
    ok_cost = cost_ok_grid(t, cost_bound)
    f = latency_dp(t, np.inf)
    ok = ok_cost & (f[-1] <= min(budget, max_cycle))
    if not ok.any():
        return None
    least = f[-1][ok].min()
    got = best_cell(t, f, cost_grid(t), cost_ok=ok_cost, budget=least * (1 + 1e-12))
    return None if got is None else Found(np.inf, f, *got)
