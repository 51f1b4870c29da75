"""Cuts for E3's device-resident constant splits on one GPU (DESIGN §2b), from measured prices. Pure.

On one device every split runs at the same constant batch B, one at a time, so the throughput of a plan is
B over the device time per B inputs entering split 1 (E3 §3.2 with one device and no pipelining across
devices):

    time(cuts) = sum over splits i of reach(first_i) x (sum_{k in split i} block_ms[k] + run_ms)

where ``reach(first_i)`` is the share of inputs that reach the split's first block (the batch profile),
``block_ms[k]`` the measured time of block k at batch B with its ramp when enabled (block 1 with the stem,
block L with the head), and ``run_ms`` what one split execution costs besides its blocks, measured on the same
device: the one host sync for the exit decisions, the rule on the host, the survivors' gather and the copy
into the next split's input. Cuts are taken only after enabled ramps (a cut where nobody exits only adds a
run). The search is exhaustive over those subsets (at most 2^11 for a 12-block model with ramps after 1-11);
a model with more ramps falls back to the DP of the same sum.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

__all__ = ["DeviceCuts", "choose_device_cuts", "plan_time_ms"]

EXHAUSTIVE_MAX_RAMPS = 14


@dataclass(frozen=True)
class DeviceCuts:
    cuts: tuple[int, ...]   # blocks after which the model is cut (ascending)
    time_ms: float          # predicted device time per B inputs entering split 1
    stock_ms: float         # the stock model's measured time per B inputs (the same device), for the ratio

    @property
    def speedup(self) -> float:
        return self.stock_ms / self.time_ms if self.time_ms > 0 else float("inf")


def plan_time_ms(cuts: tuple[int, ...], reach: list[float], block_ms: list[float], *, run_ms: float) -> float:
    """Device time per B inputs of the plan cut at ``cuts`` (module docstring). ``reach[k-1]``: share reaching
    block k; ``block_ms[k-1]``: block k's time at B."""
    L = len(block_ms)
    bounds = [0, *cuts, L]
    total = 0.0
    for a, b in zip(bounds, bounds[1:]):
        total += reach[a] * (sum(block_ms[a:b]) + run_ms)
    return total


def choose_device_cuts(reach: list[float], block_ms: list[float], run_ms: float, *, enabled_ramps: tuple[int, ...],
                       stock_ms: float = 0.0) -> DeviceCuts:
    """The cuts (a subset of ``enabled_ramps`` below L) with the least device time per B inputs."""
    L = len(block_ms)
    if len(reach) != L:
        raise ValueError(f"reach has {len(reach)} entries, the model {L} blocks")
    candidates = tuple(k for k in sorted(enabled_ramps) if 1 <= k < L)
    if len(candidates) <= EXHAUSTIVE_MAX_RAMPS:
        best = min((c for r in range(len(candidates) + 1) for c in itertools.combinations(candidates, r)),
                   key=lambda c: (plan_time_ms(c, reach, block_ms, run_ms=run_ms), len(c)))
        return DeviceCuts(best, plan_time_ms(best, reach, block_ms, run_ms=run_ms), stock_ms)
    # f[j] = least time of blocks 1..j cut after j (j a candidate or 0): f[j] = min_i f[i] + reach[i] (sum + run)
    points = [0, *candidates]
    f = {0: (0.0, ())}
    for j in [*candidates, L]:
        f[j] = min(((f[i][0] + reach[i] * (sum(block_ms[i:j]) + run_ms), f[i][1] + ((i,) if i else ()))
                    for i in points if i < j), key=lambda t: t[0])
    return DeviceCuts(f[L][1], f[L][0], stock_ms)
