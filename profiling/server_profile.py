"""What ``e3 profile`` measures on a running tritonserver: one hop between two Python models (Tx, the BLS
exchange of the heaviest cut's tensors) and the host's CPU per request of the front door and the load
generator. The probes are Python models of :mod:`e3.serving.tx_probe` in a repository of their own."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from e3.client.loadgen import closed_loop_records
from e3.core.files import write_atomic
from e3.core.names import state_output
from e3.core.spec import ModelCard, TensorSpec
from e3.deploy.server import TritonServer
from e3.export.repository import answer_specs
from e3.export.triton_config import ModelDescription, render_config
from e3.paths import artifacts_dir
from e3.profiling.profiler import cut_state

__all__ = ["probe_server", "measure_tx", "measure_request", "TX_ECHO", "TX_CALLER", "TX_FRONT", "REQUEST_CLIENTS"]

TX_ECHO, TX_CALLER, TX_FRONT = "e3_tx_echo", "e3_tx_caller", "e3_tx_front"
REQUEST_CLIENTS = 16            # the load generator's clients while request_ms is measured (as `e3 bench`)


def _tx_repository(repo: Path, card: ModelCard, max_batch: int, warmup: int) -> None:
    """The probes' repository: the hop's caller and echo (the heaviest cut's tensors) and the front door
    without compute (the model's inputs, the answer tensors)."""
    module = "e3.serving.tx_probe"
    state = cut_state(card)
    outputs = tuple(TensorSpec(state_output(t.name), t.dtype, t.shape) for t in state)
    models = {
        TX_ECHO: ModelDescription(name=TX_ECHO, kind="python", max_batch_size=max_batch, inputs=tuple(state),
                                  outputs=outputs, dynamic_batching=None, parameters={"role": "echo"}),
        TX_CALLER: ModelDescription(
            name=TX_CALLER, kind="python", max_batch_size=0,
            inputs=(*(TensorSpec(t.name, t.dtype, (-1, *t.shape)) for t in state), TensorSpec("repeats", "INT32", (1,))),
            outputs=(TensorSpec("times_ms", "FP32", (-1,)),), dynamic_batching=None,
            parameters={"role": "caller", "callee": TX_ECHO, "warmup": str(warmup),
                        "callee_outputs": json.dumps([t.name for t in outputs])}),
        TX_FRONT: ModelDescription(name=TX_FRONT, kind="python", max_batch_size=card.max_batch_size,
                                   inputs=tuple(card.inputs), outputs=answer_specs(card), parameters={"role": "front"}),
    }
    for name, desc in models.items():
        write_atomic(repo / name / "1" / "model.py", f"from {module} import TritonPythonModel  # noqa: F401\n")
        write_atomic(repo / name / "config.pbtxt", render_config(desc, "embedded"))


@contextlib.contextmanager
def probe_server(card: ModelCard, max_batch: int, warmup: int = 3, *, tritonserver: str | None = None):
    """A real tritonserver serving the probes (:func:`measure_tx`, :func:`measure_request`) for ``card``."""
    with tempfile.TemporaryDirectory(prefix="e3-tx-") as tmp:
        repo = Path(tmp)
        _tx_repository(repo, card, max_batch, warmup)
        log_file = artifacts_dir() / "logs" / f"profile-tx-tritonserver-{os.getpid()}.log"
        with TritonServer.on_free_ports(repo, [TX_ECHO, TX_CALLER, TX_FRONT], tritonserver=tritonserver,
                                        log_file=log_file) as server:
            yield server


def measure_tx(card: ModelCard, batch_sizes: Sequence[int], repeats: int, *, warmup: int = 3,
               bar=None, tritonserver: str | None = None, server=None) -> list[np.ndarray]:
    """Timings (ms) of one BLS hop carrying the heaviest cut's tensors (:func:`cut_state`) at each
    batch size, on a real tritonserver (``server``: a running :func:`probe_server`, else one of its own)."""
    import tritonclient.http as httpclient   # deferred: its gevent (~0.4 s) loads only when a hop is measured

    if server is None:
        with probe_server(card, max(batch_sizes), warmup, tritonserver=tritonserver) as server:
            return measure_tx(card, batch_sizes, repeats, warmup=warmup, bar=bar, server=server)
    state = cut_state(card)
    client = httpclient.InferenceServerClient(server.http_url, network_timeout=300)
    try:
        result = []
        for batch in batch_sizes:
            inputs = []
            for t in state:
                x = httpclient.InferInput(t.name, [batch, *t.shape], t.dtype)
                x.set_data_from_numpy(np.zeros((batch, *t.shape), dtype=t.numpy_dtype))
                inputs.append(x)
            r = httpclient.InferInput("repeats", [1], "INT32")
            r.set_data_from_numpy(np.array([repeats], dtype=np.int32))
            inputs.append(r)
            answer = client.infer(TX_CALLER, inputs)
            result.append(answer.as_numpy("times_ms").astype(float))
            if bar is not None:
                bar.update(1)
    finally:
        client.close()
    return result


def measure_request(card: ModelCard, batch_sizes: Sequence[int], requests: int = 800, *, bar=None,
                    tritonserver: str | None = None, server=None) -> list[tuple[float, float]]:
    """Host CPU (ms) per request of B inputs outside every instance, at each batch size: the real load
    generator (:data:`REQUEST_CLIENTS` clients, a closed loop) against the ``front`` probe on a real
    tritonserver (``server``: a running :func:`probe_server`, else one of its own); this process's CPU
    (the clients) plus tritonserver's own process's, over the run, per request. The probe's stub is left
    out (its handling of a request is what Tx prices). Returns (host CPU, of which the load generator's)
    per batch size."""
    if server is None:
        with probe_server(card, max(batch_sizes), tritonserver=tritonserver) as server:
            return measure_request(card, batch_sizes, requests, bar=bar, server=server)
    rng = np.random.default_rng(0)
    pool = {t.name: (rng.integers(int((t.bounds or (0, 1))[0]), int((t.bounds or (0, 1))[1]) + 1,
                                  size=(256, *t.shape)) if t.dtype.startswith("INT")
                     else rng.normal(size=(256, *t.shape))).astype(t.numpy_dtype) for t in card.inputs}
    out = []
    for batch in batch_sizes:
        n = max(REQUEST_CLIENTS * 4, requests // max(1, batch // 4))   # 800 of one input each: CPU ticks are 10 ms
        closed_loop_records(server.http_url, TX_FRONT, pool, concurrency=REQUEST_CLIENTS, batch=batch,
                            requests=REQUEST_CLIENTS * 2)                                      # warm up
        cpu0, server0 = time.process_time(), _process_cpu_s(server.process.pid)
        closed_loop_records(server.http_url, TX_FRONT, pool, concurrency=REQUEST_CLIENTS, batch=batch, requests=n)
        client = time.process_time() - cpu0
        out.append(((client + _process_cpu_s(server.process.pid) - server0) * 1e3 / n, client * 1e3 / n))
        if bar is not None:
            bar.update(1)
    return out


def _process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) one process (all its threads, not its children) has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
