"""The router's bounded admission, pure (no server): with ``max_queue_inputs`` set, a request that would
take the inputs held past the limit is refused at once; held inputs come back when a request is answered
or dropped, whichever way (finished, late, failed, the watchdog, unloading); unset, nothing changes."""

from __future__ import annotations

import numpy as np
import pytest

from e3.core.exits import EntropyRule
from e3.serving.policy import DEADLINE, ERROR, BatchRoute
from e3.serving.scheduler import Scheduler, SplitQueue, queue_limit

C, L = 2, 4
SURE, UNSURE = np.array([8.0, 0.0]), np.array([0.1, 0.0])


def _sched(limit, batches=(4, 4), slots=(1, 1), slo_s=1.0):
    return Scheduler([SplitQueue(b, s, 0.0) for b, s in zip(batches, slots)], slo_s, 0.2, max_queue_inputs=limit)


def _offer(sched, n, now=0.0, tag=0):
    """Admit a request of ``n`` inputs unless refused; returns (job or None, refusal or None)."""
    refused = sched.refusal(n)
    if refused is not None:
        return None, refused
    job = sched.job(("req", tag), n, now, C)
    sched.admit(job, {"x": np.zeros((n, 3), np.float32)}, {}, now)
    return job, None


def _finish(sched, d, exits, now=0.01):
    """Split ``d.split`` computed a ramp for the batch; rows in ``exits`` leave there (all of them at the last)."""
    n = len(d.rows)
    route = BatchRoute(n, C, L, EntropyRule(0.5))
    last = d.split == len(sched.queues) - 1
    logits = np.stack([SURE if last or i in exits else UNSURE for i in range(n)])
    ramp = L if last else 2
    feed = route.advance({f"ramp_{ramp}": logits, "x_out": np.zeros((n, 3), np.float32)}, (ramp,), ["x"])
    return sched.finish(d, route, None if last else feed, 5.0, now)


def test_unset_admits_everything_as_before():
    sched = _sched(None)
    for tag in range(50):
        assert _offer(sched, 64, tag=tag)[1] is None
    assert sched.held_inputs == 50 * 64


def test_a_request_that_would_exceed_the_limit_is_refused_and_one_that_fits_is_not():
    sched = _sched(10)
    assert _offer(sched, 6)[1] is None
    assert _offer(sched, 4, tag=1)[1] is None                   # exactly at the limit: admitted
    job, refused = _offer(sched, 1, tag=2)
    assert job is None and not refused.permanent
    assert "max_queue_inputs is 10" in refused.message and "10 inputs held" in refused.message
    assert sched.held_inputs == 10                               # a refusal takes nothing


def test_a_request_larger_than_the_limit_is_refused_for_good_even_when_empty():
    refused = _sched(8).refusal(9)
    assert refused.permanent and "at most 8 inputs per request" in refused.message


def test_answered_inputs_come_back_only_when_their_whole_request_is_answered():
    sched = _sched(8)
    a, _ = _offer(sched, 4, tag=0)
    b, _ = _offer(sched, 4, tag=1)
    assert _offer(sched, 1, tag=2)[1] is not None
    d, = sched.poll(0.0)[0]                                      # a's 4 rows (batch 4)
    done = _finish(sched, d, exits={0, 1})                       # 2 of a's rows answered, 2 go on
    assert done == [] and sched.held_inputs == 8                 # a not fully answered: still held
    d2 = [x for x in sched.poll(0.01)[0] if x.split == 1]
    done = _finish(sched, d2[0], exits=set(), now=0.02)
    assert done == [a] and sched.held_inputs == 4
    assert _offer(sched, 4, tag=3)[1] is None and _offer(sched, 1, tag=4)[1] is not None
    assert b.live


def test_dropped_requests_give_their_inputs_back_whatever_dropped_them():
    # late in a queue
    sched = _sched(8, slots=(0, 1), slo_s=0.1)                   # split 1 never dispatches: rows wait
    _offer(sched, 5)
    _, dropped, _ = sched.poll(0.2)
    assert len(dropped) == 1 and dropped[0].failed == DEADLINE and sched.held_inputs == 0
    # a failed batch
    sched = _sched(8)
    _offer(sched, 3)
    d, = sched.poll(0.0)[0]
    assert [j.n for j in sched.abandon(d, ERROR)] == [3] and sched.held_inputs == 0
    # the watchdog, then the late return of the hung call takes nothing back twice
    sched = _sched(8, slo_s=0.1)
    _offer(sched, 4)
    d, = sched.poll(0.0)[0]
    assert len(sched.expire(0.2)) == 1 and sched.held_inputs == 0
    _finish(sched, d, exits={0, 1, 2, 3}, now=0.3)
    assert sched.held_inputs == 0
    # unloading
    sched = _sched(8)
    _offer(sched, 4, tag=0)
    sched.poll(0.0)
    _offer(sched, 3, tag=1)
    assert len(sched.fail_all(ERROR)) == 2 and sched.held_inputs == 0


def test_held_inputs_match_the_live_requests_through_a_random_run():
    rng = np.random.default_rng(7)
    sched = _sched(24, batches=(4, 4), slots=(2, 2), slo_s=0.5)
    jobs, running, now, refused = [], [], 0.0, 0
    for step in range(400):
        now += 0.005
        job, refusal = _offer(sched, int(rng.integers(1, 9)), now, step)
        refused += refusal is not None
        jobs += [job] if job else []
        running += sched.poll(now)[0]
        for d in [d for d in running if rng.random() < 0.3]:   # batches return in any order, some fail
            running.remove(d)
            if rng.random() < 0.1:
                sched.abandon(d, ERROR)
            else:
                _finish(sched, d, exits=set(np.flatnonzero(rng.random(len(d.rows)) < 0.5)), now=now)
        sched.expire(now)
        assert sched.held_inputs == sum(j.n for j in jobs if j.live) <= 24
    assert refused > 0 and any(j.answered for j in jobs)


@pytest.mark.parametrize("text, limit", [(None, None), ("", None), (" 128 ", 128), ("1", 1)])
def test_the_parameter_reads_as_a_limit(text, limit):
    assert queue_limit(text) == limit


@pytest.mark.parametrize("text", ["0", "-4", "1.5", "many"])
def test_a_bad_parameter_is_refused_naming_it(text):
    with pytest.raises(ValueError, match="max_queue_inputs must be a positive integer"):
        queue_limit(text)
    with pytest.raises(ValueError, match="max_queue_inputs"):
        Scheduler([SplitQueue(4, 1, 0.0)], 1.0, 0.2, max_queue_inputs=0)


def test_export_writes_the_limit_into_the_routers_config_and_refuses_a_bad_one(tmp_path):
    from e3.export.repository import ExportError, ExportSettings, export_repository
    from e3.serving.scheduler import MAX_QUEUE_INPUTS
    with pytest.raises(ExportError, match="max_queue_inputs must be at least 1"):
        export_repository("tiny-ee", "2", tmp_path / "bad", settings=ExportSettings(max_queue_inputs=0), progress=False)
    export_repository("tiny-ee", "2", tmp_path / "repo", settings=ExportSettings(max_queue_inputs=96, baselines=False),
                      progress=False)
    config = (tmp_path / "repo" / "tiny_ee_router" / "config.pbtxt").read_text()
    assert f'key: "{MAX_QUEUE_INPUTS}"\n  value {{\n    string_value: "96"' in config
