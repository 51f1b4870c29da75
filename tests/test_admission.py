"""Elastic admission batching (E²bird), the pure policies: N-Ebird and E-Ebird decide which idle workers
take the staged inputs (no server)."""

from __future__ import annotations

import itertools
import random

import pytest

from e3.serving.ebird.policy import (NAIVE_ENGINE, EEbird, NEbird, best_worker_sets, engine_for, make_policy,
                                  max_batch_for_qos, worker_sets)


def test_n_ebird_takes_the_largest_workers_that_fit_and_moves_on_after_each_launch():
    policy = NEbird(NAIVE_ENGINE, 32)
    launched = policy.launch(12)
    assert [size for _, size in launched] == [8, 4]                 # 12 = 8 + 4, fewest launches
    assert len({w for w, _ in launched}) == 2 and policy.inflight == 12
    # the paper's Fig. 10: the worker of 8 still runs, 4 more inputs are staged -> the worker of 4... busy,
    # so the next largest that fits: 2 + 1 + 1
    assert [size for _, size in policy.launch(4)] == [2, 1, 1]
    assert policy.launch(5) == []                                   # only the worker of 16 is idle: waits


def test_n_ebird_never_exceeds_max_inflight_and_a_finished_worker_is_idle_again():
    policy = NEbird(NAIVE_ENGINE, 16)
    first = policy.launch(40)
    assert sum(size for _, size in first) == 16 and policy.inflight == 16
    assert policy.launch(40) == []                                  # the cap is reached
    w, size = first[0]
    policy.done(w)
    assert policy.inflight == 16 - size
    assert sum(s for _, s in policy.launch(40)) == size             # exactly the room freed
    with pytest.raises(ValueError, match="not running"):
        policy.done(99)


def test_every_launch_is_valid_and_leaves_no_idle_worker_that_still_fits():
    rng = random.Random(0)
    for _ in range(500):
        engine = tuple(rng.choice([1, 2, 4, 8, 16]) for _ in range(rng.randint(1, 7)))
        cap = rng.randint(min(engine), 40)
        policy = NEbird(engine, cap)
        for _ in range(rng.randint(1, 6)):
            if policy.busy and rng.random() < 0.4:
                policy.done(rng.choice(sorted(policy.busy)))
            staged = rng.randint(0, 40)
            busy_before, inflight_before = set(policy.busy), policy.inflight
            launched = policy.launch(staged)
            ids = [w for w, _ in launched]
            assert len(ids) == len(set(ids)) and not set(ids) & busy_before       # each idle worker once
            assert all(engine[w] == size for w, size in launched)
            used = sum(size for _, size in launched)
            room = min(staged, cap - inflight_before)
            assert used <= max(room, 0) and policy.inflight == inflight_before + used <= cap
            idle = [w for w in range(len(engine)) if w not in policy.busy]
            assert all(engine[w] > room - used for w in idle)                     # nothing left that fits


def test_worker_sets_are_every_power_of_two_multiset_with_the_total():
    for total, most in [(4, 4), (8, 3), (16, 4), (32, 4)]:
        sizes = [1, 2, 4, 8, 16, 32]
        brute = {tuple(sorted(c, reverse=True)) for n in range(1, most + 1)
                 for c in itertools.combinations_with_replacement(sizes, n) if sum(c) == total}
        got = worker_sets(total, most)
        assert len(got) == len(set(got)) and set(got) == brute
    assert (8, 8) in worker_sets(16, 2) and (32,) in worker_sets(32, 1)


def test_the_offline_phase_keeps_the_fastest_set_per_total_and_the_engine_holds_them_all():
    profile = {(4,): 9.0, (2, 2): 7.0, (2, 1, 1): 8.0, (8,): 20.0, (4, 4): 15.0, (16,): 40.0, (8, 8): 41.0}
    confs = best_worker_sets(profile)
    assert confs == {4: (2, 2), 8: (4, 4), 16: (16,)}
    assert engine_for(confs) == (16, 4, 4, 2, 2, 1)                  # union, plus the low-load 1 and 2
    policy = make_policy("e-ebird", confs=confs)
    assert isinstance(policy, EEbird) and policy.max_inflight == 16


def test_e_ebird_launches_only_the_configuration_for_the_current_load():
    policy = EEbird((16, 4, 4, 2, 2, 1), 16, confs={4: (2, 2), 8: (4, 4), 16: (16,)})
    assert policy.current_total(3) == 4 and policy.current_total(6) == 8 and policy.current_total(99) == 16
    assert sorted(s for _, s in policy.launch(8)) == [4, 4]          # load 8: two workers of 4, not one of 8
    policy = EEbird((16, 4, 4, 2, 2, 1), 16, confs={4: (2, 2), 8: (4, 4), 16: (16,)})
    assert [s for _, s in policy.launch(16)] == [16]                 # load 16: the single worker of 16
    policy = EEbird((16, 4, 4, 2, 2, 1), 16, confs={4: (2, 2), 8: (4, 4), 16: (16,)})
    assert sorted(s for _, s in policy.launch(3)) == [1, 2]          # load 3 -> TotalBS 4: 2 + the low-load 1


def test_e_ebird_keeps_the_low_load_workers_for_the_lowest_load_only():
    confs = {4: (2, 2), 8: (4, 4), 16: (8, 8), 32: (16, 16)}
    policy = EEbird((16, 16, 8, 8, 4, 4, 2, 2, 1), 32, slots=2, confs=confs)
    assert [s for _, s in policy.launch(20)] == [16]                # load 20 -> TotalBS 32: one worker of 16
    assert policy.launch(5) == []          # load 21: the other 16 waits for its batch; no 2 or 1 takes a slot
    assert [s for _, s in policy.launch(16)] == [16]
    policy = EEbird((16, 16, 8, 8, 4, 4, 2, 2, 1), 32, slots=2, confs=confs)
    assert sorted(s for _, s in policy.launch(3)) == [1, 2]          # the lowest load: the low-load workers too


def test_e_ebird_never_leaves_inputs_staged_while_nothing_runs():
    # the configuration for TotalBS 8 is one worker of 8: 6 staged inputs and no worker running -> the
    # largest idle worker that fits takes them rather than waiting for arrivals that may never come
    policy = EEbird((8, 4, 2, 2, 1), 8, slots=2, confs={4: (2, 2), 8: (8,)})
    assert [s for _, s in policy.launch(6)] == [4, 2]
    rng = random.Random(1)
    for _ in range(300):
        policy = EEbird((16, 8, 8, 4, 2, 2, 1), 16, slots=rng.choice([None, 1, 2]),
                        confs={4: (4,), 8: (8,), 16: (8, 8)})
        for _ in range(8):
            if policy.busy and rng.random() < 0.5:
                policy.done(rng.choice(sorted(policy.busy)))
            staged = rng.randint(0, 20)
            policy.launch(staged)
            assert policy.busy or staged == 0


def test_bad_settings_are_refused_with_what_is_wrong():
    with pytest.raises(ValueError, match="powers of two"):
        NEbird((3, 1), 8)
    with pytest.raises(ValueError, match="nothing could ever run"):
        NEbird((4,), 2)
    with pytest.raises(ValueError, match="cannot hold"):
        EEbird((4, 2, 1), 8, confs={8: (4, 4)})
    with pytest.raises(ValueError, match="unknown admission policy 'fifo'"):
        make_policy("fifo")
    with pytest.raises(ValueError, match="offline configurations"):
        make_policy("e-ebird")


def test_max_batch_for_qos_leaves_room_for_one_batch_ahead():
    latency = {1: 5.0, 2: 8.0, 4: 14.0, 8: 26.0, 16: 50.0}
    assert max_batch_for_qos(latency, 60.0) == 8
    assert max_batch_for_qos(latency, 100.0) == 16
    with pytest.raises(ValueError, match="no batch meets the QoS target"):
        max_batch_for_qos(latency, 9.0)


def test_slots_cap_the_workers_running_at_once_and_a_freed_slot_takes_what_is_staged_then():
    policy = NEbird(NAIVE_ENGINE, 32, slots=2)
    assert [s for _, s in policy.launch(31)] == [16, 8]             # two processes: two batches, the rest waits
    assert policy.launch(31) == []                                  # both slots busy, room or not
    policy.done(sorted(policy.busy)[0])                             # the worker of 8 finished
    assert [s for _, s in policy.launch(7)] == [4]                  # one slot free: one batch, the 4 of 7
    e = EEbird((8, 8, 4, 4, 2, 2, 1), 16, slots=2, confs={4: (2, 2), 8: (4, 4), 16: (8, 8)})
    assert sorted(s for _, s in e.launch(16)) == [8, 8] and e.launch(16) == []
    with pytest.raises(ValueError, match="slots must be >= 1"):
        NEbird(NAIVE_ENGINE, 32, slots=0)
    assert make_policy("n-ebird", slots=3).slots == 3
