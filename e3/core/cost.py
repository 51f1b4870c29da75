"""E3's cost model (E3 §3.2-3.2.2, Fig. 6): what a plan costs, from a latency profile and a batch profile.

The one place the project turns a plan into stage times, cycle time,
throughput, worst-case latency and cost. The planner builds its DP tables
with :func:`form_table`, the controller scores a running plan with
:func:`plan_cost`, and a simulator prices its stages the same way, so the
three can never disagree.

Per *cycle* the front door admits one input batch of B0 inputs; ``B_k = B0 *
reach[k-1]`` of them reach block k (the batch profile, with the plan's enabled
ramps: see :func:`effective_reach`). A split over blocks a..b runs on one
device configuration c with m instances; each instance takes ``B_a / m`` of the
inputs entering it. A split has a *form* (:mod:`e3.core.plan`):

* **constant** -- its own Triton model reached by a BLS hop; the batch that
  enters runs every block (no shrinking inside):
  ``T = sum_{k=a..b} P(k, c, B_a / m) + R(c, B_a / m)``, hop into it
  ``Tx = Tx(c, B_a / m)`` for *every* constant split; into the first split the
  hop carries the model inputs, ``Tx_in(c, B_1 / m)`` (``tx_in_ms``, else ``tx_ms``).
* **compact** -- the router runs the blocks itself, one call per block, and the
  rows that exit leave between blocks:
  ``T = sum_{k=a..b} P(k, c, B_k / m) + sum_{enabled ramps k in a..b} check(c, B_k / m) + R(c, B_a / m)``,
  no hop (``Tx = 0``: it runs inside the router process).
* **device** -- the router runs the split on its own device (docs/design.md §2b) at a constant batch ``b`` (the
  split's batch; the planner gives every split the plan's B0), one instance: survivors of any number of
  cycles are gathered on the device until they fill ``b``, so the split runs ``n = B_a / b`` times per cycle:
  ``T = sum_{k=a..b} P(k, c, b) + check(c, b) + R(c, b)`` per run (its blocks at the constant batch, one
  sync with the exit rule and the survivors' gather on the device, the router's work), ``Tx = 0`` (no hop:
  the hand-off is the gather inside ``check``).

``P`` includes the ramp of every enabled ramp; ``R`` is the router's own work
per batch of the split (``router_ms``: stacking rows, the exit rule at the
split's end, answering), part of the stage for both latency and cycle;
``check`` is one exit check and compaction of the rows (``check_ms``). Then

* cycle time   ``C  = max(max over splits of max(T, Tx), sum over device splits of n x T)``
                                                            (pipelined, §3.2.2), or
               ``sum over splits of (n x T + Tx)``         (not pipelined, §3.2.1)
  where ``n`` (a stage's ``runs``) is 1 for constant and compact splits. The device splits of a plan share
  one device and run one at a time (:mod:`e3.serving.device.dispatch`), so their times *add*: one pipeline
  stage of ``sum n x T``. With ``b = B0`` (the planner's choice) that is ``sum reach(a) x T``: the device
  time per B0 inputs of ``controller/planner/device.py``'s cut search, which calls this model.
* throughput   ``1000 * B0 / C``                           (inputs/s)
* worst-case latency ``1000 * (B0 - 1) / R + sum (T + Tx)`` (ms): the first input of a batch
  waits for the batch to fill at the offered rate R, then passes every stage and hop once (a device split
  once: a row waiting for a later split's batch to fill is not charged, since the device's dispatch rule
  runs a partial batch as soon as nothing upstream can add rows, and forces one before the SLO breaks)
* cost         ``sum of instances x price``; a device configuration holding device splits counts once
  (they share that device)

The planner prices both per-split forms (constant, compact) of every split candidate and keeps the one with
the smaller stage time T (tie: constant) -- :func:`form_table`; the device form is a form of the whole plan
(all its splits or none, :mod:`e3.core.plan`), priced by :func:`device_table` and chosen against the
best other plan by the planner. Profiles without ``check_ms`` / ``router_ms`` price them as 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import numpy as np

from e3.core.plan import COMPACT, CONSTANT, DEVICE, FORMS
from e3.core.profile import LatencyProfile

__all__ = ["StageCost", "PlanCost", "fill_ms", "thread_gain", "ASSUMED_THREAD_EFFICIENCY", "effective_reach", "ramps_key", "split_block_ms", "stage_table", "form_table",
           "device_table", "stage_cost", "summarise", "plan_cost", "FORM_TIE_REL", "SPLIT_FORMS"]

SPLIT_FORMS = (CONSTANT, COMPACT)   # the forms chosen split by split (form_table); DEVICE is a whole plan's

FORM_TIE_REL = 1e-9   # compact must be faster than constant by more than this share to be chosen


@dataclass(frozen=True)
class StageCost:
    """One split of a plan, priced."""
    first_block: int              # first block of the split (1-based)
    last_block: int               # last block (inclusive)
    device: str                   # device configuration, as in the latency profile
    instances: int                # m: instances of the split (the paper's replicas), all on `device`
    batch_per_instance: float     # B_a / m: inputs each instance takes per cycle (may be fractional); a device
                                  # split: the batch b of every run
    stage_ms: float               # T: the split's blocks (with enabled ramps, checks) + the router's work (ms);
                                  # a device split: one run's
    tx_ms: float                  # Tx: the hop into this split (ms); 0 for a compact or device split
    form: str = CONSTANT          # CONSTANT (own Triton model), COMPACT (in the router) or DEVICE (on its device)
    runs: float = 1.0             # n: runs per cycle; 1, a device split B_a / b (its rows gather across cycles)

    @property
    def load_ms(self) -> float:
        """Time (ms) the split's instances are busy per cycle: ``runs x stage_ms``."""
        return self.runs * self.stage_ms

    @property
    def preferred_batch(self) -> int:
        """The per-instance preferred batch for Triton: ``batch_per_instance`` rounded, at least 1."""
        return max(1, int(math.floor(self.batch_per_instance + 0.5)))


@dataclass(frozen=True)
class PlanCost:
    """What a plan costs and delivers under one batch profile and offered rate."""
    stages: tuple[StageCost, ...]  # in block order
    input_batch_size: float        # B0: inputs admitted per cycle
    cycle_ms: float                # pipelined: the slowest stage or hop; else their sum (ms)
    throughput_rps: float          # 1000 * B0 / cycle_ms (inputs/s)
    latency_ms: float              # worst-case latency: fill time + every stage and hop (ms)
    cost: float                    # sum of instances x price (relative units)
    devices_used: dict[str, int]   # device configuration -> instances
    pipelined: bool = True


def fill_ms(b0: float, rate_rps: float) -> float:
    """Time (ms) the first input of a B0 batch waits for the batch to fill at ``rate_rps`` inputs/s."""
    return 1e3 * (b0 - 1) / rate_rps


def ramps_key(ramps: Iterable[int]) -> str:
    """The key of a set of enabled ramps in ``BatchProfile.reach_by_ramps``: ``"1,3"``; ``""`` for none."""
    return ",".join(str(k) for k in sorted({int(k) for k in ramps}))


def effective_reach(reach: Sequence[float], ramps: Iterable[int] | None,
                    exact: Mapping[str, Sequence[float]] | None = None) -> np.ndarray:
    """The share of inputs entering each block when only the ramps after ``ramps`` are enabled.

    ``reach`` is the batch profile's (every ramp enabled). Where ``exact`` (a batch profile's
    ``reach_by_ramps``, measured from data) holds this set of ramps, that is the answer. Otherwise inputs
    that would have exited at a disabled ramp go on to the next enabled ramp and are assumed to exit there
    (the exit-wrapper's approximation, E3 §3.4): block k is entered by ``reach`` after the last enabled ramp
    before k. ``None``: ``reach``.
    """
    r = np.asarray(reach, dtype=float)
    if ramps is None:
        return r.copy()
    if exact:
        found = exact.get(ramps_key(ramps))
        if found is not None:
            return np.asarray(found, dtype=float)
    enabled = {int(k) for k in ramps}
    out, last = np.empty_like(r), 0
    for k in range(1, r.size + 1):
        out[k - 1] = r[last]
        if k in enabled:
            last = k
    return out


def _ramp_mask(latency: LatencyProfile, ramps: Iterable[int] | None) -> np.ndarray:
    """[L] bool: enabled ramps (None: every block's ramp as the profile prices it); never block L (the head)."""
    mask = latency.ramp_mask(True if ramps is None else tuple(ramps))
    mask[-1] = False
    return mask


def split_block_ms(latency: LatencyProfile, device: str, batch_in: np.ndarray, *, instances: np.ndarray,
                   ramps: Iterable[int] | None = None, shrink: bool = False) -> np.ndarray:
    """``P[k-1, a-1, i]``: latency (ms) of block k (with its ramp if enabled) in a split that starts at block
    a with ``instances[i]`` instances, where ``batch_in[k-1]`` inputs reach block k per cycle. [L, L, len(instances)].

    The batch block k runs at is ``batch_in[a-1] / m`` (constant form: no shrinking inside a split), or
    ``batch_in[k-1] / m`` with ``shrink`` (compact form). ``ramps``: the enabled ramps (None: all).
    """
    L = latency.num_blocks
    b = np.asarray(batch_in, dtype=float)
    m = np.asarray(instances, dtype=float)
    per = (b[:, None, None] if shrink else b[None, :, None]) / m[None, None, :]
    return latency.blocks_at(device, np.broadcast_to(per, (L, L, m.size)), with_ramp=_ramp_mask(latency, ramps))


ASSUMED_THREAD_EFFICIENCY = 0.85   # gain per intra-op thread where a profile has no 2-thread curve (assumed)


def thread_gain(latency: LatencyProfile, device: str, rows: float, threads: int,
                efficiency: float = ASSUMED_THREAD_EFFICIENCY) -> float:
    """How many times faster ``threads`` intra-op threads run a block of ``rows`` rows than 1: the profile's
    measured thread model (:meth:`LatencyProfile.thread_speedup`), else ``threads x efficiency`` (assumed;
    a profile without the 2-thread curve says so by lacking it)."""
    if threads <= 1:
        return 1.0
    measured = latency.thread_speedup(device, rows, threads)
    return measured if measured is not None else threads * efficiency


def batch_ms(latency: LatencyProfile, device: str, first: int, *, last: int, exit_block: np.ndarray,
             ramps: Iterable[int], form: str, threads: int = 1,
             efficiency: float = ASSUMED_THREAD_EFFICIENCY, one_graph: bool = False) -> float:
    """Compute time (ms) of one batch of rows through blocks ``first..last`` in ``form``, priced as a stage is
    (module docstring) but at the rows this batch really holds: ``exit_block[r]`` is the block where row r
    leaves (later than ``last``: it goes on). Constant: every block at the entering batch; device: the same and
    one exit check (the run's sync, rule and gather); compact: block k at the rows that reach it, plus an exit
    check at every enabled ramp (``ramps``), ending when no row is left.
    ``threads``: the instance's intra-op threads; every block (with its ramp) runs :func:`thread_gain` times
    faster at the rows it runs, the exit checks (numpy, one thread) do not (``efficiency``: per thread where the
    profile has no 2-thread curve). ``one_graph`` (compact): the blocks run as one composed graph, each at
    :meth:`LatencyProfile.one_graph` of its time as a call of its own at the rows it runs.
    The router's work and the hop are the caller's. The simulator prices every batch it runs here."""
    enabled = {int(k) for k in ramps if first <= k <= last and k < latency.num_blocks}
    n = len(exit_block)
    if form in (CONSTANT, DEVICE):   # device: its one sync, rule and gather per run too (:func:`device_table`)
        return (sum(latency.block(k, device, n, with_ramp=k in enabled) for k in range(first, last + 1))
                / thread_gain(latency, device, n, threads, efficiency)
                + (float(latency.check(device, n)) if form == DEVICE else 0.0))
    if form != COMPACT:
        raise ValueError(f"form {form!r} is not one of {', '.join(FORMS)}")
    ms = 0.0
    for k in range(first, last + 1):
        ratio = (latency.one_graph(device, n) or 1.0) if one_graph else 1.0
        ms += (latency.block(k, device, n, with_ramp=k in enabled) * ratio
               / thread_gain(latency, device, n, threads, efficiency))
        if k in enabled:
            ms += latency.check(device, n)
            n = int(np.sum(exit_block > k))
        if n == 0:
            break
    return ms


def _stages(latency: LatencyProfile, device: str, batch_in: np.ndarray, m: np.ndarray, *,
            ramps: Iterable[int] | None, form: str, router: bool) -> tuple[np.ndarray, np.ndarray]:
    """``T`` [a-1, j-1, i] and ``tx`` [a-1, i] of one form for the instance counts ``m`` (see the module doc)."""
    if form == DEVICE:
        raise ValueError("the device form is priced per run at its constant batch: device_table, not stage_table")
    if form not in FORMS:
        raise ValueError(f"form {form!r} is not one of {', '.join(FORMS)}")
    L = latency.num_blocks
    b = np.asarray(batch_in, dtype=float)
    ramps = None if ramps is None else tuple(ramps)
    compact = form == COMPACT
    P = split_block_ms(latency, device, b, instances=m, ramps=ramps, shrink=compact)        # [k, a, m]
    if compact:   # the exit check between blocks, at every enabled ramp, on the rows that reached it
        check = np.asarray(latency.check(device, b[:, None] / m[None, :]), dtype=float)   # [k, m]
        P = P + (check * _ramp_mask(latency, ramps)[:, None])[:, None, :]
    cs = np.concatenate([np.zeros((1, L, m.size)), np.cumsum(P, axis=0)])             # [k+1, a, m]
    T = np.transpose(cs[1:], (1, 0, 2)) - cs[np.arange(L), np.arange(L)][:, None, :]  # [a, j, m]
    per_a = b[:, None] / m[None, :]                                                    # [a, m]
    if router:
        T = T + np.asarray(latency.router(device, per_a), dtype=float)[:, None, :]
    a_idx, j_idx = np.meshgrid(np.arange(L), np.arange(L), indexing="ij")
    T = np.where((j_idx >= a_idx)[:, :, None], np.maximum(T, 0.0), np.inf)
    if compact:
        tx = np.zeros((L, m.size))
    else:
        tx = np.asarray(latency.tx(device, per_a), dtype=float)
        tx[0] = latency.tx_in(device, per_a[0])     # split 1's hop carries the model inputs
    return T, tx


def stage_table(latency: LatencyProfile, device: str, batch_in: np.ndarray, *, max_instances: int,
                ramps: Iterable[int] | None = None, form: str = CONSTANT,
                router: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Every split's stage and hop time in one ``form`` on ``device`` for 1..``max_instances`` instances.

    ``batch_in[k-1]``: inputs reaching block k per cycle (with the enabled ramps already applied, see
    :func:`effective_reach`); ``ramps``: the enabled ramps (None: every ramp the profile prices);
    ``router=False`` leaves out the router's work (the stock model, served without a router).
    Returns ``T`` [a-1, j-1, m-1]: stage time (ms) of the split over blocks a..j with m instances
    (inf where j < a), and ``tx`` [a-1, m-1]: the hop into a split starting at a (0 for compact).
    """
    m = np.arange(1, max_instances + 1, dtype=float)
    return _stages(latency, device, batch_in, m, ramps=ramps, form=form, router=router)


def form_table(latency: LatencyProfile, device: str, batch_in: np.ndarray, *, max_instances: int,
               ramps: Iterable[int] | None = None, forms: Sequence[str] = FORMS,
               router: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`stage_table` of every per-split form in ``forms``, each candidate (a, j, m) in the form with the
    smaller stage time T (tie, within :data:`FORM_TIE_REL`: constant). Returns ``T`` and ``tx`` [a-1, j-1, m-1]
    of the chosen form and ``form`` [a-1, j-1, m-1]: its index in :data:`e3.core.plan.FORMS`. ``DEVICE`` in
    ``forms`` is passed over: it is a whole plan's form (:func:`device_table`); at least one of
    :data:`SPLIT_FORMS` must be given."""
    ramps = None if ramps is None else tuple(ramps)
    if set(forms) - set(FORMS):
        raise ValueError(f"forms must be some of {', '.join(FORMS)}, got {list(forms)}")
    chosen = [f for f in SPLIT_FORMS if f in set(forms)]
    if not chosen:
        raise ValueError(f"form_table chooses among {', '.join(SPLIT_FORMS)}, got {list(forms)} (the device form "
                         f"is priced by device_table)")
    best_T = best_tx = best_f = None
    for f in chosen:
        T, tx = stage_table(latency, device, batch_in, max_instances=max_instances, ramps=ramps, form=f, router=router)
        tx = np.broadcast_to(tx[:, None, :], T.shape)
        if best_T is None:
            best_T, best_tx, best_f = T, np.array(tx), np.full(T.shape, FORMS.index(f), dtype=np.int8)
            continue
        take = T < best_T - FORM_TIE_REL * np.maximum(1.0, np.abs(np.where(np.isfinite(best_T), best_T, 0.0)))
        best_T = np.where(take, T, best_T)
        best_tx = np.where(take, tx, best_tx)
        best_f = np.where(take, FORMS.index(f), best_f).astype(np.int8)
    return best_T, best_tx, best_f


def device_table(latency: LatencyProfile, device: str, batch_in: np.ndarray, *, batch: float,
                 ramps: Iterable[int] | None = None, router: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Every split's price in the device form on ``device`` at the constant batch ``batch`` (module doc).

    ``batch_in[k-1]``: inputs reaching block k per cycle (the enabled ramps applied, :func:`effective_reach`);
    ``ramps``: the enabled ramps (None: every ramp the profile prices). Returns ``T`` [a-1, j-1]: one run of
    the split over blocks a..j (ms; inf where j < a) -- its blocks at ``batch``, one exit check and, unless
    ``router=False``, the router's work, all at ``batch`` -- and ``runs`` [a-1]: its runs per cycle,
    ``batch_in[a-1] / batch``. The hop is 0.
    """
    if not batch > 0:
        raise ValueError(f"a device split's batch must be > 0, got {batch}")
    L = latency.num_blocks
    ramps = None if ramps is None else tuple(ramps)
    P = latency.blocks_at(device, np.full(L, float(batch)), with_ramp=_ramp_mask(latency, ramps))   # [k]
    cs = np.concatenate([[0.0], np.cumsum(P)])
    a_idx, j_idx = np.meshgrid(np.arange(L), np.arange(L), indexing="ij")
    per_run = float(latency.check(device, batch)) + (float(latency.router(device, batch)) if router else 0.0)
    T = np.where(j_idx >= a_idx, cs[j_idx + 1] - cs[a_idx] + per_run, np.inf)
    return T, np.asarray(batch_in, dtype=float) / float(batch)


def stage_cost(latency: LatencyProfile, reach: Sequence[float], b0: float, *, first: int, last: int, device: str,
               instances: int, ramps: Iterable[int] | None = None, form: str = CONSTANT,
               batch: float | None = None) -> StageCost:
    """One split priced: blocks ``first..last`` on ``device`` with ``instances`` instances in ``form``,
    B0 = ``b0``. ``reach``: the batch profile's (every ramp enabled); ``ramps``: the plan's enabled ramps
    (None: every ramp, reach as given). ``batch``: a device split's constant batch (default ``b0``; the
    device form has one instance)."""
    batch_in = b0 * effective_reach(reach, ramps)
    if form == DEVICE:
        if instances != 1:
            raise ValueError(f"a device split has one instance (the router's, on its device), got {instances}")
        b = float(b0 if batch is None else batch)
        T, runs = device_table(latency, device, batch_in, batch=b, ramps=ramps)
        return StageCost(first, last, device, 1, b, float(T[first - 1, last - 1]), 0.0, DEVICE,
                         float(runs[first - 1]))
    T, tx = _stages(latency, device, batch_in, np.array([float(instances)]), ramps=ramps, form=form, router=True)
    per = float(batch_in[first - 1] / instances)
    return StageCost(first, last, device, int(instances), per, float(T[first - 1, last - 1, 0]),
                     float(tx[first - 1, 0]), form)


def summarise(stages: Sequence[StageCost], b0: float, rate_rps: float, *, prices: Mapping[str, float],
              pipelined: bool = True) -> PlanCost:
    """Cycle, throughput, worst-case latency and cost of priced ``stages`` (see the module docstring): device
    splits on one configuration share one device, so their loads (``runs x T``) add into one stage and the
    configuration counts one device."""
    pipe = sum(s.stage_ms + s.tx_ms for s in stages)
    shared: dict[str, float] = {}          # device configuration -> its device splits' load per cycle (ms)
    for s in stages:
        if s.form == DEVICE:
            shared[s.device] = shared.get(s.device, 0.0) + s.load_ms
    own = [s for s in stages if s.form != DEVICE]
    if pipelined:
        cycle = max([max(s.stage_ms, s.tx_ms) for s in own] + list(shared.values()))
    else:
        cycle = sum(s.stage_ms + s.tx_ms for s in own) + sum(shared.values())
    used: dict[str, int] = {c: 1 for c in shared}
    for s in own:
        used[s.device] = used.get(s.device, 0) + s.instances
    return PlanCost(stages=tuple(stages), input_batch_size=b0, cycle_ms=cycle,
                    throughput_rps=1e3 * b0 / cycle if cycle > 0 else math.inf,
                    latency_ms=fill_ms(b0, rate_rps) + pipe,
                    cost=sum(prices[c] * n for c, n in used.items()), devices_used=used, pipelined=pipelined)


def plan_cost(latency: LatencyProfile, reach: Sequence[float], splits: Iterable[tuple], *, b0: float,
              rate_rps: float, pipelined: bool = True, ramps: Iterable[int] | None = None) -> PlanCost:
    """Price a plan given as ``(first_block, last_block, device, instances[, form[, batch]])`` per split, in
    block order (form: CONSTANT when left out; batch: a device split's constant batch, default ``b0``).
    ``reach``: the batch profile's; ``ramps``: the plan's enabled ramps (None: every ramp the profile
    prices, reach as given).

    Raises ValueError when a split's device is not in the profile, a form is unknown or ``reach`` does
    not describe the profile's blocks.
    """
    if len(reach) != latency.num_blocks:
        raise ValueError(f"the batch profile has {len(reach)} blocks, the latency profile {latency.num_blocks}")
    ramps = None if ramps is None else tuple(ramps)
    stages = []
    for split in splits:
        first, last, device, instances = split[:4]
        form = split[4] if len(split) > 4 else CONSTANT
        batch = split[5] if len(split) > 5 else None
        if device not in latency.devices:
            raise ValueError(f"device {device!r} is not in the latency profile ({sorted(latency.devices)})")
        stages.append(stage_cost(latency, reach, b0, first=first, last=last, device=device, instances=instances,
                                 ramps=ramps, form=form, batch=batch))
    prices = {c: latency.devices[c].price for c in latency.devices}
    return summarise(stages, b0, rate_rps, prices=prices, pipelined=pipelined)
