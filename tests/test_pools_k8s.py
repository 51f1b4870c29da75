"""The controller scaling pools' Deployments through the Kubernetes API, against a recording fake of
that API on loopback (no cluster here): the real ``kubernetes`` client builds and sends every request,
so paths, verbs, content types and bodies are what a cluster would receive."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from e3.controller.applier import ControlError
from e3.controller.k8s_scaler import KubernetesScaler, RecordingScaler, scale_request
from e3.controller.pooled_applier import PlacingPlanner, PooledApplier
from e3.controller.planner.placement import place
from e3.deploy.pools import load_pools
from helpers import make_plan, make_pools

PREFIX = "/apis/apps/v1/namespaces/e3/deployments/"


class FakeKubernetes(ThreadingHTTPServer):
    """Deployments' scale and status, as the API server serves them; ``requests`` records
    (method, path, content type, JSON body). ``forbid`` names Deployments whose writes answer 403;
    ``ready_after`` makes new pods ready only after that many status reads."""

    def __init__(self, replicas: dict[str, int]):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.replicas = dict(replicas)
        self.ready = dict(replicas)
        self.requests: list[tuple[str, str, str, dict | None]] = []
        self.forbid: set[str] = set()
        self.ready_after = 0
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    server: FakeKubernetes

    def log_message(self, *args):   # quiet
        pass

    def _send(self, code: int, doc: dict) -> None:
        data = json.dumps(doc).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _scale(self, name: str) -> dict:
        return {"apiVersion": "autoscaling/v1", "kind": "Scale", "metadata": {"name": name, "namespace": "e3"},
                "spec": {"replicas": self.server.replicas[name]}, "status": {"replicas": self.server.replicas[name]}}

    def _handle(self, method: str) -> None:
        fake = self.server
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        with fake.lock:
            fake.requests.append((method, self.path, self.headers.get("Content-Type", ""), body))
            name, _, sub = self.path.removeprefix(PREFIX).partition("/")
            if not self.path.startswith(PREFIX) or name not in fake.replicas:
                return self._send(404, {"kind": "Status", "status": "Failure", "reason": "NotFound", "code": 404})
            if method == "PATCH" and sub == "scale":
                if name in fake.forbid:
                    return self._send(403, {"kind": "Status", "status": "Failure", "reason": "Forbidden", "code": 403,
                                            "message": f"deployments.apps \"{name}\" is forbidden"})
                fake.replicas[name] = body["spec"]["replicas"]
                return self._send(200, self._scale(name))
            if method == "GET" and sub == "scale":
                return self._send(200, self._scale(name))
            if method == "GET" and sub == "":
                if fake.ready_after > 0:
                    fake.ready_after -= 1
                else:
                    fake.ready[name] = fake.replicas[name]
                return self._send(200, {"apiVersion": "apps/v1", "kind": "Deployment",
                                        "metadata": {"name": name, "namespace": "e3"},
                                        "spec": {"replicas": fake.replicas[name], "selector": {"matchLabels": {}},
                                                 "template": {}},
                                        "status": {"replicas": fake.replicas[name],
                                                   "readyReplicas": fake.ready[name]}})
            return self._send(405, {"kind": "Status", "status": "Failure", "code": 405})

    def do_GET(self):
        self._handle("GET")

    def do_PATCH(self):
        self._handle("PATCH")


@pytest.fixture
def cluster():
    fake = FakeKubernetes({"demo-e3-triton-front": 1, "demo-e3-triton-t4": 1, "demo-e3-triton-t4b": 0})
    thread = threading.Thread(target=fake.serve_forever, daemon=True)
    thread.start()
    yield fake
    fake.shutdown()
    fake.server_close()


def _scaler(cluster, pools):
    from kubernetes import client
    config = client.Configuration(host=cluster.url)
    scaler = KubernetesScaler(pools, apps=client.AppsV1Api(client.ApiClient(config)))
    scaler.poll_s = 0.05
    return scaler


def test_the_patch_is_a_scale_with_only_the_replicas(cluster):
    pools = load_pools(make_pools())
    t4 = pools.named("t4")
    body = scale_request(t4, "e3", 3)
    assert body.spec.replicas == 3 and body.metadata.name == "demo-e3-triton-t4"
    scaler = _scaler(cluster, pools)
    assert scaler.replicas(t4) == 1
    scaler.scale(t4, 3)
    method, path, ctype, sent = cluster.requests[-1]
    assert (method, path) == ("PATCH", PREFIX + "demo-e3-triton-t4/scale")
    assert ctype.startswith("application/") and "patch" in ctype
    assert sent == {"apiVersion": "autoscaling/v1", "kind": "Scale",
                    "metadata": {"name": "demo-e3-triton-t4", "namespace": "e3"}, "spec": {"replicas": 3}}
    assert cluster.replicas["demo-e3-triton-t4"] == 3 and scaler.ready(t4) == 3


def test_a_refusal_is_a_control_error_naming_the_deployment(cluster):
    pools = load_pools(make_pools())
    cluster.forbid.add("demo-e3-triton-t4")
    with pytest.raises(ControlError, match=r"scale demo-e3-triton-t4 to 2: Kubernetes answered 403.*forbidden"):
        _scaler(cluster, pools).scale(pools.named("t4"), 2)


def test_an_api_that_cannot_be_reached_is_a_control_error():
    from kubernetes import client
    from e3.deploy.server import free_port
    pools = load_pools(make_pools())
    config = client.Configuration(host=f"http://127.0.0.1:{free_port()}")
    config.retries = 0
    scaler = KubernetesScaler(pools, apps=client.AppsV1Api(client.ApiClient(config)))
    with pytest.raises(ControlError, match="read scale of demo-e3-triton-t4: cannot reach the Kubernetes API"):
        scaler.replicas(pools.named("t4"))


def test_a_plan_that_needs_more_pods_scales_the_pool_first_and_back_after(cluster):
    pools = load_pools(make_pools())
    scaler = _scaler(cluster, pools)
    applier = PooledApplier("bert_ee_router", router=None, servers={}, pools=pools, scaler=scaler,
                            ready_timeout_s=30)
    big = place(make_plan(devices_=("cpu", "t4", "t4"), instances=(1, 3, 2)), pools, pin={"bert_ee_split_5-6": "t4b"})
    cluster.ready_after = 2          # the new pods pass their readiness probe a little later
    applier.prepare(big)
    patches = [(p, b["spec"]["replicas"]) for m, p, _, b in cluster.requests if m == "PATCH"]
    assert patches == [(PREFIX + "demo-e3-triton-t4/scale", 3), (PREFIX + "demo-e3-triton-t4b/scale", 1)]
    assert cluster.ready == {"demo-e3-triton-front": 1, "demo-e3-triton-t4": 3, "demo-e3-triton-t4b": 1}
    small = place(make_plan(devices_=("cpu", "t4", "t4"), instances=(1, 1, 1)), pools)
    before = len(cluster.requests)
    applier.settle(small)
    patches = [(p, b["spec"]["replicas"]) for m, p, _, b in cluster.requests[before:] if m == "PATCH"]
    assert patches == [(PREFIX + "demo-e3-triton-t4/scale", 2), (PREFIX + "demo-e3-triton-t4b/scale", 0)]


def test_pods_that_never_get_ready_fail_the_apply(cluster):
    pools = load_pools(make_pools())
    applier = PooledApplier("bert_ee_router", router=None, servers={}, pools=pools, scaler=_scaler(cluster, pools),
                            ready_timeout_s=0.5)
    cluster.ready_after = 10_000
    big = place(make_plan(devices_=("cpu", "t4", "t4"), instances=(1, 2, 2)), pools)
    with pytest.raises(ControlError, match=r"pool 't4': 1 of 4 pods ready"):
        applier.prepare(big)


def test_the_control_loop_scales_before_it_loads(tmp_path):
    """The loop's apply path: pods first (prepare), then loads and the switch; pods back after the drain."""
    from e3.controller.loop import Controller
    from e3.controller.recording_applier import RecordingApplier
    from e3.controller.settings import ControlSettings

    pools = load_pools(make_pools())
    scaler = RecordingScaler({"front": 1, "t4": 1, "t4b": 0})
    order: list[str] = []

    class Recorder(RecordingApplier):
        def prepare(self, plan):
            order.append("prepare")
            PooledApplier("bert_ee_router", None, {}, pools=pools, scaler=scaler).prepare(plan)

        def settle(self, plan):
            order.append("settle")
            PooledApplier("bert_ee_router", None, {}, pools=pools, scaler=scaler).settle(plan)

        def configure_split(self, split):
            order.append(f"load {split.model}")
            super().configure_split(split)

    big = place(make_plan(devices_=("cpu", "t4", "t4"), instances=(1, 3, 1)), pools)
    server = Recorder()
    settings = ControlSettings(model="bert_ee", devices={"cpu": 4, "t4": 10}, slo_ms=200, rate_rps=50, drain_s=0.0,
                               state_dir=tmp_path)
    # Only the apply path runs here (pinned plans): no telemetry, forecast or planning.
    controller = Controller(settings, telemetry=None, forecaster=None, planner=None, view=server, pinned=big)
    assert controller.apply_pinned()
    assert order[0] == "prepare" and order[1].startswith("load ")
    assert scaler.calls == [("t4", 4)]     # 3 + 1 t4 instances on the first t4 pool, 1 per pod
    controller.pinned = place(make_plan(devices_=("cpu", "t4", "t4"), instances=(1, 1, 1)), pools)
    assert controller.apply_pinned()
    controller.unload_unused()
    assert order[-1] == "settle" and scaler.calls[-1] == ("t4", 2)


def test_plans_from_the_planner_are_placed():
    pools = load_pools(make_pools())

    class Fixed:
        latency = "profile"

        def plan(self, forecast, devices):
            return make_plan(devices_=("cpu", "t4", "t4"), instances=(1, 1, 1))

        def throughput(self, plan, forecast):
            return 42.0

    planner = PlacingPlanner(Fixed(), pools)
    plan = planner.plan(None, {"cpu": 4, "t4": 10})
    assert [s.server for s in plan.splits] == ["", "demo-e3-triton-t4:8001", "demo-e3-triton-t4:8001"]
    assert planner.throughput(plan, None) == 42.0 and planner.latency == "profile"
