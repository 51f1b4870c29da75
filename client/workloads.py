"""Workload files (written by ``e3 workload``) read on the client side.

A workload is ``<name>.npz`` (the model inputs, named like the model's inputs,
plus ``exit_ramp``, ``label`` and ``hard`` per input, in arrival order) and
``<name>.json`` (metadata: input names, nominal ``rate_rps`` in inputs/s, and
the phase table: ``mix``, ``start_index``, ``count``, ``start_s``). The file
format is the exporter's (:mod:`e3.models.workload`); this reader stays free of
``e3.export`` so that a load generator needs neither torch nor the zoo.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

__all__ = ["Phase", "Workload", "load_workload", "phase_index"]


@dataclass(frozen=True)
class Phase:
    mix: str            # e.g. "80:20" (easy:hard)
    start_index: int    # first input of the phase (arrival order)
    count: int          # inputs in the phase
    start_s: float = 0.0  # start at the workload's nominal input rate (seconds)

    @property
    def stop_index(self) -> int:
        return self.start_index + self.count


@dataclass
class Workload:
    name: str                              # file stem, e.g. "stream"
    inputs: dict[str, np.ndarray]          # model input name -> [N, ...] array, arrival order
    phases: list[Phase]                    # at least one; covers inputs [0, N)
    exit_ramp: np.ndarray | None = None    # [N] int: the reference model's exit ramp per input
    label: np.ndarray | None = None        # [N] int: ground-truth label per input
    hard: np.ndarray | None = None         # [N] bool: the input is in the hard bin
    rate_rps: float | None = None          # nominal arrival rate (inputs/s) the phase times assume
    meta: dict = field(default_factory=dict)  # the rest of the JSON metadata

    @property
    def size(self) -> int:
        return len(next(iter(self.inputs.values())))


def load_workload(path: str | Path) -> Workload:
    """Read ``<name>.npz`` + ``<name>.json`` (either path may be given).

    A workload without a JSON file (or without phases in it) is one phase
    ``"all"``; then every array of the npz that is not ``exit_ramp``,
    ``label`` or ``hard`` is a model input.
    """
    path = Path(path)
    npz, js = path.with_suffix(".npz"), path.with_suffix(".json")
    if not npz.exists():
        raise ValueError(f"workload {npz} does not exist; write one with `e3 workload MODEL`")
    meta = json.loads(js.read_text()) if js.exists() else {}
    extra = ("exit_ramp", "label", "hard")
    with np.load(npz) as data:
        names = meta.get("inputs") or [n for n in data.files if n not in extra]
        missing = [n for n in names if n not in data.files]
        if missing:
            raise ValueError(f"workload {npz} lacks input array(s) {', '.join(missing)} named in {js.name}")
        inputs = {n: data[n] for n in names}
        known = {n: data[n] for n in extra if n in data.files}
    size = len(next(iter(inputs.values())))
    phases = [Phase(p["mix"], int(p["start_index"]), int(p["count"]), float(p.get("start_s", 0.0)))
              for p in meta.get("phases", [])] or [Phase("all", 0, size)]
    covered = sum(p.count for p in phases)
    if covered != size:
        raise ValueError(f"workload {npz}: phases cover {covered} inputs, the file holds {size}")
    rest = {k: v for k, v in meta.items() if k not in ("inputs", "phases", "exit_ramp")}
    return Workload(npz.stem, inputs, phases, known.get("exit_ramp"), known.get("label"), known.get("hard"),
                    meta.get("rate_rps"), rest)


def phase_index(first_rows: np.ndarray, phases: list[Phase]) -> np.ndarray:
    """Phase of each request, by its first input's row (-1 where no phase holds it).

    first_rows: [R] int, the row of the first input of every request.
    """
    first_rows = np.asarray(first_rows)
    out = np.full(first_rows.shape, -1, dtype=np.int64)
    for j, p in enumerate(phases):
        out[(first_rows >= p.start_index) & (first_rows < p.stop_index)] = j
    return out
