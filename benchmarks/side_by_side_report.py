"""`e3 bench side-by-side`, the pure parts: mixes, equal core budgets, the ideal speedup, the table
and the results document.

Equal budgets (docs/design.md §5): every system gets the same ``cores``, counted as
Triton instances x ONNX Runtime intra-op threads. E3's splits share them as
its plan says; each baseline is measured in every configuration within the
budget (:func:`baseline_configs`: every instances x threads = cores, and the
dynamic batcher with and without a queue delay) and keeps its best.

The ideal speedup of an exit distribution (docs/design.md §5) is the stock model's
per-input compute over the early-exit model's expected per-input compute with
exits, both from the latency profile at one batch size (:func:`ideal_speedup`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from e3.core.files import write_json_atomic
from e3.core.profile import LatencyProfile

__all__ = ["SYSTEMS", "BaselineConfig", "Row", "parse_mixes", "mix_label", "parse_batches", "baseline_configs",
           "ideal_speedup", "format_rows", "results_document", "write_results"]

SYSTEMS = ("e3", "stock", "ee")


@dataclass(frozen=True)
class BaselineConfig:
    """One way to spend a baseline's core budget."""
    instances: int
    threads: int              # ONNX Runtime intra-op threads per instance
    queue_delay_us: int       # its dynamic batcher's delay

    @property
    def cores(self) -> int:
        return self.instances * self.threads

    def describe(self) -> str:
        return f"{self.instances} inst x {self.threads} thr, delay {self.queue_delay_us} us"


@dataclass(frozen=True)
class Row:
    """One measured cell of the table."""
    mix: str              # "80:20"
    batch: int            # inputs per request
    system: str           # "e3" | "stock" | "ee"
    inputs_per_s: float
    p50_ms: float
    p99_ms: float
    accuracy: float       # share of answered inputs labelled correctly (nan without labels)
    config: str           # how the system spent its cores
    errors: int = 0
    predicted_inputs_per_s: float = float("nan")   # E3: the planner's prediction for its plan
    runs: tuple[float, ...] = ()                   # inputs/s of every measured run (the row is the median one)
    p99_interval_ms: tuple[float, float] | None = None   # 90% bootstrap interval of p99 (its run's requests)


def parse_mixes(text: str) -> list[tuple[int, int]]:
    """``"80-20,50-50"`` -> [(80, 20), (50, 50)] (easy:hard shares in percent, each pair summing to 100)."""
    out = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        try:
            easy, hard = (int(x) for x in part.replace(":", "-").split("-"))
        except ValueError:
            raise ValueError(f"a mix is EASY-HARD in percent, e.g. 80-20; got {part!r}") from None
        if easy < 0 or hard < 0 or easy + hard != 100:
            raise ValueError(f"mix {part!r}: the shares must be >= 0 and add up to 100")
        out.append((easy, hard))
    if not out:
        raise ValueError("give at least one mix, e.g. 80-20,50-50,20-80")
    return out


def mix_label(mix: tuple[int, int]) -> str:
    return f"{mix[0]}:{mix[1]}"


def parse_batches(text: str) -> list[int]:
    """``"1,8"`` -> [1, 8] (inputs per request, each >= 1)."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"batches are comma-separated integers, e.g. 1,8; got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise ValueError(f"batches must be integers >= 1, got {text!r}")
    return values


def baseline_configs(cores: int, delays_us: Sequence[int] = (0, 2000)) -> list[BaselineConfig]:
    """Every configuration of a single model within ``cores``: instances x threads = cores, each with
    every queue delay in ``delays_us``."""
    if cores < 1:
        raise ValueError(f"cores must be >= 1, got {cores}")
    return [BaselineConfig(i, cores // i, d) for i in range(1, cores + 1) if cores % i == 0 for d in delays_us]


def ideal_speedup(latency: LatencyProfile, reach: Sequence[float], batch: int, *, device: str = "cpu",
                  enabled_ramps: Sequence[int] | None = None) -> float:
    """Stock per-input compute over expected early-exit per-input compute (docs/design.md §5, "the limit").

    Stock: every block without ramps. Early exit: block k for the share ``reach[k-1]`` of inputs that
    get there, plus its ramp where enabled (default: every ramp the profile measured). Both at
    ``batch`` inputs per call, per input.
    """
    L = latency.num_blocks
    if len(reach) != L:
        raise ValueError(f"reach has {len(reach)} blocks, the profile {L}")
    ramps = set(latency.ramp_blocks() if enabled_ramps is None else enabled_ramps)
    stock = sum(latency.block(k, device, batch, with_ramp=False) for k in range(1, L + 1))
    ee = sum(reach[k - 1] * latency.block(k, device, batch, with_ramp=k in ramps) for k in range(1, L + 1))
    return stock / ee if ee > 0 else math.inf


def format_rows(rows: Sequence[Row], cores: int, ideal: dict[str, float]) -> str:
    """The side-by-side table: one line per (mix, batch, system), E3's ratio to the best baseline and
    its share of the ideal speedup, and the budget every system had."""
    header = ["mix", "batch", "system", "inputs/s", "predicted", "p50 ms", "p99 ms", "accuracy", "vs stock",
              "vs best", "of ideal", "config"]
    lines = []
    for (mix, batch), cell in _cells(rows).items():
        stock = cell.get("stock")
        best = max((cell[s].inputs_per_s for s in ("stock", "ee") if s in cell), default=float("nan"))
        for system in SYSTEMS:
            r = cell.get(system)
            if r is None:
                continue
            vs_stock = r.inputs_per_s / stock.inputs_per_s if stock and stock.inputs_per_s else float("nan")
            share = vs_stock / ideal[mix] if system == "e3" and ideal.get(mix) else float("nan")
            predicted = "" if math.isnan(r.predicted_inputs_per_s) else \
                f"{r.predicted_inputs_per_s:.0f} ({100 * (r.inputs_per_s / r.predicted_inputs_per_s - 1):+.0f}%)"
            lines.append([mix, str(batch), system, f"{r.inputs_per_s:.1f}", predicted, f"{r.p50_ms:.1f}", f"{r.p99_ms:.1f}",
                          "-" if math.isnan(r.accuracy) else f"{100 * r.accuracy:.1f}%",
                          _x(vs_stock), _x(r.inputs_per_s / best) if system == "e3" else "",
                          "" if math.isnan(share) else f"{100 * share:.0f}%", r.config])
    widths = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h) for i, h in enumerate(header)]
    fmt = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    ideal_text = ", ".join(f"{m}: {x:.2f}x" for m, x in ideal.items())
    return "\n".join([f"every system on {cores} cores (instances x threads); ideal speedup over stock {ideal_text}",
                      fmt(header), fmt(["-" * w for w in widths]), *map(fmt, lines)])


def _cells(rows: Sequence[Row]) -> dict[tuple[str, int], dict[str, Row]]:
    cells: dict[tuple[str, int], dict[str, Row]] = {}
    for r in rows:
        cells.setdefault((r.mix, r.batch), {})[r.system] = r
    return cells


def _x(v: float) -> str:
    return "-" if v is None or math.isnan(v) else f"{v:.2f}x"


def results_document(model: str, cores: int, ideal: dict[str, float], *, rows: Sequence[Row], **extra) -> dict:
    """The JSON document ``artifacts/results/side_by_side.json`` holds (``extra``: plans, commit, ...)."""
    def clean(v):
        if isinstance(v, tuple):
            return list(v)
        return None if isinstance(v, float) and not np.isfinite(v) else v
    return {"model": model, "cores": cores, "ideal_speedup": dict(ideal),
            "rows": [{k: clean(v) for k, v in asdict(r).items()} for r in rows], **extra}


def write_results(path: str | Path, document: dict) -> Path:
    write_json_atomic(path, document)
    return Path(path)

