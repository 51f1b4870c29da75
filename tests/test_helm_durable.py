"""The chart for a day of restarts (issue 39, Deliver 3 and 5), rendered offline as tests/test_helm_chart.py
renders it: Triton's readiness is not strict (the guard says whether the plan is served), the controller mounts
the repository writable and at the same subPath as the pods (it records the plans it applies there), every
pool's Triton has resources (no BestEffort pod), and the controller's liveness outlasts an apply's wait for
pods. That a restarted pod serves the recorded plan needs a cluster; tests/test_durable_plan.py shows it on
a real tritonserver."""

from __future__ import annotations

from test_helm_chart import MULTI_POOL, by_kind, render

SUBPATH = {"modelRepository": {"source": "pvc", "pvc": {"claimName": "e3-models", "subPath": "bert/v3"}}}


def _pod(docs, name):
    return by_kind(docs, "Deployment")[name]["spec"]["template"]["spec"]


def _triton_pods(docs):
    return {n: _pod(docs, n) for n, d in by_kind(docs, "Deployment").items()
            if d["metadata"]["labels"].get("app.kubernetes.io/component") == "triton"}


def test_readiness_goes_through_the_guard_and_triton_is_not_strict():
    for pod in _triton_pods(render(MULTI_POOL)).values():
        triton = pod["containers"][0]
        assert "--strict-readiness=false" in triton["args"] and "--strict-readiness=true" not in triton["args"]
        guard_port = next(p["containerPort"] for p in pod["containers"][1]["ports"] if p["name"] == "http")
        assert triton["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": guard_port}


def test_the_controller_mounts_the_repository_writable_at_the_pods_subpath():
    docs = render(SUBPATH)
    controller = _pod(docs, "demo-e3-controller")
    mount = next(m for m in controller["containers"][0]["volumeMounts"] if m["name"] == "models")
    assert mount.get("subPath") == "bert/v3" and not mount.get("readOnly")
    claim = next(v for v in controller["volumes"] if v["name"] == "models")["persistentVolumeClaim"]
    assert claim["claimName"] == "e3-models" and not claim.get("readOnly")
    assert "--repo=/models" in controller["containers"][0]["args"]
    for pod in _triton_pods(docs).values():   # the pods read the same folder
        assert next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "models")["subPath"] == "bert/v3"


def test_every_pool_has_resources_even_where_its_values_set_none():
    values = {**MULTI_POOL, "pools": [{k: v for k, v in p.items() if k != "resources"} for p in MULTI_POOL["pools"]]}
    for name, pod in _triton_pods(render(values)).items():
        for container in pod["containers"]:
            res = container.get("resources") or {}
            assert res.get("requests", {}).get("cpu") and res.get("requests", {}).get("memory"), (name, container["name"])
            assert res.get("limits", {}).get("memory"), (name, container["name"])


def test_the_controllers_liveness_outlasts_a_wait_for_pods():
    from e3.controller.metrics import ControllerMetrics
    from e3.controller.pooled_applier import POD_READY_TIMEOUT_S
    docs = render(MULTI_POOL)
    probe = _pod(docs, "demo-e3-controller")["containers"][0]["livenessProbe"]
    # the kubelet restarts after failureThreshold failed probes; /healthz fails only once stale_after_s passed
    window_s = 60.0
    now = [0.0]
    metrics = ControllerMetrics(pools=None, window_s=window_s, pod_wait_s=POD_READY_TIMEOUT_S, clock=lambda: now[0])
    without_wait = ControllerMetrics(pools=None, window_s=window_s, clock=lambda: now[0])
    now[0] = 3 * window_s + POD_READY_TIMEOUT_S   # a window began, then an apply waited the longest for pods
    assert metrics.healthy() and not without_wait.healthy()
    assert probe["failureThreshold"] * probe["periodSeconds"] >= 60
