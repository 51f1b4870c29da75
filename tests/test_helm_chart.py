"""The Helm chart (deploy/helm/e3): rendered offline for default (CPU), multi-pool, GPU, HPA, KEDA and
object-storage (s3, gs) values, linted, every manifest validated against the Kubernetes schemas (CRDs by
hand), every pod checked against the Pod Security Standards' restricted profile (tests/pss_restricted.py),
and its key fields (probes, /dev/shm, the restricted model-control API, RBAC verbs) checked and compared
with golden files (tests/golden/helm/; regenerate with E3_UPDATE_GOLDEN=1)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import helm_python            # pinned in requirements.txt: a missing package fails here, never skips
import kubernetes_validate
import pytest
import yaml

from pss_restricted import pod_specs, violations

CHART = Path(__file__).resolve().parent.parent / "deploy" / "helm" / "e3"
GOLDEN = Path(__file__).parent / "golden" / "helm"
KUBE_VERSION = "1.30.0"

MULTI_POOL = {
    "pools": [
        {"name": "front", "device": "cpu", "replicas": 1, "minReplicas": 1, "maxReplicas": 1, "devicesPerPod": 2,
         "price": 0.2, "gpu": {"type": "", "count": 0}, "nodeSelector": {"e3/pool": "front"},
         "models": ["bert_ee", "bert_ee_preprocess", "bert_ee_router", "bert_ee_split_1-3"]},
        {"name": "deep", "device": "cpu", "replicas": 2, "minReplicas": 1, "maxReplicas": 4, "devicesPerPod": 2,
         "price": 0.2, "gpu": {"type": "", "count": 0}, "nodeSelector": {"e3/pool": "deep"},
         "models": ["bert_ee_split_4-6"]},
    ],
    "router": {"pool": "front"},
    "serviceMonitor": {"enabled": True},
    "grafanaDashboard": {"enabled": True},
}

GPU = {
    "pools": [
        {"name": "t4", "device": "t4", "replicas": 1, "minReplicas": 1, "maxReplicas": 1, "devicesPerPod": 1,
         "price": 0.35, "gpu": {"type": "Tesla-T4", "count": 1}, "nodeSelector": {},
         "resources": {"requests": {"cpu": "4", "memory": "16Gi"}, "limits": {"memory": "16Gi"}},
         "models": ["bert_ee", "bert_ee_preprocess", "bert_ee_router", "bert_ee_split_1-2"]},
        {"name": "v100", "device": "v100", "replicas": 1, "minReplicas": 1, "maxReplicas": 6, "devicesPerPod": 2,
         "price": 2.48, "gpu": {"type": "Tesla-V100-SXM2-16GB", "count": 2}, "nodeSelector": {"cloud/pool": "gpu"},
         "models": ["bert_ee_split_3-6"]},
    ],
    "router": {"pool": "t4"},
    "modelRepository": {"source": "export", "export": {"cuts": "2", "format": "tensorrt", "allRanges": True,
                                                       "sizeLimit": "8Gi"}},
    "restrictedApi": {"enabled": True, "existingSecret": "my-e3-key"},
}

HPA = {**MULTI_POOL, "autoscaling": {"enabled": True, "kind": "hpa"}}
KEDA = {**MULTI_POOL, "autoscaling": {"enabled": True, "kind": "keda",
                                      "prometheusUrl": "http://prometheus.monitoring.svc:9090"}}
S3 = {"modelRepository": {"source": "objectStorage", "objectStorage": {
    "url": "s3://models-bucket/e3/bert_ee", "credentialsSecret": "e3-s3", "region": "eu-west-1"}},
      "controller": {"planConfigMap": "e3-plan"}}
GCS = {"modelRepository": {"source": "objectStorage", "objectStorage": {
    "url": "gs://models-bucket/e3/bert_ee", "credentialsSecret": "e3-gcs", "credentialsKey": "key.json"}}}

# Issue 39, Deliver 6: an Ingress (TLS, gRPC), pull secrets, affinity and spread, extra Triton flags and env
SPREAD = {"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "ScheduleAnyway"}
ANTI_AFFINITY = {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
    "weight": 100, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname",
                                       "labelSelector": {"matchLabels": {"e3.pool": "deep"}}}}]}}
EXTRAS = {
    **MULTI_POOL,
    "pools": [{**MULTI_POOL["pools"][0], "extraArgs": ["--pinned-memory-pool-byte-size=268435456", "--log-info=true"],
               "extraEnv": [{"name": "OMP_NUM_THREADS", "value": "4"}]},
              {**MULTI_POOL["pools"][1], "affinity": ANTI_AFFINITY, "topologySpreadConstraints": [SPREAD]}],
    "imagePullSecrets": [{"name": "registry-key"}],
    "ingress": {"enabled": True, "className": "nginx", "host": "e3.example.com",
                "tls": {"secretName": "e3-tls"},
                "grpc": {"enabled": True, "host": "grpc.e3.example.com",
                         "annotations": {"nginx.ingress.kubernetes.io/backend-protocol": "GRPC"}}},
    "controller": {"topologySpreadConstraints": [SPREAD]},
}

VALUES = {"default": {}, "multi-pool": MULTI_POOL, "gpu": GPU, "hpa": HPA, "keda": KEDA, "s3": S3, "gcs": GCS,
          "extras": EXTRAS}
CRDS = {"monitoring.coreos.com/": "ServiceMonitor", "keda.sh/": "ScaledObject"}   # no schema ships for these


def render(values: dict) -> list[dict]:
    """Every manifest the chart renders for ``values`` (release "demo" in namespace "e3"), as dicts."""
    chart = helm_python.Chart.load(CHART)
    try:
        files = chart.render(values, name="demo", namespace="e3")
    finally:
        chart.close()
    docs = []
    for path, text in sorted(files.items()):
        if path.endswith("NOTES.txt"):
            continue
        docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def key_fields(docs: list[dict]) -> dict:
    """The fields the goldens pin: per Triton Deployment its probes, /dev/shm, restricted API, GPUs and
    placement; the controller's RBAC rules; Services' ports; which kinds were rendered."""
    out: dict = {"kinds": sorted(f"{d['kind']}/{d['metadata']['name']}" for d in docs)}
    for name, dep in sorted(by_kind(docs, "Deployment").items()):
        pod = dep["spec"]["template"]["spec"]
        c = pod["containers"][0]
        entry = {"replicas": dep["spec"].get("replicas", "(owned by the controller or an autoscaler)"),
                 "strategy": dep["spec"].get("strategy"), "image": c["image"], "args": c.get("args", []),
                 "resources": c.get("resources", {}), "nodeSelector": pod.get("nodeSelector", {}),
                 "volumes": pod.get("volumes", []), "mounts": c.get("volumeMounts", []),
                 "initContainers": [{"name": i["name"], "command": i["command"]}
                                    for i in pod.get("initContainers", [])]}
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            if probe in c:
                entry[probe] = c[probe]
        for optional in ("imagePullSecrets", "affinity", "topologySpreadConstraints"):   # pinned where set
            if optional in pod:
                entry[optional] = pod[optional]
        out[f"Deployment/{name}"] = entry
    for name, role in sorted(by_kind(docs, "Role").items()):
        out[f"Role/{name}"] = role["rules"]
    for name, svc in sorted(by_kind(docs, "Service").items()):
        out[f"Service/{name}"] = svc["spec"]["ports"]
    for kind in ("HorizontalPodAutoscaler", "ScaledObject", "NetworkPolicy", "PodDisruptionBudget", "Ingress"):
        for name, doc in sorted(by_kind(docs, kind).items()):
            out[f"{kind}/{name}"] = doc["spec"]
    return out


@pytest.mark.parametrize("case", sorted(VALUES))
def test_every_manifest_is_valid_kubernetes(case):
    docs = render(VALUES[case])
    assert docs
    checked = 0
    for doc in docs:
        crd = [kind for group, kind in CRDS.items() if doc["apiVersion"].startswith(group)]
        if crd:   # CRDs (Prometheus Operator, KEDA): no schema for them ships with the validator; checked by hand
            assert doc["kind"] == crd[0]
            if crd[0] == "ServiceMonitor":
                assert doc["spec"]["endpoints"][0]["port"] == "metrics"
            else:
                _check_scaled_object(doc)
            continue
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
        checked += 1
    assert checked >= 7


def _check_scaled_object(doc: dict) -> None:
    """A KEDA ScaledObject as keda.sh/v1alpha1 defines it (the fields KEDA's CRD requires and what we set)."""
    spec = doc["spec"]
    assert set(spec) <= {"scaleTargetRef", "minReplicaCount", "maxReplicaCount", "pollingInterval", "advanced",
                         "triggers", "cooldownPeriod", "idleReplicaCount", "fallback"}
    assert spec["scaleTargetRef"]["name"] and spec["triggers"], spec
    assert 0 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
    for trigger in spec["triggers"]:
        assert trigger["type"] == "prometheus" and trigger["metricType"] in ("AverageValue", "Value")
        assert set(trigger["metadata"]) >= {"serverAddress", "query", "threshold"}
        assert all(isinstance(v, str) for v in trigger["metadata"].values())   # KEDA's metadata is map[string]string


@pytest.mark.parametrize("case", sorted(VALUES))
def test_every_pod_passes_pod_security_restricted(case):
    pods = pod_specs(render(VALUES[case]))
    assert pods
    for name, pod in pods.items():
        assert not violations(pod), (name, violations(pod))


def test_the_policy_check_catches_what_restricted_forbids():
    """The checker itself: a pod from the chart passes; each single change that PSS restricted rejects fails."""
    import copy
    good = pod_specs(render(GPU))["Deployment/demo-e3-triton-t4"]
    assert not violations(good) and good["initContainers"]
    breaks = [
        lambda p: p["initContainers"][0]["securityContext"].pop("allowPrivilegeEscalation"),
        lambda p: p["containers"][0]["securityContext"]["capabilities"].update(drop=[]),
        lambda p: p["containers"][0]["securityContext"]["capabilities"].update(add=["SYS_ADMIN"]),
        lambda p: (p["securityContext"].pop("seccompProfile"),
                   p["initContainers"][0]["securityContext"].pop("seccompProfile")),
        lambda p: (p["securityContext"].pop("runAsNonRoot"),
                   p["containers"][0]["securityContext"].pop("runAsNonRoot")),
        lambda p: p["volumes"].append({"name": "host", "hostPath": {"path": "/var"}}),
        lambda p: p.update(hostNetwork=True),
        lambda p: p["containers"][0]["ports"][0].update(hostPort=8000),
        lambda p: p["containers"][0]["securityContext"].update(privileged=True),
    ]
    for i, change in enumerate(breaks):
        pod = copy.deepcopy(good)
        change(pod)
        assert violations(pod), f"change {i} should break PSS restricted"


@pytest.mark.parametrize("case", sorted(VALUES))
def test_lint_finds_no_error_or_warning(case, tmp_path):
    report = helm_python.lint(CHART, VALUES[case] or None, strict=True) if VALUES[case] else \
        helm_python.lint(CHART, strict=True)
    assert not report["errors"], report
    assert all(m["severity"] < 2 for m in report["messages"]), report["messages"]


@pytest.mark.parametrize("case", sorted(VALUES))
def test_key_fields_match_golden(case):
    got = key_fields(render(VALUES[case]))
    golden = GOLDEN / f"{case}.json"
    text = json.dumps(got, indent=2, sort_keys=True) + "\n"
    if os.environ.get("E3_UPDATE_GOLDEN"):
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(text)
    assert text == golden.read_text(), f"{golden} differs (regenerate with E3_UPDATE_GOLDEN=1 if intended)"


def _triton(docs, pool):
    return by_kind(docs, "Deployment")[f"demo-e3-triton-{pool}"]["spec"]["template"]["spec"]


def test_triton_pods_probe_health_and_the_router():
    pod = _triton(render({}), "main")
    c = pod["containers"][0]
    # through the guard container, the pod's HTTP port (Triton's own is a Unix socket)
    assert c["livenessProbe"]["httpGet"] == {"path": "/v2/health/live", "port": 8000}
    assert c["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": 8000}
    guard = pod["containers"][1]
    assert guard["name"] == "guard" and {p["name"]: p["containerPort"] for p in guard["ports"]} == \
        {"http": 8000, "grpc": 8001}
    # not strict (a failed load kept it unready for good); the guard is ready only while the plan is served
    assert "--strict-readiness=false" in c["args"]
    assert c["startupProbe"]["httpGet"]["path"] == "/v2/models/bert_ee_router/ready"


def test_shm_is_a_memory_volume_sized_for_the_python_backend():
    pod = _triton(render({"triton": {"shmSize": "3Gi"}}), "main")
    shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "3Gi"}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in pod["containers"][0]["volumeMounts"]
    assert any(a.startswith("--backend-config=python,shm-default-byte-size=") for a in pod["containers"][0]["args"])


def test_model_control_is_restricted_with_the_secret_key():
    """Issue 38: the guard container checks the key (read from the Secret mounted as a file); Triton's HTTP and
    gRPC are Unix sockets on a volume only the pod mounts, and no command line or environment holds the key."""
    docs = render({})
    pod = _triton(docs, "main")
    triton, guard = pod["containers"]
    assert "--http-address=unix:/run/e3/triton/http" in triton["args"]
    assert "--grpc-address=unix:/run/e3/triton/grpc" in triton["args"]
    assert not any("restricted" in a or "E3_API_KEY" in a for a in triton["args"])
    assert not any(e["name"].startswith("E3_API") for e in triton.get("env", []))
    assert guard["command"][:3] == ["e3", "serve", "--guard-only"]
    assert "unix:/run/e3/triton/grpc:8001" in guard["command"]
    env = {e["name"]: e.get("value") for e in guard["env"]}
    assert env == {"E3_API_HEADER": "e3-api-key", "E3_API_KEY_FILE": "/var/run/e3/api-key/api-key"}
    volume = next(v for v in pod["volumes"] if v["name"] == "api-key")["secret"]
    secret = by_kind(docs, "Secret")[volume["secretName"]]
    assert len(secret["data"]["api-key"]) >= 40
    sockets = next(v for v in pod["volumes"] if v["name"] == "triton-sockets")
    assert {"name": "triton-sockets", "mountPath": "/run/e3/triton"} in triton["volumeMounts"]
    assert sockets["emptyDir"]["medium"] == "Memory"
    # Turned off: no key anywhere
    off = _triton(render({"restrictedApi": {"enabled": False}}), "main")
    assert "env" not in off["containers"][1] and not any(v["name"] == "api-key" for v in off["volumes"])
    # An existing Secret: the chart makes none
    assert "Secret" not in {d["kind"] for d in render(GPU)}


def test_controller_rbac_is_least_privilege():
    docs = render(MULTI_POOL)
    role = by_kind(docs, "Role")["demo-e3-controller"]
    pools = ["demo-e3-triton-front", "demo-e3-triton-deep"]
    assert role["rules"] == [
        {"apiGroups": ["apps"], "resources": ["deployments"], "resourceNames": pools, "verbs": ["get"]},
        {"apiGroups": ["apps"], "resources": ["deployments/scale"], "resourceNames": pools,
         "verbs": ["get", "patch"]}]
    assert "ClusterRole" not in {d["kind"] for d in docs}
    binding = by_kind(docs, "RoleBinding")["demo-e3-controller"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "demo-e3-controller", "namespace": "e3"}]


def test_pools_get_their_own_deployment_service_and_models():
    docs = render(MULTI_POOL)
    front, deep = _triton(docs, "front"), _triton(docs, "deep")
    assert "--load-model=bert_ee_router" in front["containers"][0]["args"]
    assert [a for a in deep["containers"][0]["args"] if a.startswith("--load-model")] == \
        ["--load-model=bert_ee_split_4-6"]
    assert deep["nodeSelector"] == {"e3/pool": "deep"}
    assert set(by_kind(docs, "Service")) == {"demo-e3-triton-front", "demo-e3-triton-deep",
                                             "demo-e3-triton-front-pods", "demo-e3-triton-deep-pods",
                                             "demo-e3-controller"}
    assert by_kind(docs, "Service")["demo-e3-triton-deep-pods"]["spec"]["clusterIP"] == "None"
    settings = by_kind(docs, "ConfigMap")["demo-e3-settings"]["data"]
    assert settings["E3_DEVICES"] == "cpu:10"   # 2 devices per pod x (1 + 4) max replicas
    pools = json.loads(settings["pools.json"])
    assert [p["grpc_url"] for p in pools["pools"]] == ["dns:///demo-e3-triton-front-pods:8001",
                                                       "dns:///demo-e3-triton-deep-pods:8001"]
    assert [p["pods_host"] for p in pools["pools"]] == ["demo-e3-triton-front-pods", "demo-e3-triton-deep-pods"]
    dashboard = json.loads(by_kind(docs, "ConfigMap")["demo-e3-dashboard"]["data"]["e3.json"])
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    for word in ("goodput", "drops", "batch profile", "batch size", "plan in force"):
        assert word in titles


def test_gpu_pools_ask_for_gpus_on_the_right_nodes():
    docs = render(GPU)
    t4, v100 = _triton(docs, "t4"), _triton(docs, "v100")
    assert t4["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert v100["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert v100["nodeSelector"] == {"cloud/pool": "gpu", "nvidia.com/gpu.product": "Tesla-V100-SXM2-16GB"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in t4["tolerations"]
    assert "--allow-gpu-metrics=true" in t4["containers"][0]["args"]
    assert t4["initContainers"][0]["image"] == "e3-export:0.1.0"   # PyTorch: not in the controller's image
    init = t4["initContainers"][0]["command"]
    assert init[:5] == ["e3", "export", "bert-ee", "--target", "ngc"] and "--all-ranges" in init
    assert by_kind(docs, "ConfigMap")["demo-e3-settings"]["data"]["E3_DEVICES"] == "t4:1,v100:12"


def test_bad_values_fail_with_a_clear_message():
    with pytest.raises(helm_python.HelmError, match="router.pool \"gpu\" names no pool"):
        render({"router": {"pool": "gpu"}})
    with pytest.raises(helm_python.HelmError, match="serves the router and runs exactly one pod"):
        render({"pools": [{"name": "main", "device": "cpu", "maxReplicas": 3}]})
    with pytest.raises(helm_python.HelmError, match="/modelRepository/source': value must be one of 'pvc', 'export'"):
        render({"modelRepository": {"source": "s3"}})      # the schema, checked at every render


@pytest.mark.parametrize("case", sorted(VALUES))
def test_values_pass_the_charts_schema(case):
    chart = helm_python.Chart.load(CHART)
    try:
        chart.validate_schema(VALUES[case])
    finally:
        chart.close()


@pytest.mark.parametrize("values, message", [
    ({"pools": [{"name": "Big_Pool", "device": "cpu"}]}, "/pools/0/name"),
    ({"pools": [{"name": "gpu"}]}, "missing property 'device'"),
    ({"pools": [{"name": "gpu", "device": "t4", "replica": 2}]}, "additional properties 'replica' not allowed"),
    ({"modelRepository": {"source": "s3"}}, "/modelRepository/source"),
    ({"controller": {"slack": 1.5}}, "/controller/slack"),
    # closed in every section (issue 39): a typo is refused, never rendered silently
    ({"controller": {"sloMS": 200}}, "additional properties 'sloMS' not allowed"),
    ({"tritonImage": {"repo": "x"}}, "additional properties 'repo' not allowed"),
    ({"serviceMonitor": {"enable": True}}, "additional properties 'enable' not allowed"),
    ({"modelRepository": {"pvc": {"claim": "x"}}}, "additional properties 'claim' not allowed"),
    ({"networkPolicy": {"frontDoor": []}}, "additional properties 'frontDoor' not allowed"),
    ({"replicas": 2}, "additional properties 'replicas' not allowed"),
])
def test_the_schema_names_the_bad_value(values, message):
    assert_schema_refuses(values, message)


def assert_schema_refuses(values: dict, message: str) -> None:
    """The chart's values schema refuses ``values`` with an error matching ``message``."""
    chart = helm_python.Chart.load(CHART)
    try:
        with pytest.raises(helm_python.HelmValuesError, match=message):
            chart.validate_schema(values)
    finally:
        chart.close()


def test_a_pool_needs_only_a_name_and_a_device():
    values = {"pools": [{"name": "cpu", "device": "cpu"}], "router": {"pool": "cpu"}}
    docs = render(values)
    for doc in docs:
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
    dep = by_kind(docs, "Deployment")["demo-e3-triton-cpu"]
    assert dep["spec"]["replicas"] == 1 and "--load-model=*" in dep["spec"]["template"]["spec"]["containers"][0]["args"]
    pools = json.loads(by_kind(docs, "ConfigMap")["demo-e3-settings"]["data"]["pools.json"])["pools"]
    assert pools[0]["devices_per_pod"] == 1 and pools[0]["max_replicas"] == 1
