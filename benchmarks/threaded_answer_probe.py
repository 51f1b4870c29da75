"""Does a Triton Python model that answers from a thread after ``execute`` returns survive load here?

``python3 benchmarks/threaded_answer_probe.py OUT_DIR [--kind cpu|gpu] [--rates 200,1000,3000] [--seconds 8]``

The CPU router and E²bird's threaded stage answer that way (one response thread, ``execute`` returning
``None``, a non-decoupled model). On the H200 host the stage's response thread died with a segmentation fault
inside ``InferenceResponseSender.send`` (``docs/admission.md``). This probe isolates the pattern: one model,
numpy only (no PyTorch, no CUDA calls of its own), answering every request from one thread beside a second
thread that polls every 50 us as the stage's engine did, instance kind ``--kind`` (KIND_GPU runs the same code,
only the instance is placed on GPU 0). Open-loop Poisson load at each rate (``benchmarks/gpu_load.OpenLoop``);
the run fails (exit 1) if the server's log shows a fatal error or a request failed. Writes
``OUT_DIR/threaded_answer_probe.json`` and the server's log beside it.

On a bare GPU host it unpacks the server and client from ``.gpu_wheels/`` as the other GPU runners do
(``benchmarks/gpu_host_setup.py``); the stub is the one for the running interpreter.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__:
    from e3.benchmarks.gpu_host_setup import prepare_host
    from e3.benchmarks.gpu_load import OpenLoop
else:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_host_setup import prepare_host
    from gpu_load import OpenLoop

__all__ = ["write_probe_model", "run", "main"]

MODEL = "thread_echo"

MODEL_PY = '''import faulthandler
import queue
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Answers from one thread after execute returns None; a second thread polls every 50 us."""

    def initialize(self, args):
        faulthandler.enable()
        self.outbox = queue.Queue()
        threading.Thread(target=self.answer, daemon=True).start()
        threading.Thread(target=self.poll, daemon=True).start()

    def answer(self):
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        while True:
            request, x = self.outbox.get()
            label = np.argmax(x, axis=1).astype(np.int64)[:, None]
            request.get_response_sender().send(pb_utils.InferenceResponse([pb_utils.Tensor("label", label)]),
                                               flags=final)

    def poll(self):
        a = np.ones((64, 16), np.float32)
        while True:
            (a @ a.T).sum()
            time.sleep(0.00005)

    def execute(self, requests):
        for r in requests:
            self.outbox.put((r, pb_utils.get_input_tensor_by_name(r, "x").as_numpy().copy()))
        return None
'''


def write_probe_model(repo: Path, kind: str) -> str:
    """The probe model in ``repo`` (instance kind ``cpu`` or ``gpu``); returns its name."""
    if kind not in ("cpu", "gpu"):
        raise ValueError(f"--kind must be cpu or gpu, got {kind!r}")
    d = repo / MODEL
    (d / "1").mkdir(parents=True, exist_ok=True)
    (d / "1" / "model.py").write_text(MODEL_PY)
    gpus = " gpus: [0]" if kind == "gpu" else ""
    (d / "config.pbtxt").write_text(
        f'name: "{MODEL}"\nbackend: "python"\nmax_batch_size: 1024\n'
        'input [ { name: "x" data_type: TYPE_FP32 dims: [ 16 ] } ]\n'
        'output [ { name: "label" data_type: TYPE_INT64 dims: [ 1 ] } ]\n'
        f'instance_group [ {{ count: 1 kind: KIND_{kind.upper()}{gpus} }} ]\n'
        'dynamic_batching { max_queue_delay_microseconds: 0 }\n')
    return MODEL


def run(out: Path, *, kind: str = "cpu", rates=(200.0, 1000.0, 3000.0), seconds: float = 8.0,
        wheels: Path | None = None, per_request: int = 8, echo=print) -> dict:
    import numpy as np

    binary, out = prepare_host(out, cpu=kind == "cpu", wheels=wheels)
    from e3.deploy.server import TritonServer
    repo = out / "repo"
    write_probe_model(repo, kind)
    log = out / "triton.log"
    server = TritonServer.on_free_ports(repo, [MODEL], tritonserver=binary, log_file=log)
    server.start(timeout_s=300)
    load = OpenLoop(server.grpc_url, 4)
    pool = {"x": np.random.default_rng(0).random((4096, 16), dtype=np.float32)}
    doc = {"kind": "threaded-answer-probe", "instance_kind": kind, "python": sys.version.split()[0],
           "per_request": per_request, "runs": []}
    try:
        for i, rate in enumerate(rates):
            arrivals = np.cumsum(np.random.default_rng(i + 1).exponential(1 / rate, max(1, int(rate * seconds))))
            res = load.run(MODEL, arrivals, pool, per_request=per_request)
            ok = res["latency_ms"][~res["failed"]]
            row = {"offered_rps": float(rate), "requests": int(len(arrivals)), "failed": int(res["failed"].sum()),
                   "p50_ms": float(np.percentile(ok, 50)) if len(ok) else None,
                   "p99_ms": float(np.percentile(ok, 99)) if len(ok) else None, "errors": res["errors"]}
            doc["runs"].append(row)
            echo(f"{rate:,.0f} requests/s x {seconds:g} s: {row['failed']} of {row['requests']} failed"
                 + (f", p50 {row['p50_ms']:.2f} p99 {row['p99_ms']:.2f} ms" if len(ok) else "")
                 + (f"; {row['errors'][0]}" if row["errors"] else ""))
    finally:
        load.close()
        server.stop()
    text = log.read_text(errors="replace") if log.exists() else ""
    doc["fatal_errors"] = text.count("Fatal Python error")
    doc["not_healthy"] = text.count("is not healthy")
    doc["ok"] = not doc["fatal_errors"] and not any(r["failed"] for r in doc["runs"])
    (out / "threaded_answer_probe.json").write_text(json.dumps(doc, indent=1))
    echo(f"{'survived' if doc['ok'] else 'FAILED'}: {doc['fatal_errors']} fatal errors in the server log "
         f"(Python {doc['python']}, KIND_{kind.upper()}); {out / 'threaded_answer_probe.json'}")
    return doc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="folder for threaded_answer_probe.json and the server's log")
    p.add_argument("--kind", choices=["cpu", "gpu"], default="cpu", help="the model's instance kind (default cpu)")
    p.add_argument("--rates", default="200,1000,3000", help="offered requests/s, comma-separated")
    p.add_argument("--seconds", type=float, default=8.0, help="seconds per rate (default 8)")
    p.add_argument("--wheels", type=Path, default=None,
                   help="folder with the server and client to unpack (default .gpu_wheels/ for --kind gpu)")
    a = p.parse_args(argv)
    doc = run(a.out, kind=a.kind, rates=tuple(float(r) for r in a.rates.split(",")), seconds=a.seconds,
              wheels=a.wheels)
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
