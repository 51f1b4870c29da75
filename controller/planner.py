"""E3's planner (E3 §3.2-3.2.3, Fig. 6): cuts, replicas, device configurations and
input batch size, by dynamic programming. A pure function of its inputs: no I/O,
no Triton, no torch.

The model of a plan
-------------------
A plan cuts blocks 1..L into splits. Split i covers blocks a..b, runs on one
device configuration c with m replicas (replicas of one split share one
configuration, §3.2.3). Per *cycle* the front door admits one input batch of
B0 inputs; B_k = B0 * reach[k-1] of them reach block k (batch profile). Split i
receives the B_a inputs that reach its first block and each replica takes
B_a / m of them (Fig. 6: "each GPU handles B_k/m samples"):

* stage time   T_i  = sum_{k=a..b} P(k, c, B_a / m)          (ms, ramps included)
* hop into it  Tx_i = Tx(c, B_a / m)  for i > 1, 0 for the first split
* cycle time   C    = max_i max(T_i, Tx_i)  (pipelined, §3.2.2), or
                      sum_i (T_i + Tx_i)   (``pipelined=False``, §3.2.1)
* throughput        = 1000 * B0 / C                          (inputs/s)
* worst-case latency = 1000 * (B0 - 1) / R + sum_i (T_i + Tx_i)   (ms)
* cost              = sum_i m_i * price(c_i)

Constraints: latency <= SLO * (1 - slack); devices of each configuration <=
the resources; cost <= alpha * Cost_baseline (when alpha is given). Objective
of :func:`best_plan`: the highest throughput; ties go to the lower cost, then
the lower latency. :func:`cheapest_plan` answers the converse (E3 §5.3): the
lowest cost whose throughput reaches a given goodput (ties: higher throughput).

Decisions where the paper is silent or ambiguous
------------------------------------------------
* **No shrinking inside a split.** DESIGN §2: the runtime cannot shrink a
  batch inside a split (inputs that exit at an inner ramp keep computing to
  the split's end), so every block of a split runs at the batch that entered
  it, B_a / m. Fig. 6 writes P(k, c, B_k/m), i.e. shrinking at every ramp;
  ``shrink_in_split=True`` gives that reading.
* **Tx** is the hop *into* a split, taken at the receiving configuration and
  its per-replica batch (``LatencyProfile.tx(c, B_a/m)``): each replica
  receives its share in one call, replicas receive in parallel. It is its own
  pipeline stage in the ``max`` (Fig. 6) and adds to latency. The hops into
  the first split and out of the last are the same for every plan (and for
  the stock baseline) and are left out.
* **Worst-case latency** = batch fill time of the first input of a batch,
  (B0 - 1) / R, plus one pass through every stage and hop. With throughput
  >= R consecutive batches arrive at least one cycle apart, so no stage is
  busy when a batch reaches it (no queueing in the steady state); with
  throughput < R the front door drops the excess (E3 §3.1), same bound. The
  paper's "worst case latency is simply CycleTime" is the non-pipelined case
  without fill time.
* **B0** (input batch size) is chosen by the planner from powers of two up to
  ``max_batch * total devices`` (max_batch = the profile's largest measured
  batch) whose fill time alone fits the latency budget; the best one wins.
  ``b0s=`` overrides the set.
* **Replicas.** m ranges over 1..min(N_c, ceil(B_a)): more replicas than
  inputs reaching the split per cycle cannot shorten the stage (a replica's
  batch below 1 costs P(1), the profile's smallest batch; a higher rate is
  served by a larger B0). A per-replica batch above the largest measured batch
  is not allowed (the profile says nothing about memory there).
* **Cost_baseline** (see :func:`stock_baseline`): the cheapest *stock* plan
  (model without ramps, every input through every block, one split on one
  configuration with m replicas, B0 from the same candidates) whose
  throughput reaches R within the latency budget. If no stock plan reaches R,
  the stock plan with the highest throughput sets it; if no stock plan meets
  the latency budget at all, the cost bound is dropped (logged).
* **Exit shares do not depend on B0** (independent exits): reach is the
  batch profile's, whatever B0 is chosen.
* **Ramps.** Every ramp inside a split is computed and paid for (``with_ramp``);
  disabling ramps (E3 §3.4's exit-wrapper) is not planned here.

How it is solved
----------------
For each B0 the pipelined optimum is the smallest cycle bound t (one of the
finitely many stage/hop times) for which a plan exists with every stage and
hop <= t and latency, resources and cost within their bounds; feasibility is
monotone in t, so t is found by binary search. A cheap boolean DP (fewest
replicas per split, which is enough when latency is ignored) finds the
smallest t that resources and cost allow; the latency DP below then checks
that t and, only if latency binds, the search continues upwards with it.
B0 values are visited in order of an upper bound on their throughput and
skipped once that bound cannot beat the best plan found.

That is the *reference* search (:func:`_reference_best_plan`, kept for tests
and ``benchmarks.planning_time --reference``). :func:`best_plan` (pipelined)
runs a faster search for the same answer (:func:`_search`); profiling showed
the time went to latency DPs on a B0 that loses (2.4 s of 2.8 s at 24 blocks,
64 devices, 3 configurations: the binary search starts at the most expensive
bound, the top one) and, with one configuration, to ~16 latency DPs per B0:

* **best-first over B0**: the B0 with the highest throughput upper bound gets
  the next step; tables are built only for B0s whose cheap bound
  (:func:`_cheap_cycle_bound`, least measured block + ramp time) can still
  beat the best plan; a B0 is dropped once its lowest open bound exceeds the
  ``max_bound`` the best plan leaves it, as in the reference.
* **exact lower bounds first**: one configuration: the latency DP itself on
  the 1-D device grid as one gather per prefix over the (start, replicas)
  pairs that fit the bound (:meth:`_B0Search._feasible_1d`), bisected to the
  smallest feasible bound; several configurations: the boolean DP (latency
  ignored), as before. Bisection splits geometrically while the candidates
  span > 1.5x (low bounds give cheap DPs).
* **racing probes**: then the full latency DP (the reference's own test,
  :func:`_latency_dp` + :func:`_best_cell`) is probed at the lowest open
  bound, then at the bound where this B0 would tie the runner-up's upper
  bound (an infeasible answer hands the work to the runner-up), then at the
  top, then by bisection.

Why it is still exact: every B0's answer is still the smallest candidate bound
(same candidate set, same ``max_bound``) at which the same latency DP finds a
cell within latency and cost; the extra tests only skip bounds they prove
infeasible (a 1-D DP that computes the same f values, the latency-free DP,
monotonicity in the bound) or B0s whose throughput bound cannot reach the best
plan; the plan itself comes from the same f, :func:`_best_cell` and
:func:`_backtrack`. ``tests/test_planner.py`` checks both searches against
brute force and the fast one against the reference on 30 random instances
(1-3 configurations, cost bounds); 330 such instances agreed plan for plan.
Non-pipelined planning uses the reference search.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import numpy as np

from e3.core.names import split_name
from e3.core.plan import Plan, SplitPlan, entry_queue_delay_us
from e3.core.profile import BatchProfile, LatencyProfile

__all__ = ["PlannerError", "SplitChoice", "PlannerResult", "best_plan", "cheapest_plan", "stock_baseline",
           "parse_resources", "b0_candidates"]

log = logging.getLogger(__name__)

_REL = 1e-9  # relative tolerance when comparing throughputs and costs


class PlannerError(ValueError):
    """Inputs the planner cannot use, or no plan meets the constraints; the message says which."""


@dataclass(frozen=True)
class SplitChoice:
    first_block: int        # first block of the split (1-based)
    last_block: int         # last block (inclusive)
    device: str             # device configuration name, as in the latency profile
    replicas: int           # m: replicas (Triton instances), all on `device`
    batch_per_replica: float  # B_a / m: inputs each replica takes per cycle (may be fractional)
    stage_ms: float         # T: sum of the split's block latencies at that batch (ms)
    tx_ms: float            # hop into this split (ms); 0 for the first split

    @property
    def preferred_batch(self) -> int:
        """The per-instance preferred batch for Triton: B_a/m rounded, at least 1."""
        return max(1, int(math.floor(self.batch_per_replica + 0.5)))


@dataclass(frozen=True)
class PlannerResult:
    splits: tuple[SplitChoice, ...]   # in block order
    input_batch_size: int             # B0: inputs admitted per cycle
    cycle_ms: float                   # pipelined: slowest stage or hop; else their sum (ms)
    throughput_rps: float             # 1000 * B0 / cycle_ms (inputs/s)
    goodput_rps: float                # min(throughput, R): what the offered rate lets it answer (inputs/s)
    latency_ms: float                 # worst-case latency: fill time + every stage and hop (ms)
    cost: float                       # sum of replicas x price
    devices_used: dict[str, int]      # configuration -> devices used
    rate_rps: float                   # R the plan was made for (inputs/s)
    latency_budget_ms: float          # SLO * (1 - slack)
    cost_bound: float | None = None   # alpha * Cost_baseline, None when unbounded
    cost_baseline: float | None = None  # cost of the stock baseline plan (see stock_baseline)
    pipelined: bool = True
    notes: tuple[str, ...] = field(default=())  # anything the caller should know (e.g. fallback baselines)

    @property
    def cuts(self) -> list[int]:
        """Cut after these blocks (the `--cuts` vocabulary)."""
        return [s.last_block for s in self.splits[:-1]]

    def to_plan(self, model: str, num_blocks: int, exit_rule: Mapping[str, Any], ramp_blocks: Iterable[int],
                slo_ms: float, slack: float) -> Plan:
        """The shared plan document for this result (every ramp inside a split enabled).

        ``queue_delay_us`` of each split after the first is one cycle (a replica's batch arrives within
        one cycle in the steady state; waiting longer means the forecast was wrong), capped so that the
        splits' queue delays together stay within the SLO's slack; the first split's (and the router's)
        is :func:`e3.core.plan.entry_queue_delay_us` (0, measured).
        """
        ramps = tuple(sorted(set(int(k) for k in ramp_blocks)))
        slack_us = slo_ms * slack * 1e3 / max(1, len(self.splits))
        delay_us = int(max(0.0, min(self.cycle_ms * 1e3, slack_us)))
        splits = tuple(
            SplitPlan(model=split_name(model, s.first_block, s.last_block), first_block=s.first_block,
                      last_block=s.last_block, batch_size=s.preferred_batch, instances=s.replicas,
                      device=s.device,
                      queue_delay_us=entry_queue_delay_us() if s.first_block == 1 else delay_us,
                      enabled_ramps=tuple(k for k in ramps if s.first_block <= k <= s.last_block and k < num_blocks))
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


# ----------------------------------------------------------------------------------------------------------
# inputs

def parse_resources(text: str) -> dict[str, int]:
    """``"v100:6,t4:8"`` -> ``{"v100": 6, "t4": 8}`` (names lower-cased)."""
    out: dict[str, int] = {}
    for item in (p.strip() for p in text.split(",")):
        if not item:
            continue
        name, sep, count = item.partition(":")
        try:
            n = int(count) if sep else -1
        except ValueError:
            n = -1
        if not name.strip() or n < 0:
            raise PlannerError(f"devices are written CONFIG:COUNT[,CONFIG:COUNT...], e.g. cpu:2 or v100:6,t4:8; "
                               f"got {item!r}")
        out[name.strip().lower()] = out.get(name.strip().lower(), 0) + n
    if not out:
        raise PlannerError("no devices given; write e.g. cpu:2")
    return out


def _check_inputs(latency: LatencyProfile, batch: BatchProfile | None, resources: Mapping[str, int],
                  slo_ms: float, slack: float, rate_rps: float) -> dict[str, int]:
    unknown = sorted(set(resources) - set(latency.devices))
    if unknown:
        raise PlannerError(f"device configuration(s) {unknown} are not in the latency profile of "
                           f"{latency.model!r}, which has {sorted(latency.devices)}; profile them or drop them")
    res = {c: int(n) for c, n in resources.items() if int(n) > 0}
    if any(int(n) < 0 for n in resources.values()):
        raise PlannerError(f"device counts must be >= 0, got {dict(resources)}")
    if not res:
        raise PlannerError(f"no devices to plan with: {dict(resources)}")
    if batch is not None and len(batch.reach) != latency.num_blocks:
        raise PlannerError(f"the batch profile has {len(batch.reach)} blocks, the latency profile "
                           f"{latency.num_blocks}; they must describe the same model")
    if not slo_ms > 0 or not 0 <= slack < 1 or not rate_rps > 0:
        raise PlannerError(f"need slo_ms > 0, 0 <= slack < 1 and rate_rps > 0; got {slo_ms}, {slack}, {rate_rps}")
    return res


def b0_candidates(latency: LatencyProfile, resources: Mapping[str, int], rate_rps: float,
                  latency_budget_ms: float) -> list[int]:
    """Powers of two up to max measured batch x total devices whose fill time (B0-1)/R fits the budget."""
    top = latency.batch_sizes[-1] * max(1, sum(resources.values()))
    out, b = [], 1
    while b <= top and 1e3 * (b - 1) / rate_rps < latency_budget_ms:
        out.append(b)
        b *= 2
    return out


def _interp_rows(xs: np.ndarray, rows: np.ndarray, x: np.ndarray) -> np.ndarray:
    """``LatencyProfile._interp`` for many rows at once: row k of ``rows`` [K, len(xs)] at ``x[k]``
    (``x`` is [K, ...]): linear between measured batches, linear extrapolation past the last, 0 at batch <= 0."""
    out = np.empty(x.shape)
    for k, ys in enumerate(rows):
        xk = x[k]
        v = np.interp(xk, xs, ys)
        if len(xs) > 1:
            slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
            v = np.where(xk > xs[-1], ys[-1] + slope * (xk - xs[-1]), v)
        out[k] = np.where(xk <= 0, 0.0, v)
    return out


# ----------------------------------------------------------------------------------------------------------
# cost tables for one B0

@dataclass
class _Tables:
    b0: int
    configs: list[str]           # configuration names, grid axis order
    caps: list[int]              # devices of each configuration (grid axis c has caps[c] + 1 cells)
    prices: np.ndarray           # [C]
    T: list[np.ndarray]          # per c: [a-1, j-1, m-1] stage time of split a..j with m replicas, inf if illegal
    tx: list[np.ndarray]         # per c: [a-1, m-1] hop into a split starting at a
    stage: list[np.ndarray]      # per c: max(T, tx)  (what the pipelined cycle sees)
    lat: list[np.ndarray]        # per c: T + tx      (what latency sees)
    batch_in: np.ndarray         # [a-1] B_a: inputs entering block a per cycle


def _tables(latency: LatencyProfile, reach: np.ndarray, res: Mapping[str, int], b0: int, with_ramp: bool,
            shrink_in_split: bool) -> _Tables:
    L = latency.num_blocks
    xs = np.asarray(latency.batch_sizes, dtype=float)
    bmax = xs[-1]
    Bk = b0 * reach                               # [L] inputs reaching block k
    configs = list(res)
    T_l, tx_l, st_l, lat_l = [], [], [], []
    for c in configs:
        M = res[c]
        m = np.arange(1, M + 1, dtype=float)
        per = Bk[:, None] / m[None, :]             # [a, m] per-replica batch entering a split at a
        legal = (m[None, :] <= np.maximum(1.0, np.ceil(Bk[:, None] - 1e-9))) & (per <= bmax + 1e-9)
        blocks = np.asarray(latency.block_ms[c], dtype=float)
        ramps = np.asarray(latency.ramp_ms[c], dtype=float)
        # x[k, a, m]: the batch block k runs at in a split that starts at a
        x = np.broadcast_to((Bk[:, None, None] if shrink_in_split else Bk[None, :, None]) / m[None, None, :],
                            (L, L, M))
        P = _interp_rows(xs, blocks, x) + (_interp_rows(xs, ramps, x) if with_ramp else 0.0)   # [k, a, m]
        cs = np.concatenate([np.zeros((1, L, M)), np.cumsum(P, axis=0)])      # [k+1, a, m]
        T = np.transpose(cs[1:], (1, 0, 2)) - cs[np.arange(L), np.arange(L)][:, None, :]  # [a, j, m]
        a_idx, j_idx = np.meshgrid(np.arange(L), np.arange(L), indexing="ij")
        ok = (j_idx >= a_idx)[:, :, None] & legal[:, None, :]
        T = np.where(ok, np.maximum(T, 0.0), np.inf)
        tx = _interp_rows(xs, np.asarray(latency.tx_ms[c], dtype=float)[None, :], per[None])[0]
        tx[0] = 0.0
        T_l.append(T)
        tx_l.append(tx)
        st_l.append(np.maximum(T, tx[:, None, :]))
        lat_l.append(T + tx[:, None, :])
    prices = np.array([latency.devices[c].price for c in configs], dtype=float)
    return _Tables(b0, configs, [res[c] for c in configs], prices, T_l, tx_l, st_l, lat_l, Bk)


# ----------------------------------------------------------------------------------------------------------
# the DP

def _shift(c: int, m: int, ndim: int, src: bool) -> tuple:
    """Index that moves a grid by m devices along axis c (src: the cells m lower; dst: the cells from m up)."""
    sl = [slice(None)] * ndim
    sl[c] = slice(None, -m) if src else slice(m, None)
    return tuple(sl)


def _cost_grid(t: _Tables) -> np.ndarray:
    grids = np.meshgrid(*[np.arange(n + 1) for n in t.caps], indexing="ij")
    return sum(p * g for p, g in zip(t.prices, grids))


def _feasible_ignoring_latency(t: _Tables, bound: float, cost_ok: np.ndarray) -> bool:
    """Is there a plan with every stage and hop <= bound within resources and cost (latency ignored)?

    Boolean DP over (prefix, devices used): with latency ignored the fewest replicas that meet the bound
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
                fj[_shift(c, m, nd, False)] |= F[rows].any(axis=0)[_shift(c, m, nd, True)]
    return bool((F[L] & cost_ok).any())


def _latency_dp(t: _Tables, bound: float) -> np.ndarray:
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
            # a replica more that does not lower the latency is never needed ("at most u" semantics)
            before = np.concatenate([np.full((j, 1), np.inf), np.minimum.accumulate(lat, axis=1)[:, :-1]], axis=1)
            useful = lat < before
            if nd > 1:   # big grid: one shifted copy per replica count, rows = the split starts that use it
                for m0 in np.nonzero(useful.any(axis=0))[0]:
                    rows = np.nonzero(useful[:, m0])[0]
                    add = lat[rows, m0].reshape((-1,) + (1,) * nd)
                    cand = (f[rows][(slice(None),) + _shift(c, m0 + 1, nd, True)] + add).min(axis=0)
                    dst = best[_shift(c, m0 + 1, nd, False)]
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


def _backtrack(t: _Tables, f: np.ndarray, bound: float, u: tuple[int, ...]) -> list[tuple[int, int, int, int]]:
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


def _lower_bound_cycle(t: _Tables) -> float:
    """Every block lies in some split: the cycle is at least max_k min over splits holding k of its stage."""
    L = t.T[0].shape[0]
    s = np.min(np.stack([st.min(axis=2) for st in t.stage]), axis=0)   # [a-1, j-1]
    lb = 0.0
    for k in range(L):
        lb = max(lb, float(s[: k + 1, k:].min()))
    return lb


@dataclass
class _Found:
    bound: float
    f: np.ndarray
    cell: tuple[int, ...]
    cost: float
    latency: float


def _best_cell(t: _Tables, f: np.ndarray, cost_grid: np.ndarray, cost_ok: np.ndarray, budget: float):
    ok = cost_ok & (f[-1] <= budget)
    if not ok.any():
        return None
    cost = np.where(ok, cost_grid, np.inf)
    cmin = cost.min()
    tie = ok & (cost_grid <= cmin * (1 + _REL) + 1e-12)
    lat = np.where(tie, f[-1], np.inf)
    cell = tuple(int(i) for i in np.unravel_index(int(np.argmin(lat)), lat.shape))
    return cell, float(cmin), float(lat[cell])


def _solve_b0(t: _Tables, budget: float, cost_bound: float | None, pipelined: bool,
              max_bound: float) -> _Found | None:
    """Smallest cycle bound <= max_bound that a plan meets for this B0 (pipelined), or least latency."""
    cost_grid = _cost_grid(t)
    cost_ok = np.ones_like(cost_grid, dtype=bool) if cost_bound is None else \
        cost_grid <= cost_bound * (1 + _REL) + 1e-12
    if not pipelined:
        # the cycle is the pipeline latency itself: least latency first, then least cost
        f = _latency_dp(t, np.inf)
        ok = cost_ok & (f[-1] <= min(budget, max_bound))
        if not ok.any():
            return None
        least = f[-1][ok].min()
        got = _best_cell(t, f, cost_grid, cost_ok, least * (1 + 1e-12))
        return None if got is None else _Found(np.inf, f, *got)
    cands = np.unique(np.concatenate([s[np.isfinite(s)] for s in t.stage]))
    cands = cands[(cands >= _lower_bound_cycle(t) * (1 - 1e-12)) & (cands <= max_bound)]
    if cands.size == 0 or not _feasible_ignoring_latency(t, float(cands[-1]), cost_ok):
        return None
    lo, hi = 0, cands.size - 1                      # smallest feasible index, latency ignored
    while lo < hi:
        mid = (lo + hi) // 2
        if _feasible_ignoring_latency(t, float(cands[mid]), cost_ok):
            hi = mid
        else:
            lo = mid + 1
    f = _latency_dp(t, float(cands[lo]))
    got = _best_cell(t, f, cost_grid, cost_ok, budget)
    if got is not None:
        return _Found(float(cands[lo]), f, *got)
    # latency binds: search the bounds above with the latency DP
    f_top = _latency_dp(t, float(cands[-1]))
    got_top = _best_cell(t, f_top, cost_grid, cost_ok, budget)
    if got_top is None:
        return None
    lo, hi, best = lo + 1, cands.size - 1, _Found(float(cands[-1]), f_top, *got_top)
    while lo < hi:
        mid = (lo + hi) // 2
        f = _latency_dp(t, float(cands[mid]))
        got = _best_cell(t, f, cost_grid, cost_ok, budget)
        if got is not None:
            hi, best = mid, _Found(float(cands[mid]), f, *got)
        else:
            lo = mid + 1
    if best.bound != float(cands[lo]):
        f = _latency_dp(t, float(cands[lo]))
        best = _Found(float(cands[lo]), f, *_best_cell(t, f, cost_grid, cost_ok, budget))
    return best


def _result(t: _Tables, found: _Found, rate_rps: float, budget: float, pipelined: bool,
            cost_bound: float | None, cost_baseline: float | None, notes: tuple[str, ...]) -> PlannerResult:
    parts = _backtrack(t, found.f, found.bound, found.cell)
    splits, used = [], {}
    for a, j, c, m in parts:
        name = t.configs[c]
        splits.append(SplitChoice(a, j, name, m, float(t.batch_in[a - 1] / m), float(t.T[c][a - 1, j - 1, m - 1]),
                                  float(t.tx[c][a - 1, m - 1])))
        used[name] = used.get(name, 0) + m
    return _summarise(tuple(splits), t.b0, {c: float(p) for c, p in zip(t.configs, t.prices)}, used, rate_rps,
                      budget, pipelined, cost_bound, cost_baseline, notes)


def _summarise(splits: tuple[SplitChoice, ...], b0: int, prices: Mapping[str, float], used: dict[str, int],
               rate_rps: float, budget: float, pipelined: bool, cost_bound: float | None,
               cost_baseline: float | None, notes: tuple[str, ...]) -> PlannerResult:
    pipe = sum(s.stage_ms + s.tx_ms for s in splits)
    cycle = max(max(s.stage_ms, s.tx_ms) for s in splits) if pipelined else pipe
    thr = 1e3 * b0 / cycle if cycle > 0 else math.inf
    return PlannerResult(splits=splits, input_batch_size=b0, cycle_ms=cycle, throughput_rps=thr,
                         goodput_rps=min(thr, rate_rps), latency_ms=1e3 * (b0 - 1) / rate_rps + pipe,
                         cost=sum(prices[c] * n for c, n in used.items()), devices_used=used, rate_rps=rate_rps,
                         latency_budget_ms=budget, cost_bound=cost_bound, cost_baseline=cost_baseline,
                         pipelined=pipelined, notes=notes)


# ----------------------------------------------------------------------------------------------------------
# the fast search (pipelined): best-first over B0, cheap exact lower bounds, probes that race the B0s

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

    def __init__(self, t: _Tables, budget: float, cost_bound: float | None):
        self.t, self.b0, self.budget = t, t.b0, budget
        self.cost_grid = _cost_grid(t)
        self.cost_ok = np.ones_like(self.cost_grid, dtype=bool) if cost_bound is None else \
            self.cost_grid <= cost_bound * (1 + _REL) + 1e-12
        cands = np.unique(np.concatenate([s[np.isfinite(s)] for s in t.stage]))
        self.cands = cands[cands >= _lower_bound_cycle(t) * (1 - 1e-12)]   # the same set _solve_b0 searches
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
        f = _latency_dp(self.t, float(self.cands[i]))
        got = _best_cell(self.t, f, self.cost_grid, self.cost_ok, self.budget)
        if got is None:
            self.lo = i + 1
        else:
            self.hi, self.found = i, _Found(float(self.cands[i]), f, *got)

    def refine(self, top: int) -> None:
        """Raise lo to an exact lower bound: with one configuration the 1-D latency DP below gives the
        smallest feasible candidate itself; with several, the boolean DP (latency ignored) as in
        :func:`_solve_b0`. ``top``: the largest candidate index still worth searching."""
        self.refined = True
        if top < self.lo:
            return
        test = self._feasible_1d if len(self.t.configs) == 1 else \
            (lambda b: _feasible_ignoring_latency(self.t, b, self.cost_ok))
        lo, hi = self.lo, top + 1          # hi: feasible, or top + 1 = nothing feasible up to top (yet)
        while lo < hi:
            mid = _mid(self.cands, lo, hi)
            if test(float(self.cands[mid])):
                hi = mid
            else:
                lo = mid + 1
        self.lo = lo

    def _feasible_1d(self, bound: float) -> bool:
        """One configuration: the latency DP of :func:`_latency_dp` on its 1-D grid, as one gather per
        prefix over the (split start, replicas) pairs whose stage fits the bound. It adds the same two
        numbers per transition and takes the same minima, so it gives the same f to the last bit (dropping
        "useless" replica counts there only drops sums that are >= a kept one)."""
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
                base = a0 * W + M - (mi + 1)        # cell (a0, u - m) of f (see _latency_dp) sits at a0 * W + M + u - m
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


def _cheap_cycle_bound(latency: LatencyProfile, reach: np.ndarray, res: Mapping[str, int],
                       with_ramp: bool) -> float:
    """A lower bound on the pipelined cycle of every plan, for every B0, without building tables: block k
    runs in some split at some batch in (0, max batch], and P(k, c, x) there is at least the least measured
    value of its block row plus that of its ramp row (linear interpolation between measured batches, P(1)
    below the smallest). 0 when some block is reached by no input (it may then cost nothing)."""
    if not (np.asarray(reach) > 0).all():
        return 0.0
    lb = 0.0
    for k in range(latency.num_blocks):
        per_c = [min(latency.block_ms[c][k]) + (min(latency.ramp_ms[c][k]) if with_ramp else 0.0) for c in res]
        lb = max(lb, min(per_c))
    return max(0.0, lb * (1 - 1e-9))


def _search(build, b0s: list[int], cheap_lb: float, budget: float, rate_rps: float, cost_bound: float | None,
            baseline_cost: float | None, notes: tuple[str, ...]) -> PlannerResult | None:
    """Pipelined best plan over all B0, with the answer of :func:`_reference_search` (see the module doc).

    Best-first: the live B0 with the highest throughput upper bound gets the next piece of work (first an
    exact lower bound, then exact latency-DP probes). A probe is placed where it decides the race with the
    runner-up (the bound at which this B0's throughput equals the runner-up's upper bound), else as in
    :func:`_solve_b0` (lowest candidate first, then the top, then bisection). A B0 is finished when its
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
                r = _result(st.t, st.found, rate_rps, budget, True, cost_bound, baseline_cost, notes)
                if best is None or _better(r, best):
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
                states.append(_B0Search(build(b_next), budget - 1e3 * (b_next - 1) / rate_rps, cost_bound))
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

def stock_baseline(latency: LatencyProfile, resources: Mapping[str, int], *, slo_ms: float, rate_rps: float,
                   slack: float = 0.2, b0s: Iterable[int] | None = None) -> PlannerResult | None:
    """Cost_baseline's plan: the cheapest one-split plan of the *stock* model (no ramps, no exits) on one
    configuration with replicas whose throughput reaches ``rate_rps`` within SLO*(1-slack); if none reaches
    it, the one with the highest throughput (ties: cheaper); None if no stock plan meets the latency budget."""
    res = _check_inputs(latency, None, resources, slo_ms, slack, rate_rps)
    budget = slo_ms * (1 - slack)
    reach = np.ones(latency.num_blocks)
    best, best_key = None, None
    for b0 in (b0s if b0s is not None else b0_candidates(latency, res, rate_rps, budget)):
        t = _tables(latency, reach, res, int(b0), with_ramp=False, shrink_in_split=False)
        L = latency.num_blocks
        for ci, c in enumerate(t.configs):
            T = t.T[ci][0, L - 1]                          # [m-1]
            for mi in np.nonzero(np.isfinite(T))[0]:
                lat = 1e3 * (b0 - 1) / rate_rps + T[mi]
                if lat > budget * (1 + 1e-12):
                    continue
                thr = 1e3 * b0 / T[mi] if T[mi] > 0 else math.inf
                cost = (mi + 1) * t.prices[ci]
                meets = thr >= rate_rps * (1 - _REL)
                key = (0, cost, -thr, lat) if meets else (1, -thr, cost, lat)
                if best_key is None or key < best_key:
                    split = SplitChoice(1, L, c, int(mi + 1), float(b0 / (mi + 1)), float(T[mi]), 0.0)
                    best_key, best = key, _summarise((split,), int(b0), {c: float(t.prices[ci])}, {c: int(mi + 1)},
                                                     rate_rps, budget, True, None, None, ())
    return best


def best_plan(latency: LatencyProfile, batch: BatchProfile, resources: Mapping[str, int], *, slo_ms: float,
              rate_rps: float, slack: float = 0.2, alpha: float | None = 1.0, pipelined: bool = True,
              shrink_in_split: bool = False, b0s: Iterable[int] | None = None,
              cost_bound: float | None = None, _reference: bool = False) -> PlannerResult:
    """The plan with the highest throughput (inputs/s) under SLO*(1-slack), the resources and
    cost <= alpha * Cost_baseline (``alpha=None``: no cost bound; ``cost_bound`` sets the bound directly).

    latency: P(k, c, B) and Tx per configuration; batch: share of inputs reaching every block;
    resources: configuration -> device count, e.g. ``{"v100": 6, "t4": 8}``; rate_rps: R, the offered rate.
    Raises :class:`PlannerError` when no plan fits.
    """
    res = _check_inputs(latency, batch, resources, slo_ms, slack, rate_rps)
    budget = slo_ms * (1 - slack)
    reach = np.asarray(batch.reach, dtype=float)
    cands = list(b0s) if b0s is not None else b0_candidates(latency, res, rate_rps, budget)
    notes: list[str] = []
    baseline_cost = None
    if cost_bound is None and alpha is not None:
        base = stock_baseline(latency, res, slo_ms=slo_ms, rate_rps=rate_rps, slack=slack, b0s=cands)
        if base is None:
            notes.append("no stock plan meets the latency budget: cost bound dropped")
            log.warning("planner: %s", notes[-1])
        else:
            baseline_cost = base.cost
            cost_bound = alpha * base.cost
            if base.throughput_rps < rate_rps * (1 - _REL):
                notes.append(f"no stock plan reaches {rate_rps:g} inputs/s; Cost_baseline is the fastest stock "
                             f"plan's ({base.throughput_rps:.1f} inputs/s)")
                log.info("planner: %s", notes[-1])
    if pipelined and not _reference:
        best = _search(lambda b0: _tables(latency, reach, res, int(b0), True, shrink_in_split), cands,
                       _cheap_cycle_bound(latency, reach, res, with_ramp=True), budget, rate_rps, cost_bound,
                       baseline_cost, tuple(notes))
    else:
        tables = {b0: _tables(latency, reach, res, int(b0), True, shrink_in_split) for b0 in cands}
        best = _reference_search(tables, budget, rate_rps, cost_bound, baseline_cost, tuple(notes), pipelined)
    if best is None:
        raise PlannerError(f"no plan meets latency <= {budget:.1f} ms (SLO {slo_ms:g} ms, slack {slack:g}) at "
                           f"{rate_rps:g} inputs/s with {res}" +
                           (f" and cost <= {cost_bound:.4g}" if cost_bound is not None else ""))
    return best


def _reference_best_plan(*args: Any, **kwargs: Any) -> PlannerResult:
    """:func:`best_plan` through the original search (binary search per B0, B0 by a cycle lower bound):
    slower, kept as the reference that tests compare the fast search with."""
    return best_plan(*args, _reference=True, **kwargs)


def _reference_search(tables: dict[int, _Tables], budget: float, rate_rps: float, cost_bound: float | None,
                      baseline_cost: float | None, notes: tuple[str, ...], pipelined: bool) -> PlannerResult | None:
    """The original B0 loop: B0 by an upper bound on its throughput, each one by :func:`_solve_b0`."""
    cands = list(tables)
    bound_of = {b0: (_lower_bound_cycle(t) if pipelined else 0.0) for b0, t in tables.items()}
    order = sorted(cands, key=lambda b: -(b / bound_of[b]) if bound_of[b] > 0 else -math.inf)
    best: PlannerResult | None = None
    for b0 in order:
        t = tables[b0]
        max_bound = math.inf
        if best is not None:
            max_bound = 1e3 * b0 / best.throughput_rps * (1 + 1e-9)
            if pipelined and bound_of[b0] > max_bound:
                continue
        found = _solve_b0(t, budget - 1e3 * (b0 - 1) / rate_rps, cost_bound, pipelined, max_bound)
        if found is None:
            continue
        r = _result(t, found, rate_rps, budget, pipelined, cost_bound, baseline_cost, notes)
        if best is None or _better(r, best):
            best = r
    return best


def _better(r: PlannerResult, best: PlannerResult) -> bool:
    if r.throughput_rps > best.throughput_rps * (1 + _REL):
        return True
    if r.throughput_rps < best.throughput_rps * (1 - _REL):
        return False
    if r.cost < best.cost * (1 - _REL) - 1e-12:
        return True
    if r.cost > best.cost * (1 + _REL) + 1e-12:
        return False
    return r.latency_ms < best.latency_ms


def cheapest_plan(latency: LatencyProfile, batch: BatchProfile, resources: Mapping[str, int], *, slo_ms: float,
                  goodput_rps: float, rate_rps: float | None = None, slack: float = 0.2, pipelined: bool = True,
                  shrink_in_split: bool = False, b0s: Iterable[int] | None = None) -> PlannerResult:
    """The converse (E3 §5.3): the cheapest plan whose throughput reaches ``goodput_rps`` under
    SLO*(1-slack) and the resources; ties go to the higher throughput. ``rate_rps`` (fill time) defaults
    to the goodput. Raises :class:`PlannerError` when no plan reaches it."""
    rate = goodput_rps if rate_rps is None else rate_rps
    res = _check_inputs(latency, batch, resources, slo_ms, slack, rate)
    if not goodput_rps > 0:
        raise PlannerError(f"goodput_rps must be > 0, got {goodput_rps}")
    budget = slo_ms * (1 - slack)
    reach = np.asarray(batch.reach, dtype=float)
    cands = list(b0s) if b0s is not None else b0_candidates(latency, res, rate, budget)
    cheapest = math.inf
    for b0 in cands:
        t = _tables(latency, reach, res, int(b0), True, shrink_in_split)
        cycle = 1e3 * b0 / goodput_rps * (1 + 1e-12)
        cost_grid = _cost_grid(t)
        f = _latency_dp(t, cycle if pipelined else np.inf)
        fill = 1e3 * (b0 - 1) / rate
        ok = f[-1] <= budget - fill + 1e-9 * budget
        if not pipelined:
            ok &= f[-1] <= cycle
        if ok.any():
            cheapest = min(cheapest, float(cost_grid[ok].min()))
    if not math.isfinite(cheapest):
        raise PlannerError(f"no plan reaches {goodput_rps:g} inputs/s within {budget:.1f} ms with {res}")
    return best_plan(latency, batch, res, slo_ms=slo_ms, rate_rps=rate, slack=slack, alpha=None,
                     pipelined=pipelined, shrink_in_split=shrink_in_split, b0s=cands, cost_bound=cheapest)
