"""`e3 bench machine-speed`: how this machine's speed moves while nothing else runs, read from the model's
stock graph.

The stock graph (every block, no ramp) at ``batch`` rows on 1 intra-op thread, timed back to back in readings
of ``calls`` calls for ``seconds``: each reading's 25th percentile and median (ms), the cores other processes
used meanwhile and the steal time the machine's counters report. :func:`spells` splits the readings into the
machine's fast and slow spells.

Why: the side-by-side bench and the profile both sample a machine whose speed is not constant. The 2-core VM
these benches run on moved between two speeds 35% apart in spells of 5-40 s, with nothing else running and no
steal time counted (docs/data/cpu/machine_speed_trace_20261128.json, made with this timing before the
command existed); that spread, not the simulator, set how many runs a cell needs
(:func:`e3.benchmarks.side_by_side.run_evaluation`) and how the profile measures the second thread's gain
(:func:`e3.profiling.profiler.second_thread_gain`). Run it before trusting a bench on a new machine.

Glue only, but for :func:`spells` (pure, tested).
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from e3.core.files import write_json_atomic
from e3.paths import artifacts_dir
from e3.profiling.host_profile import ForeignLoad, cpu_jiffies
from e3.profiling.profiler import time_calls

__all__ = ["SpeedSettings", "Spells", "spells", "trace", "run_machine_speed", "default_speed_path"]


@dataclass(frozen=True)
class SpeedSettings:
    model: str = "bert-ee"
    seconds: float = 150.0     # how long to trace
    batch: int = 8             # rows per call of the stock graph
    calls: int = 8             # calls per reading
    out: Path | None = None    # default artifacts/results/machine_speed.json

    def __post_init__(self) -> None:
        if not self.seconds > 0 or self.batch < 1 or self.calls < 1:
            raise ValueError(f"--seconds must be > 0 and --batch, --calls >= 1; got {self.seconds}, {self.batch}, "
                             f"{self.calls}")


def default_speed_path() -> Path:
    return artifacts_dir() / "results" / "machine_speed.json"


@dataclass(frozen=True)
class Spells:
    fast_ms: float              # the median reading of the fast spells
    slow_ms: float              # ... of the slow ones
    threshold_ms: float         # a reading above this is slow: halfway between the 10th and 90th percentiles
    slow_share: float           # of the readings
    fast_spells_s: list[float]  # each spell's length (s), in order
    slow_spells_s: list[float]

    def to_dict(self) -> dict:
        return {"fast_ms": round(self.fast_ms, 2), "slow_ms": round(self.slow_ms, 2),
                "ratio": round(self.slow_ms / self.fast_ms, 3) if self.fast_ms > 0 else None,
                "threshold_ms": round(self.threshold_ms, 2), "slow_share": round(self.slow_share, 3),
                "fast_spells_s": [round(s, 1) for s in self.fast_spells_s],
                "slow_spells_s": [round(s, 1) for s in self.slow_spells_s]}


def spells(t_s: Sequence[float], median_ms: Sequence[float]) -> Spells:
    """The readings (``t_s``: when each ended, ``median_ms``: its median call) split into fast and slow spells.

    Decision: a reading is slow above halfway between the 10th and the 90th percentile of the readings, not
    above their median: on a machine of two speeds the median falls inside whichever level holds more of the
    trace and would split it. A spell lasts from the end of the reading before it to the end of its last
    reading. On one speed (the two percentiles within 5% of each other) every reading is fast."""
    t, ms = np.asarray(t_s, dtype=float), np.asarray(median_ms, dtype=float)
    if t.size == 0 or t.size != ms.size:
        raise ValueError(f"one time per reading: got {t.size} times and {ms.size} readings")
    low, high = np.percentile(ms, [10, 90])
    threshold = (low + high) / 2 if high > 1.05 * low else float("inf")
    slow = ms > threshold
    lengths: dict[bool, list[float]] = {False: [], True: []}
    start = 0.0
    for i in range(t.size):
        if i + 1 == t.size or slow[i + 1] != slow[i]:
            lengths[bool(slow[i])].append(float(t[i] - start))
            start = float(t[i])
    return Spells(fast_ms=float(np.median(ms[~slow])), slow_ms=float(np.median(ms[slow])) if slow.any() else
                  float(np.median(ms[~slow])), threshold_ms=float(threshold), slow_share=float(slow.mean()),
                  fast_spells_s=lengths[False], slow_spells_s=lengths[True])


def _steal() -> int | None:
    """The steal time (clock ticks) the machine's counters report since boot; None where unreadable."""
    counters = cpu_jiffies()
    return None if counters is None else counters[7]


def trace(run: Callable[[], None], seconds: float, calls: int, progress=None) -> list[list[float]]:
    """``run()`` timed in readings of ``calls`` calls for ``seconds`` (:func:`e3.profiling.profiler.time_calls`,
    one warm-up call first): [[t_s, p25_ms, median_ms, steal ticks meanwhile (-1 where unreadable)] per
    reading]."""
    run()   # warm: the first call allocates
    out = []
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        steal0 = _steal()
        ms = time_calls(run, calls, 0)
        steal1 = _steal()
        out.append([round(time.perf_counter() - start, 2), round(float(np.percentile(ms, 25)), 2),
                    round(float(np.median(ms)), 2),
                    steal1 - steal0 if steal0 is not None and steal1 is not None else -1])
        if progress is not None:
            progress(out[-1])
    return out


def run_machine_speed(settings: SpeedSettings = SpeedSettings(), echo=print) -> dict:
    """Trace the machine's speed (module docstring); writes and returns the document."""
    # deferred: torch (the model, its export) and ONNX Runtime load only when the trace runs
    from tqdm import tqdm
    from e3.models.zoo import resolve_model
    from e3.profiling.host_profile import stock_runner

    model = resolve_model(settings.model)
    meter = ForeignLoad(None)
    with tempfile.TemporaryDirectory(prefix="e3-speed-") as tmp, \
            tqdm(total=int(settings.seconds), desc="machine speed", unit="s") as bar:
        once = stock_runner(model, workdir=Path(tmp))

        def progress(reading):
            bar.update(max(0, int(reading[0]) - bar.n))
        meter.start()
        readings = trace(lambda: once(settings.batch), settings.seconds, settings.calls, progress)
        foreign = meter.stop()
    split = spells([r[0] for r in readings], [r[2] for r in readings])
    doc = {"what": f"the stock graph of {settings.model} at {settings.batch} rows on 1 intra-op thread "
                   f"(e3.profiling.host_profile.stock_runner), {settings.calls} calls per reading, the 25th "
                   "percentile and the median of each reading (ms); steal: jiffies of steal time /proc/stat "
                   "counted meanwhile (-1: unreadable)",
           "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "foreign_cores": round(foreign, 3),
           "columns": ["t_s", "p25_ms", "median_ms", "steal_jiffies"], "readings": readings,
           "spells": split.to_dict()}
    out = settings.out or default_speed_path()
    write_json_atomic(out, doc)
    d = split.to_dict()
    echo(f"{len(readings)} readings over {settings.seconds:.0f} s; others used {foreign:.2f} cores meanwhile")
    echo(f"fast {d['fast_ms']} ms, slow {d['slow_ms']} ms (x{d['ratio']}), slow {d['slow_share']:.0%} of the time; "
         f"spells (s): fast {d['fast_spells_s']}, slow {d['slow_spells_s']}")
    echo(f"wrote {out}")
    return doc
