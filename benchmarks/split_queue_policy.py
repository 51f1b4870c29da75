"""What a Triton queue policy on E3's splits costs: the router's throughput and p99 with and without it.

E3's splits used to carry Triton's REJECT queue policy (a default timeout of 1 h that BLS calls override with
their remaining SLO), so that Triton dropped a call that turned late in a split's queue. With any queue policy,
Triton 2.51's dynamic batcher stops prefetching and waits for a free instance by polling (core PR #237;
server issue #8870). This runs tiny-ee cut after block 2 (two constant splits, batch 8, one instance each)
behind the router, reloads both splits with and without the policy in interleaved rounds, and prints inputs/s
and p99 per round, side by side on one server. Measured here (16 clients x 8 inputs, 3 rounds of 8 s):
with the policy 2,845 / 1,347 / 2,139 inputs/s, p99 203 / 627 / 541 ms; without 2,564 / 2,244 / 2,385, p99
128 / 122 / 139 ms. So splits are exported without it (``ExportSettings.split_queue_policy``).

Usage: ``.venv/bin/python benchmarks/split_queue_policy.py [--inputs 8] [--clients 16] [--rounds 3] [--seconds 8]``
"""

from __future__ import annotations

import argparse
import copy
import http.client
import json
import sys
import tempfile
import threading
import time

import numpy as np

from e3.controller.triton_api import TritonControl
from e3.deploy.server import TritonServer
from e3.export.repository import ExportSettings, export_repository
from e3.models.zoo import resolve_model

SPLITS = ["tiny_ee_split_1-2", "tiny_ee_split_3-4"]
POLICY = {"timeout_action": "REJECT", "default_timeout_microseconds": 3_600_000_000, "allow_timeout_override": True}


def _binary_request(arrays: dict[str, np.ndarray]) -> tuple[bytes, dict]:
    """One binary-protocol HTTP infer body (JSON header, then the raw tensors) and the header saying where the
    JSON ends (KServe v2's binary extension)."""
    header = json.dumps({"inputs": [{"name": k, "shape": list(a.shape), "datatype": "INT64",
                                     "parameters": {"binary_data_size": a.nbytes}} for k, a in arrays.items()]}).encode()
    return header + b"".join(a.tobytes() for a in arrays.values()), {"Inference-Header-Content-Length": str(len(header))}


def _load(port: int, body: bytes, headers: dict, clients: int, seconds: float) -> tuple[int, list[float]]:
    """Closed loop of ``clients`` threads for ``seconds``; (requests answered, latencies in s)."""
    stop = time.monotonic() + seconds
    done, latencies, lock = [0], [], threading.Lock()

    def client():
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        mine = []
        while time.monotonic() < stop:
            t0 = time.perf_counter()
            conn.request("POST", "/v2/models/tiny_ee_router/infer", body=body, headers=headers)
            conn.getresponse().read()
            mine.append(time.perf_counter() - t0)
        with lock:
            done[0] += len(mine)
            latencies.extend(mine)
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return done[0], latencies


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--inputs", type=int, default=8, help="inputs per request (default 8)")
    p.add_argument("--clients", type=int, default=16, help="closed-loop clients (default 16)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    p.add_argument("--seconds", type=float, default=8.0, help="load per round and setting (default 8)")
    args = p.parse_args(argv)
    repo = tempfile.mkdtemp(prefix="e3-queue-policy-")
    export_repository("tiny-ee", "2", repo, settings=ExportSettings(slo_ms=60_000), progress=False)
    ids, mask = (np.ascontiguousarray(x.numpy()) for x in resolve_model("tiny-ee").example_inputs(args.inputs, seed=5))
    body, headers = _binary_request({"input_ids": ids, "attention_mask": mask})
    results: dict[str, list[tuple[float, float]]] = {"with the queue policy": [], "without (default)": []}
    with TritonServer.on_free_ports(repo, ["tiny_ee_router", *SPLITS], exit_timeout_s=3) as server, \
            TritonControl(server.http_url) as control:
        base = {s: control.model_config(s) for s in SPLITS}
        for r in range(args.rounds):
            for name in results:
                for s in SPLITS:
                    config = copy.deepcopy(base[s])
                    config["dynamic_batching"].pop("default_queue_policy", None)
                    if name.startswith("with "):
                        config["dynamic_batching"]["default_queue_policy"] = POLICY
                    control.load(s, config)
                time.sleep(1.0)
                t0 = time.monotonic()
                n, lat = _load(server.http_port, body, headers, args.clients, args.seconds)
                rate = n * args.inputs / (time.monotonic() - t0)
                p99 = 1e3 * float(np.percentile(lat, 99))
                results[name].append((rate, p99))
                print(f"round {r + 1}  {name:22s} {rate:7.0f} inputs/s  p99 {p99:6.0f} ms", flush=True)
    print(f"budget: every split 1 instance x 1 thread, router 1 instance; {args.clients} clients x "
          f"{args.inputs} inputs")
    for name, rows in results.items():
        print(f"{name:22s} mean {np.mean([r for r, _ in rows]):7.0f} inputs/s, p99 per round "
              f"{', '.join(f'{p:.0f}' for _, p in rows)} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
