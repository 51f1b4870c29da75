"""XScheduler (ExeGPT §5): the schedule with the highest throughput whose p99-length latency meets a bound.

Two searches over the same space, so that one checks the other:

* :func:`grid_search` evaluates every point;
* :func:`branch_and_bound` is Algorithm 1, which relies on each control variable moving throughput and
  latency monotonically (within tolerances).

Control variables (tensor parallelism is left out: this machine has no devices to split a layer over):

==========  ========================  =====================  =====================
schedule    variable                   throughput as it grows latency as it grows
==========  ========================  =====================  =====================
RRA         ``batch_size`` (B_E)       up                     up
RRA         ``decode_iters`` (N_D)     down                   down   (encoding frequency = 1 / N_D)
WAA         ``batch_size`` (B_E)       up                     up
WAA         ``micro_batches`` (B_m)    up                     down   (1..decode workers, simulator doc)
==========  ========================  =====================  =====================

Algorithm 1's ambiguities, and what we chose:

* **Directions.** The pseudo-code assumes both objectives grow with every variable (the top-right corner
  bounds throughput from above, the bottom-left bounds latency from below). Each :class:`Variable` declares
  its two directions instead, and a block's throughput bound is read at the corner that maximises throughput,
  its latency bound at the corner that minimises latency. With N_D (both fall) and B_m (throughput up, latency
  down) this is what makes the bounds valid.
* **Queue order.** "PriorityQueue sorted by lower bound" but ``popMax``: we pop the block with the highest
  throughput upper bound first (best-first), the usual branch-and-bound order.
* **Solved blocks.** With ``throughput_tol`` = 0, a block whose throughput-maximising corner meets the bound
  holds no better point: it updates the incumbent and is not split (line 16 of the pseudo-code, applied to
  every child; at the root this is the paper's "if the constraint is met at (b1, b2) it is optimal"). With a
  tolerance the corner is only trusted to within it: the block's best is taken to be at most
  corner x (1 + throughput_tol), so the block is split on while that could beat the incumbent. This is what
  lets the tolerance find an optimum where throughput is not monotonic (measured here: WAA's throughput peaks
  at a middle batch size on this CPU, ``docs/exegpt.md``).
* **Incumbent.** Every evaluated point that meets the bound may become the incumbent (the pseudo-code only
  looks at children's top-right corners); this never hurts and prunes earlier.
* **Tolerances.** ``throughput_tol`` and ``latency_tol`` are relative: a block is pruned when its throughput
  bound x (1 + throughput_tol) is below the incumbent (see "Solved blocks"), and dropped as infeasible when
  its latency bound exceeds the latency bound x (1 + latency_tol). Larger tolerances keep more blocks (more
  evaluations, safer where the simulator is not exactly monotonic); zero trusts monotonicity fully.
* **Split heuristic** (lines 7-10): the two mixed corners are evaluated; if the one at low x1 / high x2 (in
  the throughput orientation) is the better feasible one the block is split along x1, otherwise along x2; if
  neither meets the bound, along the longer side; a side of length one is never split.
* **Both schedules** are searched separately and the faster feasible answer wins (§5.1).
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass
from typing import Callable

from e3.generation.exegpt.simulator import Prediction, Workload, simulate

__all__ = ["Variable", "SearchSpace", "SearchResult", "rra_space", "waa_space", "grid_search",
           "branch_and_bound", "plan"]


@dataclass(frozen=True)
class Variable:
    """One control variable: its candidate values (increasing) and how throughput and latency move with it."""

    name: str
    values: tuple[int, ...]
    throughput_dir: int   # +1: throughput grows with the value; -1: it falls
    latency_dir: int      # +1: latency grows with the value; -1: it falls

    def __post_init__(self):
        if not self.values or any(b <= a for a, b in zip(self.values, self.values[1:])):
            raise ValueError(f"{self.name}: values must be non-empty and strictly increasing")
        if self.throughput_dir not in (1, -1) or self.latency_dir not in (1, -1):
            raise ValueError(f"{self.name}: directions must be +1 or -1")


@dataclass(frozen=True)
class SearchSpace:
    """A schedule and its two control variables (in the order of the simulator's config tuple)."""

    schedule: str
    variables: tuple[Variable, Variable]

    def size(self) -> int:
        return len(self.variables[0].values) * len(self.variables[1].values)


def rra_space(batch_sizes: tuple[int, ...], decode_iters: tuple[int, ...]) -> SearchSpace:
    return SearchSpace("rra", (Variable("batch_size", tuple(batch_sizes), 1, 1),
                               Variable("decode_iters", tuple(decode_iters), -1, -1)))


def waa_space(batch_sizes: tuple[int, ...], max_micro_batches: int) -> SearchSpace:
    return SearchSpace("waa", (Variable("batch_size", tuple(batch_sizes), 1, 1),
                               Variable("micro_batches", tuple(range(1, max_micro_batches + 1)), 1, -1)))


@dataclass(frozen=True)
class SearchResult:
    """The best feasible point found (``None`` if none meets the bound) and what finding it cost."""

    best: Prediction | None
    evaluations: int        # distinct points simulated
    seconds: float          # wall time of the search


class _Evaluator:
    """Simulates a point once and counts distinct evaluations."""

    def __init__(self, space: SearchSpace, fn: Callable[[tuple], Prediction]):
        self.space, self.fn, self.cache = space, fn, {}

    def __call__(self, idx: tuple[int, int]) -> Prediction:
        if idx not in self.cache:
            v0, v1 = self.space.variables
            self.cache[idx] = self.fn((v0.values[idx[0]], v1.values[idx[1]]))
        return self.cache[idx]


def _point_fn(workload: Workload, space: SearchSpace) -> Callable[[tuple], Prediction]:
    return lambda config: simulate(workload, space.schedule, config)


def grid_search(workload: Workload, space: SearchSpace, latency_bound_ms: float,
                *, evaluate: Callable[[tuple], Prediction] | None = None) -> SearchResult:
    """Every point of ``space``; the highest throughput meeting ``latency_bound_ms`` (ties: first found)."""
    t0 = time.perf_counter()
    ev = _Evaluator(space, evaluate or _point_fn(workload, space))
    best = None
    for i in range(len(space.variables[0].values)):
        for j in range(len(space.variables[1].values)):
            p = ev((i, j))
            if p.meets(latency_bound_ms) and (best is None or p.throughput_seq_s > best.throughput_seq_s):
                best = p
    return SearchResult(best, len(ev.cache), time.perf_counter() - t0)


def branch_and_bound(workload: Workload, space: SearchSpace, latency_bound_ms: float,
                     *, throughput_tol: float = 0.0, latency_tol: float = 0.0,
                     evaluate: Callable[[tuple], Prediction] | None = None) -> SearchResult:
    """Algorithm 1 over ``space`` (module doc for the choices made). ``evaluate`` replaces the simulator
    (tests use it to count or to feed non-monotonic functions)."""
    if throughput_tol < 0 or latency_tol < 0:
        raise ValueError("tolerances must be >= 0")
    t0 = time.perf_counter()
    ev = _Evaluator(space, evaluate or _point_fn(workload, space))
    v0, v1 = space.variables
    lat_cap = latency_bound_ms * (1.0 + latency_tol)
    best: list[Prediction | None] = [None]

    def consider(p: Prediction) -> bool:
        ok = p.meets(latency_bound_ms)
        if ok and (best[0] is None or p.throughput_seq_s > best[0].throughput_seq_s):
            best[0] = p
        return ok

    def pick(lo: int, hi: int, direction: int, maximise: bool) -> int:
        return hi if (direction > 0) == maximise else lo

    def thr_corner(b):  # b = (lo0, hi0, lo1, hi1), inclusive index ranges
        return (pick(b[0], b[1], v0.throughput_dir, True), pick(b[2], b[3], v1.throughput_dir, True))

    def lat_corner(b):
        return (pick(b[0], b[1], v0.latency_dir, False), pick(b[2], b[3], v1.latency_dir, False))

    def mixed_corners(b):
        # "top-left" (x1 at its low-throughput end, x2 at its high end) and "bottom-right"
        tl = (pick(b[0], b[1], v0.throughput_dir, False), pick(b[2], b[3], v1.throughput_dir, True))
        br = (pick(b[0], b[1], v0.throughput_dir, True), pick(b[2], b[3], v1.throughput_dir, False))
        return tl, br

    heap: list = []
    counter = 0

    def offer(b) -> None:
        nonlocal counter
        up = ev(thr_corner(b))
        if consider(up) and throughput_tol == 0:
            return                      # its best point meets the bound: solved
        if ev(lat_corner(b)).latency_ms > lat_cap:
            return                      # nothing in it can meet the bound
        if best[0] is not None and up.throughput_seq_s * (1 + throughput_tol) < best[0].throughput_seq_s:
            return
        if b[0] == b[1] and b[2] == b[3]:
            return                      # a single point, already judged
        counter += 1
        heapq.heappush(heap, (-up.throughput_seq_s, counter, b))

    offer((0, len(v0.values) - 1, 0, len(v1.values) - 1))
    while heap:
        neg_up, _, b = heapq.heappop(heap)
        if best[0] is not None and -neg_up * (1 + throughput_tol) < best[0].throughput_seq_s:
            continue                    # pruned since it was queued
        tl, br = mixed_corners(b)
        p_tl, p_br = ev(tl), ev(br)
        ok_tl, ok_br = consider(p_tl), consider(p_br)
        len0, len1 = b[1] - b[0] + 1, b[3] - b[2] + 1
        if ok_tl and (not ok_br or p_tl.throughput_seq_s >= p_br.throughput_seq_s):
            axis = 0
        elif ok_br:
            axis = 1
        else:
            axis = 0 if len0 >= len1 else 1
        if (len0, len1)[axis] == 1:
            axis = 1 - axis
        if axis == 0:
            mid = (b[0] + b[1]) // 2
            children = ((b[0], mid, b[2], b[3]), (mid + 1, b[1], b[2], b[3]))
        else:
            mid = (b[2] + b[3]) // 2
            children = ((b[0], b[1], b[2], mid), (b[0], b[1], mid + 1, b[3]))
        for c in children:
            offer(c)
    return SearchResult(best[0], len(ev.cache), time.perf_counter() - t0)


def plan(workload: Workload, latency_bound_ms: float, batch_sizes: tuple[int, ...],
         *, decode_iters: tuple[int, ...], throughput_tol: float = 0.0, latency_tol: float = 0.0,
         method: str = "bnb") -> dict[str, SearchResult]:
    """Search RRA (and WAA where ``workload.workers`` >= 2) with ``method`` ("bnb" or "grid").

    Returns ``{"rra": ..., "waa": ..., "best": ...}``; ``best`` is the faster feasible of the two (its
    ``evaluations`` and ``seconds`` are the sums of both searches)."""
    if method not in ("bnb", "grid"):
        raise ValueError(f"unknown method {method!r}; choose 'bnb' or 'grid'")
    spaces = [rra_space(batch_sizes, decode_iters)]
    if workload.workers >= 2:
        spaces.append(waa_space(batch_sizes, workload.workers - 1))
    out: dict[str, SearchResult] = {}
    for s in spaces:
        if method == "grid":
            out[s.schedule] = grid_search(workload, s, latency_bound_ms)
        else:
            out[s.schedule] = branch_and_bound(workload, s, latency_bound_ms, throughput_tol=throughput_tol, latency_tol=latency_tol)
    feasible = [r.best for r in out.values() if r.best is not None]
    best = max(feasible, key=lambda p: p.throughput_seq_s) if feasible else None
    out["best"] = SearchResult(best, sum(r.evaluations for r in out.values()),
                               sum(r.seconds for r in out.values()))
    return out
