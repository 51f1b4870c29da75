"""The planner's inputs: devices parsed and checked, the B0 candidates, and one B0's cost table.

A table holds, for one input batch B0, every split's stage and hop time for every
start, end, device configuration and instance count. It is priced by E3's one
cost model (:func:`e3.core.cost.stage_table`); the planner never interpolates a
latency profile itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np

from e3.controller.planner.result import PlannerError
from e3.core.cost import stage_table
from e3.core.profile import BatchProfile, LatencyProfile

__all__ = ["parse_devices", "check_inputs", "b0_candidates", "Tables", "build_tables"]


def parse_devices(text: str) -> dict[str, int]:
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


def check_inputs(latency: LatencyProfile, batch: BatchProfile | None, devices: Mapping[str, int],
                 slo_ms: float, slack: float, rate_rps: float) -> dict[str, int]:
    """The devices with a count > 0; raises :class:`PlannerError` naming what the planner cannot use."""
    unknown = sorted(set(devices) - set(latency.devices))
    if unknown:
        raise PlannerError(f"device configuration(s) {unknown} are not in the latency profile of "
                           f"{latency.model!r}, which has {sorted(latency.devices)}; profile them or drop them")
    if any(int(n) < 0 for n in devices.values()):
        raise PlannerError(f"device counts must be >= 0, got {dict(devices)}")
    res = {c: int(n) for c, n in devices.items() if int(n) > 0}
    if not res:
        raise PlannerError(f"no devices to plan with: {dict(devices)}")
    if batch is not None and len(batch.reach) != latency.num_blocks:
        raise PlannerError(f"the batch profile has {len(batch.reach)} blocks, the latency profile "
                           f"{latency.num_blocks}; they must describe the same model")
    if not slo_ms > 0 or not 0 <= slack < 1 or not rate_rps > 0:
        raise PlannerError(f"need slo_ms > 0, 0 <= slack < 1 and rate_rps > 0; got {slo_ms}, {slack}, {rate_rps}")
    return res


def b0_candidates(latency: LatencyProfile, devices: Mapping[str, int], rate_rps: float,
                  latency_budget_ms: float) -> list[int]:
    """Powers of two up to max measured batch x total devices whose fill time (B0-1)/R fits the budget."""
    top = latency.batch_sizes[-1] * max(1, sum(devices.values()))
    out, b = [], 1
    while b <= top and 1e3 * (b - 1) / rate_rps < latency_budget_ms:
        out.append(b)
        b *= 2
    return out


@dataclass
class Tables:
    b0: int
    configs: list[str]           # configuration names, grid axis order
    caps: list[int]              # devices of each configuration (grid axis c has caps[c] + 1 cells)
    prices: np.ndarray           # [C]
    T: list[np.ndarray]          # per c: [a-1, j-1, m-1] stage time of split a..j with m instances, inf if illegal
    tx: list[np.ndarray]         # per c: [a-1, m-1] hop into a split starting at a
    stage: list[np.ndarray]      # per c: max(T, tx)  (what the pipelined cycle sees)
    lat: list[np.ndarray]        # per c: T + tx      (what latency sees)
    batch_in: np.ndarray         # [a-1] B_a: inputs entering block a per cycle


def build_tables(latency: LatencyProfile, reach: np.ndarray, devices: Mapping[str, int], b0: int, *,
                 with_ramp: bool = True, shrink_in_split: bool = False) -> Tables:
    """One B0's table. Illegal cells are inf: more instances than inputs entering the split
    (m > max(1, ceil(B_a))) or a per-instance batch above the largest measured batch."""
    bmax = float(latency.batch_sizes[-1])
    Bk = b0 * np.asarray(reach, dtype=float)      # [L] inputs reaching block k
    configs = list(devices)
    T_l, tx_l, st_l, lat_l = [], [], [], []
    for c in configs:
        M = devices[c]
        m = np.arange(1, M + 1, dtype=float)
        per = Bk[:, None] / m[None, :]             # [a, m] per-instance batch entering a split at a
        legal = (m[None, :] <= np.maximum(1.0, np.ceil(Bk[:, None] - 1e-9))) & (per <= bmax + 1e-9)
        T, tx = stage_table(latency, c, Bk, M, with_ramp=with_ramp, shrink_in_split=shrink_in_split)
        T = np.where(legal[:, None, :], T, np.inf)
        T_l.append(T)
        tx_l.append(tx)
        st_l.append(np.maximum(T, tx[:, None, :]))
        lat_l.append(T + tx[:, None, :])
    prices = np.array([latency.devices[c].price for c in configs], dtype=float)
    return Tables(b0, configs, [devices[c] for c in configs], prices, T_l, tx_l, st_l, lat_l, Bk)
