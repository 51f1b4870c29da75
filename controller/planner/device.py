"""The device form's cuts (docs/design.md §2b): E3's splits on one accelerator, inside the router, priced by the one
cost model (:func:`e3.core.cost.device_table`). Pure.

On one device every split runs at the same constant batch b, one at a time, so a plan's cycle adds its splits'
loads (:mod:`e3.core.cost`, the device form):

    cycle(cuts) = sum over splits i of runs_i x T_i,   runs_i = B_{a_i} / b,
    T_i = sum_{k in split i} P(k, c, b) + check(c, b) + R(c, b)

and its worst-case latency adds one run of every split to the fill time. With b = B0 (what the planner gives
every split), ``runs_i`` is ``reach(first_i)``: the device time per B0 inputs. Cuts go only after enabled
ramps (a cut where nobody exits only adds a run).

The search (:func:`best_device_cuts`) is exact: a DP over the cut points that keeps, per prefix ending in a
cut, every plan not dominated in (cycle, latency) -- the cycle is a sum, so the DP of the pipelined search
(a bound on the slowest stage) does not apply, and the latency budget makes the least-cycle prefix alone not
enough. ``tests/test_device_form_planning.py`` checks it against every subset of the ramps.

:func:`choose_device_cuts` and :func:`plan_time_ms` keep the interface the GPU benches call with measured
prices at one batch (every block's time at B with its ramp, and ``run_ms``: what one split execution costs
besides its blocks); they price through the same cost model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from e3.core.cost import device_table
from e3.core.profile import DeviceConfig, LatencyProfile

__all__ = ["DeviceCuts", "best_device_cuts", "choose_device_cuts", "plan_time_ms", "device_cycle_ms"]

REL = 1e-9   # relative tolerance when comparing cycles


@dataclass(frozen=True)
class DeviceCuts:
    cuts: tuple[int, ...]   # blocks after which the model is cut (ascending)
    time_ms: float          # predicted device time per cycle (per B inputs entering split 1): the cycle
    stock_ms: float = 0.0   # the stock model's measured time per B inputs (the same device), for the ratio
    latency_ms: float = 0.0  # one run of every split (ms): what the plan adds to the fill time

    @property
    def speedup(self) -> float:
        return self.stock_ms / self.time_ms if self.time_ms > 0 else float("inf")


def _bounds(cuts: Sequence[int], L: int) -> list[tuple[int, int]]:
    edges = [0, *cuts, L]
    return [(a + 1, b) for a, b in zip(edges, edges[1:])]


def device_cycle_ms(cuts: Sequence[int], T: np.ndarray, runs: np.ndarray) -> tuple[float, float]:
    """(cycle, latency) in ms of the device plan cut at ``cuts`` from :func:`e3.core.cost.device_table`'s
    ``T`` [a-1, j-1] and ``runs`` [a-1]: ``sum runs x T`` and ``sum T`` over its splits."""
    L = T.shape[0]
    cycle = latency = 0.0
    for a, b in _bounds(cuts, L):
        cycle += float(runs[a - 1] * T[a - 1, b - 1])
        latency += float(T[a - 1, b - 1])
    return cycle, latency


def best_device_cuts(T: np.ndarray, runs: np.ndarray, candidates: Iterable[int], *,
                     budget_ms: float = math.inf) -> DeviceCuts | None:
    """The cuts (a subset of ``candidates``, blocks < L) whose device plan has the least cycle among those
    whose latency (one run of every split) stays within ``budget_ms``; ties: the lower latency, then fewer
    cuts. ``T`` and ``runs`` as :func:`e3.core.cost.device_table` returns them. None: no plan fits."""
    L = T.shape[0]
    points = [0, *sorted({int(k) for k in candidates if 1 <= int(k) < L})]
    # f[j] = the plans of blocks 1..j cut after j that no other such plan beats in both cycle and latency
    #        (with a latency within the budget), as (cycle, latency, cuts), by ascending cycle;
    # f[j] = front of { (c + runs[i] T[i, j-1], l + T[i, j-1], cuts + (i,) if i) : i < j a point, (c, l, cuts) in f[i] }
    f: dict[int, list[tuple[float, float, tuple[int, ...]]]] = {0: [(0.0, 0.0, ())]}
    for j in points[1:] + [L]:
        cands = []
        for i in points:
            if i >= j:
                break
            t = float(T[i, j - 1])
            add_c, cut = float(runs[i]) * t, ((i,) if i else ())
            cands += [(c + add_c, lat + t, cuts + cut) for c, lat, cuts in f[i]
                      if lat + t <= budget_ms * (1 + REL)]
        cands.sort(key=lambda p: (p[0], p[1], len(p[2])))
        front: list[tuple[float, float, tuple[int, ...]]] = []
        for p in cands:
            if not front or p[1] < front[-1][1] * (1 - REL) - 1e-12:
                front.append(p)
        f[j] = front
    if not f[L]:
        return None
    least = f[L][0][0]
    tie = [p for p in f[L] if p[0] <= least * (1 + REL) + 1e-12]
    cycle, latency, cuts = min(tie, key=lambda p: (p[1], len(p[2])))
    return DeviceCuts(cuts, cycle, 0.0, latency)


def _one_batch_profile(block_ms: Sequence[float], run_ms: float) -> LatencyProfile:
    """Measured prices at one batch as a latency profile: every block's time (its ramp included), ``run_ms``
    as the exit check of a run (the router's work inside it)."""
    L = len(block_ms)
    return LatencyProfile(model="device", num_blocks=L, batch_sizes=[1], devices={"gpu": DeviceConfig("gpu")},
                          block_ms={"gpu": [[float(t)] for t in block_ms]}, ramp_ms={"gpu": [[0.0]] * L},
                          tx_ms={"gpu": [0.0]}, check_ms={"gpu": [float(run_ms)]})


def _priced(reach: Sequence[float], block_ms: Sequence[float], run_ms: float) -> tuple[np.ndarray, np.ndarray]:
    if len(reach) != len(block_ms):
        raise ValueError(f"reach has {len(reach)} entries, the model {len(block_ms)} blocks")
    return device_table(_one_batch_profile(block_ms, run_ms), "gpu", np.asarray(reach, dtype=float), batch=1.0,
                        ramps=())


def plan_time_ms(cuts: tuple[int, ...], reach: list[float], block_ms: list[float], *, run_ms: float) -> float:
    """Device time per B inputs of the plan cut at ``cuts`` (the module's cycle with b = B): ``reach[k-1]``:
    share reaching block k; ``block_ms[k-1]``: block k's time at B (its ramp included where enabled);
    ``run_ms``: one split execution besides its blocks."""
    T, runs = _priced(reach, block_ms, run_ms)
    return device_cycle_ms(cuts, T, runs)[0]


def choose_device_cuts(reach: list[float], block_ms: list[float], run_ms: float, *, enabled_ramps: tuple[int, ...],
                       stock_ms: float = 0.0) -> DeviceCuts:
    """The cuts (a subset of ``enabled_ramps`` below L) with the least device time per B inputs (no latency
    bound), priced as :func:`plan_time_ms`."""
    T, runs = _priced(reach, block_ms, run_ms)
    got = best_device_cuts(T, runs, enabled_ramps)
    assert got is not None   # without a budget the uncut plan always fits
    return DeviceCuts(got.cuts, got.time_ms, stock_ms, got.latency_ms)
