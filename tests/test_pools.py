"""Device pools without a server: reading the chart's pools.json, placing splits, the models each pool
loads, the pods each pool needs; and the plan's ``server`` field."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from e3.core.plan import COMPACT, Plan, PlanError
from e3.controller.planner.placement import place
from e3.deploy.pools import PoolError, devices, load_pools, pool_models, replicas_needed
from helpers import make_plan, make_pools



def test_pools_json_from_the_chart_is_read_and_checked():
    pools = load_pools(make_pools())
    assert pools.router.name == "front" and pools.namespace == "e3"
    assert pools.of_server("demo-e3-triton-t4:8001").name == "t4" and pools.of_server("").name == "front"
    assert devices(pools) == {"cpu": 4, "t4": 10}
    bad = make_pools()
    bad["pools"][1]["router"] = True
    with pytest.raises(PoolError, match="exactly one pool must serve the router"):
        load_pools(bad)
    bad = make_pools()
    del bad["pools"][2]["grpc_url"]
    with pytest.raises(PoolError, match=r"pools\[2\] is missing the field 'grpc_url'"):
        load_pools(bad)
    with pytest.raises(PoolError, match="max_replicas"):
        load_pools(make_pools(min_replicas=3))
    with pytest.raises(PoolError, match="the router's pool 'front' runs exactly one pod"):
        load_pools(make_pools(max_replicas=2))


def test_splits_go_to_a_pool_of_their_device_the_routers_first():
    pools = load_pools(make_pools())
    plan = make_plan(devices_=("cpu", "t4", "t4"), instances=(1, 1, 1))
    placed = place(plan, pools)
    # cpu split: the router's own pool (BLS, no hop); t4 splits: the first t4 pool, over gRPC
    assert [s.server for s in placed.splits] == ["", "demo-e3-triton-t4:8001", "demo-e3-triton-t4:8001"]
    assert placed.plan_id != plan.plan_id
    assert place(placed, pools) is placed        # nothing changes: same plan
    moved = place(placed, pools, pin={"bert_ee_split_5-6": "t4b"})
    assert moved.splits[2].server == "demo-e3-triton-t4b:8001" and moved.splits[1] == placed.splits[1]
    assert pool_models(moved, pools, ("bert_ee", "bert_ee_router")) == {
        "front": ["bert_ee", "bert_ee_router", "bert_ee_split_1-2"], "t4": ["bert_ee_split_3-4"],
        "t4b": ["bert_ee_split_5-6"]}
    with pytest.raises(PoolError, match="runs on t4; pool 'front' has cpu"):
        place(plan, pools, pin={"bert_ee_split_3-4": "front"})
    with pytest.raises(PoolError, match="no pool has device 'v100'"):
        place(make_plan(devices_=("cpu", "v100", "t4")), pools)


def test_compact_splits_stay_in_the_routers_pool():
    pools = load_pools(make_pools())
    plan = make_plan(devices_=("cpu", "t4", "t4"))
    compact = replace(plan, splits=(replace(plan.splits[0], form=COMPACT), *plan.splits[1:]))
    assert place(compact, pools).splits[0].server == ""
    gpu_compact = replace(plan, splits=(plan.splits[0], replace(plan.splits[1], form=COMPACT), plan.splits[2]))
    with pytest.raises(PoolError, match="compact"):
        place(gpu_compact, pools)


def test_replicas_follow_the_instances_placed_on_each_pool():
    pools = load_pools(make_pools())
    placed = place(make_plan(devices_=("cpu", "t4", "t4"), instances=(3, 2, 1)), pools,
                   pin={"bert_ee_split_5-6": "t4b"})
    # front: 3 instances / 4 per pod -> 1 pod; t4: 2 / 1 -> 2; t4b: 1 / 2 -> 1
    assert replicas_needed(placed, pools) == {"front": 1, "t4": 2, "t4b": 1}
    idle = place(make_plan(devices_=("cpu", "cpu", "cpu"), instances=(1, 1, 1)), pools)
    assert replicas_needed(idle, pools) == {"front": 1, "t4": 1, "t4b": 0}   # min_replicas hold
    with pytest.raises(PoolError, match="no pool of device 'cpu' has room for bert_ee_split_5-6's 1 instances .room left: front=0"):
        place(make_plan(devices_=("cpu", "cpu", "cpu"), instances=(2, 2, 1)), pools)
    # five t4 instances: one t4 pool holds 4, so the second split goes to t4b (issue 39)
    spread = place(make_plan(devices_=("cpu", "t4", "t4"), instances=(1, 3, 2)), pools)
    assert replicas_needed(spread, pools) == {"front": 1, "t4": 3, "t4b": 1}
    too_many = place(make_plan(devices_=("cpu", "t4", "t4"), instances=(1, 3, 2)), pools,
                     pin={"bert_ee_split_3-4": "t4", "bert_ee_split_5-6": "t4"})
    with pytest.raises(PoolError, match="needs 5 pods in pool 't4'.*max_replicas is 4"):
        replicas_needed(too_many, pools)


def test_the_plan_carries_a_splits_server_and_checks_it():
    plan = make_plan(devices_=("cpu", "t4", "t4"), instances=(1, 1, 1))
    placed = place(plan, load_pools(make_pools()))
    doc = placed.to_dict()
    assert "server" not in doc["splits"][0] and doc["splits"][1]["server"] == "demo-e3-triton-t4:8001"
    assert Plan.from_json(placed.to_json()) == placed
    assert "server" not in json.dumps(plan.to_dict())       # plans without pools read as before
    doc = placed.to_dict()
    doc["splits"][1]["server"] = "dns:///demo-e3-triton-t4-pods:8001"   # gRPC resolves it, round-robin
    assert Plan.from_dict(doc).splits[1].server == "dns:///demo-e3-triton-t4-pods:8001"
    for bad in ("t4-pool", "t4:http", ":8001", "a b:8001", "host:70000", "dns:///:8001"):
        doc = placed.to_dict()
        doc["splits"][1]["server"] = bad
        with pytest.raises(PlanError, match=r"splits\[1\].*is not a gRPC address host:port"):
            Plan.from_dict(doc)
    doc = placed.to_dict()
    doc["splits"][1]["form"] = COMPACT
    with pytest.raises(PlanError, match="only a constant split can be placed on another server"):
        Plan.from_dict(doc)


def test_changes_to_a_pool_go_to_each_of_its_pods():
    """Loads, readiness checks and unloads reach every pod a pool's headless Service lists; a split's
    instances are spread over them; the router's pool is reached through its Service."""
    from e3.controller.applier import ControlError
    from e3.controller.pooled_applier import PooledApplier
    from e3.controller.recording_applier import RecordingApplier

    class Pod(RecordingApplier):
        @property
        def control(self):
            return self

        def is_ready(self, model):
            return model in self.splits

    class Router(RecordingApplier):
        def switch_plan(self, router, plan):   # this server holds only the splits placed on it
            self.calls.append(("switch", plan.plan_id))
            self.plan = plan

    pools_doc = make_pools()
    pools_doc["pools"][1]["pods_host"] = "demo-e3-triton-t4-pods"
    pools = load_pools(pools_doc)
    plan = place(make_plan(devices_=("cpu", "t4", "t4"), instances=(1, 3, 1)), pools)
    pods: dict[str, Pod] = {}
    listed = {"demo-e3-triton-t4-pods": ["10.0.0.1:8000", "10.0.0.2:8000"]}
    router = Router(plan)
    applier = PooledApplier("bert_ee_router", router, {p.grpc_url: Pod() for p in pools.pools if not p.router},
                            pools=pools, resolve=lambda host, port: listed[host],
                            make_applier=lambda url: pods.setdefault(url, Pod()))
    for split in plan.triton_splits:
        applier.configure_split(split)
    assert set(pods) == {"10.0.0.1:8000", "10.0.0.2:8000"}
    for pod in pods.values():   # 3 instances over 2 pods: 2 each; split 5-6 (1 instance): 1 each
        assert pod.calls == [("load", "bert_ee_split_3-4", 2, 8), ("load", "bert_ee_split_5-6", 1, 8)]
    assert router.calls == []   # split 1-2 is on the router's server already with its settings: nothing to load
    applier.switch_plan("bert_ee_router", plan)
    assert router.calls[-1] == ("switch", plan.plan_id)
    applier.unload("bert_ee_split_5-6@demo-e3-triton-t4:8001")
    assert all(pod.calls[-1] == ("unload", "bert_ee_split_5-6") for pod in pods.values())
    with pytest.raises(ControlError, match="not ready on demo-e3-triton-t4:8001"):   # 5-6 is gone from the pods
        applier.switch_plan("bert_ee_router", plan)
    listed["demo-e3-triton-t4-pods"] = []
    with pytest.raises(ControlError, match="pool 't4' has no ready pod"):
        applier.configure_split(plan.splits[1])
