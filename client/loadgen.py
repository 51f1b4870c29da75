"""Load generators: closed loop, open loop (Poisson arrivals) and workload replay.

* :func:`closed_loop`: ``concurrency`` clients, each sending requests of
  ``batch`` inputs back to back, until ``requests`` requests were sent.
  Latency is from send to answer.
* :func:`open_loop`: requests arrive at seeded Poisson times (exponential
  inter-arrival gaps, mean ``1 / rate_rps``) whether or not the server keeps
  up; a bounded pool of worker threads (one client each) sends them. Latency is
  measured from the **scheduled arrival**, so a request that waited for a free
  worker is charged that wait (no coordinated omission: a slow server cannot
  slow the arrivals down and hide its own queue).
* :func:`replay_workload`: a workload file (``e3 workload``) sent once, in
  order, open or closed loop; for a switching stream the result carries one
  result per phase.

Inputs are taken in order from a pool of arrays (wrapping around for the
pool-driven loops), so every answer can be matched with its input afterwards.
The run itself only records a :class:`RequestRecord` per request; the numbers
(throughput, goodput under an SLO, percentiles, per-phase results) come from
pure functions over those records (:func:`summarize`, :func:`summarize_phases`).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from e3.client.sdk import ClientError, E3Client
from e3.client.workloads import Phase, Workload, load_workload, phase_index

__all__ = ["LoadResult", "RequestRecord", "closed_loop", "closed_loop_records", "open_loop", "replay_workload", "poisson_arrivals",
           "request_rows", "percentile_ms", "summarize", "summarize_phases", "scheduled_records"]

log = logging.getLogger(__name__)


@dataclass
class LoadResult:
    model: str
    requests: int = 0                 # requests answered (successfully or with an error)
    inputs: int = 0                   # inputs answered successfully
    errors: int = 0                   # requests that came back with an error
    duration_s: float = 0.0           # wall time of the run (open loop: first arrival slot to last answer)
    latencies_ms: list[float] = field(default_factory=list)   # per successful request
    exit_counts: Counter = field(default_factory=Counter)     # exit ramp -> inputs
    error_messages: Counter = field(default_factory=Counter)  # message -> count
    slo_ms: float | None = None       # latency objective per request; None: no SLO given
    good_inputs: int = 0              # inputs answered successfully within slo_ms (all answered if no SLO)
    slo_misses: int = 0               # inputs answered successfully but later than slo_ms
    offered_rps: float | None = None  # open loop: scheduled arrival rate (requests/s); None for a closed loop
    max_send_lag_ms: float = 0.0      # worst wait between a request's arrival time and its send (client queueing)
    labelled: int = 0                 # answered inputs with a known true label (workload replays)
    correct: int = 0                  # ... whose answered label equals it
    exit_mismatches: int = 0          # answered inputs whose exit ramp differs from the workload's reference
    # workload replays: the ramps the workload's reference exits were recorded with (e3 workload: every ramp of
    # the model); None when the workload does not say
    reference_ramps: list[int] | None = None
    phase: str | None = None          # the workload phase (mix) this result covers; None: the whole run
    phases: list["LoadResult"] = field(default_factory=list)  # per-phase results of a workload replay

    @property
    def throughput_ips(self) -> float:
        """Inputs answered per second."""
        return self.inputs / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def goodput_ips(self) -> float:
        """Inputs answered within the SLO per second (= throughput without an SLO)."""
        return self.good_inputs / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def accuracy(self) -> float:
        """Share of answered, labelled inputs answered correctly (nan without labels)."""
        return self.correct / self.labelled if self.labelled else float("nan")

    def percentile_ms(self, q: float) -> float:
        return percentile_ms(self.latencies_ms, q)


@dataclass
class RequestRecord:
    """What the run saw of one request; all times in seconds from the run's start."""
    index: int                        # request number, in schedule order
    first_row: int                    # pool row of its first input
    inputs: int                       # inputs (rows) it carried
    scheduled_s: float                # arrival time (closed loop: the send time)
    sent_s: float                     # when a worker sent it
    done_s: float                     # when its answer (or error) came back
    label: np.ndarray | None = None   # [inputs] answered labels; None on error
    exit_ramp: np.ndarray | None = None  # [inputs] answered exit ramps; None on error
    error: str | None = None          # the server's message, if it failed

    @property
    def latency_ms(self) -> float:
        return (self.done_s - self.scheduled_s) * 1e3


# -- pure decisions ---------------------------------------------------------------------------------------

def poisson_arrivals(rate_rps: float, *, duration_s: float | None = None, count: int | None = None,
                     seed: int = 0) -> np.ndarray:
    """Arrival times (s, from 0, increasing) of a Poisson process of ``rate_rps`` requests/s.

    Exactly one of ``duration_s`` (every arrival before it) or ``count``
    (that many arrivals) bounds the schedule. Gaps are exponential with mean
    ``1 / rate_rps``; the same seed gives the same schedule.
    """
    if not rate_rps > 0:
        raise ValueError(f"rate_rps must be > 0, got {rate_rps}")
    if (duration_s is None) == (count is None):
        raise ValueError("give exactly one of duration_s or count")
    rng = np.random.default_rng(seed)
    if count is not None:
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        return np.cumsum(rng.exponential(1.0 / rate_rps, size=count))
    if not duration_s > 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    times = np.empty(0)
    chunk = max(16, int(rate_rps * duration_s * 1.2) + 16)
    last = 0.0
    while last < duration_s:  # draw in chunks so the schedule for a seed does not depend on the chunk size
        gaps = rng.exponential(1.0 / rate_rps, size=chunk)
        times = np.concatenate([times, last + np.cumsum(gaps)])
        last = times[-1]
    return times[times < duration_s]


def request_rows(index: int, batch: int, size: int, *, wrap: bool = True) -> np.ndarray:
    """Pool rows of request ``index`` carrying ``batch`` inputs from a pool of ``size`` rows.

    wrap: cycle through the pool; otherwise the last request is shorter
    (workload replays send every input exactly once).
    """
    start = index * batch
    if wrap:
        return (np.arange(batch) + start) % size
    return np.arange(start, min(start + batch, size))


def percentile_ms(latencies_ms, q: float) -> float:
    """The ``q``-th percentile (linear interpolation) of latencies; nan when there are none."""
    return float(np.percentile(latencies_ms, q)) if len(latencies_ms) else float("nan")


def percentile_interval_ms(latencies_ms, q: float, level: float = 0.9, *, resamples: int = 2000,
                           seed: int = 0) -> tuple[float, float]:
    """A bootstrap confidence interval (percentile method, ``scipy.stats.bootstrap``) of the ``q``-th
    percentile of latencies: how far one run's tail figure may move between runs of the same system. A
    p99 of 100 requests is close to their maximum, so its interval is wide. (nan, nan) for fewer than 2."""
    from scipy.stats import bootstrap   # deferred: scipy.stats takes seconds to load, only for intervals
    x = np.asarray(latencies_ms, dtype=float)
    if len(x) < 2:
        return float("nan"), float("nan")
    ci = bootstrap((x,), lambda a, axis: np.percentile(a, q, axis=axis), confidence_level=level,
                   n_resamples=resamples, method="percentile", random_state=np.random.default_rng(seed)
                   ).confidence_interval
    return float(ci.low), float(ci.high)


def summarize(records: list[RequestRecord], model: str, *, duration_s: float | None = None,
              slo_ms: float | None = None, offered_rps: float | None = None,
              true_label: np.ndarray | None = None, expected_exit: np.ndarray | None = None) -> LoadResult:
    """Counts, latencies, goodput and exit histogram of ``records``.

    duration_s: the run's wall time; default: from the earliest arrival to the
    last answer among ``records``. A request is good when it succeeded and its
    latency (from its arrival) is at most ``slo_ms``; goodput counts its inputs.
    true_label / expected_exit: per pool row (workload replays), to count
    correct labels and exit ramps that differ from the reference.
    """
    if duration_s is None:
        duration_s = (max(r.done_s for r in records) - min(r.scheduled_s for r in records)) if records else 0.0
    result = LoadResult(model, duration_s=duration_s, slo_ms=slo_ms, offered_rps=offered_rps)
    for r in sorted(records, key=lambda r: r.index):
        result.requests += 1
        result.max_send_lag_ms = max(result.max_send_lag_ms, (r.sent_s - r.scheduled_s) * 1e3)
        if r.error is not None:
            result.errors += 1
            result.error_messages[r.error[:200]] += 1
            continue
        n = len(r.label)
        result.inputs += n
        result.latencies_ms.append(r.latency_ms)
        result.exit_counts.update(r.exit_ramp.tolist())
        if slo_ms is None or r.latency_ms <= slo_ms:
            result.good_inputs += n
        else:
            result.slo_misses += n
        rows = np.arange(r.first_row, r.first_row + n)
        if true_label is not None:
            result.labelled += n
            result.correct += int((r.label == true_label[rows]).sum())
        if expected_exit is not None:
            result.exit_mismatches += int((r.exit_ramp != expected_exit[rows]).sum())
    return result


def summarize_phases(records: list[RequestRecord], phases: list[Phase], model: str, **kwargs) -> list[LoadResult]:
    """One result per phase, a request belonging to the phase that holds its first input.

    Each phase's duration runs from its earliest arrival to its last answer,
    so its throughput and goodput are rates over its own stretch of the run.
    """
    which = phase_index(np.array([r.first_row for r in records], dtype=np.int64), phases)
    out = []
    for j, p in enumerate(phases):
        mine = [r for r, w in zip(records, which) if w == j]
        res = summarize(mine, model, **kwargs)
        res.phase = p.mix
        out.append(res)
    return out


# -- the run --------------------------------------------------------------------------------------------

def _run(url: str, model: str, pool: dict[str, np.ndarray], rows: list[np.ndarray], *, workers: int,
         schedule: np.ndarray | None, protocol: str, warmup: int, timeout_s: float = 60.0, shm: bool = False
         ) -> tuple[list[RequestRecord], float]:
    """Send ``rows[i]`` as request i from ``workers`` threads (one client each); returns records and wall time.

    schedule: arrival time (s from the start) per request, open loop; a worker
    takes the next request in order, sleeps until its arrival, sends it. None:
    closed loop, a worker sends the next request as soon as it is free.
    """
    records: list[RequestRecord] = []
    lock = threading.Lock()
    counter = iter(range(len(rows)))
    clock = {"t0": 0.0}
    failures: list[BaseException] = []

    def worker() -> None:
        try:
            with E3Client(url, protocol, timeout_s=timeout_s, shm=shm) as client:
                for i in range(warmup):
                    client.infer(model, {k: v[rows[i % len(rows)]] for k, v in pool.items()})
                barrier.wait()
                t0 = clock["t0"]
                while True:
                    with lock:
                        i = next(counter, None)
                    if i is None:
                        return
                    if schedule is not None:
                        wait = t0 + schedule[i] - time.perf_counter()
                        if wait > 0:
                            time.sleep(wait)
                    sent = time.perf_counter() - t0
                    first = int(rows[i][0])
                    try:
                        answers = client.infer(model, {k: v[rows[i]] for k, v in pool.items()})
                        rec = RequestRecord(i, first, len(rows[i]), sent if schedule is None else float(schedule[i]),
                                            sent, time.perf_counter() - t0, answers.label, answers.exit_ramp)
                    except ClientError as err:
                        rec = RequestRecord(i, first, len(rows[i]), sent if schedule is None else float(schedule[i]),
                                            sent, time.perf_counter() - t0, error=str(err))
                    with lock:
                        records.append(rec)
        except BaseException as err:  # noqa: BLE001 - reported by the caller, never swallowed
            failures.append(err)
            barrier.abort()

    # The barrier's action runs once, before any thread is released: every worker sees the same t0.
    barrier = threading.Barrier(workers + 1, action=lambda: clock.__setitem__("t0", time.perf_counter()))
    threads = [threading.Thread(target=worker, daemon=True, name=f"loadgen-{j}") for j in range(workers)]
    for t in threads:
        t.start()
    try:
        barrier.wait()
    except threading.BrokenBarrierError:
        pass
    start = clock["t0"]
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    if failures:
        err = next((f for f in failures if not isinstance(f, threading.BrokenBarrierError)), failures[0])
        if isinstance(err, ClientError):
            raise err
        if isinstance(err, OSError):  # refused, reset, unreachable: the user's address or server is wrong
            raise ClientError(f"cannot reach {url}: {err}") from err
        raise RuntimeError(f"load generator worker failed: {err!r}") from err
    return records, wall


def _check(batch: int, workers: int) -> None:
    if batch < 1:
        raise ValueError(f"batch must be >= 1 input per request, got {batch}")
    if workers < 1:
        raise ValueError(f"need at least one client (concurrency/workers), got {workers}")


def closed_loop(url: str, model: str, pool: dict[str, np.ndarray], *, concurrency: int = 8, batch: int = 4,
                requests: int = 200, protocol: str = "http", warmup: int = 0,
                slo_ms: float | None = None, true_label: np.ndarray | None = None, shm: bool = False) -> LoadResult:
    """Run a closed loop against ``model``; returns counts, latencies, goodput and the exit histogram
    (and accuracy, given ``true_label`` per pool row)."""
    records, wall = closed_loop_records(url, model, pool, concurrency=concurrency, batch=batch, requests=requests,
                                        protocol=protocol, warmup=warmup, shm=shm)
    return summarize(records, model, duration_s=wall, slo_ms=slo_ms, true_label=true_label)


def closed_loop_records(url: str, model: str, pool: dict[str, np.ndarray], *, concurrency: int = 8, batch: int = 4,
                        requests: int = 200, protocol: str = "http",
                        warmup: int = 0, shm: bool = False) -> tuple[list[RequestRecord], float]:
    """:func:`closed_loop`'s run itself: every request's record (latency, answers) and the wall time (s)."""
    _check(batch, concurrency)
    size = next(iter(pool.values())).shape[0]
    rows = [request_rows(i, batch, size) for i in range(requests)]
    return _run(url, model, pool, rows, workers=concurrency, schedule=None, protocol=protocol, warmup=warmup,
                shm=shm)


def scheduled_records(url: str, model: str, pool: dict[str, np.ndarray], *, schedule: np.ndarray, batch: int = 1,
                      workers: int = 64, protocol: str = "http", warmup: int = 1,
                      shm: bool = False) -> tuple[list[RequestRecord], float]:
    """Open loop on a given arrival ``schedule`` (s from the start, increasing; e.g. a burst's phases):
    every request's record and the wall time (s). See :func:`open_loop` for ``workers``."""
    _check(batch, workers)
    size = next(iter(pool.values())).shape[0]
    rows = [request_rows(i, batch, size) for i in range(len(schedule))]
    return _run(url, model, pool, rows, workers=workers, schedule=np.asarray(schedule), protocol=protocol,
                warmup=warmup, shm=shm)


def open_loop(url: str, model: str, pool: dict[str, np.ndarray], *, rate_rps: float,
              duration_s: float | None = None, requests: int | None = None, batch: int = 1,
              slo_ms: float | None = None, protocol: str = "http", seed: int = 0, workers: int = 32,
              warmup: int = 1, shm: bool = False) -> LoadResult:
    """Poisson arrivals of ``rate_rps`` requests/s (``batch`` inputs each) for ``duration_s`` or ``requests``.
    ``shm``: inputs through Triton's system shared memory (a client on the server's machine).

    ``workers`` bounds the requests in flight; when all are busy, arrivals wait
    in the client and that wait counts in their latency (see
    ``max_send_lag_ms``: if it is large, the client, not the server, limited
    the run; raise ``workers``). Each worker sends ``warmup`` untimed requests
    first.
    """
    _check(batch, workers)
    schedule = poisson_arrivals(rate_rps, duration_s=duration_s, count=requests, seed=seed)
    size = next(iter(pool.values())).shape[0]
    rows = [request_rows(i, batch, size) for i in range(len(schedule))]
    records, wall = _run(url, model, pool, rows, workers=workers, schedule=schedule, protocol=protocol,
                         warmup=warmup, shm=shm)
    log.info("open loop on %s: %d arrivals at %.1f requests/s in %.2f s", model, len(schedule), rate_rps, wall)
    return summarize(records, model, duration_s=wall, slo_ms=slo_ms, offered_rps=rate_rps)


def replay_workload(url: str, model: str, workload: str | Path | Workload, *, batch: int = 1,
                    rate_rps: float | None = None, concurrency: int | None = None, slo_ms: float | None = None,
                    protocol: str = "http", seed: int = 0, workers: int = 32, warmup: int = 1) -> LoadResult:
    """Send every input of a workload once, in order, and report overall and per-phase results.

    Open loop (Poisson, ``rate_rps`` requests/s; default: the workload's
    nominal input rate divided by ``batch``) unless ``concurrency`` is given,
    which makes it a closed loop of that many clients. Answers are checked
    against the workload's true labels (accuracy) and reference exit ramps.
    """
    wl = workload if isinstance(workload, Workload) else load_workload(workload)
    closed = concurrency is not None
    _check(batch, concurrency if closed else workers)
    rows = [request_rows(i, batch, wl.size, wrap=False) for i in range(math.ceil(wl.size / batch))]
    schedule = None
    if not closed:
        if rate_rps is None:
            if not wl.rate_rps:
                raise ValueError(f"workload {wl.name} has no nominal rate; pass rate_rps (or a concurrency)")
            rate_rps = wl.rate_rps / batch
        schedule = poisson_arrivals(rate_rps, count=len(rows), seed=seed)
    records, wall = _run(url, model, wl.inputs, rows, workers=concurrency if closed else workers,
                         schedule=schedule, protocol=protocol, warmup=warmup)
    common = dict(slo_ms=slo_ms, offered_rps=None if closed else rate_rps, true_label=wl.label,
                  expected_exit=wl.exit_ramp)
    result = summarize(records, model, duration_s=wall, **common)
    result.reference_ramps = wl.meta.get("enabled_ramps")
    if len(wl.phases) > 1:
        result.phases = summarize_phases(records, wl.phases, model, **common)
    return result
