"""`e3 bench repeatability A B`: two side-by-side runs of the same configurations against each other, with the
simulator's bar: how far the machine itself moves between two benches.

Why: the simulator is held to goodput within 8% and p99 within 15% of a measured run (issue 42). That bar
means something only where the machine repeats itself within it: the same cell (inputs per request, system,
configuration), measured twice by the same code, must land within it too. On this 2-core machine it does
not: the three benches of 2026-11-28 03:05-03:51 (the same code and profile, 5 runs per cell) agreed with each
other within both bars in 14 of their 24 shared cells, pair by pair, while the simulator had 24 of the 36 cells
of their tables within both (docs/RESULTS.md). A simulator that matched one bench exactly would miss the next
by as much.

Glue only, but for :func:`compare` (pure, tested).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from e3.benchmarks.sim_validation import GOODPUT_TOLERANCE, P99_TOLERANCE

__all__ = ["Agreement", "compare", "run_repeatability"]


@dataclass(frozen=True)
class Agreement:
    cell: str                # "<mix> batch <b> <system> (<config>)"
    goodput_a: float         # inputs/s
    goodput_b: float
    p99_a_ms: float
    p99_b_ms: float

    @property
    def goodput_diff(self) -> float:
        """A over B, less 1."""
        return self.goodput_a / self.goodput_b - 1 if self.goodput_b > 0 else float("inf")

    @property
    def p99_diff(self) -> float:
        return self.p99_a_ms / self.p99_b_ms - 1 if self.p99_b_ms > 0 else float("inf")

    def within(self, goodput_tol: float = GOODPUT_TOLERANCE, p99_tol: float = P99_TOLERANCE) -> bool:
        return abs(self.goodput_diff) <= goodput_tol and abs(self.p99_diff) <= p99_tol


def _cells(doc: Mapping) -> dict[str, Mapping]:
    """Every measured cell of a side-by-side document (the table's and the forced configurations'), by name."""
    return {f"{r['mix']} batch {r['batch']} {r['system']} ({r['config']})": r
            for r in list(doc.get("rows") or ()) + list(doc.get("alternatives") or ())}


def compare(a: Mapping, b: Mapping) -> list[Agreement]:
    """The cells two side-by-side documents both measured (same mix, inputs per request, system and
    configuration), in ``a``'s order. Calibration runs are left out: they are short runs of another length."""
    theirs = _cells(b)
    return [Agreement(name, float(r["inputs_per_s"]), float(theirs[name]["inputs_per_s"]), float(r["p99_ms"]),
                      float(theirs[name]["p99_ms"]))
            for name, r in _cells(a).items() if name in theirs]


def run_repeatability(a: Path, b: Path, echo=print) -> list[Agreement]:
    """Print the cells ``a`` and ``b`` share, A against B, with the simulator's bar; returns them."""
    docs = []
    for path in (a, b):
        if not path.exists():
            raise ValueError(f"{path} does not exist: give two results files of `e3 bench` or `e3 bench side-by-side`")
        docs.append(json.loads(path.read_text()))
    if docs[0].get("model") != docs[1].get("model"):
        raise ValueError(f"{a.name} measured {docs[0].get('model')} and {b.name} {docs[1].get('model')}: "
                         "compare runs of one model")
    try:
        shared = compare(*docs)
    except (KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"{a.name} or {b.name} is not a results file of `e3 bench` (a cell lacks {err})") from None
    if not shared:
        raise ValueError(f"{a.name} and {b.name} share no cell (mix, inputs per request, system and configuration)")
    echo(f"A: {a} (commit {docs[0].get('commit', '?')}); B: {b} (commit {docs[1].get('commit', '?')})")
    echo("| cell | A inputs/s | B inputs/s | A / B | A p99 (ms) | B p99 (ms) | A / B |")
    echo("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for x in shared:
        g = f"{x.goodput_diff:+.1%}" if abs(x.goodput_diff) <= GOODPUT_TOLERANCE else f"**{x.goodput_diff:+.1%}**"
        p = f"{x.p99_diff:+.1%}" if abs(x.p99_diff) <= P99_TOLERANCE else f"**{x.p99_diff:+.1%}**"
        echo(f"| {x.cell} | {x.goodput_a:.1f} | {x.goodput_b:.1f} | {g} | {x.p99_a_ms:.1f} | {x.p99_b_ms:.1f} | {p} |")
    echo(f"{sum(x.within() for x in shared)} of {len(shared)} shared cells agree within the simulator's bar "
         f"(goodput {GOODPUT_TOLERANCE:.0%}, p99 {P99_TOLERANCE:.0%}); the machine's own repeatability bounds "
         "what a validation against either run can show")
    return shared
