"""Plain-text tables of load results (what `e3 demo`, `e3 load` and benchmarks print)."""

from __future__ import annotations

import math
from typing import Mapping

from e3.client.loadgen import LoadResult

__all__ = ["format_table", "exit_histogram", "exit_comparison"]


def exit_histogram(result: LoadResult) -> str:
    """``"1:35% 2:17% 4:48%"`` (ramp: share of inputs); ``"-"`` for a model without ramps."""
    total = sum(result.exit_counts.values())
    if not total or set(result.exit_counts) == {-1}:
        return "-"
    return " ".join(f"{k}:{100 * v / total:.0f}%" for k, v in sorted(result.exit_counts.items()))


def exit_comparison(result: LoadResult) -> str:
    """The served exits against a workload's reference exits, and why they may differ: the reference was recorded
    with every ramp of the model on (``e3 workload``), and a plan that disables ramps (the exit-wrapper) moves
    those inputs' exits to a later ramp by design, while the labels are what to compare then."""
    ramps = ("every ramp of the model (the workload does not list them)" if result.reference_ramps is None
             else f"ramps {', '.join(map(str, result.reference_ramps))} enabled")
    return (f"exit ramps differing from the workload's reference: {result.exit_mismatches} of {result.inputs} "
            f"(served exits {exit_histogram(result)}). The reference was recorded with {ramps}; a plan that "
            "disables ramps moves the exits of inputs that would leave there to later ramps, so a served plan "
            "with fewer ramps differs by design: compare its enabled ramps (e3_repository.json) and the accuracy")


def format_table(results: list[LoadResult], reference: str | None = None,
                 budgets: Mapping[str, str] | None = None) -> str:
    """One row per result: throughput, latency percentiles, errors, exit histogram.

    ``reference`` names the model whose throughput the ``speedup`` column
    divides by. When any result has an SLO, goodput (inputs/s answered within
    it) and SLO misses (inputs answered late) are shown; when any has labels
    (workload replays), accuracy. A result of one workload phase is named
    ``model [mix]``. ``budgets`` (served model -> text) adds a ``cores`` column: the compute each
    system was given, so that a comparison shows it ran at an equal budget.
    """
    base = next((r.throughput_ips for r in results if r.model == reference and r.phase is None), None)
    slo = any(r.slo_ms is not None for r in results)
    acc = any(r.labelled for r in results)
    header = ["model"] + (["cores"] if budgets else []) + ["requests", "inputs/s"] + (["goodput/s", "SLO ms", "SLO misses"] if slo else []) + \
        ["p50 ms", "p99 ms", "errors"] + (["accuracy"] if acc else []) + (["speedup"] if base else []) + \
        ["exit histogram (ramp:share)"]
    rows = []
    for r in results:
        row = [r.model + (f" [{r.phase}]" if r.phase else "")] + ([budgets.get(r.model, "-")] if budgets else []) + \
            [str(r.requests), f"{r.throughput_ips:.1f}"]
        if slo:
            row += [f"{r.goodput_ips:.1f}", f"{r.slo_ms:g}" if r.slo_ms is not None else "-", str(r.slo_misses)]
        row += [f"{r.percentile_ms(50):.1f}", f"{r.percentile_ms(99):.1f}", str(r.errors)]
        if acc:
            row.append("-" if math.isnan(r.accuracy) else f"{100 * r.accuracy:.1f}%")
        if base:
            row.append(f"{r.throughput_ips / base:.2f}x")
        rows.append(row + [exit_histogram(r)])
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])
