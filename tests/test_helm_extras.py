"""The chart's extras (issue 39, Deliver 6), rendered offline as tests/test_helm_chart.py renders them (its
"extras" variant is rendered, linted, validated strictly, checked against PSS restricted and pinned by a golden
there): an Ingress to the guard only (HTTP with TLS from a named Secret; gRPC on a host of its own),
imagePullSecrets on every pod, affinity and topology spread per pool and for the controller, and extra Triton
flags and environment per pool, where the flags the chart sets and those that would open a door past the guard
are refused. Unset, none of them renders anything (the default goldens are unchanged). What an ingress class
does with the rendered Ingress needs a cluster."""

from __future__ import annotations

import re

import helm_python
import pytest

from pss_restricted import pod_specs
from test_helm_chart import CHART, EXTRAS, MULTI_POOL, S3, assert_schema_refuses, by_kind, render

FRONT, DEEP = "demo-e3-triton-front", "demo-e3-triton-deep"


def _pod(docs, name):
    return by_kind(docs, "Deployment")[name]["spec"]["template"]["spec"]


def _with_front(**fields) -> dict:
    """MULTI_POOL with fields set on its router pool ("front")."""
    return {**MULTI_POOL, "pools": [{**MULTI_POOL["pools"][0], **fields}, MULTI_POOL["pools"][1]]}


def test_unset_extras_render_nothing():
    docs = render(MULTI_POOL)
    assert "Ingress" not in {d["kind"] for d in docs}
    for name, pod in pod_specs(docs).items():
        assert not {"imagePullSecrets", "affinity", "topologySpreadConstraints"} & set(pod), name
    assert "env" not in _pod(docs, FRONT)["containers"][0]


def test_the_ingress_leads_only_to_the_guard_of_the_router_pool_with_tls():
    docs = render(EXTRAS)
    ingresses = by_kind(docs, "Ingress")
    assert set(ingresses) == {"demo-e3", "demo-e3-grpc"}
    guard = _pod(docs, FRONT)["containers"][1]
    assert guard["name"] == "guard"
    guard_ports = {p["name"] for p in guard["ports"]}
    for name, want_port, host in (("demo-e3", "http", "e3.example.com"),
                                  ("demo-e3-grpc", "grpc", "grpc.e3.example.com")):
        spec = ingresses[name]["spec"]
        assert spec["ingressClassName"] == "nginx"
        assert spec["tls"] == [{"secretName": "e3-tls", "hosts": [host]}]
        [rule] = spec["rules"]
        assert rule["host"] == host
        backends = [p["backend"]["service"] for p in rule["http"]["paths"]]
        assert backends == [{"name": FRONT, "port": {"name": want_port}}]   # the router's pool, never a split's
        service = by_kind(docs, "Service")[FRONT]
        target = next(p["targetPort"] for p in service["spec"]["ports"] if p["name"] == want_port)
        assert target in guard_ports and target != "metrics"
    # the class's gRPC annotation only on the gRPC Ingress
    assert ingresses["demo-e3-grpc"]["metadata"]["annotations"] == {
        "nginx.ingress.kubernetes.io/backend-protocol": "GRPC"}
    assert "annotations" not in ingresses["demo-e3"]["metadata"]
    # without a TLS secret: plain HTTP, one Ingress, any host
    plain = by_kind(render({"ingress": {"enabled": True}}), "Ingress")["demo-e3"]["spec"]
    assert "tls" not in plain and "host" not in plain["rules"][0]
    assert plain["rules"][0]["http"]["paths"][0]["backend"]["service"] == {"name": "demo-e3-triton-main",
                                                                           "port": {"name": "http"}}


def test_grpc_through_the_ingress_needs_its_own_host():
    with pytest.raises(helm_python.HelmError, match="ingress.grpc.enabled needs ingress.grpc.host"):
        render({"ingress": {"enabled": True, "grpc": {"enabled": True}}})


def test_every_pod_pulls_with_the_secrets():
    pods = pod_specs(render(EXTRAS))
    assert set(pods) == {f"Deployment/{FRONT}", f"Deployment/{DEEP}", "Deployment/demo-e3-controller"}
    for name, pod in pods.items():
        assert pod["imagePullSecrets"] == [{"name": "registry-key"}], name


def test_affinity_and_spread_land_on_their_own_pods():
    docs = render(EXTRAS)
    deep, front, controller = _pod(docs, DEEP), _pod(docs, FRONT), _pod(docs, "demo-e3-controller")
    assert deep["affinity"] == EXTRAS["pools"][1]["affinity"] and "affinity" not in front
    # a constraint without a labelSelector counts its own Deployment's pods
    [spread] = deep["topologySpreadConstraints"]
    assert spread["labelSelector"]["matchLabels"] == \
        by_kind(docs, "Deployment")[DEEP]["spec"]["selector"]["matchLabels"]
    [spread] = controller["topologySpreadConstraints"]
    assert spread["labelSelector"]["matchLabels"] == \
        by_kind(docs, "Deployment")["demo-e3-controller"]["spec"]["selector"]["matchLabels"]
    assert "topologySpreadConstraints" not in front
    # one that names its own selector keeps it
    own = {"maxSkew": 2, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "DoNotSchedule",
           "labelSelector": {"matchLabels": {"team": "ml"}}}
    pod = _pod(render(_with_front(topologySpreadConstraints=[own])), FRONT)
    assert pod["topologySpreadConstraints"] == [own]


def test_extra_args_and_env_follow_the_charts_own_in_tritons_container_only():
    docs = render(EXTRAS)
    base = _pod(render(MULTI_POOL), FRONT)["containers"][0]["args"]
    triton, guard = _pod(docs, FRONT)["containers"]
    assert triton["args"] == base + ["--pinned-memory-pool-byte-size=268435456", "--log-info=true"]
    assert triton["env"] == [{"name": "OMP_NUM_THREADS", "value": "4"}]
    assert "OMP_NUM_THREADS" not in str(guard) and "pinned-memory" not in str(guard)
    assert _pod(docs, DEEP)["containers"][0]["args"] == _pod(render(MULTI_POOL), DEEP)["containers"][0]["args"]
    # beside the chart's own environment (an s3 repository's region)
    s3 = {**S3, "pools": [{"name": "main", "device": "cpu", "extraEnv": [{"name": "OMP_NUM_THREADS", "value": "2"}]}]}
    env = _pod(render(s3), "demo-e3-triton-main")["containers"][0]["env"]
    assert [e["name"] for e in env] == ["AWS_DEFAULT_REGION", "OMP_NUM_THREADS"]


def _refused() -> list[str]:
    text = (CHART / "templates" / "_helpers.tpl").read_text()
    body = text.split('define "e3.refusedTritonFlags" -}}', 1)[1].split("{{- end -}}", 1)[0]
    return body.split()


def test_every_flag_the_chart_sets_is_refused_in_extra_args():
    """A later flag overrides an earlier one in tritonserver: each flag the chart renders (in every variant that
    changes Triton's command) must be refused, or extraArgs could move Triton's sockets off the guard."""
    refused = set(_refused())
    assert {"http-address", "grpc-address", "http-port", "grpc-port", "allow-http", "allow-grpc",
            "allow-sagemaker", "allow-vertex-ai", "model-control-mode", "grpc-restricted-api"} <= refused
    for values in ({}, MULTI_POOL, S3):
        for pod in pod_specs(render(values)).values():
            if pod["containers"][0]["name"] != "triton":
                continue
            for arg in pod["containers"][0]["args"]:
                flag = re.match(r"--([^=]+)", arg).group(1)
                assert flag in refused or flag == "backend-config", flag


@pytest.mark.parametrize("arg", ["--http-address=0.0.0.0", "--grpc-port=9001", "--allow-sagemaker=true",
                                 "--model-control-mode=poll", "--http-restricted-api=model-repository:k=v",
                                 "--load-model=other", "--metrics-address=0.0.0.0"])
def test_a_refused_flag_fails_the_render_with_its_name(arg):
    flag = arg.split("=")[0]
    with pytest.raises(helm_python.HelmError, match=f"extraArgs: {re.escape(arg)} is the chart's own or would "
                                                    f"bypass the guard"):
        render(_with_front(extraArgs=["--log-info=true", arg]))
    assert flag.lstrip("-") in _refused()


@pytest.mark.parametrize("values, message", [
    (_with_front(extraArgs=["--log-file", "/tmp/x"]), "/pools/0/extraArgs/1"),   # one --flag=value word each
    (_with_front(extraArgs=["-v"]), "/pools/0/extraArgs/0"),
    (_with_front(extraEnv=[{"value": "1"}]), "missing property 'name'"),
    ({"ingress": {"enable": True}}, "additional properties 'enable' not allowed"),
    ({"ingress": {"tls": {"secret": "x"}}}, "additional properties 'secret' not allowed"),
    ({"imagePullSecrets": ["registry-key"]}, "/imagePullSecrets/0"),
    ({"controller": {"topologySpreadConstraints": [{"maxSkew": 1}]}}, "missing propert"),
])
def test_the_schema_refuses_bad_extras(values, message):
    assert_schema_refuses(values, message)
