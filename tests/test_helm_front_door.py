"""Issue 39, item 4: the guard is the chart's front door.

* Rendered (every variant of tests/test_helm_chart.py): each Service's HTTP and gRPC ports lead to the guard
  container and to nothing else; Triton's container opens no HTTP or gRPC port (its endpoints are Unix sockets
  on the pod's own memory volume, which only the two containers mount); an Ingress, where rendered, points at
  those Services' HTTP port.
* Run: the guard container's command exactly as the chart renders it (`e3 serve --guard-only`, the key from a
  file), in front of the real tritonserver on Unix sockets: a body declaring a crash-sized shape gets 400 and
  Triton stays up; model control without the key is refused, with it answered."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import http_call, serving
from polling import wait_until
from test_helm_chart import VALUES, by_kind, render

ROOT = Path(__file__).resolve().parents[1]
SOCKETS = "/run/e3/triton"


def _containers(deployment: dict) -> list[dict]:
    return deployment["spec"]["template"]["spec"]["containers"]


@pytest.mark.parametrize("case", sorted(VALUES))
def test_outside_traffic_reaches_only_the_guard(case):
    docs = render(VALUES[case])
    deployments = {n: d for n, d in by_kind(docs, "Deployment").items() if "-triton-" in n}
    assert deployments
    for service in by_kind(docs, "Service").values():
        selector = service["spec"]["selector"]
        if selector.get("app.kubernetes.io/component") != "triton":
            continue
        pods = [d for d in deployments.values()
                if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert len(pods) == 1, service["metadata"]["name"]
        for port in service["spec"]["ports"]:
            owners = [c["name"] for c in _containers(pods[0])
                      if any(p["name"] == port["targetPort"] for p in c.get("ports", []))]
            want = ["triton"] if port["name"] == "metrics" else ["guard"]
            assert owners == want, (service["metadata"]["name"], port)
    for name, deployment in deployments.items():
        pod = deployment["spec"]["template"]["spec"]
        triton, guard = _containers(deployment)
        assert [p["name"] for p in triton["ports"]] == ["metrics"], name
        assert {"--http-address=unix:/run/e3/triton/http", "--grpc-address=unix:/run/e3/triton/grpc",
                "--http-port=0"} <= set(triton["args"])
        sockets = next(v for v in pod["volumes"] if v["name"] == "triton-sockets")
        assert "persistentVolumeClaim" not in sockets and sockets["emptyDir"]["medium"] == "Memory"
        assert [c["name"] for c in pod["containers"] + pod.get("initContainers", [])
                if any(m["name"] == "triton-sockets" for m in c["volumeMounts"])] == ["triton", "guard"]
        # the probes go through the guard (the only one with an HTTP port)
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert triton[probe]["httpGet"]["port"] == next(p["containerPort"] for p in guard["ports"]
                                                             if p["name"] == "http")
    for ingress in by_kind(docs, "Ingress").values():
        for rule in ingress["spec"]["rules"]:
            for path in rule["http"]["paths"]:
                backend = path["backend"]["service"]
                service = by_kind(docs, "Service")[backend["name"]]
                port = next(p for p in service["spec"]["ports"] if p["name"] == backend["port"]["name"])
                assert port["name"] in ("http", "grpc") and port["targetPort"] in ("http", "grpc")


@pytest.mark.e2e
def test_the_rendered_guard_answers_a_crash_sized_shape_with_400(tiny_repo, tmp_path):
    from e3.deploy.server import free_port
    guard = _containers(by_kind(render({}), "Deployment")["demo-e3-triton-main"])[1]
    env_names = {e["name"]: e["value"] for e in guard["env"]}
    header = env_names["E3_API_HEADER"]
    key_file = tmp_path / "api-key"
    key_file.write_text("rendered-guard-key\n")
    key_file.chmod(0o400)
    http_port, grpc_port = free_port(), free_port()
    with serving(tiny_repo, ["tiny_ee_split_1-2", "tiny_ee_split_3-4", "tiny_ee_router"], name="helm-guard",
                 private=True) as server:
        sockets = str(server.socket_dir)
        command = [a.replace(SOCKETS, sockets).replace(f"grpc:{8001}", f"grpc:{server.grpc_port}")
                   for a in guard["command"]]
        command = ["127.0.0.1" if a == "0.0.0.0" else str(http_port) if a == "8000" else
                   str(grpc_port) if a == "8001" else a for a in command]
        assert command[:3] == ["e3", "serve", "--guard-only"] and sockets in command[command.index("--triton-http") + 1]
        command[0] = str(Path(sys.executable).with_name("e3"))
        env = {**os.environ, "E3_API_HEADER": header, "E3_API_KEY_FILE": str(key_file)}
        env.pop("E3_API_KEY", None)
        proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        address = ("127.0.0.1", http_port)
        try:
            def ready():
                assert proc.poll() is None, proc.stderr.read()
                try:
                    return http_call(address, "GET", "/v2/health/ready", timeout=5)[0] == 200
                except OSError:
                    return False
            wait_until(ready, 60, "the rendered guard in front of Triton")
            crash = {"inputs": [{"name": "input_ids", "shape": [2**33, 16], "datatype": "INT64", "data": [1]}]}
            status, text = http_call(address, "POST", "/v2/models/tiny_ee_split_1-2/infer",
                                     json.dumps(crash).encode())
            assert status == 400, text
            assert server.alive() and http_call(address, "GET", "/v2/health/live")[0] == 200
            assert http_call(address, "POST", "/v2/repository/models/tiny_ee_split_1-2/load", b"{}")[0] in (401, 403)
            assert http_call(address, "POST", "/v2/repository/index", b"{}",
                             {header: "rendered-guard-key"})[0] == 200
        finally:
            proc.terminate()
            proc.wait(timeout=30)
