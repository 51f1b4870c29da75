"""Small helpers shared by the end-to-end tests."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from e3.client.sdk import E3Client
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
    from e3.export.zoo import resolve_model
    repo = tmp_path_factory.mktemp(name)
    export_repository("tiny-ee", "2", repo, ExportSettings(), progress=False,
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
