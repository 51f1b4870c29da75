"""Plain-text tables of load results (what `e3 demo` and benchmarks print)."""

from __future__ import annotations

from e3.client.loadgen import LoadResult

__all__ = ["format_table", "exit_histogram"]


def exit_histogram(result: LoadResult) -> str:
    """``"1:35% 2:17% 4:48%"`` (ramp: share of inputs); ``"-"`` for a model without ramps."""
    total = sum(result.exit_counts.values())
    if not total or set(result.exit_counts) == {-1}:
        return "-"
    return " ".join(f"{k}:{100 * v / total:.0f}%" for k, v in sorted(result.exit_counts.items()))


def format_table(results: list[LoadResult], reference: str | None = None) -> str:
    """One row per model: throughput, latency percentiles, errors, exit histogram.

    ``reference`` names the model whose throughput the ``speedup`` column divides by.
    """
    base = next((r.throughput_ips for r in results if r.model == reference), None)
    header = ["model", "requests", "inputs/s", "p50 ms", "p99 ms", "errors"] + (["speedup"] if base else []) + \
        ["exit histogram (ramp:share)"]
    rows = []
    for r in results:
        row = [r.model, str(r.requests), f"{r.throughput_ips:.1f}", f"{r.percentile_ms(50):.1f}",
               f"{r.percentile_ms(99):.1f}", str(r.errors)]
        if base:
            row.append(f"{r.throughput_ips / base:.2f}x")
        rows.append(row + [exit_histogram(r)])
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])
