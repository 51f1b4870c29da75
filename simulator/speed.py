"""The machine's speed over time: two levels in spells, as `e3 bench machine-speed` measures them.

A shared machine does not run at one speed. The 2-core VM of these benches moved between two speeds about 1.35x
apart for seconds at a time, with nothing else running (docs/data/cpu/machine_speed_trace_20261128*.json: at
03:35 slow 21% of the time, fast spells 0.6-30 s, slow ones 0.7-8 s). :class:`TwoSpeeds` is that process:
spells of exponential length with the trace's mean lengths, the first spell's kind drawn by the slow share,
each batch's time multiplied by the level of the spell it starts in (:class:`e3.simulator.des.CallCosts`'s
``speed``: E3's router and the baselines' instances; a plan of the device form, GPU-only, runs at one speed).

Decision (2026-11-28, after seeing the validations; opt-in, ``e3 bench simulator --speed TRACE``): a path's
levels are scaled so that their mean over the simulated run (``horizon_s``: the run's length at one speed) is 1.
The profile prices the machine's level, which a bench's runs taken together measure; the spells give a run its
tail (requests that meet a slow spell: timed request by request, a run at the fast speed had its p99 6-15%
over its p50, one the slow speed held throughout 2.5-4.4%, docs/data/cpu/stock_b8_requests_timed_20261128.json).
Weighted to a mean of 1 over the whole process instead, the median seed fell in the fast level and every
predicted goodput rose (the forced bench of 03:20: 7 and 3 cells within both bars became 7 and 1). Scaled per
run, on the three benches of 03:05-03:51 the median p99 error went from -2.1%, -9.9% and -11.5% to -0.7%,
-4.2% and -5.1%, the median goodput error (absolute) from 2.9%, 6.4% and 5.7% to 2.4%, 5.5% and 5.9%, and the
table's cells within both bars from 10, 7 and 7 to 9, 8 and 7 (the count is the machine's: two benches of the
same code agree in 14 of 24 shared cells, docs/RESULTS.md). It stays opt-in: a trace is one machine's at one
hour (21% slow at 03:35, 43% at 00:21), and the bench measures none by itself.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import numpy as np

__all__ = ["TwoSpeeds", "SpeedPath", "speed_path"]


@dataclass(frozen=True)
class TwoSpeeds:
    ratio: float                     # a slow spell's time per call over a fast one's (>= 1)
    fast_spell_s: float              # mean length of a fast spell (s)
    slow_spell_s: float              # mean length of a slow spell (s)
    horizon_s: float | None = None   # each path scaled to a mean of 1 over [0, horizon_s]; None: over all time

    def __post_init__(self) -> None:
        if not self.ratio >= 1 or not self.fast_spell_s > 0 or not self.slow_spell_s > 0:
            raise ValueError(f"ratio must be >= 1 and the spells > 0 s, got {self.ratio}, {self.fast_spell_s} "
                             f"and {self.slow_spell_s}")
        if self.horizon_s is not None and not self.horizon_s > 0:
            raise ValueError(f"horizon_s must be > 0, got {self.horizon_s}")

    @property
    def slow_share(self) -> float:
        """The share of the time in slow spells."""
        return self.slow_spell_s / (self.fast_spell_s + self.slow_spell_s)

    def levels(self) -> tuple[float, float]:
        """(fast, slow) time factors, their time-weighted mean over all time 1."""
        fast = 1.0 / (1.0 - self.slow_share + self.slow_share * self.ratio)
        return fast, fast * self.ratio

    def path(self, seed: int) -> "SpeedPath":
        return SpeedPath(self, seed)

    @classmethod
    def load(cls, path: Path) -> "TwoSpeeds":
        """From a trace file of `e3 bench machine-speed` (:meth:`from_trace`)."""
        if not path.exists():
            raise ValueError(f"{path} does not exist: trace the machine with `e3 bench machine-speed` first")
        return cls.from_trace(json.loads(path.read_text()))

    @classmethod
    def from_trace(cls, doc: Mapping) -> "TwoSpeeds":
        """From a document of `e3 bench machine-speed` (its ``spells``): the ratio of the two levels and each
        kind's mean spell. A trace of one speed (no slow spell) gives ratio 1."""
        try:
            s = doc["spells"]
            fast, slow = [float(x) for x in s["fast_spells_s"]], [float(x) for x in s["slow_spells_s"]]
            ratio = float(s["slow_ms"]) / float(s["fast_ms"])
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as err:
            raise ValueError(f"not a trace of `e3 bench machine-speed` (its spells: {err})") from None
        if not fast or not slow:
            return cls(1.0, 1.0, 1.0)
        return cls(max(1.0, ratio), float(np.mean(fast)), float(np.mean(slow)))


class SpeedPath:
    """One draw of :class:`TwoSpeeds`: ``path(t_s)`` is the time factor at ``t_s`` (s from the start). Spells
    are drawn as time goes on; with ``horizon_s`` the path is drawn that far at once and scaled so that its
    mean over it is 1."""

    def __init__(self, speeds: TwoSpeeds, seed: int):
        self.speeds = speeds
        self.rng = np.random.default_rng(seed)
        self.slow = [bool(self.rng.random() < speeds.slow_share)]
        self.ends = [self._length(self.slow[0])]
        self.scale = 1.0
        if speeds.horizon_s is not None:
            self.scale = 1.0 / self.mean(speeds.horizon_s)

    def _length(self, slow: bool) -> float:
        return float(self.rng.exponential(self.speeds.slow_spell_s if slow else self.speeds.fast_spell_s))

    def _grow(self, t_s: float) -> None:
        while self.ends[-1] <= t_s:
            self.slow.append(not self.slow[-1])
            self.ends.append(self.ends[-1] + self._length(self.slow[-1]))

    def mean(self, horizon_s: float) -> float:
        """The path's mean factor over [0, horizon_s], before any scaling."""
        self._grow(horizon_s)
        fast, slow = self.speeds.levels()
        starts = [0.0] + self.ends[:-1]
        area = sum((min(end, horizon_s) - start) * (slow if is_slow else fast)
                   for start, end, is_slow in zip(starts, self.ends, self.slow) if start < horizon_s)
        return area / horizon_s

    def __call__(self, t_s: float) -> float:
        self._grow(t_s)
        fast, slow = self.speeds.levels()
        i = int(np.searchsorted(self.ends, t_s, side="right"))
        return (slow if self.slow[i] else fast) * self.scale


def speed_path(speeds: TwoSpeeds | None, seed: int):
    """``path(t_s)``: ``speeds``' draw for ``seed`` (:class:`SpeedPath`), or 1.0 at every time without them."""
    return speeds.path(seed) if speeds is not None else (lambda t_s: 1.0)
