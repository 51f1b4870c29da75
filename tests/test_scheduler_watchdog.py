"""The scheduler's watchdog, pure: a batch whose split call has not returned by its jobs' deadline drops
them as late at that deadline, keeps its slot until the call returns, and a late return answers nothing
twice (no server; the hung split on the real tritonserver is tests/test_hung_split.py)."""

from __future__ import annotations

import numpy as np
import pytest

from e3.core.exits import EntropyRule
from e3.serving.policy import BatchRoute
from e3.serving.scheduler import WATCHDOG_GRACE_S, Scheduler, SplitQueue

C, L = 2, 4
SURE, UNSURE = np.array([8.0, 0.0]), np.array([0.1, 0.0])
SLO_S = 0.1
DUE_S = SLO_S + WATCHDOG_GRACE_S   # when a job arriving at 0 and still in a running batch is dropped


def _sched(batches=(4, 4), slots=(1, 1)):
    return Scheduler([SplitQueue(b, s, 0.0) for b, s in zip(batches, slots)], SLO_S, 0.2)


def _admit(sched, n, now, tag=0):
    job = sched.job(("req", tag), n, now, C)
    sched.admit(job, {"x": np.full((n, 3), tag, dtype=np.float32)}, {}, now)
    return job


def _return_split1(sched, d, now, ms, exits=None):
    """Split 1's call for ``d`` returns at ``now`` after ``ms``: rows in ``exits`` (default all) exit at ramp 2."""
    n = len(d.rows)
    exits = set(range(n)) if exits is None else exits
    route = BatchRoute(n, C, L, EntropyRule(0.5))
    logits = np.stack([SURE if i in exits else UNSURE for i in range(n)])
    feed = route.advance({"ramp_2": logits, "x_out": np.zeros((n, 3), np.float32)}, (2,), ["x"])
    return sched.finish(d, route, feed, ms, now)


def test_a_job_in_a_batch_still_running_at_its_deadline_is_dropped_then_once():
    sched = _sched()
    job = _admit(sched, 2, 0.0)
    d, = sched.poll(0.0)[0]
    assert sched.next_expiry() == pytest.approx(DUE_S)        # the timer is told when to look
    assert sched.expire(DUE_S - 1e-3) == []                    # not yet (a split's own timeout reports first)
    assert sched.expire(DUE_S) == [job]                        # at its deadline plus the grace
    assert job.failed == "deadline" and job.stuck_in == 0 and not job.live
    assert sched.expire(SLO_S + 1.0) == [] and sched.next_expiry() is None   # dropped once
    assert sched.queues[0].in_flight == 1                      # the stuck call still holds its slot


def test_a_late_return_answers_nothing_frees_the_slot_and_counts_only_until_abandoned():
    sched = _sched()
    sched.queues[0].observe(1, 1.0)                            # a first batch: one-time costs, not learnt
    job = _admit(sched, 2, 0.0)
    stuck, = sched.poll(0.0)[0]                                # the split's next batch hangs
    assert sched.expire(DUE_S) == [job]
    waiting = _admit(sched, 1, 0.12, tag=1)
    assert sched.poll(0.12)[0] == []                           # one slot, still taken: the new job waits
    assert _return_split1(sched, stuck, 20.0, 20_000.0) == []  # returns 20 s late: nobody answered again
    assert sched.queues[0].in_flight == 0 and not sched.running
    # learnt as the 150 ms it had run when abandoned (nothing is clipped while warming up), not the 20 s hang
    assert sched.queues[0].expected_ms(2) == pytest.approx(DUE_S * 1e3)
    assert sched.poll(20.0)[1] == [waiting]                    # its own deadline (0.22) passed meanwhile
    fresh = _admit(sched, 1, 20.0, tag=2)                      # (one row: ~75 ms expected, within the SLO)
    d, = sched.poll(20.0)[0]                                   # the freed slot serves again
    assert _return_split1(sched, d, 20.01, 10.0) == [fresh]


def test_the_splits_other_slots_keep_serving_while_one_call_hangs():
    sched = _sched(slots=(2, 1))
    hung = _admit(sched, 4, 0.0, 1)
    stuck, = sched.poll(0.0)[0]
    other = _admit(sched, 2, 0.01, 2)
    d, = sched.poll(0.01)[0]                                   # the second slot takes the next request
    assert _return_split1(sched, d, 0.02, 10.0) == [other]     # and it is answered
    assert sched.expire(DUE_S) == [hung]
    third = _admit(sched, 2, 0.2, 3)
    d, = sched.poll(0.2)[0]
    assert _return_split1(sched, d, 0.21, 10.0) == [third] and stuck in sched.running.values()


def test_only_the_jobs_past_their_deadline_are_dropped_the_rest_of_the_batch_is_answered_on_return():
    sched = _sched()
    early = _admit(sched, 1, 0.0, 1)
    late = _admit(sched, 1, 0.09, 2)                           # deadline 0.19
    sched.queues[0].in_flight = 1                              # hold the batch until both are queued
    sched.poll(0.09)
    sched.queues[0].in_flight = 0
    d, = sched.poll(0.09)[0]
    assert len(d.rows) == 2
    assert sched.expire(DUE_S) == [early]
    assert sched.next_expiry() == pytest.approx(0.19 + WATCHDOG_GRACE_S)
    assert _return_split1(sched, d, 0.17, 80.0) == [late]      # back before the second deadline


def test_queued_rows_behind_splits_whose_every_slot_hangs_are_dropped_at_their_deadline():
    sched = _sched()
    _admit(sched, 4, 0.0, 1)
    sched.poll(0.0)
    queued = _admit(sched, 1, 0.05, 2)
    assert sched.expire(DUE_S)
    assert sched.next_expiry() == pytest.approx(0.05 + SLO_S)  # no event will come: the timer must look then
    assert sched.poll(0.05 + SLO_S + 1e-6)[1] == [queued]


def test_unloading_drops_the_jobs_of_batches_still_running():
    sched = _sched()
    job = _admit(sched, 2, 0.0)
    sched.poll(0.0)
    assert sched.fail_all("error") == [job] and job.failed == "error"
