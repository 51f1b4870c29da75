"""ExeGPT's front-door decisions (generation/exegpt/scheduler.py), pure: RRA's phases around the engine, RRA or
WAA by the same branch-and-bound, the served profiles from timed steps, and re-planning when the output lengths
shift. No server; about a second."""

from __future__ import annotations

import math

import pytest

from e3.generation.exegpt.scheduler import (LengthWatch, ReplanPolicy, RraSchedule, RraScheduler, StepTimes,
                                            best_static, choose_rra)
from e3.generation.exegpt.simulator import Workload, simulate_rra
from e3.generation.exegpt.workload import LayerProfile, LengthDistribution


def served_like(decode_base_ms: float = 6.0, per_row_ms: float = 0.15, prefill_base_ms: float = 6.0,
                per_token_ms: float = 0.02) -> LayerProfile:
    """A whole-model step profile shaped like the served tiny model's: a large fixed cost per step."""
    return LayerProfile.from_dict({"num_layers": 1,
                                   "prefill": {"tokens": [8, 256], "ms": [prefill_base_ms + per_token_ms * t
                                                                          for t in (8, 256)]},
                                   "decode": {"batch": [1, 64], "ms": [decode_base_ms + per_row_ms * b
                                                                       for b in (1, 64)]}})


LENGTHS = LengthDistribution.from_samples(list(range(2, 17)))
BATCHES = tuple(range(1, 17))


def make(bound_ms: float = math.inf, **policy) -> RraScheduler:
    return RraScheduler(served_like(), LENGTHS, 8, BATCHES, bound_ms, ReplanPolicy(**policy), clock=lambda: 0.0)


def run_phases(s: RraScheduler, waiting: int, steps: int, active_after=lambda admitted, active: active + admitted):
    """Drive admissions for ``steps`` steps with ``waiting`` requests queued; the admissions per step."""
    out, active = [], 0
    for _ in range(steps):
        n = s.admissions(waiting, active)
        waiting -= n
        active = active_after(n, active)
        out.append(n)
        s.stepped(0, 0, 1.0)
    return out


def test_phases_admit_a_batch_then_run_the_decode_steps():
    s = make()
    s.pin(RraSchedule(batch_size=3, decode_iters=4))
    assert run_phases(s, waiting=100, steps=12) == [3, 0, 0, 0] * 3
    s.pin(RraSchedule(batch_size=3, decode_iters=1))       # N_D = 1: admissions before every step
    assert run_phases(s, waiting=7, steps=4) == [3, 3, 1, 0]


def test_a_phase_starts_at_once_when_nothing_is_active_and_admits_what_waits():
    s = make()
    s.pin(RraSchedule(batch_size=4, decode_iters=10))
    # every admitted sequence finishes after one step: the engine never idles while requests wait
    assert run_phases(s, waiting=6, steps=4, active_after=lambda n, a: 0) == [4, 2, 0, 0]
    assert s.admissions(0, 0) == 0


def test_served_profile_fits_pure_steps_only():
    st = StepTimes(min_points=2)
    for rows in (1, 4, 8):
        for _ in range(2):
            st.record(0, rows, 5.0 + 0.5 * rows)       # decode alone
    assert st.profile() is None                      # no prefill sizes yet
    for tokens in (8, 32):
        for _ in range(2):
            st.record(tokens, 0, 4.0 + 0.1 * tokens)  # prefill alone
    st.record(32, 8, 1000.0)                          # both in one step: not counted
    p = st.profile()
    assert p.num_layers == 1
    assert p.decode_layer_ms(4) == pytest.approx(7.0) and p.decode_layer_ms(16) == pytest.approx(13.0)
    assert p.prefill_layer_ms(32) == pytest.approx(7.2)


def test_plans_meet_the_bound_net_of_slack_and_beat_the_static_batch():
    w = Workload(served_like(), LengthDistribution.fixed(8), LENGTHS, workers=1)
    floor = simulate_rra(w, 1, 16).latency_ms
    s = make(bound_ms=5 * floor, slack=0.2)
    assert not s.pinned and s.feasible and s.history[-1]["profile"] == "offline"
    chosen = simulate_rra(w, s.schedule.batch_size, s.schedule.decode_iters)
    assert chosen.latency_ms <= 0.8 * 5 * floor
    static = best_static(served_like(), 8, LENGTHS, bound_ms=0.8 * 5 * floor, batch_sizes=BATCHES)
    assert static.config[1] == 16 and chosen.throughput_seq_s >= static.throughput_seq_s
    assert chosen.config[1] < 16    # with a large fixed cost per step, refilling the batch pays
    # a looser bound never lowers throughput; a bound nothing meets puts the lowest-latency schedule in force
    s.set_bound(10 * floor)
    assert simulate_rra(w, *s.schedule.__dict__.values()).throughput_seq_s >= chosen.throughput_seq_s
    s.set_bound(0.5 * floor)
    assert not s.feasible and s.schedule == RraSchedule(1, 16)
    assert s.status()["feasible"] is False and s.status()["bound_ms"] == pytest.approx(0.5 * floor)


def test_length_watch_judges_mean_and_p99_against_the_plan():
    w = LengthWatch(ReplanPolicy(window=20, min_samples=10, threshold=0.25), LENGTHS)   # mean 9, p99 16
    for _ in range(9):
        w.observe(2)
    assert w.shift() is None                                 # too few samples
    w.observe(2)
    assert w.shift()["mean"] == pytest.approx(2 / 9 - 1)
    w.rebase(LengthDistribution.fixed(2))
    assert w.shift() is None and not w.seen
    for n in [2] * 9 + [3]:                                  # p99 2 -> 3 (+50%), mean +5%
        w.observe(n)
    assert w.shift()["p99"] == pytest.approx(0.5)


def test_a_length_shift_re_plans_with_the_same_branch_and_bound():
    w = Workload(served_like(), LengthDistribution.fixed(8), LENGTHS, workers=1)
    bound = 5 * simulate_rra(w, 1, 16).latency_ms
    s = make(bound_ms=bound, window=40, min_samples=20, threshold=0.25)
    before = s.schedule
    short = list(range(2, 17)) * 2
    assert not any(s.finished(n) for n in short) and s.schedule == before   # as planned: no re-plan
    # one sequence of 32 tokens moves the window's p99 from 16 to 32: re-planned at once, for what was seen
    assert s.finished(32) and s.status()["replans"] == 1
    h = s.history[-1]
    assert h["reason"].startswith("lengths shifted") and h["p99_length"] == 32
    seen = LengthDistribution.from_samples(short + [32])
    assert s.schedule == RraSchedule(*choose_rra(served_like(), 8, seen, bound_ms=0.8 * bound, batch_sizes=BATCHES).config)
    # then every sequence is long: after min_samples more, the mean has moved too, and it re-plans again
    replans = [s.finished(32) for _ in range(20)]
    assert replans == [False] * 19 + [True] and s.status()["replans"] == 2
    long = LengthDistribution.fixed(32)
    assert s.schedule == RraSchedule(*choose_rra(served_like(), 8, long, bound_ms=0.8 * bound, batch_sizes=BATCHES).config)
    assert s.schedule != before and s.watch.planned == long
    # a pinned schedule is held whatever the lengths do
    s.pin(RraSchedule(2, 2))
    assert not any(s.finished(2) for _ in range(40)) and s.schedule == RraSchedule(2, 2)


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="batch_size >= 1"):
        RraSchedule(0, 4)
    with pytest.raises(ValueError, match="min_samples"):
        ReplanPolicy(window=10, min_samples=20)
    with pytest.raises(ValueError, match="bound_ms"):
        RraScheduler(served_like(), LENGTHS, 8, BATCHES, bound_ms=0)


# -- WAA beside RRA (the door's choice between them) ---------------------------------------------------------
def _waa_steps(s, decode_base_ms: float, per_row_ms: float, encode_ms: float) -> None:
    """Feed the scheduler WAA's timed encode passes and decode iterations (3 of each size)."""
    for _ in range(3):
        for tokens in (32, 128):
            s.encoded(tokens, encode_ms)
        for rows in (10, 40, 160):
            s.decoded(rows, decode_base_ms + per_row_ms * rows)


def make_both(bound_ms: float = math.inf, **policy):
    from e3.generation.exegpt.scheduler import ExegptScheduler
    return ExegptScheduler(served_like(), LENGTHS, 8, BATCHES, bound_ms, ReplanPolicy(**policy), clock=lambda: 0.0,
                           schedules=("rra", "waa"))


def test_the_planner_chooses_rra_or_waa_by_the_same_branch_and_bound():
    from e3.generation.exegpt.scheduler import WaaSchedule, choose_waa, predict_waa
    from e3.generation.exegpt.search import grid_search, waa_space
    floor = simulate_rra(Workload(served_like(), LengthDistribution.fixed(8), LENGTHS), 1, 16).latency_ms
    s = make_both(bound_ms=8 * floor)
    # before WAA has run, it is predicted from RRA's profile (a decode iteration = a decode step), where two
    # workers beat one: the encode pass leaves the decode worker's path
    assert s.waa_profiles()[2] == "offline"
    cands = s.history[-1]["candidates"]
    assert s.schedule.kind == "waa" and cands["waa"]["predicted_seq_s"] > cands["rra"]["predicted_seq_s"]
    # WAA's own served profile, slow (contention: its decode iterations cost 3x RRA's steps): RRA wins
    _waa_steps(s, decode_base_ms=18.0, per_row_ms=0.45, encode_ms=20.0)
    assert s.waa_profiles()[2] == "served-waa"
    assert s.replan("asked").kind == "rra" and s.status()["kind"] == "rra"
    # the WAA candidate is B&B's answer, the grid's optimum over the same space
    waa = s.waa_steps.profile()
    tail = s.waa_steps.profile(s.policy.latency_quantile)
    net = 0.8 * 8 * floor
    best = choose_waa(waa, 8, LENGTHS, bound_ms=net, batch_sizes=BATCHES, latency_profile=tail)
    grid = grid_search(None, waa_space(BATCHES, 1), net,
                       evaluate=lambda c: predict_waa(waa, 8, LENGTHS, schedule=c, latency_profile=tail)).best
    assert s.history[-1]["candidates"]["waa"]["schedule"] == list(best.config)
    assert best.throughput_seq_s >= 0.95 * grid.throughput_seq_s
    # fast WAA iterations: WAA again, and admissions go to the encode worker, B_E per decode iteration
    s2 = make_both(bound_ms=8 * floor)
    _waa_steps(s2, decode_base_ms=5.0, per_row_ms=0.1, encode_ms=6.0)
    assert s2.replan("asked").kind == "waa"
    sched = s2.schedule
    assert isinstance(sched, WaaSchedule) and s2.predict(sched).latency_ms <= net * 1.05
    assert s2.admissions(waiting=50, active=0) == 0 and s2.handover(50) == sched.batch_size
    assert s2.handover(1) == 1
    s2.pin(RraSchedule(4, 2))
    assert s2.handover(50) == 0 and s2.admissions(50, 0) == 4


def test_waa_re_plans_on_a_length_shift_too():
    s = make_both(bound_ms=math.inf, window=40, min_samples=20, threshold=0.25)
    _waa_steps(s, decode_base_ms=5.0, per_row_ms=0.1, encode_ms=6.0)
    s.replan("asked")
    assert s.schedule.kind == "waa"
    for _ in range(20):
        s.finished(40)
    h = s.history[-1]
    assert h["reason"].startswith("lengths shifted") and h["p99_length"] == 40 and set(h["candidates"]) == {"rra",
                                                                                                           "waa"}


def test_schedules_from_control_documents():
    from e3.generation.exegpt.scheduler import WaaSchedule, schedule_from_json
    assert schedule_from_json([4, 2]) == RraSchedule(4, 2) == schedule_from_json(["rra", 4, 2])
    assert schedule_from_json(["waa", 8, 1]) == WaaSchedule(8, 1)
    assert WaaSchedule(8).as_list() == ["waa", 8, 1] and RraSchedule(4, 2).as_list() == ["rra", 4, 2]
    for bad in (["waa", 8], ["xyz", 1, 1], [1.5, 2], ["waa", True, 1], "rra"):
        with pytest.raises(ValueError, match="schedule must be"):
            schedule_from_json(bad)
    with pytest.raises(ValueError, match="micro_batches must be <= 1"):
        schedule_from_json(["waa", 8, 2])
    with pytest.raises(ValueError, match="schedules must name"):
        RraScheduler(served_like(), LENGTHS, 8, BATCHES, schedules=("xyz",))
