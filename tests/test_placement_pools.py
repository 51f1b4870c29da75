"""Issue 39, item 2: placement over two pools of one device, with the docs' two-pool values (docs/kubernetes.md,
rendered by the chart into pools.json): the router's pool `front` (1 pod x 2 CPUs) and `deep` (1..4 pods x 2
CPUs); the planner is told cpu:10. A plan of five instances goes over both pools; a split no pool holds makes
the planner ask again with fewer devices; a plan the pools refuse is reported once and not retried."""

from __future__ import annotations

import json
import logging
import re
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from e3.controller.applier import PlanRefused
from e3.controller.planner.placement import NoRoom, place
from e3.controller.pooled_applier import PlacingPlanner
from e3.deploy.pools import devices, load_pools, replicas_needed
from helpers import make_plan
from test_helm_chart import by_kind, render

DOCS = Path(__file__).resolve().parents[1] / "docs" / "kubernetes.md"


def docs_pools():
    """The pools the chart writes for the docs' two-pool values (the first yaml block naming pool `deep`)."""
    block = next(b for b in re.findall(r"```yaml\n(.*?)```", DOCS.read_text(), re.S) if "name: deep" in b)
    values = yaml.safe_load(block.replace("<registry>/", ""))
    settings = by_kind(render(values), "ConfigMap")["demo-e3-settings"]["data"]
    return load_pools(json.loads(settings["pools.json"])), settings["E3_DEVICES"]


def test_a_plan_of_five_instances_is_placed_over_both_pools():
    pools, told = docs_pools()
    assert told == "cpu:10" and devices(pools) == {"cpu": 10}
    plan = make_plan(devices_=("cpu", "cpu"), instances=(2, 3), ranges=((1, 3), (4, 6)))
    placed = place(plan, pools)
    servers = {s.model: pools.of_server(s.server).name for s in placed.splits}
    # 3 instances do not fit the router's pool (2): they go to deep; the 2 fill front
    assert servers == {"bert_ee_split_1-3": "front", "bert_ee_split_4-6": "deep"}
    assert replicas_needed(placed, pools) == {"front": 1, "deep": 2}
    # eight on one split: only deep holds them, the other split stays with the router
    placed = place(make_plan(devices_=("cpu", "cpu"), instances=(2, 8), ranges=((1, 3), (4, 6))), pools)
    assert replicas_needed(placed, pools) == {"front": 1, "deep": 4}
    with pytest.raises(NoRoom, match="no pool of device 'cpu' has room for bert_ee_split_4-6's 9 instances"):
        place(make_plan(devices_=("cpu", "cpu"), instances=(1, 9), ranges=((1, 3), (4, 6))), pools)


class GreedyPlanner:
    """Uses every device it is given on the last split (a stand-in for the planner at a high rate)."""

    def __init__(self):
        self.asked = []

    def plan(self, forecast, devices):
        self.asked.append(dict(devices))
        return make_plan(devices_=("cpu", "cpu"), instances=(1, devices["cpu"] - 1), ranges=((1, 3), (4, 6)))


def test_the_planner_is_told_what_the_pools_hold():
    pools, _ = docs_pools()
    planner = GreedyPlanner()
    plan = PlacingPlanner(planner, pools).plan(None, {"cpu": 10})
    # cpu:10 puts 9 on one split (no pool holds 9): asked again with 9 -> 8 on deep, 1 on front
    assert planner.asked == [{"cpu": 10}, {"cpu": 9}]
    assert [s.instances for s in plan.splits] == [1, 8] and replicas_needed(plan, pools) == {"front": 1, "deep": 4}


def test_a_refused_plan_is_reported_once_and_not_retried(tmp_path, caplog):
    from e3.controller.recording_applier import RecordingApplier
    from test_controller import EASY, initial_plan, make_controller

    class PoolsTooSmall(RecordingApplier):
        prepared = 0

        def prepare(self, plan):
            self.prepared += 1
            raise PlanRefused(f"plan {plan.plan_id} needs 5 pods in pool 'deep'; its max_replicas is 4")

    app = PoolsTooSmall(initial_plan())
    ctl, _, clock = make_controller(tmp_path, [EASY] * 5, applier=app, backoff_base_s=1.0)
    with caplog.at_level(logging.WARNING, logger="e3.controller.loop"):
        for _ in range(5):
            ctl.step()
            clock.t += 100.0
            ctl.retry()
    assert app.prepared == 1 and ctl.pending is None and ctl.retry_at is None
    assert sum("not retried" in r.getMessage() for r in caplog.records) == 1
    assert "refused for good" in ctl.reports[-1].decision
