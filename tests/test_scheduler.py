"""E3's scheduler, pure: dispatch when full or forced, merge across requests, answer each request
as soon as its own rows are decided, drop only what will miss (no server)."""

from __future__ import annotations

import numpy as np
import pytest

from e3.core.exits import EntropyRule
from e3.serving.policy import BatchRoute
from e3.serving.scheduler import EWMA_ALPHA, OUTLIER_X, WARM_BATCHES, Scheduler, SplitQueue

C, L = 2, 4
SURE, UNSURE = np.array([8.0, 0.0]), np.array([0.1, 0.0])


def _sched(batches=(4, 4), slots=(1, 1), delays_s=(0.0, 0.01), slo_s=1.0, slack=0.2):
    return Scheduler([SplitQueue(b, s, d) for b, s, d in zip(batches, slots, delays_s)], slo_s, slack)


def _admit(sched, n, now, tag=0):
    job = sched.job(("req", tag), n, now, C)
    sched.admit(job, {"x": np.full((n, 3), tag, dtype=np.float32)}, {}, now)
    return job


def _run_split1(sched, d, exits, now, ms=10.0):
    """Split 1 computed ramp 2 for the batch; rows in ``exits`` leave there."""
    n = len(d.rows)
    route = BatchRoute(n, C, L, EntropyRule(0.5))
    logits = np.stack([SURE if i in exits else UNSURE for i in range(n)])
    feed = route.advance({"ramp_2": logits, "x_out": np.zeros((n, 3), np.float32)}, (2,), ["x"])
    return sched.finish(d, route, feed, ms, now)


def _run_last(sched, d, now, ms=10.0):
    n = len(d.rows)
    route = BatchRoute(n, C, L, EntropyRule(0.5))
    route.advance({"ramp_4": np.stack([UNSURE] * n)}, (L,), ["x"])
    return sched.finish(d, route, None, ms, now)


def test_split_one_with_no_delay_takes_what_is_there_when_a_slot_is_free():
    sched = _sched()
    _admit(sched, 2, 0.0)
    dispatches, dropped, _ = sched.poll(0.0)
    assert [len(d.rows) for d in dispatches] == [2] and not dropped


def test_rows_of_several_requests_merge_into_the_plans_batch_and_the_rest_waits_for_a_slot():
    sched = _sched()
    first, = sched.poll(_admit(sched, 3, 0.0).arrival)[0]   # slot taken by a batch of 3
    for tag in (1, 2, 3):
        _admit(sched, 2, 0.001, tag)
    assert sched.poll(0.002)[0] == []                         # no free slot: the rows wait
    _run_split1(sched, first, exits={0, 1, 2}, now=0.01)
    batch, = sched.poll(0.01)[0]
    assert len(batch.rows) == 4 and {r.job.handle[1] for r in batch.rows} == {1, 2}  # two requests, one batch


def test_a_later_split_waits_for_a_full_batch_while_upstream_is_busy_then_its_delay_forces_it():
    sched = _sched(batches=(4, 4), slots=(2, 1), delays_s=(0.0, 0.05))
    a = sched.poll(_admit(sched, 4, 0.0, 1).arrival)[0][0]
    sched.poll(_admit(sched, 4, 0.0, 2).arrival)             # a second batch keeps split 1 busy
    _run_split1(sched, a, exits={0, 1}, now=0.01)          # 2 survivors reach split 2; the other batch runs
    dispatches, _, wake = sched.poll(0.01)
    assert dispatches == [] and wake == pytest.approx(0.06)  # waits for a fuller batch, at most its delay
    assert [len(d.rows) for d in sched.poll(0.0601)[0]] == [2]


def test_a_later_split_goes_at_once_when_nothing_upstream_can_fill_it():
    sched = _sched(delays_s=(0.0, 10.0))
    a = sched.poll(_admit(sched, 4, 0.0).arrival)[0][0]
    _run_split1(sched, a, exits={0}, now=0.01)
    assert [len(d.rows) for d in sched.poll(0.01)[0]] == [3]


def test_the_slo_forces_a_partial_batch_before_its_delay_would():
    sched = _sched(batches=(4, 8), slots=(2, 1), delays_s=(0.0, 10.0), slo_s=0.1, slack=0.2)
    a = sched.poll(_admit(sched, 4, 0.0, 1).arrival)[0][0]
    sched.poll(_admit(sched, 4, 0.0, 2).arrival)             # keeps split 1 busy
    _run_split1(sched, a, exits={0}, now=0.01, ms=10.0)
    sched.queues[1].observe(8, 30.0)                          # split 2 is known to take ~30 ms at batch 8
    _, _, wake = sched.poll(0.011)
    # target = 0 + 0.1 * 0.8 = 0.08 s; split 2 needs ~30 ms: it must go by 0.05 s
    assert wake == pytest.approx(0.08 - sched.remaining_ms(1) / 1e3)
    assert sched.poll(wake - 1e-4)[0] == []
    assert [len(d.rows) for d in sched.poll(wake)[0]] == [3]


def test_each_request_is_answered_when_its_own_rows_are_decided():
    sched = _sched(batches=(8, 8))
    easy = _admit(sched, 2, 0.0, 1)
    hard = _admit(sched, 2, 0.0, 2)
    d, = sched.poll(0.0)[0]
    done = _run_split1(sched, d, exits={0, 1}, now=0.01)     # the easy request's two rows exit
    assert done == [easy] and easy.exit_ramp.tolist() == [2, 2] and hard.pending == 2
    d2, = sched.poll(0.01)[0]
    assert _run_last(sched, d2, now=0.02) == [hard] and hard.exit_ramp.tolist() == [L, L]


def test_only_rows_that_will_miss_are_dropped_and_a_dropped_requests_other_rows_are_left_behind():
    sched = _sched(batches=(2, 2), slo_s=0.05)
    for _ in range(WARM_BATCHES + 1):                         # (the first batch is not learnt)
        sched.queues[0].observe(2, 20.0)                      # split 1 takes ~20 ms
    late = _admit(sched, 3, 0.0, 1)
    on_time = _admit(sched, 1, 0.04, 2)
    dispatches, dropped, _ = sched.poll(0.04)                  # 0.04 + 0.02 > 0.05: the first job will miss
    assert dropped == [late] and late.failed == "deadline"
    assert [r.job for d in dispatches for r in d.rows] == [on_time]


def test_a_failed_batch_drops_its_jobs_once_and_their_other_rows_are_never_answered():
    sched = _sched(batches=(2, 2), slots=(2, 1))
    job = _admit(sched, 3, 0.0)
    a, b = sched.poll(0.0)[0]
    assert sched.abandon(a, "error") == [job]
    assert _run_split1(sched, b, exits=set(), now=0.01) == []  # its last row is not answered again...
    assert not sched.queues[1].rows and sched.poll(0.01)[0] == []  # ...nor sent on


def test_the_first_batch_is_not_learnt_and_nothing_is_dropped_early_on_a_guess():
    q = SplitQueue(8, 1, 0.0)
    q.observe(8, 2000.0)                                      # a cold first run
    assert q.expected_ms(8) == 0.0
    sched = _sched(batches=(2, 2), slo_s=0.05)
    for _ in range(WARM_BATCHES - 1):
        sched.queues[0].observe(2, 40.0)                      # not yet trusted for drops
    job = _admit(sched, 1, 0.0)
    dispatches, dropped, _ = sched.poll(0.02)                 # 0.02 + 0.04 > 0.05, but still warming up
    assert not dropped and [r.job for d in dispatches for r in d.rows] == [job]


def test_expected_time_learns_a_fixed_and_a_per_row_part():
    q = SplitQueue(8, 1, 0.0)
    for _ in range(200):
        q.observe(2, 2.0 + 1.0 * 1)
        q.observe(8, 2.0 + 1.0 * 7)
    assert q.expected_ms(2) == pytest.approx(3.0, rel=0.05)
    assert q.expected_ms(8) == pytest.approx(9.0, rel=0.05)


def test_one_stalled_batch_does_not_make_the_split_look_that_slow():
    q = SplitQueue(8, 1, 0.0)
    for _ in range(50):
        q.observe(8, 5.0)
    q.observe(8, 1000.0)                                      # one batch stalled (a model loading beside it)
    assert q.expected_ms(8) < 5.0 * (1 + 1.1 * (OUTLIER_X - 1) * EWMA_ALPHA)   # unclipped: ~105 ms
    for _ in range(40):                                       # a split that really became slower is followed
        q.observe(8, 50.0)
    assert q.expected_ms(8) == pytest.approx(50.0, rel=0.05)


def test_a_row_is_dropped_by_the_batch_it_can_go_in_now_not_the_plans_full_batch():
    sched = _sched(batches=(8, 8), slo_s=0.05)
    for _ in range(10):
        sched.queues[0].observe(1, 5.0)
        sched.queues[0].observe(8, 40.0)                      # 5 ms for one row, 40 ms for eight
    job = _admit(sched, 1, 0.0)
    dispatches, dropped, _ = sched.poll(0.02)                 # 0.02 + 0.040 > 0.05, but 0.02 + 0.005 is not
    assert not dropped and [r.job for d in dispatches for r in d.rows] == [job]


def test_stack_keeps_row_order_and_rule_state():
    sched = _sched()
    job = sched.job("r", 3, 0.0, C)
    sched.admit(job, {"x": np.arange(6).reshape(3, 2)}, {"count": np.array([0, 1, 2])}, 0.0)
    d, = sched.poll(0.0)[0]
    feed, rule = Scheduler.stack(d.rows)
    assert feed["x"].tolist() == [[0, 1], [2, 3], [4, 5]] and rule["count"].tolist() == [0, 1, 2]


def test_a_partial_batch_never_queues_behind_a_busy_instance():
    # 1 instance, 2 slots: a full batch may wait in Triton's queue, a partial one may not (Triton's
    # batcher would merge it with the batch behind it).
    sched = Scheduler([SplitQueue(4, 2, 0.0, partial_slots=1)], 1.0, 0.2)
    _admit(sched, 4, 0.0)
    assert [len(d.rows) for d in sched.poll(0.0)[0]] == [4]
    _admit(sched, 4, 0.0, 1)
    assert [len(d.rows) for d in sched.poll(0.0)[0]] == [4]   # full: takes the second slot
    sched.queues[0].in_flight = 1
    _admit(sched, 2, 0.0, 2)
    assert sched.poll(0.0)[0] == []                            # partial: waits for the free instance
    sched.queues[0].in_flight = 0
    assert [len(d.rows) for d in sched.poll(0.0)[0]] == [2]
