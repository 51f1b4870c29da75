"""Small helpers and factories shared by the tests (no test file imports another)."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from dataclasses import replace

import numpy as np

from e3.client.sdk import E3Client
from e3.core.plan import Plan, default_plan
from e3.core.profile import DeviceConfig, LatencyProfile
from e3.core.rows import request_slices


@contextmanager
def serving(repo: str | os.PathLike, models: list[str] | None = None, *, name: str = "session",
            **server_args) -> Iterator:
    """The real embedded tritonserver serving ``repo`` (``models``, default: its manifest) on free
    loopback ports, for as long as the ``with`` lasts; its log goes to
    ``artifacts/logs/test-tritonserver-<name>-<pid>.log``; ``server_args`` go to TritonServer (e.g.
    ``api_key``). Every e2e test starts its servers here."""
    from e3.deploy.server import TritonServer
    from e3.paths import artifacts_dir
    log = Path(artifacts_dir()) / "logs" / f"test-tritonserver-{name}-{os.getpid()}.log"
    # A test server has nothing in flight when it stops; Triton's wait for models that never report
    # unloaded (seen after a refused router reload) is cut to 3 s, after which the launcher kills it.
    with TritonServer.on_free_ports(repo, models, log_file=log, exit_timeout_s=3, **server_args) as server:
        yield server


@contextmanager
def serving_every_range(tmp_path_factory, name: str) -> Iterator:
    """:func:`serving` on a repository of its own: tiny-ee cut after block 2, with every block range
    pre-exported, so that a controller or a plan switch can load any split at once."""
    from e3.export.repository import ExportSettings, all_ranges, export_repository
    from e3.models.zoo import resolve_model
    repo = tmp_path_factory.mktemp(name)
    export_repository("tiny-ee", "2", repo, settings=ExportSettings(), progress=False,
                      extra_ranges=all_ranges(resolve_model("tiny-ee").card.num_blocks))
    with serving(repo, name=name) as server:
        yield server


def mixed_sizes(total: int, max_size: int, seed: int) -> list[int]:
    """Request sizes 1..max_size (seeded) adding up to ``total`` inputs."""
    rng = np.random.default_rng(seed)
    sizes, left = [], total
    while left:
        sizes.append(int(min(left, rng.integers(1, max_size + 1))))
        left -= sizes[-1]
    return sizes


def send_concurrently(url: str, model: str, make_inputs: Callable[[int, int], dict], sizes: list[int], *,
                      workers: int, protocol: str = "http") -> tuple[np.ndarray, np.ndarray]:
    """Send rows [a, b) of each request (``make_inputs(a, b)``) from ``workers`` clients at once;
    returns (label, exit_ramp) reassembled in input order."""
    rows = request_slices(sizes)

    def one(j):
        with E3Client(url, protocol) as client:
            return j, client.infer(model, make_inputs(rows[j].start, rows[j].stop))

    with ThreadPoolExecutor(workers) as pool:
        parts = dict(pool.map(one, range(len(sizes))))
    order = range(len(sizes))
    return np.concatenate([parts[j].label for j in order]), np.concatenate([parts[j].exit_ramp for j in order])


def tau_in_widest_gap(entropies: np.ndarray, lo_q: float = 0.25, hi_q: float = 0.45) -> float:
    """A τ between the 25% and 45% quantiles of ``entropies`` (exits at every ramp), placed
    mid-way in the widest gap between observed values there (so few inputs sit near it)."""
    ent = np.sort(entropies)
    lo, hi = int(lo_q * len(ent)), int(hi_q * len(ent))
    gap = lo + int(np.argmax(np.diff(ent[lo:hi])))
    return float((ent[gap] + ent[gap + 1]) / 2)


def binary_request(ids: np.ndarray, mask: np.ndarray) -> tuple[bytes, dict]:
    """One binary-protocol HTTP request body (JSON header + raw ``input_ids`` and ``attention_mask``) and the
    header that says where the JSON ends."""
    import json
    header = json.dumps({"inputs": [
        {"name": "input_ids", "shape": list(ids.shape), "datatype": "INT64",
         "parameters": {"binary_data_size": ids.nbytes}},
        {"name": "attention_mask", "shape": list(mask.shape), "datatype": "INT64",
         "parameters": {"binary_data_size": mask.nbytes}}]}).encode()
    return header + ids.tobytes() + mask.tobytes(), {"Inference-Header-Content-Length": str(len(header))}


def json_request(ids: np.ndarray, mask: np.ndarray) -> str:
    """A JSON-protocol infer body for ``input_ids`` / ``attention_mask`` (INT64, batch-first)."""
    import json
    return json.dumps({"inputs": [
        {"name": "input_ids", "shape": list(ids.shape), "datatype": "INT64", "data": ids.reshape(-1).tolist()},
        {"name": "attention_mask", "shape": list(mask.shape), "datatype": "INT64", "data": mask.reshape(-1).tolist()}]})


def post_until(port: int, model: str, body: str, stop, outcomes: list) -> None:
    """Send ``body`` to ``model`` on one connection until ``stop`` (a threading.Event) is set, appending
    ``(HTTP status, response text)`` per request to ``outcomes`` (a load thread's loop)."""
    import http.client
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    while not stop.is_set():
        conn.request("POST", f"/v2/models/{model}/infer", body=body)
        r = conn.getresponse()
        outcomes.append((r.status, r.read().decode(errors="replace")))


# -- the controller's scenarios (test_controller, test_control_e2e, test_simulator) -----------------------
SLO_MS, RATE_RPS, DEVICES = 1000.0, 2000.0, {"cpu": 2}


def synthetic_profile(model: str = "tiny_ee") -> LatencyProfile:
    """A made-up CPU profile under which EASY and HARD have different optimal plans on cpu:2.

    Per-call cost dominates (2 ms + 0.25 ms per input per block, 0.5 ms per ramp,
    Tx 1 ms + 0.1 ms per input): with few survivors, cutting after block 1 and
    pipelining wins; with many, one split 1-4 on both devices does.
    """
    sizes = [1, 2, 4, 8, 16, 32]
    return LatencyProfile(
        model=model, num_blocks=4, batch_sizes=sizes, devices={"cpu": DeviceConfig("cpu")},
        block_ms={"cpu": [[2.0 + 0.25 * b for b in sizes] for _ in range(4)]},
        ramp_ms={"cpu": [[0.5] * len(sizes) for _ in range(3)] + [[0.0] * len(sizes)]},
        tx_ms={"cpu": [1.0 + 0.1 * b for b in sizes]}, source="synthetic (tests)")


# -- device pools (test_pools, test_pools_k8s) ----------------------------------------------------------
POOL_RAMPS = (1, 2, 3, 4, 5)


def make_pools(**router_overrides) -> dict:
    """Three pools as the chart writes them: a CPU pool serving the router, two GPU pools."""
    front = {"name": "front", "device": "cpu", "deployment": "demo-e3-triton-front",
             "grpc_url": "demo-e3-triton-front:8001", "http_url": "demo-e3-triton-front:8000",
             "devices_per_pod": 4, "min_replicas": 1, "max_replicas": 1, "price": 0.1, "router": True,
             "pods_host": "demo-e3-triton-front-pods"}
    front.update(router_overrides)
    return {"namespace": "e3", "pools": [
        front,
        {"name": "t4", "device": "t4", "deployment": "demo-e3-triton-t4", "grpc_url": "demo-e3-triton-t4:8001",
         "http_url": "demo-e3-triton-t4:8000", "devices_per_pod": 1, "min_replicas": 1, "max_replicas": 4,
         "price": 0.35, "router": False},
        {"name": "t4b", "device": "t4", "deployment": "demo-e3-triton-t4b", "grpc_url": "demo-e3-triton-t4b:8001",
         "http_url": "demo-e3-triton-t4b:8000", "devices_per_pod": 2, "min_replicas": 0, "max_replicas": 3,
         "price": 0.35, "router": False}]}


def make_plan(devices_=("t4", "t4", "t4"), instances=(1, 2, 3), ranges=((1, 2), (3, 4), (5, 6))) -> Plan:
    plan = default_plan("bert_ee", 6, list(ranges), exit_rule={"kind": "entropy", "tau_nats": 0.4}, ramp_blocks=POOL_RAMPS)
    return replace(plan, splits=tuple(replace(s, device=d, instances=n)
                                      for s, d, n in zip(plan.splits, devices_, instances)))


def read_until_serving(proc, timeout_s: float = 120) -> list[str]:
    """The lines ``e3 serve`` (``proc``, stdout piped as text) printed up to its "serving ..." line, its exit, or
    ``timeout_s``; the caller asserts on them."""
    lines = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        lines.append(line)
        if line.startswith("serving ") or proc.poll() is not None:
            break
    return lines


def http_call(address, method: str, target: str, body: bytes | str | None = None, headers: dict | None = None, *,
              timeout: float = 60) -> tuple[int, str]:
    """One HTTP call on a fresh connection to ``address`` (host, port): (status, body as text)."""
    import http.client
    conn = http.client.HTTPConnection(*address, timeout=timeout)
    try:
        conn.request(method, target, body=body, headers=headers or {})
        r = conn.getresponse()
        return r.status, r.read().decode(errors="replace")
    finally:
        conn.close()
