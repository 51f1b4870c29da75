"""E3's exit-wrapper (E3 §3.4, Fig. 25): which ramps are worth keeping. Pure: profiles in, ramps out.

A ramp costs every input that reaches it (the ramp's own layers and the
router's exit check with the compaction of the rows that go on); it pays back
only through the inputs that exit there, which skip the blocks after it. The
wrapper disables the ramps whose cost exceeds what their exits save, so that a
plan neither computes nor checks them.

The model, per cycle of an input batch of B0 on one device configuration c
(B_k: inputs entering block k, from the batch profile with the ramps still
enabled, :func:`e3.core.cost.effective_reach`):

* cost of ramp k   ``ramp_ms(k, c, B_k) + check_ms(c, B_k)``                        (ms)
* saving of ramp k ``(B_k - B_{k+1}) * sum_{i=k+1..k'} P(i, c, B_i) / B_i``          (ms)

where k' is the next enabled ramp after k (or L): under the approximation
below, an input that exits at k skips exactly those blocks. ``P(i, c, B_i) /
B_i`` is block i's per-input cost at its own batch (its ramp left out; a batch
below one input is read at one input: a block runs at least one input when it
runs at all). Ramp k is disabled when cost > saving.

**Approximation.** Inputs that would have exited at a disabled ramp are assumed
to go on to the next enabled ramp and exit there (the batch profile says
nothing about how they would fare at a later ramp; with an entropy rule an
input confident at k is very likely confident later). The reach of every block
is recomputed that way after each ramp is disabled (a disabled ramp's exits
join the next enabled ramp's), which changes the other ramps' costs and
savings.

**Order.** Greedy: with every candidate enabled, the ramp whose cost exceeds
its saving by the most is disabled, the reach recomputed, and so on until
every enabled ramp pays for itself (at most one pass per ramp; ties: the lower
block first).

**Dependent rules** (PABEE's patience: an exit at ramp k needs the ramps before
it to have agreed). Disabling a ramp another ramp relies on changes that ramp's
exits in a way the approximation above cannot follow (a patience-1 model whose
ramp 1 was disabled exited nothing at ramp 2 any more). So:

* with **measured reach** (``exact``: a batch profile's ``reach_by_ramps``, the
  rule replayed on data for every set of ramps), every ramp may be disabled and
  each is judged by the whole cycle it changes: its saving is the blocks' and
  the other ramps' cost per cycle without it minus with it (both from the
  measured reach), so a ramp whose removal stops later exits pays for itself;
  the tables then price the kept ramps with their measured reach;
* without it, a ramp that an enabled ramp relies on (``relies_on(block,
  enabled)``, :meth:`e3.core.exits.ExitRule.relies_on`) is never disabled (it is
  reported kept, saving as computed); a ramp no other relies on (the last of a
  patience chain) may be, its exits moving to the next enabled ramp as above.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np

from e3.core.cost import effective_reach, ramps_key
from e3.core.profile import BatchProfile, LatencyProfile, interp_linear

__all__ = ["RampVerdict", "candidate_ramps", "judge_ramps", "ramps_worth_keeping", "wrap_for_devices"]


@dataclass(frozen=True)
class RampVerdict:
    """Why a ramp is kept or disabled, in ms per cycle of an input batch of ``b0``."""
    block: int          # the ramp after this block
    kept: bool          # False: the exit-wrapper disables it
    device: str         # device configuration it was judged on
    b0: float           # input batch size per cycle
    reached: float      # B_k: inputs reaching the ramp per cycle
    exits: float        # inputs exiting at it per cycle (with the ramps enabled when it was judged)
    saving_ms: float    # exits x per-input cost of the blocks they skip (ms per cycle)
    cost_ms: float      # the ramp + the exit check at B_k (ms per cycle)

    def describe(self) -> str:
        """One line for people: what the ramp saves and costs."""
        verdict = "kept" if self.kept else "disabled"
        return (f"ramp {self.block} {verdict} on {self.device}: saves {self.saving_ms:.3f} ms, costs "
                f"{self.cost_ms:.3f} ms per cycle (B0 {self.b0:g}: {self.reached:.2f} inputs reach it, "
                f"{self.exits:.2f} exit)")


def _reach_of(batch: BatchProfile | Sequence[float]) -> np.ndarray:
    return np.asarray(batch.reach if isinstance(batch, BatchProfile) else batch, dtype=float)


def candidate_ramps(latency: LatencyProfile, batch: BatchProfile | Sequence[float]) -> tuple[int, ...]:
    """The ramps a plan may enable when the caller does not name the model's: blocks < L whose ramp the
    profile prices on some device (:meth:`LatencyProfile.ramp_blocks`) or where inputs exit."""
    reach = _reach_of(batch)
    exits = {k for k in range(1, latency.num_blocks) if reach[k - 1] > reach[k] + 1e-12}
    return tuple(sorted(set(latency.ramp_blocks()) | exits))


ReliesOn = Callable[[int, tuple], tuple]   # (block, enabled ramps) -> the ramps its decision reads


def _cycle_ms(latency: LatencyProfile, r: np.ndarray, device: str, b0: float, enabled: Sequence[int],
              skip: int | None = None) -> float:
    """Blocks, ramps and exit checks per cycle (ms) with reach ``r`` and the ramps ``enabled`` (``skip``: one
    enabled ramp whose own cost is left out): every block at its own batch, per input (a batch below one
    input read at one)."""
    total = 0.0
    for i in range(1, latency.num_blocks + 1):
        x = b0 * r[i - 1]
        total += x * latency.block(i, device, max(1.0, x), with_ramp=False) / max(1.0, x)
    for k in enabled:
        if k != skip:
            bk = b0 * r[k - 1]
            total += float(interp_linear(latency.batch_sizes, latency.ramp_ms[device][k - 1], bk))
            total += float(latency.check(device, bk))
    return total


def _verdict(latency: LatencyProfile, reach: np.ndarray, device: str, b0: float, k: int,
             enabled: Sequence[int], exact: Mapping[str, Sequence[float]] | None = None) -> RampVerdict:
    """Cost and saving of enabled ramp ``k`` with the ramps ``enabled`` (k among them); with ``exact`` reach
    for both sets, the saving is the whole cycle's change (module docstring)."""
    L = latency.num_blocks
    r = effective_reach(reach, enabled, exact)
    without = [e for e in enabled if e != k]
    if exact and all(ramps_key(s) in exact for s in (enabled, without)):
        bk = b0 * r[k - 1]
        cost = float(interp_linear(latency.batch_sizes, latency.ramp_ms[device][k - 1], bk)) + float(latency.check(device, bk))
        saving = (_cycle_ms(latency, effective_reach(reach, without, exact), device, b0, without)
                  - _cycle_ms(latency, r, device, b0, enabled, skip=k))
        return RampVerdict(block=k, kept=True, device=device, b0=float(b0), reached=float(bk),
                           exits=float(max(0.0, bk - b0 * r[k])), saving_ms=float(saving), cost_ms=float(cost))
    bk, bnext = b0 * r[k - 1], b0 * r[k]
    later = [e for e in enabled if e > k]
    stop = min(later) if later else L
    per_input = 0.0
    for i in range(k + 1, stop + 1):
        x = max(1.0, b0 * r[i - 1])
        per_input += latency.block(i, device, x, with_ramp=False) / x
    exits = max(0.0, bk - bnext)
    ramp = float(interp_linear(latency.batch_sizes, latency.ramp_ms[device][k - 1], bk))
    cost = ramp + float(latency.check(device, bk))
    return RampVerdict(block=k, kept=True, device=device, b0=float(b0), reached=float(bk), exits=float(exits),
                       saving_ms=float(exits * per_input), cost_ms=float(cost))


def judge_ramps(latency: LatencyProfile, batch: BatchProfile | Sequence[float], device: str, *, b0: float,
                ramps: Iterable[int] | None = None, exact: Mapping[str, Sequence[float]] | None = None,
                relies_on: ReliesOn | None = None) -> tuple[RampVerdict, ...]:
    """Every candidate ramp's verdict on ``device`` at input batch ``b0`` (see the module docstring), in block
    order. ``ramps``: the candidates (default :func:`candidate_ramps`); blocks >= L are ignored; ``exact``:
    measured reach per set of ramps (default: a BatchProfile's ``reach_by_ramps``); ``relies_on``: the
    rule's dependencies (None: an independent rule)."""
    if exact is None and isinstance(batch, BatchProfile):
        exact = batch.reach_by_ramps or None
    if device not in latency.devices:
        raise ValueError(f"device {device!r} is not in the latency profile ({sorted(latency.devices)})")
    reach = _reach_of(batch)
    if reach.size != latency.num_blocks:
        raise ValueError(f"the batch profile has {reach.size} blocks, the latency profile {latency.num_blocks}")
    cands = candidate_ramps(latency, reach) if ramps is None else ramps
    enabled = sorted({int(k) for k in cands if 1 <= int(k) < latency.num_blocks})
    disabled: dict[int, RampVerdict] = {}
    while True:
        verdicts = {k: _verdict(latency, reach, device, b0, k, enabled, exact) for k in enabled}
        relied = set()
        if relies_on is not None and not (exact and all(ramps_key([e for e in enabled if e != k]) in exact
                                                        for k in enabled)):
            relied = {d for j in enabled for d in relies_on(j, tuple(enabled)) if d != j}
        worst = max((v for v in verdicts.values() if v.block not in relied),
                    key=lambda v: (v.cost_ms - v.saving_ms, -v.block), default=None)
        if worst is None or not worst.cost_ms > worst.saving_ms:
            break
        disabled[worst.block] = replace(worst, kept=False)
        enabled.remove(worst.block)
    return tuple(sorted([*verdicts.values(), *disabled.values()], key=lambda v: v.block))


def ramps_worth_keeping(latency: LatencyProfile, batch: BatchProfile | Sequence[float], device: str, *, b0: float,
                        ramps: Iterable[int] | None = None, exact: Mapping[str, Sequence[float]] | None = None,
                        relies_on: ReliesOn | None = None) -> tuple[int, ...]:
    """The exit-wrapper: the ramps (blocks, ascending) worth keeping on ``device`` at input batch ``b0``."""
    return tuple(v.block for v in judge_ramps(latency, batch, device, b0=b0, ramps=ramps, exact=exact,
                                              relies_on=relies_on) if v.kept)


def wrap_for_devices(latency: LatencyProfile, batch: BatchProfile | Sequence[float], devices: Iterable[str],
                     *, b0: float, ramps: Iterable[int] | None = None,
                     exact: Mapping[str, Sequence[float]] | None = None, relies_on: ReliesOn | None = None
                     ) -> tuple[tuple[int, ...], tuple[RampVerdict, ...]]:
    """The planner's use of the wrapper when a plan may use several configurations: a ramp stays enabled
    unless every configuration disables it (one batch profile holds for the whole plan, so one set of
    ramps must). Returns the kept ramps and, per ramp, the verdict of the first configuration (in
    ``devices`` order) that keeps it, else the first one's."""
    devices = list(devices)
    per_device: Mapping[str, tuple[RampVerdict, ...]] = {
        d: judge_ramps(latency, batch, d, b0=b0, ramps=ramps, exact=exact, relies_on=relies_on) for d in devices}
    blocks = sorted({v.block for vs in per_device.values() for v in vs})
    chosen = []
    for k in blocks:
        mine = [v for d in devices for v in per_device[d] if v.block == k]
        chosen.append(next((v for v in mine if v.kept), mine[0]))
    return tuple(v.block for v in chosen if v.kept), tuple(chosen)
