"""Elastic admission batching (E²bird, TPDS), pure: which idle workers take which staged inputs.

E²bird stages every input as it arrives (its "memory pool") and keeps a pool
of *workers*, each running the same model (one copy of the weights) at one
fixed batch granularity, a power of two. A scheduler hands the staged inputs,
oldest first, to idle workers whose batch fits, so that nothing waits for a
batch to fill at low load and several batches run at once at high load. This
module decides; :mod:`e3.serving.ebird.engine` runs it and :mod:`e3.serving.ebird.model` is the Triton model.

* **N-Ebird** (Algorithm 1): the engine is fixed (default ``[1, 1, 2, 4, 8,
  16]`` for ``MaxBS = 32``). With ``R = min(N, MaxInf - CurInf)`` (staged
  inputs, and room under the cap on inputs in flight), idle workers are taken
  largest first while their batch fits in ``R``.
* **E-Ebird** (Algorithm 2): an offline profile gives, for every total batch
  ``TotalBS`` (4, 8, 16, 32), the set of workers that ran it with the lowest
  mean latency; the engine holds the union of those sets plus one worker of 1
  and one of 2 (the paper keeps them for very low load). Online, the load
  (``MemState``: inputs staged, plus those in flight) picks the smallest
  ``TotalBS`` that covers it (the largest profiled one above that), and only
  that configuration's workers may be launched; the workers of 1 and 2 only
  at the lowest profiled load (below it the paper profiles nothing).

Decisions where the paper is silent or wrong, written down:

* **The loop defect.** Algorithm 1 (and 2) never advance ``Worker`` after
  scheduling it: line 11 removes it from ``Q`` and the loop tests the same,
  now running, worker again (an endless loop, or the same worker launched
  twice with one batch of inputs each). Here the next candidate after a launch
  is the largest idle worker that still fits in what is left of ``R``.
* **Order of Q.** The paper keeps idle workers in a red-black tree by batch
  size and its Fig. 10 takes the worker of 4 for 4 staged inputs: largest
  first, which also means any ``R`` is covered by the power-of-two sizes with
  the fewest launches.
* **MaxInf.** The cap on inputs in flight is ``MaxBS``, the largest batch one
  worker may run within the QoS target (:func:`max_batch_for_qos`): under the
  paper's equal-sharing hypothesis, workers summing to ``MaxBS`` together run
  as fast as one batch of ``MaxBS``.
* **The low-load workers.** The paper keeps a worker of 1 and one of 2 "to
  support the extremely low load"; they join the configuration only at the
  lowest profiled ``TotalBS``. Earlier they could launch at any load: at high
  load a batch of 1 or 2 then took one of the few worker processes while a
  configured worker's batch was filling (measured on resnet-ee in a closed
  loop: 444 of 615 batches were of 1 or 2 inputs). One guard keeps the
  no-waiting promise: when no worker runs and no configured worker fits what
  is staged, the largest idle worker of the engine that fits takes it.
* **Which inputs.** Workers take staged inputs in arrival order; one request's
  rows may go to several workers, and the request is answered when its last
  row is done.
* **Slots.** A worker is a role (a batch granularity), not a process: the
  stage runs every launched batch on one of ``slots`` worker processes (Triton
  instances of one intra-op thread each, :mod:`e3.serving.ebird.host_ops`). At most
  ``slots`` workers run at once; the paper runs every worker of a set on its
  own CUDA stream of one GPU, whose spare parallelism a CPU of ``slots`` cores
  does not have: a launch beyond the slots would only wait in a queue, with
  its batch size fixed while fewer inputs were staged. ``slots=None`` (the
  paper) leaves concurrency to the engine.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

__all__ = ["NAIVE_ENGINE", "PROFILED_TOTALS", "ElasticPolicy", "NEbird", "EEbird", "worker_sets", "naive_engine", "max_inflight_for_qos",
           "best_worker_sets", "engine_for", "max_batch_for_qos", "make_policy", "POLICIES"]

NAIVE_ENGINE = (1, 1, 2, 4, 8, 16)      # N-Ebird's engine for MaxBS = 32 (paper §7.2.1)
PROFILED_TOTALS = (4, 8, 16, 32)        # E-Ebird's offline loads TotalBS (paper §7.3.2)
LOW_LOAD_WORKERS = (1, 2)               # E-Ebird keeps these for very low load (paper §7.3.2)


@dataclass
class ElasticPolicy:
    """The pool of workers and what is in flight. ``launch`` is the scheduler's one step."""
    engine: tuple[int, ...]             # batch size of every worker (its granularity), index = worker id
    max_inflight: int                   # MaxInf: inputs in flight at most
    slots: int | None = None            # workers running at once at most (processes); None: no cap
    busy: set[int] = field(default_factory=set)   # ids of workers running a batch
    inflight: int = 0                   # CurInf: inputs being computed

    def __post_init__(self) -> None:
        if not self.engine or any(b < 1 or b & (b - 1) for b in self.engine):
            raise ValueError(f"worker batch sizes must be powers of two >= 1, got {list(self.engine)}")
        if self.slots is not None and self.slots < 1:
            raise ValueError(f"slots must be >= 1 (worker processes), got {self.slots}")
        if self.max_inflight < min(self.engine):
            raise ValueError(f"max_inflight {self.max_inflight} is below the smallest worker's batch "
                             f"{min(self.engine)}: nothing could ever run")

    def allowed(self, staged: int) -> Sequence[int]:
        """Ids of the workers this load may use (N-Ebird: all of them)."""
        return range(len(self.engine))

    def launch(self, staged: int) -> list[tuple[int, int]]:
        """``staged`` inputs wait: the workers to launch now, in order, as (worker id, batch size);
        each takes the next ``batch size`` staged inputs. Marks them busy."""
        return self._launch(staged, self.allowed(staged))

    def _launch(self, staged: int, candidates: Iterable[int]) -> list[tuple[int, int]]:
        """Algorithm 1's inner loop over the idle workers among ``candidates``."""
        room = min(staged, self.max_inflight - self.inflight)
        idle = sorted((w for w in candidates if w not in self.busy), key=lambda w: (-self.engine[w], w))
        launched = []
        for w in idle:               # largest first; after a launch, the next that still fits
            if room <= 0 or (self.slots is not None and len(self.busy) >= self.slots):
                break
            size = self.engine[w]
            if size <= room:
                launched.append((w, size))
                self.busy.add(w)
                self.inflight += size
                room -= size
        return launched

    def done(self, worker: int) -> None:
        """Worker ``worker`` finished its batch: it is idle again."""
        if worker not in self.busy:
            raise ValueError(f"worker {worker} was not running")
        self.busy.remove(worker)
        self.inflight -= self.engine[worker]


class NEbird(ElasticPolicy):
    """Algorithm 1 (with the loop defect fixed): a fixed engine, inputs in flight capped at MaxInf."""


@dataclass
class EEbird(ElasticPolicy):
    """Algorithm 2: the configuration for the current load, from the offline profile."""
    confs: Mapping[int, Sequence[int]] = field(default_factory=dict)   # TotalBS -> worker batch sizes

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.confs:
            raise ValueError("E-Ebird needs its offline configurations (TotalBS -> workers)")
        have = Counter(self.engine)
        for total, workers in self.confs.items():
            if any(Counter(workers)[b] > have[b] for b in set(workers)):
                raise ValueError(f"the engine {list(self.engine)} cannot hold the configuration for "
                                 f"TotalBS {total}: {list(workers)}")

    def current_total(self, staged: int) -> int:
        """MemState -> the TotalBS whose configuration serves it: the smallest covering the load
        (staged + in flight), else the largest."""
        load = staged + self.inflight
        totals = sorted(self.confs)
        return next((t for t in totals if t >= load), totals[-1])

    def allowed(self, staged: int) -> Sequence[int]:
        """The current configuration's workers; at the lowest profiled load also the low-load workers."""
        total = self.current_total(staged)
        want = Counter(self.confs[total])
        if total == min(self.confs):
            want += Counter(LOW_LOAD_WORKERS)
        ids = []
        for w, b in enumerate(self.engine):
            if want[b] > 0:
                want[b] -= 1
                ids.append(w)
        return ids

    def launch(self, staged: int) -> list[tuple[int, int]]:
        launched = super().launch(staged)
        if not launched and not self.busy and staged > 0:
            # nothing runs and the configuration's workers are all larger than what is staged: any worker
            # of the engine that fits, so that no input waits for arrivals that may never come
            launched = self._launch(staged, range(len(self.engine)))
        return launched


POLICIES = ("n-ebird", "e-ebird")


def make_policy(kind: str, *, engine: Sequence[int] | None = None, max_inflight: int | None = None,
                confs: Mapping[int, Sequence[int]] | None = None, slots: int | None = None) -> ElasticPolicy:
    """``n-ebird`` (engine default :data:`NAIVE_ENGINE`, MaxInf default twice its largest worker, the
    paper's 32) or ``e-ebird`` (``confs`` required; engine default :func:`engine_for` them, MaxInf
    default their largest TotalBS); ``slots``: workers running at once at most (None: no cap)."""
    if kind == "n-ebird":
        engine = tuple(engine or NAIVE_ENGINE)
        return NEbird(engine, max_inflight or 2 * max(engine), slots)
    if kind == "e-ebird":
        if not confs:
            raise ValueError("e-ebird needs its offline configurations: run `e3 admission` (it profiles them)")
        confs = {int(t): tuple(int(b) for b in w) for t, w in confs.items()}
        return EEbird(tuple(engine or engine_for(confs)), max_inflight or max(confs), slots, confs=confs)
    raise ValueError(f"unknown admission policy {kind!r}: choose one of {', '.join(POLICIES)}")


def worker_sets(total: int, max_workers: int, largest: int | None = None) -> list[tuple[int, ...]]:
    """Every multiset of power-of-two batch sizes summing to ``total`` with at most ``max_workers``
    workers (the paper's Equation 6 cases, bounded: on a CPU more concurrent workers than a few times
    the cores only time-slice), none larger than ``largest`` (default ``total``). Largest batch first."""
    cap = total if largest is None else min(total, largest)
    sizes = [1 << i for i in range(cap.bit_length()) if 1 << i <= cap][::-1]
    out = []

    def rec(left: int, start: int, acc: tuple[int, ...]) -> None:
        if left == 0:
            out.append(acc)
            return
        if len(acc) == max_workers:
            return
        for i in range(start, len(sizes)):
            if sizes[i] <= left:
                rec(left - sizes[i], i, acc + (sizes[i],))

    rec(total, 0, ())
    return out


def best_worker_sets(mean_latency_ms: Mapping[tuple[int, ...], float]) -> dict[int, tuple[int, ...]]:
    """The offline phase's choice: per TotalBS, the worker set with the lowest mean latency (ms)."""
    best: dict[int, tuple[tuple[int, ...], float]] = {}
    for workers, ms in mean_latency_ms.items():
        total = sum(workers)
        if total not in best or ms < best[total][1]:
            best[total] = (tuple(workers), ms)
    return {t: w for t, (w, _) in sorted(best.items())}


def engine_for(confs: Mapping[int, Iterable[int]]) -> tuple[int, ...]:
    """The smallest engine that can run every configuration: per batch size the most any one needs,
    plus the low-load workers (1 and 2). Largest first."""
    need: Counter = Counter(LOW_LOAD_WORKERS)
    for workers in confs.values():
        need |= Counter(workers)
    return tuple(sorted(need.elements(), reverse=True))


def max_batch_for_qos(latency_ms: Mapping[int, float], qos_ms: float) -> int:
    """MaxBS: the largest profiled power-of-two batch whose run, after waiting for one batch like it
    (the worst case when the engine is full), still ends within the QoS target: ``2 x latency(b) <=
    qos_ms``. Raises if not even a batch of 1 fits."""
    fits = [b for b, ms in latency_ms.items() if 2 * ms <= qos_ms]
    if not fits:
        raise ValueError(f"no batch meets the QoS target of {qos_ms} ms: a batch of "
                         f"{min(latency_ms)} takes {latency_ms[min(latency_ms)]:.1f} ms")
    return max(fits)


def naive_engine(max_bs: int) -> list[int]:
    """N-Ebird's engine for MaxBS (the paper's [1, 1, 2, 4, 8, 16] for 32): a worker of 1, then one per
    power of two below MaxBS, so any load up to MaxBS is covered."""
    engine, b = [1], 1
    while b < max_bs:
        engine.append(b)
        b *= 2
    return sorted(engine, reverse=True)


def max_inflight_for_qos(slowest_ms: Mapping[tuple[int, ...], float], confs: Mapping[int, Sequence[int]],
                         qos_ms: float, *, max_bs: int) -> int:
    """E-Ebird's MaxInf read off its offline profile: the largest profiled TotalBS whose chosen worker set,
    launched at once, has its slowest worker end within half the target (``2 x slowest <= qos_ms``, the
    rule :func:`max_batch_for_qos` applies to one worker), and never below ``max_bs``.

    The paper caps inputs in flight at MaxBS for both policies, from its hypothesis that co-running
    workers share the GPU equally (so workers summing to MaxBS take as long as one batch of MaxBS).
    E-Ebird exists because that hypothesis does not hold; where the profile shows concurrent sets
    finishing sooner, the cap forfeits exactly the parallelism the workers exist for (measured on an H200
    with resnet's stock model, QoS 1 ms, MaxBS 64: with MaxInf = 64 E-Ebird reached NO_Wait's throughput
    at the target while four Triton instances reached 1.53x it; four batches of 32 at once end in 0.49 ms,
    so the profile gives MaxInf 128, and E-Ebird then reached >= 1.77x). So E-Ebird's offline phase also profiles totals
    above MaxBS (workers no larger than MaxBS) and lets the measured latencies set the cap; N-Ebird keeps
    the paper's MaxBS. ``slowest_ms``: per profiled set, its slowest worker's latency (ms)."""
    fits = [t for t, workers in confs.items() if 2 * slowest_ms.get(tuple(workers), float("inf")) <= qos_ms]
    return max([max_bs, *fits])

