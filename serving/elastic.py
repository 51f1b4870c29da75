"""``<model>_admission``: E²bird's elastic admission stage in front of one ONNX model (Triton Python model).

* **Staging.** ``execute`` only stages the request's rows (in arrival order)
  and returns ``None``; each request is answered later through its own
  response sender, as the router does (allowed for a non-decoupled model:
  plain ``infer`` calls and ``perf_analyzer`` work). Nothing waits for a batch
  to fill: the moment a worker fits, it runs. With a local client, inputs can
  arrive through Triton's system shared memory (`e3 load --shm`, `E3Client(shm=True)`): they are
  staged without a copy through the HTTP/gRPC body.
* **Workers.** One thread per worker of the policy's engine (power-of-two
  batch granularities). With parameter ``workers_model`` (what
  ``write_admission`` writes: ``<stage>_workers``, a model of ``slots``
  Triton instances of one intra-op thread each, no Triton batcher), a
  worker's batch runs by BLS on a free instance of that model: each instance
  is its own process (its own copy of the weights, as Triton's instances have),
  so the workers' Python work never shares one interpreter lock. Measured
  before: the workers as threads of this one process reached ~110 inputs/s on
  bert (2 cores), where two Triton instances reached 128. The stage loads
  ``workers_model`` itself on its first batch if it is not loaded (explicit
  model control, as ``e3 serve`` runs); list it beside the stage to load it
  up front. Without ``workers_model`` the workers are threads of this process
  calling the *same* ONNX Runtime session (one copy of the weights, the
  paper's sharing; intra-op threads: parameter ``intra_op_threads``).
* **Scheduling.** :mod:`e3.serving.admission` decides (N-Ebird or E-Ebird,
  parameter ``policy``: ``{"kind", "engine", "max_inflight", "confs",
  "slots"}``), under one lock, whenever rows arrive or a worker finishes.
* **Answers.** A request is answered when its last row is computed; every
  response leaves through one sender thread (measured for the router:
  responses sent from several threads at once crashed the Python backend).
  A failed batch answers each of its requests with the error; none is lost.
"""

from __future__ import annotations

import json
import os
import queue
import threading
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import triton_python_backend_utils as pb_utils

from e3.serving.admission import make_policy
from e3.serving.session import make_session
from e3.serving.triton_io import ResponseSender, bls, gather, io_specs, model_parameters



@dataclass(eq=False)
class _Request:
    """One staged request: its rows' answers fill in as workers finish."""
    handle: object                      # the Triton request (its response sender answers it)
    n: int                              # rows
    outputs: dict[str, np.ndarray] = field(default_factory=dict)   # name -> [n, ...], filled per row
    pending: int = 0                    # rows not computed yet
    failed: str | None = None


class TritonPythonModel:
    def initialize(self, args):
        config, params = model_parameters(args)
        self.inputs = io_specs(config, "input")
        self.outputs = [t.name for t in io_specs(config, "output")]
        self.workers_model = params.get("workers_model", "")
        self.workers_loaded = False
        self.load_lock = threading.Lock()
        self.session = None
        if not self.workers_model:      # workers as threads of this process, one shared session
            version_dir = os.path.join(args["model_repository"], args["model_version"])
            self.session = make_session(os.path.join(version_dir, params.get("onnx_file", "model.onnx")),
                                        int(params.get("intra_op_threads", "1")))
        spec = json.loads(params["policy"])
        self.policy = make_policy(spec["kind"], engine=spec.get("engine"), max_inflight=spec.get("max_inflight"),
                                  confs=spec.get("confs"), slots=spec.get("slots"))
        self.staged: deque = deque()        # (request, row index, {name: row array})
        self.lock = threading.Lock()
        self.stopping = False
        self.work = [queue.Queue() for _ in self.policy.engine]
        self.workers = [threading.Thread(target=self._worker, args=(w,), name=f"e3-worker-{w}-b{b}", daemon=True)
                        for w, b in enumerate(self.policy.engine)]
        self.outbox = ResponseSender("e3 admission")
        for t in self.workers:
            t.start()

    def finalize(self):
        with self.lock:
            self.stopping = True
            left = {id(r): r for r, _, _ in self.staged}
            self.staged.clear()
        for q in self.work:
            q.put(None)
        for t in self.workers:
            t.join(timeout=5)
        for r in left.values():
            self._fail(r, "the admission stage is unloading")
        self.outbox.close()

    def execute(self, requests):
        got = gather(requests, self.inputs)
        for request, response in zip(requests, got.responses):
            if response is not None:  # malformed: answered now, the others go on
                self.outbox.put(request, response)
        start = 0
        with self.lock:
            for i, n in zip(got.valid, got.sizes):
                r = _Request(requests[i], n, pending=n)
                for j in range(n):
                    self.staged.append((r, j, {k: v[start + j] for k, v in got.arrays.items()}))
                start += n
            self._pump()
        return None

    # -- scheduling (caller holds the lock) ------------------------------------------------------------
    def _pump(self) -> None:
        if self.stopping:
            return
        for w, size in self.policy.launch(len(self.staged)):
            rows = [self.staged.popleft() for _ in range(size)]
            self.work[w].put(rows)

    # -- workers --------------------------------------------------------------------------------------
    def _worker(self, w: int) -> None:
        while True:
            rows = self.work[w].get()
            if rows is None:
                return
            try:
                feed = {t.name: np.stack([row[t.name] for _, _, row in rows]) for t in self.inputs}
                out = self._run(feed)
                err = None
            except Exception as e:  # noqa: BLE001 - every failure answers its requests
                out, err = None, f"the admission stage's batch failed: {e}"
            done = []
            with self.lock:
                self.policy.done(w)
                for i, (r, j, _) in enumerate(rows):
                    if err is not None:
                        r.failed = r.failed or err
                    else:
                        for name, a in out.items():
                            if name not in r.outputs:
                                r.outputs[name] = np.empty((r.n,) + a.shape[1:], a.dtype)
                            r.outputs[name][j] = a[i]
                    r.pending -= 1
                    if r.pending == 0:
                        done.append(r)
                self._pump()
            for r in done:
                self.outbox.put(r.handle, r.failed if r.failed else r.outputs)

    def _run(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One worker's batch ([b, ...] per input) -> the model's outputs ([b, ...] per output)."""
        if self.session is not None:
            return dict(zip(self.outputs, self.session.run(self.outputs, feed)))
        if not self.workers_loaded:
            self._load_workers()
        return bls(self.workers_model, feed, self.outputs)

    def _load_workers(self) -> None:
        """Load the workers' model once if it is not loaded yet (the server is up: a batch is waiting)."""
        with self.load_lock:
            if self.workers_loaded:
                return
            if not pb_utils.is_model_ready(model_name=self.workers_model):
                pb_utils.Logger.log_info(f"e3 admission: loading the workers' model {self.workers_model}")
                pb_utils.load_model(model_name=self.workers_model)
                if not pb_utils.is_model_ready(model_name=self.workers_model):
                    raise RuntimeError(f"the workers' model {self.workers_model} could not be loaded")
            self.workers_loaded = True

    def _fail(self, r: _Request, message: str) -> None:
        self.outbox.put(r.handle, message)

