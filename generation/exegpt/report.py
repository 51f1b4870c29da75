"""The tables ``e3 plan-generate`` prints: branch-and-bound against the grid per latency bound, and the
schedule chosen per bound (the paper's Table 6 analogue). Pure."""

from __future__ import annotations

import math
from dataclasses import dataclass

from e3.generation.exegpt.search import SearchResult, plan
from e3.generation.exegpt.simulator import Prediction, Workload, simulate

__all__ = ["PlanRow", "plan_rows", "default_bounds_ms", "format_search_table", "format_schedule_table"]


@dataclass(frozen=True)
class PlanRow:
    """One latency bound: what each search found and what it cost."""

    bound_ms: float
    bnb: SearchResult     # best over RRA and WAA (evaluations and seconds summed)
    grid: SearchResult
    tolerance: float = 1e-3   # relative throughput within which B&B's optimum counts as the grid's

    def same_optimum(self) -> bool:
        a, b = self.bnb.best, self.grid.best
        if a is None or b is None:
            return a is None and b is None
        return a.throughput_seq_s >= b.throughput_seq_s * (1 - self.tolerance)


def default_bounds_ms(workload: Workload, batch_sizes: tuple[int, ...], decode_iters: tuple[int, ...],
                      *, factors: tuple[float, ...] = (1.2, 2.0, 4.0, 8.0)) -> tuple[float, ...]:
    """Bounds relative to the lowest p99-length latency any schedule of the space reaches (it is at the
    smallest batch size), plus no bound (inf)."""
    b = batch_sizes[0]
    candidates = [simulate(workload, "rra", (b, nd)) for nd in decode_iters]
    if workload.workers >= 2:
        candidates += [simulate(workload, "waa", (b, bm)) for bm in range(1, workload.workers)]
    floor = min(p.latency_ms for p in candidates)
    return tuple(round(floor * f, 1) for f in factors) + (math.inf,)


def plan_rows(workload: Workload, bounds_ms: tuple[float, ...], batch_sizes: tuple[int, ...],
              *, decode_iters: tuple[int, ...], throughput_tol: float = 0.0,
              latency_tol: float = 0.0) -> list[PlanRow]:
    """Both searches at every bound."""
    rows = []
    for bound in bounds_ms:
        bnb = plan(workload, bound, batch_sizes, decode_iters=decode_iters, throughput_tol=throughput_tol, latency_tol=latency_tol, method="bnb")["best"]
        grid = plan(workload, bound, batch_sizes, decode_iters=decode_iters, method="grid")["best"]
        rows.append(PlanRow(bound, bnb, grid, max(1e-3, throughput_tol)))
    return rows


def _config(p: Prediction | None) -> str:
    if p is None:
        return "none meets it"
    names = ("B_E", "N_D") if p.schedule == "rra" else ("B_E", "B_m")
    return f"{p.schedule.upper()} " + ", ".join(f"{n}={v}" for n, v in zip(names, p.config))


def _bound(b: float) -> str:
    return "inf" if math.isinf(b) else f"{b:,.0f}"


def format_search_table(rows: list[PlanRow]) -> str:
    """Markdown: per bound, B&B's and the grid's optimum, evaluations and time."""
    out = ["| bound (ms) | B&B optimum | seq/s | evals | ms | grid optimum | seq/s | evals | ms | within tol |",
           "|---:|---|---:|---:|---:|---|---:|---:|---:|:-:|"]
    for r in rows:
        b, g = r.bnb, r.grid
        out.append(f"| {_bound(r.bound_ms)} | {_config(b.best)} | "
                   f"{b.best.throughput_seq_s if b.best else 0:.2f} | {b.evaluations} | {b.seconds * 1000:.1f} | "
                   f"{_config(g.best)} | {g.best.throughput_seq_s if g.best else 0:.2f} | {g.evaluations} | "
                   f"{g.seconds * 1000:.1f} | {'yes' if r.same_optimum() else 'NO'} |")
    return "\n".join(out)


def format_schedule_table(rows: list[PlanRow]) -> str:
    """Markdown, the Table 6 analogue: per bound, the schedule B&B chose and its predicted figures."""
    out = ["| bound (ms) | schedule | control variables | tokens/s | seq/s | p99-length latency (ms) |",
           "|---:|---|---|---:|---:|---:|"]
    for r in rows:
        p = r.bnb.best
        if p is None:
            out.append(f"| {_bound(r.bound_ms)} | none | - | - | - | - |")
            continue
        out.append(f"| {_bound(r.bound_ms)} | {p.schedule.upper()} | {_config(p).split(' ', 1)[1]} | "
                   f"{p.throughput_tok_s:.1f} | {p.throughput_seq_s:.2f} | {p.latency_ms:,.0f} |")
    return "\n".join(out)
