"""The GPU runs' load (benchmarks/gpu_load.py): the open loop's per-run record, the closed loop's window, repeated points
and the SLO rows. Pure, no server."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

from e3.benchmarks.gpu_load import _RunRecord


def test_a_late_answer_lands_in_its_own_run_and_past_the_drain_counts_as_not_answered():
    now = time.time()   # answers are timed from the run's start
    first = _RunRecord(3, start_at=now)
    first.answered(0, None)
    first.answered(1, RuntimeError("Deadline Exceeded"))
    offsets = np.array([0.0, 0.1, 0.2])
    reported = first.report(offsets, drain_s=10.0)
    second = _RunRecord(2, start_at=now)
    first.answered(2, RuntimeError("late error of the first run"))   # arrives while the second run goes on
    second.answered(0, None)
    second.answered(1, None)
    _, _, done2, errors2 = second.report(np.array([0.0, 0.1]), drain_s=10.0)
    assert errors2 == [] and not np.isnan(done2).any() and second.all_done.is_set()
    _, _, done1, errors1 = reported
    assert errors1 == ["Deadline Exceeded"] and math.isnan(done1[1]) and math.isnan(done1[2])
    assert first.all_done.is_set() and first.errors[-1] == "late error of the first run"


def test_answers_after_the_drain_cutoff_are_reported_as_failed_and_errors_are_capped():
    rec = _RunRecord(5, start_at=0.0)
    rec.done[:] = [0.5, 1.0, 2.9, 3.1, np.nan]    # seconds from the start; the last arrival at 1.0, drain 2 s
    _, _, done, _ = rec.report(np.array([0.0, 0.2, 0.4, 0.8, 1.0]), drain_s=2.0)
    assert list(np.isnan(done)) == [False, False, False, True, True]
    capped = _RunRecord(5, start_at=0.0)
    for i in range(5):
        capped.answered(i, ValueError(f"bad {i}"))
    assert capped.errors == ["bad 0", "bad 1", "bad 2"] and capped.all_done.is_set()


# -- the closed loop's window (window_stats), repeated points (measure_point) and the SLO rows -------------------------
from e3.benchmarks.gpu_load import (INPUTS_PER_REQUEST, MIN_REPS, aggregate, goodput_at, measure_point, slo_rows,  # noqa: E402
                                    window_stats)


def closed_loop(latency_s: float, *, start: float, end: float, clients: int = 1):
    """Send and answer times of ``clients`` closed loops of a fixed latency, sending from ``start`` (the warm-up
    begins before the window's 0) until ``end`` (the window's end: no send after it, the last answers later)."""
    sent, done = [], []
    for c in range(clients):
        t = start + c * latency_s / clients
        while t < end:
            sent.append(t)
            done.append(t + latency_s)
            t += latency_s
    return np.array(sent), np.array(done)


def test_throughput_counts_every_answer_inside_the_window_where_the_old_rule_under_read_by_w_over_window():
    W, window = 0.2, 1.0
    sent, done = closed_loop(W, start=-0.3, end=window, clients=4)
    stats = window_stats(sent, done, window)
    true_rate = 4 / W * INPUTS_PER_REQUEST                  # Little: 4 in flight, each W long
    assert stats["inputs_per_s"] == pytest.approx(true_rate, rel=0.06)
    old = np.count_nonzero((sent >= 0) & (done <= window)) * INPUTS_PER_REQUEST / window   # sent after, answered before
    assert old < stats["inputs_per_s"] * (1 - W / window) * 1.05            # under-read by about W / window
    assert old == pytest.approx(true_rate * (1 - W / window), rel=0.1)
    # latency percentiles: the requests sent inside the window, the ones answered after its end included
    assert len(stats["latencies_ms"]) == np.count_nonzero((sent >= 0) & (sent < window))
    assert stats["p50_ms"] == pytest.approx(W * 1e3) and stats["p99_ms"] == pytest.approx(W * 1e3)


def test_a_failed_request_is_no_answer_and_goodput_counts_answers_inside_the_window_within_the_slo():
    sent = np.array([-0.05, 0.1, 0.2, 0.3, 0.9])
    done = np.array([0.05, 0.11, np.nan, 0.35, 1.2])     # one failed, one answered after the window's end
    stats = window_stats(sent, done, 1.0)
    assert stats["requests"] == 3                          # 0.05 (sent in the warm-up), 0.11, 0.35
    assert sorted(np.round(stats["latencies_ms"])) == [10.0, 50.0, 300.0]   # sent inside: 0.1, 0.3, 0.9
    run = {**stats}
    assert goodput_at(run, 20.0) == 1 * INPUTS_PER_REQUEST / 1.0          # 0.11 - 0.1 only; 0.05 took 100 ms
    assert goodput_at(run, 100.0) == 3 * INPUTS_PER_REQUEST / 1.0


class FakeLoad:
    """A LoadPool whose runs have a p50 fixed per concurrency and a rate that cycles through ``rates``."""

    def __init__(self, p50_ms: dict, rates=(100.0, 300.0, 200.0), slower: list | None = None):
        self.p50_ms, self.rates, self.windows = p50_ms, list(rates), []
        self.slower = list(slower or [])   # the p50 of the next runs, one each, before p50_ms applies again

    def run(self, model, concurrency, pool, *, warmup_s, duration_s):
        self.windows.append(duration_s)
        rate = self.rates[(len(self.windows) - 1) % len(self.rates)]
        lat = np.full(50, self.slower.pop(0) if self.slower else self.p50_ms[concurrency])
        return {"concurrency": concurrency, "requests": 50, "inputs_per_s": rate, "duration_s": duration_s,
                "p50_ms": float(lat[0]), "p99_ms": float(lat[0]) * 1.5, "latencies_ms": lat,
                "answer_latencies_ms": lat, "errors": 0, "error_sample": [], "exits": {"2": 40, "12": 10}}


def test_a_point_is_repeated_its_figure_the_median_and_a_window_too_short_for_its_p50_is_a_discarded_probe():
    load = FakeLoad({8: 150.0})
    p = measure_point(load, "m", 8, {}, warmup_s=0.1, min_window_s=0.5, max_window_s=4.0, reps=1, slos_ms=(20, 200))
    # the first run (0.5 s) was shorter than 10 x its p50 (1.5 s): set aside, the next three at 1.5 s x 1.2
    assert load.windows == pytest.approx([0.5, 1.8, 1.8, 1.8]) and p["probe_discarded"] == 1 and p["reps"] == MIN_REPS
    assert p["window_over_p50"] == pytest.approx(12.0)
    assert (p["inputs_per_s"], p["inputs_per_s_min"], p["inputs_per_s_max"]) == (200.0, 100.0, 300.0)
    assert p["exits"] == {"2": 120, "12": 30} and p["goodput"]["20"] == 0.0
    hinted = FakeLoad({8: 150.0})
    measure_point(hinted, "m", 8, {}, warmup_s=0.1, min_window_s=0.5, max_window_s=4.0, p50_hint_ms=150.0)
    assert hinted.windows == [1.5, 1.5, 1.5]               # a good hint: no probe
    # a neighbour slows a later run (p50 150 -> 250 ms): that run is set aside too, and every run that counts
    # has a window of at least 10 x its own p50
    slowed = FakeLoad({8: 150.0}, slower=[150.0, 150.0, 250.0])
    r = measure_point(slowed, "m", 8, {}, warmup_s=0.1, min_window_s=0.5, max_window_s=4.0, p50_hint_ms=150.0)
    assert slowed.windows == pytest.approx([1.5, 1.5, 1.5, 3.0]) and r["probe_discarded"] == 1
    assert r["window_over_p50"] >= 10
    capped = FakeLoad({8: 1000.0})
    q = measure_point(capped, "m", 8, {}, warmup_s=0.1, min_window_s=0.5, max_window_s=4.0)
    assert capped.windows == [0.5, 4.0, 4.0, 4.0] and q["window_over_p50"] == pytest.approx(4.0)
    assert q["probe_discarded"] == 1   # at the cap the window cannot grow: no endless probing


def test_slo_rows_pick_the_best_goodput_among_points_whose_median_p99_meets_the_slo():
    def point(c, rates, p99s, errors=0):
        runs = [{"concurrency": c, "requests": 10, "inputs_per_s": r, "duration_s": 1.0, "p50_ms": p / 2, "p99_ms": p,
                 "latencies_ms": np.full(int(r / INPUTS_PER_REQUEST), p / 2),
                 "answer_latencies_ms": np.full(int(r / INPUTS_PER_REQUEST), p / 2), "errors": errors}
                for r, p in zip(rates, p99s)]
        return aggregate(runs, (10, 20))
    low = point(4, [800, 880, 960], [6, 7, 30])        # median p99 7 ms: meets 10 (the slow run answered none within)
    mid = point(12, [1600, 1680, 1760], [9, 15, 16])    # median 15: meets 20 only
    high = point(48, [2400, 2480, 2560], [40, 41, 42])   # saturating, meets neither
    broken = point(64, [4000] * 3, [5, 5, 5], errors=1)  # fast, but a request failed: never a figure
    points = [low, mid, high, broken]
    r10 = slo_rows(points, 10)
    assert (r10["goodput"], r10["goodput_min"], r10["goodput_max"], r10["concurrency"]) == (800, 0, 880, 4)
    r20 = slo_rows(points, 20)
    assert (r20["goodput"], r20["goodput_min"], r20["goodput_max"], r20["p99_ms"]) == (1680, 1600, 1760, 15)
    sat = slo_rows(points, None)
    assert sat["goodput"] == 2480 and sat["concurrency"] == 48
    assert slo_rows([high], 10) is None


def test_a_point_that_answered_nothing_is_not_repeated():
    class Dead(FakeLoad):
        def run(self, model, concurrency, pool, *, warmup_s, duration_s):
            self.windows.append(duration_s)
            return {"concurrency": concurrency, "requests": 0, "inputs_per_s": 0.0, "duration_s": duration_s,
                    "p50_ms": None, "p99_ms": None, "latencies_ms": np.array([]), "answer_latencies_ms": np.array([]),
                    "errors": 4, "error_sample": ["Deadline Exceeded"], "exits": {}}
    dead = Dead({})
    p = measure_point(dead, "m", 4, {}, warmup_s=0.1, min_window_s=0.5, max_window_s=4.0, slos_ms=(10,))
    assert len(dead.windows) == 1 and p["errors"] == 4 and p["p99_ms"] is None and slo_rows([p], None) is None
