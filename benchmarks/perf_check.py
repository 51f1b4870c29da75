"""perf_analyzer against the load generator (`e3 bench perf`, and a step of `e3 bench`): the pure parts.

Users point Triton's own ``perf_analyzer`` at whatever we serve; its figure and the
project's load generator (:func:`e3.client.loadgen.closed_loop`) must agree, or one of
them measures something else. The check runs both against E3's front door for model
inputs (``<m>_router``) on one server, at the same concurrency and inputs per request,
with the same inputs: perf_analyzer reads them from a JSON file written from the
workload (one "step" per input; a request of ``b`` inputs takes ``b`` consecutive
steps, which is how perf_analyzer batches real data), so both send the same easy:hard
mix and the router sees the same exits. Random or zero inputs would not: every row of
zeros exits at the same ramp.

Decisions: the runs alternate (load generator, perf_analyzer, ...) and each side's
median is compared, since this shared machine drifts by +-10% between runs;
perf_analyzer measures ``windows`` windows of ``window_requests`` requests after its own
warm-up with its stability check off (``--stability-percentage 999``: on a loaded
machine it would otherwise never settle) and reports their mean; the load generator's
figure is taken over its steady part the same way (:func:`steady_ips`: answers between
the first answer and the last send, not the start, when the pipeline fills, nor the
drain after the last send, when fewer than ``concurrency`` requests are in flight; its
whole-run figure is kept beside it). perf_analyzer's ``Inferences/Second`` counts inputs
(batch x requests).
"""

from __future__ import annotations

import csv
import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from e3.core.files import write_atomic

__all__ = ["TOLERANCE", "PerfCheck", "perf_input_document", "perf_arguments", "read_perf_csv", "agreement",
           "format_check", "write_input_data", "steady_ips"]

TOLERANCE = 0.10   # |perf_analyzer / load generator - 1| the check allows (the bar)


@dataclass
class PerfCheck:
    """One comparison: both tools' runs (inputs/s) at one setting, and the verdict."""
    model: str                        # the served model both tools loaded (e.g. "bert_ee_router")
    batch: int                        # inputs per request
    concurrency: int                  # requests in flight (closed-loop clients / perf_analyzer's concurrency)
    loadgen_ips: list[float] = field(default_factory=list)    # every load-generator run, steady part (inputs/s)
    loadgen_whole_ips: list[float] = field(default_factory=list)   # the same runs over their whole wall time
    perf_ips: list[float] = field(default_factory=list)       # every perf_analyzer run (inputs/s)
    command: str = ""                 # the perf_analyzer command line (as `e3 perf -- ...`)
    tolerance: float = TOLERANCE

    @property
    def loadgen_median(self) -> float:
        return float(statistics.median(self.loadgen_ips)) if self.loadgen_ips else float("nan")

    @property
    def perf_median(self) -> float:
        return float(statistics.median(self.perf_ips)) if self.perf_ips else float("nan")

    @property
    def difference(self) -> float:
        """perf_analyzer's median over the load generator's, minus 1 (nan without both)."""
        return agreement(self.perf_median, self.loadgen_median)

    @property
    def agrees(self) -> bool:
        return bool(np.isfinite(self.difference) and abs(self.difference) <= self.tolerance)

    def to_dict(self) -> dict:
        return {**asdict(self), "loadgen_median_ips": self.loadgen_median, "perf_median_ips": self.perf_median,
                "difference": self.difference, "agrees": self.agrees}


def perf_input_document(pool: Mapping[str, np.ndarray], rows: int | None = None) -> dict:
    """perf_analyzer's ``--input-data`` JSON for the first ``rows`` inputs of a workload ``pool`` (input name ->
    [n, ...] array; all rows when None): one step per input, each tensor without its batch dimension."""
    if not pool:
        raise ValueError("the workload has no inputs")
    n = next(iter(pool.values())).shape[0]
    if any(x.shape[0] != n for x in pool.values()):
        raise ValueError("the workload's inputs disagree on the number of rows")
    rows = n if rows is None else min(int(rows), n)
    if rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows}")
    return {"data": [{name: {"content": np.asarray(x[i]).reshape(-1).tolist(), "shape": list(x.shape[1:])}
                      for name, x in pool.items()} for i in range(rows)]}


def perf_arguments(url: str, model: str, batch: int, *, concurrency: int, input_data: str | Path,
                   csv_path: str | Path | None = None, protocol: str = "http", window_requests: int = 50,
                   windows: int = 3) -> list[str]:
    """perf_analyzer's arguments for one measurement (what follows ``e3 perf --``): ``concurrency`` requests
    of ``batch`` inputs in flight, measured over ``windows`` windows of ``window_requests`` requests each,
    the stability check off (module docstring); ``csv_path``: where it writes its CSV report."""
    if batch < 1 or concurrency < 1 or window_requests < 1 or windows < 1:
        raise ValueError("batch, concurrency, window_requests and windows must be >= 1")
    args = ["-m", model, "-u", url, "-i", protocol, "-b", str(batch), "--input-data", str(input_data),
            "--concurrency-range", str(concurrency), "--measurement-mode", "count_windows",
            "--measurement-request-count", str(window_requests), "--stability-percentage", "999",
            "--max-trials", str(windows)]
    if csv_path is not None:
        args += ["-f", str(csv_path)]
    return args


def read_perf_csv(path: str | Path) -> float:
    """The ``Inferences/Second`` (inputs/s) of perf_analyzer's CSV report (its ``-f`` file; one concurrency).
    Raises ValueError naming the file when it holds no such figure."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    for row in rows:
        value = row.get("Inferences/Second")
        if value not in (None, ""):
            return float(value)
    raise ValueError(f"{path} holds no Inferences/Second row (perf_analyzer's CSV report expected)")


def steady_ips(records: Sequence) -> float:
    """Inputs/s of a closed-loop run over its steady part: the inputs of the requests answered after the first
    answer and by the last send, over that span (records: :class:`e3.client.loadgen.RequestRecord`, times in
    s; failed requests count nothing). nan when the span is empty."""
    ok = [r for r in records if r.error is None]
    if not ok:
        return float("nan")
    start = min(r.done_s for r in ok)
    end = max(r.sent_s for r in records)
    if end <= start:
        return float("nan")
    inside = sum(r.inputs for r in ok if start < r.done_s <= end)
    return inside / (end - start)


def agreement(perf_ips: float, loadgen_ips: float) -> float:
    """``perf_ips / loadgen_ips - 1``; nan when the load generator measured nothing."""
    return perf_ips / loadgen_ips - 1.0 if loadgen_ips > 0 and np.isfinite(perf_ips) else float("nan")


def format_check(checks: Sequence[PerfCheck]) -> str:
    """The markdown table of the checks (one line per setting)."""
    out = ["| model | inputs/request | concurrency | load generator, steady part (inputs/s, runs) | load generator, "
           "whole runs | perf_analyzer (inputs/s, runs) | perf_analyzer / load generator | within the bar |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    runs = (lambda xs: ", ".join(f"{x:,.1f}" for x in xs))
    for c in checks:
        whole = f"{statistics.median(c.loadgen_whole_ips):,.1f}" if c.loadgen_whole_ips else "-"
        out.append(f"| {c.model} | {c.batch} | {c.concurrency} | {c.loadgen_median:,.1f} ({runs(c.loadgen_ips)}) | "
                   f"{whole} | {c.perf_median:,.1f} ({runs(c.perf_ips)}) | {c.difference:+.1%} | "
                   f"{'yes' if c.agrees else '**no**'} (±{c.tolerance:.0%}) |")
    return "\n".join(out)


def write_input_data(pool: Mapping[str, np.ndarray], path: str | Path, rows: int | None = None) -> Path:
    """:func:`perf_input_document` written to ``path`` (atomically); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(perf_input_document(pool, rows)))
    return path
