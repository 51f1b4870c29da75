"""E3's cost model (E3 §3.2-3.2.2, Fig. 6): what a plan costs, from a latency profile and a batch profile.

The one place the project turns a plan into stage times, cycle time,
throughput, worst-case latency and cost. The planner builds its DP tables
with :func:`stage_table`, the controller scores a running plan with
:func:`plan_cost`, and a simulator prices its stages the same way, so the
three can never disagree.

Per *cycle* the front door admits one input batch of B0 inputs; ``B_k = B0 *
reach[k-1]`` of them reach block k (the batch profile). A split over blocks
a..b runs on one device configuration c with m instances; each instance
takes ``B_a / m`` of the inputs entering it:

* stage time   ``T  = sum_{k=a..b} P(k, c, B_a / m)``      (ms, ramps included)
* hop into it  ``Tx = Tx(c, B_a / m)`` for every split but the first (ms)
* cycle time   ``C  = max over splits of max(T, Tx)``      (pipelined, §3.2.2), or
               ``sum over splits of (T + Tx)``             (not pipelined, §3.2.1)
* throughput   ``1000 * B0 / C``                           (inputs/s)
* worst-case latency ``1000 * (B0 - 1) / R + sum (T + Tx)`` (ms): the first input of a batch
  waits for the batch to fill at the offered rate R, then passes every stage and hop once
* cost         ``sum of instances x price``

Inside a split the batch does not shrink (DESIGN §2: inputs that exit at an
inner ramp compute to the split's end), so every block of a split runs at
``B_a / m``. ``shrink_in_split=True`` gives Fig. 6's literal reading, ``P(k, c,
B_k / m)``: the batch shrinks at every ramp.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import numpy as np

from e3.core.profile import LatencyProfile

__all__ = ["StageCost", "PlanCost", "fill_ms", "split_block_ms", "stage_table", "stage_cost", "summarise",
           "plan_cost"]


@dataclass(frozen=True)
class StageCost:
    """One split of a plan, priced."""
    first_block: int              # first block of the split (1-based)
    last_block: int               # last block (inclusive)
    device: str                   # device configuration, as in the latency profile
    instances: int                # m: Triton instances of the split (the paper's replicas), all on `device`
    batch_per_instance: float     # B_a / m: inputs each instance takes per cycle (may be fractional)
    stage_ms: float               # T: the split's blocks (with their ramps) at that batch (ms)
    tx_ms: float                  # Tx: the hop into this split (ms); 0 for the first split

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


def split_block_ms(latency: LatencyProfile, device: str, batch_in: np.ndarray, instances: np.ndarray, *,
                   with_ramp: bool = True, shrink_in_split: bool = False) -> np.ndarray:
    """``P[k-1, a-1, i]``: latency (ms) of block k in a split that starts at block a with ``instances[i]``
    instances, where ``batch_in[k-1]`` inputs reach block k per cycle. [L, L, len(instances)].

    The batch block k runs at is ``batch_in[a-1] / m`` (no shrinking inside a split), or
    ``batch_in[k-1] / m`` with ``shrink_in_split``.
    """
    L = latency.num_blocks
    b = np.asarray(batch_in, dtype=float)
    m = np.asarray(instances, dtype=float)
    per = (b[:, None, None] if shrink_in_split else b[None, :, None]) / m[None, None, :]
    return latency.blocks_at(device, np.broadcast_to(per, (L, L, m.size)), with_ramp=with_ramp)


def stage_table(latency: LatencyProfile, device: str, batch_in: np.ndarray, max_instances: int, *,
                with_ramp: bool = True, shrink_in_split: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Every split's stage and hop time on ``device`` for 1..``max_instances`` instances (the planner's table).

    Returns ``T`` [a-1, j-1, m-1]: stage time (ms) of the split over blocks a..j with m instances
    (inf where j < a), and ``tx`` [a-1, m-1]: the hop into a split starting at a (0 for a = 1).
    """
    L = latency.num_blocks
    m = np.arange(1, max_instances + 1, dtype=float)
    P = split_block_ms(latency, device, batch_in, m, with_ramp=with_ramp, shrink_in_split=shrink_in_split)
    cs = np.concatenate([np.zeros((1, L, m.size)), np.cumsum(P, axis=0)])            # [k+1, a, m]
    T = np.transpose(cs[1:], (1, 0, 2)) - cs[np.arange(L), np.arange(L)][:, None, :]  # [a, j, m]
    a_idx, j_idx = np.meshgrid(np.arange(L), np.arange(L), indexing="ij")
    T = np.where((j_idx >= a_idx)[:, :, None], np.maximum(T, 0.0), np.inf)
    tx = np.asarray(latency.tx(device, np.asarray(batch_in, dtype=float)[:, None] / m[None, :]), dtype=float)
    tx[0] = 0.0
    return T, tx


def stage_cost(latency: LatencyProfile, reach: Sequence[float], b0: float, first: int, last: int, device: str,
               instances: int, *, with_ramp: bool = True, shrink_in_split: bool = False) -> StageCost:
    """One split priced: blocks ``first..last`` on ``device`` with ``instances`` instances, B0 = ``b0``."""
    batch_in = b0 * np.asarray(reach, dtype=float)
    P = split_block_ms(latency, device, batch_in, np.array([instances]), with_ramp=with_ramp,
                       shrink_in_split=shrink_in_split)
    per = float(batch_in[first - 1] / instances)
    stage = float(max(0.0, P[first - 1:last, first - 1, 0].sum()))
    tx = float(latency.tx(device, per)) if first > 1 else 0.0
    return StageCost(first, last, device, int(instances), per, stage, tx)


def summarise(stages: Sequence[StageCost], b0: float, rate_rps: float, prices: Mapping[str, float], *,
              pipelined: bool = True) -> PlanCost:
    """Cycle, throughput, worst-case latency and cost of priced ``stages`` (see the module docstring)."""
    pipe = sum(s.stage_ms + s.tx_ms for s in stages)
    cycle = max(max(s.stage_ms, s.tx_ms) for s in stages) if pipelined else pipe
    used: dict[str, int] = {}
    for s in stages:
        used[s.device] = used.get(s.device, 0) + s.instances
    return PlanCost(stages=tuple(stages), input_batch_size=b0, cycle_ms=cycle,
                    throughput_rps=1e3 * b0 / cycle if cycle > 0 else math.inf,
                    latency_ms=fill_ms(b0, rate_rps) + pipe,
                    cost=sum(prices[c] * n for c, n in used.items()), devices_used=used, pipelined=pipelined)


def plan_cost(latency: LatencyProfile, reach: Sequence[float], splits: Iterable[tuple[int, int, str, int]],
              b0: float, rate_rps: float, *, pipelined: bool = True, with_ramp: bool = True,
              shrink_in_split: bool = False) -> PlanCost:
    """Price a plan given as ``(first_block, last_block, device, instances)`` per split, in block order.

    Raises ValueError when a split's device is not in the profile or ``reach`` does not
    describe the profile's blocks.
    """
    if len(reach) != latency.num_blocks:
        raise ValueError(f"the batch profile has {len(reach)} blocks, the latency profile {latency.num_blocks}")
    stages = []
    for first, last, device, instances in splits:
        if device not in latency.devices:
            raise ValueError(f"device {device!r} is not in the latency profile ({sorted(latency.devices)})")
        stages.append(stage_cost(latency, reach, b0, first, last, device, instances, with_ramp=with_ramp,
                                 shrink_in_split=shrink_in_split))
    prices = {c: latency.devices[c].price for c in latency.devices}
    return summarise(stages, b0, rate_rps, prices, pipelined=pipelined)
