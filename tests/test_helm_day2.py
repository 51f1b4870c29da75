"""The chart's day-2 behaviour, rendered offline (as tests/test_helm_chart.py renders it): one owner of every
pool's replicas (the chart leaves live counts alone; an HPA or KEDA on the controller's signal when enabled,
and then the controller cannot patch), a stable API key (checksum-rolled pods), logging and trace restricted,
object-storage repositories with credentials from a Secret, an export path that needs no training (and builds
TensorRT engines only on GPU pools), NetworkPolicies, PodDisruptionBudgets, the controller's probes and
metrics, and a dashboard whose panels cover GPUs, latency, failures and replicas with metrics that exist."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

from test_helm_chart import GCS, GPU, HPA, KEDA, MULTI_POOL, S3, by_kind, render

ROOT = Path(__file__).resolve().parents[1]


def _pod(docs, name):
    return by_kind(docs, "Deployment")[name]["spec"]["template"]


def _args(docs, name, container=0):
    return _pod(docs, name)["spec"]["containers"][container].get("args", [])


def test_the_chart_leaves_scaled_pools_replicas_to_their_owner():
    docs = render(MULTI_POOL)
    deployments = by_kind(docs, "Deployment")
    assert "replicas" not in deployments["demo-e3-triton-deep"]["spec"]         # 1..4 pods: the controller's
    front = deployments["demo-e3-triton-front"]["spec"]
    assert front["replicas"] == 1 and front["strategy"] == {"type": "Recreate"}  # one router, never two
    assert deployments["demo-e3-triton-deep"]["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1,
                                                                                       "maxUnavailable": 0}
    # a pool of fixed size keeps its count
    fixed = {**MULTI_POOL, "pools": [MULTI_POOL["pools"][0], {**MULTI_POOL["pools"][1], "replicas": 2,
                                                              "minReplicas": 2, "maxReplicas": 2}]}
    assert by_kind(render(fixed), "Deployment")["demo-e3-triton-deep"]["spec"]["replicas"] == 2
    # without an autoscaler the controller owns them and may patch the scale
    role = by_kind(docs, "Role")["demo-e3-controller"]["rules"]
    assert role[1]["verbs"] == ["get", "patch"] and "--replicas-owner=controller" in _args(docs, "demo-e3-controller")


def test_an_hpa_owns_a_scaled_pool_on_the_controllers_signal():
    docs = render(HPA)
    hpas = by_kind(docs, "HorizontalPodAutoscaler")
    assert set(hpas) == {"demo-e3-triton-deep"}               # not the router's pool
    spec = hpas["demo-e3-triton-deep"]["spec"]
    assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "demo-e3-triton-deep"}
    assert (spec["minReplicas"], spec["maxReplicas"]) == (1, 4)
    metric = spec["metrics"][0]["external"]
    assert metric["metric"] == {"name": "e3_controller_desired_replicas", "selector": {"matchLabels": {"pool": "deep"}}}
    assert metric["target"] == {"type": "AverageValue", "averageValue": "1"}   # desired = ceil(signal / 1)
    # one owner: the controller publishes and waits, and may not patch
    role = by_kind(docs, "Role")["demo-e3-controller"]["rules"]
    assert all("patch" not in rule["verbs"] for rule in role)
    assert "--replicas-owner=autoscaler" in _args(docs, "demo-e3-controller")


def test_keda_scales_on_the_same_signal():
    docs = [d for d in render(KEDA) if d["kind"] == "ScaledObject"]
    assert [d["metadata"]["name"] for d in docs] == ["demo-e3-triton-deep"]
    trigger = docs[0]["spec"]["triggers"][0]
    assert trigger["metadata"]["query"] == 'max(e3_controller_desired_replicas{namespace="e3",pool="deep"})'
    assert trigger["metadata"]["serverAddress"] == "http://prometheus.monitoring.svc:9090"
    assert not by_kind(render(KEDA), "HorizontalPodAutoscaler")     # KEDA makes its own


def test_the_controller_has_probes_metrics_and_no_checkpoint():
    docs = render(MULTI_POOL)
    pod = _pod(docs, "demo-e3-controller")["spec"]
    c = pod["containers"][0]
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert {"name": "metrics", "containerPort": 9090, "protocol": "TCP"} in c["ports"]
    assert "--metrics-port=9090" in c["args"] and "--follow-traffic" in c["args"]
    assert by_kind(docs, "Service")["demo-e3-controller"]["spec"]["ports"][0]["port"] == 9090
    assert "demo-e3-controller" in {d["metadata"]["name"] for d in docs if d["kind"] == "ServiceMonitor"}
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert not any("checkpoint" in str(v).lower() for v in pod["volumes"])


def test_a_stable_api_key_rolls_every_pod_that_reads_it():
    def checksums(values):
        docs = render(values)
        return {name: _pod(docs, name)["metadata"]["annotations"]["checksum/api-key"]
                for name in by_kind(docs, "Deployment")}, docs
    one, docs = checksums({"restrictedApi": {"key": "k" * 40}})
    assert len(set(one.values())) == 1 and set(one) == {"demo-e3-triton-main", "demo-e3-controller"}
    secret = by_kind(docs, "Secret")["demo-e3-api-key"]
    assert secret["data"]["api-key"] == base64.b64encode(b"k" * 40).decode()
    again, _ = checksums({"restrictedApi": {"key": "k" * 40}})
    other, _ = checksums({"restrictedApi": {"key": "z" * 40}})
    assert again == one and set(other.values()).isdisjoint(one.values())   # same key: no roll; new key: roll
    existing, docs = checksums({"restrictedApi": {"existingSecret": "mine"}})
    assert "Secret" not in {d["kind"] for d in docs} and len(set(existing.values())) == 1


def test_logging_and_trace_are_restricted_with_what_e3_serve_restricts():
    """The chart's guard container is `e3 serve`'s guard (--guard-only): the same groups need the key."""
    from e3.deploy.routes import KEYED
    guard = _pod(render({}), "demo-e3-triton-main")["spec"]["containers"][1]
    assert guard["command"][:3] == ["e3", "serve", "--guard-only"]
    assert {"logging", "trace", "model-repository", "model-config", "shared-memory"} <= KEYED
    assert not KEYED & {"inference", "health", "metadata", "statistics"}   # clients and probes stay open


def test_object_storage_repositories_take_credentials_from_a_secret():
    docs = render(S3)
    pod = _pod(docs, "demo-e3-triton-main")["spec"]
    c = pod["containers"][0]
    assert "--model-repository=s3://models-bucket/e3/bert_ee" in c["args"]
    assert c["envFrom"] == [{"secretRef": {"name": "e3-s3"}}]
    assert {"name": "AWS_DEFAULT_REGION", "value": "eu-west-1"} in c["env"]
    assert "models" not in {v["name"] for v in pod["volumes"]} and "initContainers" not in pod
    controller = _args(docs, "demo-e3-controller")
    assert "--repo=" in controller and "--plan=/etc/e3/plan/plan.json" in controller
    gs = _pod(render(GCS), "demo-e3-triton-main")["spec"]
    env = {e["name"]: e.get("value") for e in gs["containers"][0]["env"]}
    assert env["GOOGLE_APPLICATION_CREDENTIALS"] == "/var/run/e3/storage/key.json"
    assert {"name": "storage-credentials", "secret": {"secretName": "e3-gcs"}} in gs["volumes"]


def test_the_export_path_reads_checkpoints_and_builds_engines_only_on_gpus():
    values = {**GPU, "pools": [{**GPU["pools"][0], "gpu": {"type": "", "count": 0}, "device": "cpu"},
                               GPU["pools"][1]],
              "modelRepository": {**GPU["modelRepository"], "export": {**GPU["modelRepository"]["export"],
                                                                       "checkpointsPvc": "e3-checkpoints"}}}
    docs = render(values)
    cpu, gpu = (_pod(docs, n)["spec"] for n in ("demo-e3-triton-t4", "demo-e3-triton-v100"))
    cpu_cmd, gpu_cmd = cpu["initContainers"][0]["command"], gpu["initContainers"][0]["command"]
    assert cpu_cmd[cpu_cmd.index("--format") + 1] == "onnx" and "--gpus" not in cpu_cmd   # no GPU: no engine
    assert gpu_cmd[gpu_cmd.index("--format") + 1] == "tensorrt" and gpu_cmd[gpu_cmd.index("--gpus") + 1] == "2"
    assert gpu["initContainers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 2      # the build sees its GPUs
    init = gpu["initContainers"][0]
    assert {"name": "E3_ARTIFACTS", "value": "/var/lib/e3"} in init["env"]
    assert {"name": "checkpoints", "mountPath": "/var/lib/e3/checkpoints", "readOnly": True} in init["volumeMounts"]
    assert {"name": "checkpoints", "persistentVolumeClaim": {"claimName": "e3-checkpoints", "readOnly": True}} \
        in gpu["volumes"]
    pools = json.loads(by_kind(docs, "ConfigMap")["demo-e3-settings"]["data"]["pools.json"])["pools"]
    assert {p["name"]: p["gpus_per_pod"] for p in pools} == {"t4": 0, "v100": 2}


def test_network_policies_let_only_the_router_and_controller_reach_split_pools():
    docs = render({**MULTI_POOL, "networkPolicy": {"enabled": True, "frontDoorFrom": [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress"}}}]}})
    policies = by_kind(docs, "NetworkPolicy")
    deep = policies["demo-e3-triton-deep"]["spec"]["ingress"][0]["from"]
    assert deep == [{"podSelector": {"matchLabels": {"app.kubernetes.io/instance": "demo", "e3.pool": "front"}}},
                    {"podSelector": {"matchLabels": {"app.kubernetes.io/component": "controller",
                                                     "app.kubernetes.io/instance": "demo"}}}]
    front = policies["demo-e3-triton-front"]["spec"]["ingress"][0]["from"]
    assert front[0] == {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress"}}}
    assert "demo-e3-controller" in policies
    assert not by_kind(render({"networkPolicy": {"enabled": False}}), "NetworkPolicy")


def test_disruption_budgets_for_pools_that_run_several_pods():
    budgets = by_kind(render(MULTI_POOL), "PodDisruptionBudget")
    assert set(budgets) == {"demo-e3-triton-deep"}          # the router's one pod gets none (drains would block)
    assert budgets["demo-e3-triton-deep"]["spec"]["maxUnavailable"] == 1


def test_the_dashboard_covers_gpus_latency_failures_and_replicas_with_real_metrics():
    dashboard = json.loads(by_kind(render(MULTI_POOL), "ConfigMap")["demo-e3-dashboard"]["data"]["e3.json"])
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    for word in ("gpu", "latency", "failures", "replicas", "goodput", "drops"):
        assert word in titles, word
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p.get("targets", []))
    for gpu_metric in ("nv_gpu_utilization", "nv_gpu_memory_used_bytes", "nv_inference_request_failure",
                       "nv_inference_request_duration_us"):
        assert gpu_metric in exprs
    # every e3_* metric a panel reads is one the router or the controller exports
    sources = "".join(p.read_text() for folder in ("serving", "controller", "e3")
                      for p in (ROOT / folder).rglob("*.py"))
    for name in set(re.findall(r"\b(e3_[a-z_]+)", exprs)):
        base = re.sub(r"_total$", "", name)
        assert f'"{name}"' in sources or f'"{base}"' in sources, \
            f"the dashboard reads {name}, which nothing exports"


def test_a_gpu_pool_may_have_its_own_repository():
    """TensorRT engines are built per GPU type: a pool names its own PVC subPath, claim or object-storage URL."""
    values = {**GPU, "modelRepository": {"source": "pvc", "pvc": {"claimName": "e3-onnx"}},
              "pools": [GPU["pools"][0], {**GPU["pools"][1], "repository": {"claimName": "e3-engines",
                                                                            "subPath": "v100"}}]}
    docs = render(values)
    t4, v100 = (_pod(docs, n)["spec"] for n in ("demo-e3-triton-t4", "demo-e3-triton-v100"))
    claim = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in v100["volumes"]
             if "persistentVolumeClaim" in v}
    assert claim == {"models": "e3-engines"}
    assert {"name": "models", "mountPath": "/models", "readOnly": True, "subPath": "v100"} in \
        v100["containers"][0]["volumeMounts"]
    assert [v["persistentVolumeClaim"]["claimName"] for v in t4["volumes"] if v["name"] == "models"] == ["e3-onnx"]
    s3 = {**S3, "pools": [{"name": "main", "device": "cpu"},
                          {"name": "a100", "device": "a100", "minReplicas": 1, "maxReplicas": 2,
                           "gpu": {"type": "A100", "count": 1}, "repository": {"url": "s3://models-bucket/e3/a100"}}],
          "router": {"pool": "main"}}
    docs = render(s3)
    assert "--model-repository=s3://models-bucket/e3/a100" in _args(docs, "demo-e3-triton-a100")
    assert "--model-repository=s3://models-bucket/e3/bert_ee" in _args(docs, "demo-e3-triton-main")
