"""The controller's scaling signals and its model facts, pure (no server): the rate it plans for, the pods
each pool should run, where the model's exit rule comes from without a checkpoint, the metrics endpoint and
its probes, and one owner of replicas (a controller that leaves them to an autoscaler never patches)."""

from __future__ import annotations

import urllib.request
from dataclasses import replace

import pytest

from e3.controller.applier import ControlError
from e3.controller.k8s_scaler import RecordingScaler
from e3.controller.loop import StepReport
from e3.controller.metrics import ControllerMetrics
from e3.controller.model_facts import model_facts, planning_facts
from e3.controller.planner.placement import place
from e3.controller.pooled_applier import PooledApplier
from e3.controller.recording_applier import RecordingApplier
from e3.controller.signals import desired_replicas, drop_rate_rps, observed_rate_rps, planned_rate_rps
from e3.core.plan import default_plan
from e3.core.profile import BatchProfile
from e3.deploy.pools import load_pools
from helpers import make_plan, make_pools, synthetic_profile


def test_the_planned_rate_follows_traffic_above_the_floor():
    assert observed_rate_rps(900, 100, 10.0) == 100.0           # dropped inputs are demand too
    assert drop_rate_rps(100, 10.0) == 10.0 and drop_rate_rps(5, 0.0) == 0.0
    assert planned_rate_rps(50.0, 100.0) == 100.0 and planned_rate_rps(50.0, 10.0) == 50.0
    assert planned_rate_rps(50.0, None) == 50.0 and planned_rate_rps(50.0, float("nan")) == 50.0


def test_desired_replicas_per_pool():
    pools = load_pools(make_pools())
    plan = place(make_plan(devices_=("cpu", "t4", "t4"), instances=(1, 3, 1)), pools)
    assert desired_replicas(plan, pools) == {"front": 1, "t4": 4, "t4b": 0}    # t4: 1 per pod, 3 + 1 instances
    assert desired_replicas(None, pools) == {"front": 1, "t4": 1, "t4b": 0}   # no plan: min replicas
    big = replace(plan, splits=tuple(replace(s, instances=9) if s.device == "t4" else s for s in plan.splits))
    assert desired_replicas(big, pools)["t4"] == 4                             # clamped to max_replicas


def test_model_facts_come_from_a_card_or_a_plan_never_a_checkpoint():
    latency = synthetic_profile()
    card = {"num_blocks": 4, "ramp_blocks": [1, 2, 3], "exit_rule": {"kind": "entropy", "tau_nats": 0.3}}
    facts = model_facts(latency, card=card)
    assert (facts.num_blocks, facts.ramp_blocks, facts.exit_rule["tau_nats"]) == (4, (1, 2, 3), 0.3)
    plan = default_plan("tiny_ee", 4, [(1, 4)], exit_rule={"kind": "entropy", "tau_nats": 0.7}, ramp_blocks=(1, 2, 3))
    facts = model_facts(latency, plan=plan)
    assert facts.exit_rule["tau_nats"] == 0.7 and facts.ramp_blocks == (1, 2, 3)   # ramps: the profile's
    with pytest.raises(ValueError, match="give --plan PLAN.json"):
        model_facts(latency)
    with pytest.raises(ValueError, match="latency profile is for 4 blocks"):
        model_facts(latency, card={**card, "num_blocks": 6, "ramp_blocks": [1]})
    with pytest.raises(ValueError, match="no timings for the ramps after blocks \\[5\\]"):
        model_facts(latency, card={**card, "ramp_blocks": [1, 5]})


def test_e3_plan_takes_ramps_and_rule_from_the_card_else_from_the_profiles():
    from types import SimpleNamespace
    latency = synthetic_profile()
    batch = BatchProfile(model="tiny_ee", batch_size=8, reach=[1.0, 0.6, 0.4, 0.3])
    card = SimpleNamespace(ramp_blocks=(1, 3), exit_rule={"kind": "patience", "patience": 1})
    facts = planning_facts(latency, batch, card=card)
    assert facts.ramp_blocks == facts.planner_ramps == (1, 3) and facts.exit_rule["kind"] == "patience"
    assert facts.relies_on(3, (1, 3)) == (1,)                    # patience relies on the ramp before
    facts = planning_facts(latency, batch, tau_nats=0.4)         # no card, no rule in the batch profile
    assert facts.ramp_blocks == tuple(latency.ramp_blocks()) and facts.planner_ramps is None
    assert facts.exit_rule == {"kind": "entropy", "tau_nats": 0.4} and facts.relies_on is None
    user = replace(batch, exit_rule={"kind": "not_importable_here:Rule"})   # a user's rule that is not on the path
    facts = planning_facts(latency, user)
    assert facts.exit_rule["kind"] == "not_importable_here:Rule" and facts.relies_on(3, (1, 2, 3)) == (1, 2)


def test_metrics_endpoint_and_probes():
    now = [0.0]
    pools = load_pools(make_pools())
    metrics = ControllerMetrics(pools=pools, window_s=10, clock=lambda: now[0])
    port = metrics.serve(0, host="127.0.0.1")
    try:
        def get(path):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
                    return r.status, r.read().decode()
            except urllib.error.HTTPError as err:
                return err.code, ""
        assert get("/readyz")[0] == 503 and get("/healthz")[0] == 200
        metrics.started(None)
        plan = place(make_plan(devices_=("cpu", "t4", "t4"), instances=(1, 2, 1)), pools)
        metrics.observe(StepReport(window=1, offered_rps=120.0, dropped_rps=4.5, planned_rps=120.0, applied=True), plan)
        status, text = get("/metrics")
        assert status == 200 and get("/readyz")[0] == 200
        assert 'e3_controller_desired_replicas{pool="t4"} 3.0' in text
        assert "e3_controller_dropped_rate 4.5" in text and "e3_controller_plans_applied_total 1.0" in text
        now[0] = 3 * 10 + 61.0                       # no window for three windows and a minute: wedged
        assert get("/healthz")[0] == 503
    finally:
        metrics.close()


def test_with_an_autoscaler_the_controller_never_patches_and_waits_for_pods():
    pools = load_pools(make_pools())
    plan = place(make_plan(devices_=("cpu", "t4", "t4"), instances=(1, 2, 1)), pools)

    class Autoscaled(RecordingScaler):
        owns_replicas = False

    scaler = Autoscaled({"front": 1, "t4": 1, "t4b": 0})
    applier = PooledApplier("bert_ee_router", RecordingApplier(plan), {}, pools=pools, scaler=scaler)
    with pytest.raises(ControlError, match="waiting for the autoscaler: pool 't4' has 1 of 3 pods ready"):
        applier.prepare(plan)
    scaler.pods["t4"] = 3                            # the autoscaler followed the signal
    applier.prepare(plan)
    applier.settle(replace(plan, splits=plan.splits[:1]))
    assert scaler.calls == []                        # never a scale call: one owner
    owned = RecordingScaler({"front": 1, "t4": 1, "t4b": 0})
    PooledApplier("bert_ee_router", RecordingApplier(plan), {}, pools=pools, scaler=owned).prepare(plan)
    assert owned.calls == [("t4", 3)]
