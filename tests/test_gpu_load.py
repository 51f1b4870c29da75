"""The open loop's per-run record (benchmarks/gpu_load.py): pure, no server."""

from __future__ import annotations

import math
import time

import numpy as np

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
