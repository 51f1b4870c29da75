"""Durable plans (issue 39, Deliver 3): a plan and instance counts applied through the controller's applier are
written into the repository, so a restarted tritonserver serves them again; readiness is false while the
router's plan names a split the server does not serve; no request is answered by a split the plan does not
name."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import threading
import time
from dataclasses import replace

import pytest

from e3.controller.triton_api import ControlError, TritonControl
from e3.controller.triton_applier import TritonApplier
from e3.core.manifest import read_manifest
from e3.core.plan import COMPACT, Plan, SplitPlan
from e3.deploy.durable import PlanWatch, plan_gaps, record_plan
from e3.deploy.supervisor import Snapshot, restore_set
from polling import wait_until
from test_supervision import ROUTER, _infer, _json_body, _pids, _ready, e3_serve

OLD_SPLIT, KEPT_SPLIT = "tiny_ee_split_3-4", "tiny_ee_split_1-2"


def _router_config(plan: dict) -> dict:
    return {"parameters": {"plan": {"string_value": json.dumps(plan)}}}


def _plan_doc(*splits: tuple[str, str]) -> dict:
    return {"splits": [{"model": m, "form": f} for m, f in splits]}


# -- pure parts ---------------------------------------------------------------------------------------------
def test_plan_gaps_name_a_router_whose_plan_names_a_split_not_ready():
    plan = _plan_doc(("m_split_1-2", "constant"), ("m_split_3-4", "compact"))
    remote = {"splits": [{"model": "m_split_1-2", "form": "constant", "server": "pool-b:8001"}]}
    configs = {"m_router": _router_config(plan), "m_split_1-2": {}}
    assert plan_gaps(configs, ["m_router", "m_split_1-2"]) == {}
    assert plan_gaps(configs, ["m_router"]) == {"m_router": ["m_split_1-2"]}           # the constant split is gone
    assert plan_gaps(configs, ["m_split_1-2"]) == {}                                  # no router: nothing to check
    assert plan_gaps({"m_router": _router_config(remote)}, ["m_router"]) == {}      # another pool's split


def test_record_plan_replaces_the_served_splits_and_keeps_the_rest(tmp_path):
    (tmp_path / "e3_repository.json").write_text(json.dumps({"models": {}, "deployments": {"m": {
        "router": "m_router", "plan": _plan_doc(("m_split_1-2", "constant"), ("m_split_3-4", "constant")),
        "serve": ["m_split_1-2", "m_split_3-4", "m_router", "m_stock"]}}}))
    plan = _plan_doc(("m_split_1-1", "constant"), ("m_split_2-4", "compact"))
    assert record_plan(tmp_path, "m_router", plan)
    deployment = read_manifest(tmp_path)["deployments"]["m"]
    assert deployment["serve"] == ["m_split_1-1", "m_router", "m_stock"]
    assert deployment["plan"] == plan
    assert not record_plan(tmp_path, "other_router", plan)


def test_restore_prefers_a_file_written_after_the_snapshot_and_adds_the_plans_splits(tmp_path):
    for name in ("m_router", "m_split_1-2", "m_split_1-1"):
        (tmp_path / name).mkdir()
    plan = _plan_doc(("m_split_1-1", "constant"))
    (tmp_path / "m_router" / "config.pbtxt").write_text(
        'name: "m_router"\nparameters {\n  key: "plan"\n  value { string_value: %s }\n}\n' % json.dumps(json.dumps(plan)))
    (tmp_path / "m_split_1-2" / "config.pbtxt").write_text('name: "m_split_1-2"\n')
    old = {"m_router": _router_config(_plan_doc(("m_split_1-2", "constant"))), "m_split_1-2": {"name": "m_split_1-2"}}
    os.utime(tmp_path / "m_split_1-2" / "config.pbtxt", (100.0, 100.0))
    snap = Snapshot(configs=old, taken_wall=time.time() - 5)   # the router's file is newer, the split's older
    assert restore_set(snap, tmp_path) == {"m_router": None, "m_split_1-2": old["m_split_1-2"], "m_split_1-1": None}
    assert restore_set(replace(snap, taken_wall=time.time() + 5), tmp_path) == old   # nothing newer: the snapshot


# -- a real tritonserver under e3 serve ------------------------------------------------------------------------
def _served(port: int) -> tuple[str, int, int]:
    """(the router's plan_id, the kept split's instances, the old split's inferences) as the server says."""
    with TritonControl(f"127.0.0.1:{port}", timeout_s=10) as control:
        plan_id = control.current_plan(ROUTER).plan_id
        count = sum(int(g.get("count", 1)) for g in control.model_config(KEPT_SPLIT)["instance_group"])
        try:
            old = int(control.statistics(OLD_SPLIT)["model_stats"][0]["inference_count"])
        except Exception:  # noqa: BLE001 (not loaded: it answered nothing)
            old = 0
    return plan_id, count, old


@pytest.mark.e2e
def test_an_applied_plan_outlives_a_tritonserver_restart(tiny_repo, tiny_model, tmp_path):
    repo = tmp_path / "repo"
    shutil.copytree(tiny_repo, repo)
    ids, mask = (x.numpy() for x in tiny_model.example_inputs(4, seed=5))
    body = _json_body(ids, mask)
    with e3_serve(repo) as (proc, port, grpc_port, lines):
        applier = TritonApplier(f"127.0.0.1:{port}", repo=repo)
        try:
            before = applier.current_plan(ROUTER)
            # Another cut (after blocks 2 and 3; the blocks after 2 run inside the router) and 2 instances of the
            # split kept: split 3-4, still loaded, is named by no plan any more.
            kept = replace(before.splits[0], instances=2, batch_size=4)
            compact = tuple(SplitPlan(model=f"tiny_ee_split_{k}-{k}", first_block=k, last_block=k, batch_size=4,
                                      instances=1, queue_delay_us=0, form=COMPACT,
                                      enabled_ramps=tuple(r for r in before.enabled_ramps if r == k))
                            for k in (3, 4))
            plan = Plan.from_dict(replace(before, splits=(kept, *compact), plan_id="durable").to_dict())
            applier.configure_split(kept)
            applier.switch_plan(ROUTER, plan)
        finally:
            applier.close()
        assert _infer(port, body)[0] == 200
        # On disk at once: the router's file carries the plan, the split's its instances, the manifest both.
        assert f'\\"plan_id\\": \\"durable\\"' in (repo / ROUTER / "config.pbtxt").read_text()
        assert "count: 2" in (repo / KEPT_SPLIT / "config.pbtxt").read_text()
        serve = read_manifest(repo)["deployments"]["tiny_ee"]["serve"]
        assert KEPT_SPLIT in serve and OLD_SPLIT not in serve

        # Kill tritonserver right away (the supervisor's snapshot may predate the switch); watch readiness.
        servers = _pids(lambda c: "bin/tritonserver" in c and f"--grpc-port={grpc_port}" in c)
        assert len(servers) == 1
        seen: list[tuple[int, tuple | None]] = []   # (readiness, what was served when it said 200)
        stop = threading.Event()

        def watch():
            while not stop.is_set():
                status = _ready(port)
                seen.append((status, _served(port) if status == 200 else None))
                time.sleep(0.05)

        os.kill(servers[0], signal.SIGKILL)
        killed_at = time.monotonic()
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        wait_until(lambda: any(s == 200 for s, _ in seen[1:]) and _infer(port, body)[0] == 200, 60,
                   lambda: "serving after the restart: " + "".join(lines[-20:]))
        stop.set()
        watcher.join(timeout=30)
        restored_s = time.monotonic() - killed_at
        answers = [_infer(port, body)[0] for _ in range(40)]
        plan_id, instances, old_inferences = _served(port)
    not_ready = sum(s != 200 for s, _ in seen)
    print(f"durable plan: restored in {restored_s:.1f} s; readiness polled {len(seen)} times, {not_ready} not "
          f"ready; after it: plan {plan_id}, {instances} instances of {KEPT_SPLIT}, {answers.count(200)}/40 "
          f"answered, {old_inferences} inferences on {OLD_SPLIT}")
    assert any("tritonserver died (SIGKILL)" in l for l in lines)
    assert not_ready >= 1                                   # it said so while the server came back
    # Whenever readiness said 200 after the kill, the applied plan and instance count were being served.
    assert all(served[:2] == ("durable", 2) for s, served in seen if s == 200), seen
    assert (plan_id, instances) == ("durable", 2)
    assert answers == [200] * 40
    assert old_inferences == 0                              # no request answered by a split the plan does not name

    # A new server on the same repository (a new pod, a new e3 serve): no snapshot, only the files.
    with e3_serve(repo) as (proc, port, grpc_port, lines):
        wait_until(lambda: _ready(port) == 200, 60, "ready")
        answers = [_infer(port, body)[0] for _ in range(20)]
        served = _served(port)
    print(f"durable plan: a new e3 serve on the repository serves plan {served[0]} with {served[1]} instances of "
          f"{KEPT_SPLIT}; {answers.count(200)}/20 answered, {served[2]} inferences on {OLD_SPLIT}")
    assert served == ("durable", 2, 0) and answers == [200] * 20


@pytest.mark.e2e
def test_the_pods_readiness_recovers_from_a_failed_load_and_follows_the_plan(tiny_repo):
    """The chart's pod: tritonserver as the chart runs it (no strict readiness, endpoints on Unix sockets) and
    the guard in front (``e3 serve --guard-only``'s loop). A failed load of a split no plan names leaves the pod
    ready (strict readiness answered 400 for good); unloading a split the router's plan names makes it not
    ready, loading it again ready."""
    from e3.deploy.serve import KEEP_SERVING_ARGS, guard_until_stopped
    from e3.deploy.server import TritonServer, free_port
    port, stop = free_port(), threading.Event()
    with TritonServer.on_free_ports(tiny_repo, [KEPT_SPLIT, OLD_SPLIT, ROUTER], private=True,
                                    extra_args=list(KEEP_SERVING_ARGS)) as server:
        guard = threading.Thread(target=guard_until_stopped, args=(server.http_url, server.grpc_url, stop),
                                 kwargs=dict(host="127.0.0.1", http_port=port, grpc_port=free_port(), headers=None,
                                             echo=lambda _: None), daemon=True)
        guard.start()
        try:
            wait_until(lambda: _ready(port) == 200, 30, "the guard answering ready")
            with TritonControl(f"127.0.0.1:{port}") as control:
                with pytest.raises(ControlError):   # a model no plan names, with a backend nobody has: it fails
                    control.load("tiny_ee_ee", {**control.model_config(OLD_SPLIT), "name": "tiny_ee_ee",
                                                "backend": "no_such_backend"})
                time.sleep(2.5)                  # one plan-watch period
                after_failed_load = _ready(port)
                control.unload(KEPT_SPLIT)
                not_ready = wait_until(lambda: _ready(port) == 503, 10, "readiness false without the plan's split")
                router_ready = _ready(port, f"/v2/models/{ROUTER}/ready")
                control.load(KEPT_SPLIT)
                wait_until(lambda: _ready(port) == 200, 10, "readiness back with the plan's split")
        finally:
            stop.set()
            guard.join(timeout=30)
    print(f"pod readiness: {after_failed_load} after a failed load, 503 without {KEPT_SPLIT} (router {router_ready}), "
          "200 once it is loaded again")
    assert after_failed_load == 200 and not_ready and router_ready == 503
