"""The controller's decisions without Triton: margin, drift, pin, backoff, history atomicity,
stragglers, dead stubs, and the order of operations (load, switch, drain, unload)."""

from __future__ import annotations

import dataclasses
import json
import itertools
import os
import threading

import numpy as np
import pytest

from e3.controller.applier import ServerControl, ServerView
from e3.controller.decisions import backoff_delay_s, decide, layout, plan_diff, same_layout, score_plan
from e3.controller.forecast import make_forecaster
from e3.controller.health import SplitStats, exclude_stragglers, failed_requests, find_stragglers
from e3.deploy.stubs import is_dead_stub
from e3.controller.history import HistoryError, PlanHistory
from e3.controller.loop import Clock, Controller, ProfilePlanner
from e3.controller.planner import PlanOptions, best_plan
from e3.controller.recording_applier import RecordingApplier
from e3.controller.report import describe_report, status_lines
from e3.controller.settings import ControlSettings
from e3.controller.telemetry import Window
from e3.controller.triton_applier import probe_inputs, with_split_settings
from e3.core import cost
from e3.core.plan import default_plan
from e3.core.profile import BatchProfile
from helpers import DEVICES, RATE_RPS, SLO_MS, synthetic_profile

MODEL = "tiny_ee"
EXIT_RULE = {"kind": "entropy", "tau_nats": 0.7412}
RAMPS = (1, 2, 3)
EASY = [1.0, 0.15, 0.10, 0.08]   # most inputs exit at ramp 1
HARD = [1.0, 0.90, 0.85, 0.80]   # most inputs reach the head


def make_planner(latency=None) -> ProfilePlanner:
    # constant splits only: with compact splits this CPU-like profile gives both mixes one compact split
    # (tests/test_split_forms.py covers the forms); the controller's scenarios need two plans
    return ProfilePlanner(latency or synthetic_profile(), exit_rule=EXIT_RULE, ramp_blocks=RAMPS, slo_ms=SLO_MS,
                          rate_rps=RATE_RPS, forms=("constant",))


def ranges(plan) -> list[tuple[int, int, int]]:
    return [(s.first_block, s.last_block, s.instances) for s in plan.splits]


def window(reach, inputs=512.0) -> Window:
    profile = None if reach is None else BatchProfile(MODEL, 8, list(reach), source="test")
    return Window(model=MODEL, duration_s=2.0, inputs=0.0 if reach is None else inputs, batches=64.0, dropped=0.0,
                  reached={}, exited={}, reset=False, profile=profile)


class ScriptedTelemetry:
    def __init__(self, reaches):
        self.reaches = list(reaches)

    def close_window(self) -> Window:
        return window(self.reaches.pop(0))


class FakeClock(Clock):
    def __init__(self):
        self.t = 1000.0

    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float, stop: threading.Event | None = None) -> None:
        self.t += max(0.0, seconds)


def initial_plan():
    return default_plan(MODEL, 4, [(1, 2), (3, 4)], exit_rule=EXIT_RULE, ramp_blocks=RAMPS, batch_size=8)


def make_controller(tmp_path, reaches, *, applier=None, pinned=None, **overrides):
    settings = ControlSettings(model=MODEL, devices=dict(DEVICES), slo_ms=SLO_MS, rate_rps=RATE_RPS,
                               window_s=2.0, state_dir=tmp_path, **overrides)
    applier = applier or RecordingApplier(initial_plan())
    clock = FakeClock()
    ctl = Controller(settings, telemetry=ScriptedTelemetry(reaches), forecaster=make_forecaster("last"),
                     planner=make_planner(), view=applier, control=applier, clock=clock, pinned=pinned)
    return ctl, applier, clock


# ------------------------------------------------------------------------------------------- the profile

def _best_layout_by_brute_force(latency, reach, b0, ramps) -> list[tuple[int, int, int]]:
    """Every way to cut the 4 blocks into constant splits with instances on at most DEVICES' 2 cpus, priced by
    the cost model at the planner's B0 and ramps, no instance given more inputs than the profile measured: the
    fastest within SLO x (1 - slack) (ties: fewer splits)."""
    best, best_key = None, None
    for mask in range(8):                       # a cut after block k when bit k-1 is set (k = 1..3)
        cuts = [k for k in (1, 2, 3) if mask >> (k - 1) & 1]
        bounds = list(zip([1] + [c + 1 for c in cuts], cuts + [4]))
        for instances in itertools.product((1, 2), repeat=len(bounds)):
            if sum(instances) > DEVICES["cpu"]:
                continue
            layout = [(a, b, m) for (a, b), m in zip(bounds, instances)]
            pc = cost.plan_cost(latency, reach, [(a, b, "cpu", m) for a, b, m in layout], b0=b0, rate_rps=RATE_RPS, ramps=ramps)
            if pc.latency_ms > SLO_MS * 0.8 or max(s.batch_per_instance for s in pc.stages) > latency.batch_sizes[-1]:
                continue
            key = (round(pc.throughput_rps, 6), -len(layout))
            if best_key is None or key > best_key:
                best, best_key = layout, key
    return best


def test_easy_and_hard_mixes_have_different_optimal_plans():
    """Each mix's plan is the brute-force best layout at its B0 and ramps, the two differ, and each is the
    better of the two under its own mix."""
    latency, planner = synthetic_profile(), make_planner()
    plans = {}
    for name, reach in (("easy", EASY), ("hard", HARD)):
        plan = plans[name] = planner.plan(BatchProfile(MODEL, 8, reach), DEVICES)
        b0 = float(plan.predicted["input_batch_size"])
        assert ranges(plan) == _best_layout_by_brute_force(latency, reach, b0, plan.enabled_ramps)
    assert ranges(plans["easy"]) != ranges(plans["hard"])
    for name, reach in (("easy", EASY), ("hard", HARD)):
        other = plans["hard" if name == "easy" else "easy"]
        mine = score_plan(latency, BatchProfile(MODEL, 8, reach), plans[name], rate_rps=RATE_RPS)
        assert mine > score_plan(latency, BatchProfile(MODEL, 8, reach), other, rate_rps=RATE_RPS)


@pytest.mark.parametrize("reach", [EASY, HARD, [1.0, 0.5, 0.45, 0.4]])
def test_score_plan_reproduces_the_planners_prediction(reach):
    latency = synthetic_profile()
    batch = BatchProfile(MODEL, 8, reach)
    result = best_plan(latency, batch, DEVICES, PlanOptions(slo_ms=SLO_MS, rate_rps=RATE_RPS))
    plan = result.to_plan(model=MODEL, num_blocks=4, exit_rule=EXIT_RULE, ramp_blocks=RAMPS, slo_ms=SLO_MS,
                          slack=0.2)
    assert score_plan(latency, batch, plan, rate_rps=RATE_RPS) == pytest.approx(result.throughput_rps, rel=1e-9)


def test_score_plan_against_hand_computed_numbers():
    # Synthetic profile: block 2 + 0.25 B ms, ramps 0.5 ms (blocks 1-3), Tx 1 + 0.1 B ms, all linear in B.
    latency, easy = synthetic_profile(), BatchProfile(MODEL, 8, EASY)
    plan = initial_plan()   # no prediction: B0 = first split's batch 8 x 1 instance
    cut_after_1 = default_plan(MODEL, 4, [(1, 1), (2, 4)], exit_rule=EXIT_RULE, ramp_blocks=RAMPS, batch_size=8)
    # split 1-1 at 8: 4 + 0.5 = 4.5 ms; split 2-4 at 8 x 0.15 = 1.2: 3 x 2.3 + 2 x 0.5 = 7.9 ms, Tx 1.12 ms
    assert score_plan(latency, easy, cut_after_1, rate_rps=RATE_RPS) == pytest.approx(8000 / 7.9)
    # split 1-2 at 8: 2 x 4 + 2 x 0.5 = 9 ms; split 3-4 at 8 x 0.10 = 0.8 (P(1) below batch 1): 2 x 2.25 + 0.5
    assert score_plan(latency, easy, plan, rate_rps=RATE_RPS) == pytest.approx(8000 / 9.0)
    # B0 comes from the plan's prediction when it has one: 16 -> split 2-4 at 2.4: 3 x 2.6 + 1 = 8.8 ms
    predicted = dataclasses.replace(cut_after_1, predicted={"input_batch_size": 16.0})
    assert score_plan(latency, easy, predicted, rate_rps=RATE_RPS) == pytest.approx(16000 / 8.8)
    # one split 1-4 with 2 instances: B0 = 8 x 2, each instance 8: 4 x 4 + 3 x 0.5 = 17.5 ms
    wide = default_plan(MODEL, 4, [(1, 4)], exit_rule=EXIT_RULE, ramp_blocks=RAMPS, batch_size=8, instances=2)
    assert score_plan(latency, easy, wide, rate_rps=RATE_RPS) == pytest.approx(16000 / 17.5)
    # worst-case latency of cut_after_1: fill 7 / 2000 s = 3.5 ms + the hop into split 1 (the model inputs,
    # Tx at 8: 1.8 ms) + 4.5 + 7.9 + 1.12 = 18.82 ms
    assert score_plan(latency, easy, dataclasses.replace(cut_after_1, slo_ms=23.5), rate_rps=RATE_RPS) == 0.0   # 18.8 ms
    assert score_plan(latency, easy, dataclasses.replace(cut_after_1, slo_ms=23.6), rate_rps=RATE_RPS) > 0    # 18.88 ms
    # a batch profile of another model length cannot be scored
    assert score_plan(latency, BatchProfile(MODEL, 8, [1.0, 0.5, 0.2]), plan, rate_rps=RATE_RPS) is None


def test_score_plan_cannot_score_unknown_devices():
    plan = initial_plan()
    object.__setattr__(plan.splits[0], "device", "v100")
    assert score_plan(synthetic_profile(), BatchProfile(MODEL, 8, EASY), plan, rate_rps=RATE_RPS) is None


# ------------------------------------------------------------------------------------------- decide

def _two_plans():
    planner = make_planner()
    return planner.plan(BatchProfile(MODEL, 8, EASY), DEVICES), planner.plan(BatchProfile(MODEL, 8, HARD), DEVICES)


def test_decide_margin():
    easy, hard = _two_plans()
    kw = dict(candidate=hard, current=easy, drift=False, pinned=False, margin=0.10)
    assert not decide(candidate_rps=105.0, current_rps=100.0, **kw).apply
    assert not decide(candidate_rps=110.0, current_rps=100.0, **kw).apply      # "beats by 10%" is strict
    assert decide(candidate_rps=111.0, current_rps=100.0, **kw).apply
    assert decide(candidate_rps=130.0, current_rps=100.0, **{**kw, "margin": 0.25}).apply
    assert not decide(candidate_rps=120.0, current_rps=100.0, **{**kw, "margin": 0.25}).apply


def test_decide_drift_pin_same_layout_and_nothing_running():
    easy, hard = _two_plans()
    assert decide(candidate=hard, current=easy, candidate_rps=101.0, current_rps=100.0, drift=True,
                  pinned=False).apply
    assert not decide(candidate=hard, current=easy, candidate_rps=500.0, current_rps=100.0, drift=True,
                      pinned=True).apply
    again = make_planner().plan(BatchProfile(MODEL, 8, HARD), DEVICES)       # new plan_id, same layout
    assert again.plan_id != hard.plan_id and same_layout(again, hard)
    assert not decide(candidate=again, current=hard, candidate_rps=500.0, current_rps=100.0, drift=True,
                      pinned=False).apply
    assert decide(candidate=hard, current=None, candidate_rps=1.0, current_rps=None, drift=False,
                  pinned=False).apply
    assert decide(candidate=hard, current=easy, candidate_rps=1.0, current_rps=0.0, drift=False,
                  pinned=False).apply   # running plan breaks its SLO under the forecast


def test_plan_diff_names_added_removed_and_changed_splits():
    easy, hard = _two_plans()
    lines = plan_diff(easy, hard)
    assert any(line.startswith("+ tiny_ee_split_1-4 x2") for line in lines)
    assert "- tiny_ee_split_1-1" in lines and "- tiny_ee_split_2-4" in lines
    assert plan_diff(hard, hard) == ["= tiny_ee_split_1-4"]


def test_backoff_doubles_and_caps():
    assert [backoff_delay_s(n, 1.0, 8.0) for n in range(6)] == [0.0, 1.0, 2.0, 4.0, 8.0, 8.0]


def test_settings_are_validated_with_what_to_write():
    with pytest.raises(ValueError, match="e.g. 0.1"):
        ControlSettings(model=MODEL, devices=DEVICES, slo_ms=1, rate_rps=1, margin=-1).validate()
    with pytest.raises(ValueError, match=r"--devices cpu:2"):
        ControlSettings(model=MODEL, devices={}, slo_ms=1, rate_rps=1).validate()
    with pytest.raises(ValueError, match="window_s"):
        ControlSettings(model=MODEL, devices=DEVICES, slo_ms=1, rate_rps=1, window_s=0.1).validate()
    ControlSettings(model=MODEL, devices=DEVICES, slo_ms=1, rate_rps=1).validate()   # the defaults are valid


# ------------------------------------------------------------------------------------------- the loop

def test_mix_switch_applies_the_new_plan_in_order_and_unloads_after_the_drain(tmp_path):
    ctl, app, clock = make_controller(tmp_path, [EASY, EASY, HARD, HARD])
    r1 = ctl.step()
    assert r1.applied and ranges(app.plan) == [(1, 1, 1), (2, 4, 1)]
    # every split of the new plan is loaded before the switch; nothing is unloaded before it
    kinds = [c[0] for c in app.calls]
    assert kinds.index("switch") > max(i for i, k in enumerate(kinds) if k == "load")
    assert "unload" not in kinds                       # the drain (the SLO, 1 s) has not passed
    clock.t += 1.5
    r2 = ctl.step()
    assert not r2.applied and "running layout" in r2.decision
    assert ("unload", "tiny_ee_split_1-2") in app.calls and ("unload", "tiny_ee_split_3-4") in app.calls
    assert set(app.splits) == {"tiny_ee_split_1-1", "tiny_ee_split_2-4"}
    r3 = ctl.step()                                    # the first hard window
    assert r3.drift and r3.applied and ranges(app.plan) == [(1, 4, 2)]
    assert ranges(ctl.history.last_good) == [(1, 4, 2)] and len(ctl.history.entries) == 2
    assert r3.forecast == HARD and r3.forecast_for_window == EASY
    # the applied plan is the planner's plan for the forecast made from the observed window
    assert layout(app.plan) == layout(make_planner().plan(BatchProfile(MODEL, 8, r3.forecast), DEVICES))
    state = json.loads((tmp_path / "tiny_ee.state.json").read_text())
    assert state["report"]["window"] == 3 and state["report"]["applied"]


def test_a_small_gain_without_drift_is_not_applied(tmp_path):
    # 0.45 -> 0.40 moves neither the plan structure nor drift; the gain stays within 10%
    mid, mid2 = [1.0, 0.45, 0.4, 0.35], [1.0, 0.40, 0.36, 0.3]
    ctl, app, clock = make_controller(tmp_path, [mid, mid2])
    assert ctl.step().applied
    before = app.plan.plan_id
    rep = ctl.step()
    assert not rep.drift and not rep.applied and app.plan.plan_id == before


def test_pinned_plan_is_never_replaced(tmp_path):
    pin = initial_plan()
    ctl, app, _ = make_controller(tmp_path, [EASY, HARD], applier=RecordingApplier(pin), pinned=pin)
    assert not ctl.apply_pinned()                      # already running: nothing to do
    for _ in range(2):
        rep = ctl.step()
        assert not rep.applied and rep.decision.startswith("pinned")
    assert app.plan.plan_id == pin.plan_id and not [c for c in app.calls if c[0] in ("load", "switch")]


def test_pin_is_applied_once_when_another_plan_runs(tmp_path):
    easy, _ = _two_plans()
    ctl, app, _ = make_controller(tmp_path, [HARD], applier=RecordingApplier(easy), pinned=initial_plan())
    assert ctl.apply_pinned() and app.plan.plan_id == ctl.pinned.plan_id
    assert not ctl.step().applied


def test_refused_apply_keeps_the_last_good_plan_and_retries_with_backoff(tmp_path):
    ctl, app, clock = make_controller(tmp_path, [EASY], backoff_base_s=1.0, backoff_max_s=8.0)
    old = app.plan.plan_id
    app.fail["switch"] = 2
    rep = ctl.step()
    assert not rep.applied and app.plan.plan_id == old and ctl.failures == 1
    assert ctl.retry_at == pytest.approx(clock.t + 1.0) and ctl.history.last_good is None
    assert not ctl.retry()                             # too early
    clock.t += 1.0
    assert not ctl.retry() and ctl.failures == 2       # refused again: next in 2 s
    assert ctl.retry_at == pytest.approx(clock.t + 2.0)
    assert ctl.unload_unused() == []                   # nothing serving is unloaded while a retry is pending
    assert app.plan.plan_id == old and "tiny_ee_split_1-2" in app.splits
    clock.t += 2.0
    assert ctl.retry() and ctl.failures == 0 and ctl.retry_at is None
    assert ranges(app.plan) == [(1, 1, 1), (2, 4, 1)] and ctl.history.last_good.plan_id == app.plan.plan_id
    assert [c for c in app.calls if c[0] == "refused"] == [("refused", "switch", ctl.history.last_good.plan_id)] * 2


def test_run_loop_retries_between_windows(tmp_path):
    ctl, app, clock = make_controller(tmp_path, [EASY, EASY], backoff_base_s=0.5)
    app.fail["configure"] = 1
    ctl.run(max_windows=1)
    assert ctl.failures == 1
    ctl.run(max_windows=2)   # the retry at +0.5 s happens before the second window
    assert ranges(app.plan) == [(1, 1, 1), (2, 4, 1)]
    assert set(app.splits) == {"tiny_ee_split_1-1", "tiny_ee_split_2-4"}   # unloaded after the drain, before returning
    assert ctl.reports[-1].window == 2 and not ctl.reports[-1].applied


def test_missing_split_models_are_exported_before_loading(tmp_path):
    app = RecordingApplier(initial_plan(), exported=["tiny_ee_split_1-2", "tiny_ee_split_3-4", "tiny_ee_split_1-1"])
    ctl, _, _ = make_controller(tmp_path, [EASY], applier=app)
    assert ctl.step().applied
    kinds = [c[0] for c in app.calls]
    assert app.calls[0] == ("export", ("tiny_ee_split_2-4",)) and kinds.index("export") < kinds.index("load")


def test_dry_run_touches_nothing(tmp_path):
    ctl, app, clock = make_controller(tmp_path, [EASY], dry_run=True)
    rep = ctl.step()
    assert not rep.applied and rep.decision.startswith("dry run, would apply")
    assert any(line.startswith("+ tiny_ee_split_1-1") for line in rep.diff)
    assert app.calls == [] and not (tmp_path / "tiny_ee.history.json").exists()


def test_no_traffic_keeps_everything(tmp_path):
    ctl, app, _ = make_controller(tmp_path, [None])
    rep = ctl.step()
    assert not rep.applied and "no traffic" in rep.decision and app.calls == []


# ------------------------------------------------------------------------------------------- stragglers

def test_find_stragglers_compares_measured_with_profiled_latency():
    latency = synthetic_profile()
    plan = default_plan(MODEL, 4, [(1, 4)], exit_rule=EXIT_RULE, ramp_blocks=RAMPS, batch_size=8, instances=2)
    # profiled 1-4 at batch 8: 4 x (2 + 2) + 3 x 0.5 = 17.5 ms per batch
    before = {"tiny_ee_split_1-4": SplitStats(10, 80, 0)}
    ok = {"tiny_ee_split_1-4": SplitStats(20, 160, int(10 * 30e6))}       # 30 ms: 1.7x
    slow = {"tiny_ee_split_1-4": SplitStats(20, 160, int(10 * 40e6))}     # 40 ms: 2.3x
    assert find_stragglers(before, ok, plan, latency=latency, factor=2.0) == {}
    got = find_stragglers(before, slow, plan, latency=latency, factor=2.0)
    assert got["tiny_ee_split_1-4"] == pytest.approx(40 / 17.5)
    few = {"tiny_ee_split_1-4": SplitStats(12, 96, int(2 * 40e6))}        # 2 executions: no evidence
    assert find_stragglers(before, few, plan, latency=latency, factor=2.0) == {}
    reset = {"tiny_ee_split_1-4": SplitStats(6, 48, int(6 * 40e6))}       # reloaded: counters went down
    assert find_stragglers(before, reset, plan, latency=latency, factor=2.0) == {}
    assert exclude_stragglers({"cpu": 2}, plan, got) == {"cpu": 1}
    assert exclude_stragglers({"cpu": 1}, plan, got) == {"cpu": 1}        # never below one


def test_a_straggler_is_left_out_of_the_next_plan(tmp_path):
    hard = make_planner().plan(BatchProfile(MODEL, 8, HARD), DEVICES)
    app = RecordingApplier(hard)
    ctl, _, _ = make_controller(tmp_path, [HARD, HARD], applier=app)
    name = hard.splits[0].model                     # tiny_ee_split_1-4 x2, batch 32
    app.stats[name] = SplitStats(0, 0, 0)
    assert not ctl.step().applied                   # first window: baseline stats only
    app.stats[name] = SplitStats(50, 1600, int(50 * 200e6))   # 200 ms per batch of 32 (profile: 41.5 ms)
    rep = ctl.step()
    assert set(rep.stragglers) == {name} and rep.devices == {"cpu": 1}
    assert rep.applied and sum(s.instances for s in app.plan.splits) == 1


# ------------------------------------------------------------------------------------------- dead stubs

METRICS = """# HELP nv_inference_request_failure Number of failed inference requests
# TYPE nv_inference_request_failure counter
nv_inference_request_failure{model="tiny_ee_split_1-2",reason="BACKEND",version="1"} %d
nv_inference_request_failure{model="tiny_ee_split_1-2",reason="REJECTED",version="1"} 1
nv_inference_request_failure{model="tiny_ee_router",reason="BACKEND",version="1"} 0
"""


def test_failed_request_counters_are_summed_per_model():
    assert failed_requests(METRICS % 4) == {"tiny_ee_split_1-2": 5.0, "tiny_ee_router": 0.0}
    assert is_dead_stub("Failed to process the request(s) for model instance 'tiny_ee_split_1-2_0_0', "
                        "message: Stub process 'tiny_ee_split_1-2_0_0' is not healthy.")
    assert not is_dead_stub("Request timeout expired") and not is_dead_stub(None)


def test_a_model_whose_stub_died_is_reloaded(tmp_path):
    ctl, app, _ = make_controller(tmp_path, [None, None, None])
    app.failures = {"tiny_ee_split_1-2": 0.0}
    ctl.step()                                      # baseline
    app.failures = {"tiny_ee_split_1-2": 7.0, "tiny_ee_split_3-4": 0.0}
    app.probe_errors["tiny_ee_split_1-2"] = "Stub process 'tiny_ee_split_1-2_0_0' is not healthy."
    rep = ctl.step()
    assert rep.reloaded == ["tiny_ee_split_1-2"] and ("reload", "tiny_ee_split_1-2") in app.calls
    app.failures = {"tiny_ee_split_1-2": 9.0}       # failures for another reason (deadline): probed, not reloaded
    rep = ctl.step()
    assert rep.reloaded == [] and app.calls.count(("reload", "tiny_ee_split_1-2")) == 1


# ------------------------------------------------------------------------------------------- history

def test_history_is_validated_and_replaced_atomically(tmp_path, monkeypatch):
    path = tmp_path / "h.json"
    history = PlanHistory(path, MODEL)
    first = initial_plan()
    history.append(first, "test")
    saved = path.read_text()
    assert PlanHistory(path, MODEL).last_good.plan_id == first.plan_id

    def crash(*_):
        raise OSError("disk full")
    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        history.append(_two_plans()[0], "test")
    monkeypatch.undo()
    assert path.read_text() == saved                              # the old file is intact
    assert [p.name for p in tmp_path.iterdir()] == ["h.json"]     # no temporary file left behind
    assert history.last_good.plan_id == first.plan_id

    broken = initial_plan()
    object.__setattr__(broken.splits[1], "first_block", 2)        # overlaps split 1: not a plan
    with pytest.raises(ValueError):
        history.append(broken, "test")
    assert path.read_text() == saved

    path.write_text('{"version": 1, "entries": [{"plan": {"model": "x"}}]}')
    with pytest.raises(HistoryError, match="entry 0"):
        PlanHistory(path, MODEL)


# ------------------------------------------------------------------------------------------- view and control

class ViewOnly(ServerView):
    """A server the controller may read but not change (what a dry run gets)."""

    def __init__(self, inner: RecordingApplier):
        self.inner = inner

    def current_plan(self, router):
        return self.inner.current_plan(router)

    def loaded_splits(self, model):
        return self.inner.loaded_splits(model)

    def exported(self, split):
        return self.inner.exported(split)

    def split_stats(self, names):
        return self.inner.split_stats(names)

    def failed_requests(self):
        return self.inner.failed_requests()

    def probe(self, name):
        return self.inner.probe(name)


def test_reads_go_to_the_view_and_changes_to_the_control(tmp_path):
    settings = ControlSettings(model=MODEL, devices=dict(DEVICES), slo_ms=SLO_MS, rate_rps=RATE_RPS, window_s=2.0,
                               state_dir=tmp_path)
    served = RecordingApplier(initial_plan())
    kw = dict(telemetry=ScriptedTelemetry([EASY]), forecaster=make_forecaster("last"), planner=make_planner(),
              clock=FakeClock())
    with pytest.raises(ValueError, match="control="):
        Controller(settings, view=ViewOnly(served), **kw)      # it could not apply anything
    dry = Controller(dataclasses.replace(settings, dry_run=True), view=ViewOnly(served), **kw)
    assert dry.control is None and dry.step().decision.startswith("dry run, would apply")
    assert served.calls == []
    control = RecordingApplier(initial_plan())
    ctl = Controller(settings, view=ViewOnly(served), control=control,
                     **{**kw, "telemetry": ScriptedTelemetry([EASY])})
    assert ctl.step().applied
    assert ranges(control.plan) == [(1, 1, 1), (2, 4, 1)] and ranges(served.plan) == [(1, 2, 1), (3, 4, 1)]
    assert [c[0] for c in control.calls] == ["load", "load", "switch"] and served.calls == []
    assert isinstance(served, ServerView) and isinstance(served, ServerControl)


def test_probe_inputs_use_the_one_dtype_map():
    config = {"input": [{"name": "input_ids", "data_type": "TYPE_INT64", "dims": [-1]},
                        {"name": "attention_mask", "data_type": "TYPE_INT32", "dims": [48]},
                        {"name": "hidden", "data_type": "TYPE_FP16", "dims": [3, 4]},
                        {"name": "text", "data_type": "TYPE_STRING", "dims": [1]}]}
    got = {name: (dtype, data) for name, dtype, data in probe_inputs(config)}
    assert {n: d for n, (d, _) in got.items()} == {"input_ids": "INT64", "attention_mask": "INT32",
                                                   "hidden": "FP16", "text": "BYTES"}
    assert got["input_ids"][1].shape == (1, 1) and got["input_ids"][1].dtype == np.int64
    assert (got["attention_mask"][1] == 1).all() and got["attention_mask"][1].shape == (1, 48)   # a real mask
    assert got["hidden"][1].dtype == np.float16 and got["hidden"][1].shape == (1, 3, 4) and not got["hidden"][1].any()
    assert got["text"][1].dtype == object
    assert probe_inputs({"input": [{"name": "x", "data_type": "TYPE_FP64", "dims": [1]}]}) is None   # no probe


def test_split_settings_override_instances_and_batch_and_keep_no_delay():
    config = {"name": "tiny_ee_split_1-2", "max_batch_size": 16, "instance_group": [{"count": 1, "kind": "KIND_CPU"}],
              "dynamic_batching": {"preferred_batch_size": [4], "max_queue_delay_microseconds": 0}}
    split = dataclasses.replace(initial_plan().splits[0], instances=3, batch_size=32, queue_delay_us=700)
    want = with_split_settings(config, split)
    assert want["instance_group"] == [{"count": 3, "kind": "KIND_CPU"}]
    # 700 us is the scheduler's wait; Triton's batcher must not merge the scheduler's batches
    assert want["dynamic_batching"] == {"preferred_batch_size": [16], "max_queue_delay_microseconds": 0}
    assert config["instance_group"][0]["count"] == 1                    # the live config is not modified


# ------------------------------------------------------------------------------------------- reports

def test_reports_and_status_show_what_the_loop_did(tmp_path):
    ctl, app, _ = make_controller(tmp_path, [EASY])
    rep = ctl.step()
    text = describe_report(rep)
    assert text.splitlines()[-1] == f"  APPLIED: {rep.decision}" and rep.decision.startswith("predicted throughput")
    assert "observed reach [1.00, 0.15, 0.10, 0.08]" in text
    assert "+ tiny_ee_split_1-1 x1" in text and "- tiny_ee_split_1-2" in text
    lines = status_lines(app, MODEL, tmp_path)
    assert lines[0] == f"plan in force on tiny_ee_router: {app.plan.plan_id} (SLO 1000 ms, slack 0.2, " \
                       f"exit rule {EXIT_RULE})"
    assert "loaded splits: tiny_ee_split_1-1 x1, tiny_ee_split_1-2 x1, tiny_ee_split_2-4 x1, tiny_ee_split_3-4 x1" \
        in lines                                                        # before the drain: old splits still loaded
    assert any(line.startswith("controller's last window (1,") for line in lines)
    assert "plan history (1 applied, last 10):" in lines
    assert lines[-1].endswith(f"{app.plan.plan_id}  1-1 x1 | 2-4 x1  ({rep.decision})")
    assert status_lines(RecordingApplier(), MODEL, tmp_path / "empty")[:2] == [
        "tiny_ee_router is not loaded", "loaded splits: none"]


def test_e3_control_without_a_server_says_so_instead_of_a_traceback(tmp_path, capsys):
    from e3.cli import main
    profile = tmp_path / "profile.json"
    synthetic_profile().save(profile)
    rc = main(["control", "--model", "tiny-ee", "--latency-profile", str(profile), "--devices", "cpu:2",
               "--slo-ms", "200", "--rate-rps", "50", "--url", "127.0.0.1:1", "--metrics-url", "127.0.0.1:1",
               "--once"])
    err = capsys.readouterr().err
    assert rc == 2 and "cannot reach the server" in err and "127.0.0.1:1" in err
