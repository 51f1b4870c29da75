"""``<model>_admission``: E²bird's elastic admission stage in front of one ONNX model (Triton Python model).

* **Staging.** ``execute`` only stages the requests (in arrival order; a
  worker takes the next rows, across requests)
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
* **Answers.** A request is answered when its last row is computed; a
  request wholly inside one batch gets its rows of the batch's outputs as
  they are (no copy), one split across batches fills in part by part. The
  responses leave through ``response_threads`` sender threads (parameter,
  default 1; ``write_admission`` writes 2), each worker's answers through one
  of them. Each send waits for the server to take the response (measured on
  resnet-ee in a closed loop: 0.5-0.75 ms per response under load, with
  0.1 ms of CPU), so one thread caps the stage near 1,400-2,000 answers/s;
  two halve that wait. The router found responses sent from many threads at
  once crashing the Python backend; here each thread sends one at a time, and
  no crash came in the runs measured with two (closed loops and `e3 bench
  admission --quick`); the server's `boost::interprocess::lock_exception`
  under load (server issue #8882) came once with one sender as well.
  A failed batch answers each of its requests with the error; none is lost.
"""

from __future__ import annotations

import json
import os
import queue
import threading
from collections import deque
from dataclasses import dataclass

import numpy as np
import triton_python_backend_utils as pb_utils

from e3.serving.admission import make_policy
from e3.core.session import make_session
from e3.serving.triton_io import ResponseSender, bls, gather, io_specs, model_parameters, sender_of



@dataclass(eq=False)
class _Request:
    """One staged request: its rows go to workers in arrival order; its answers fill in as they finish."""
    handle: object                      # the request's response sender, taken inside execute
    n: int                              # rows
    arrays: dict[str, np.ndarray]       # name -> [n, ...]: its inputs (views of the execute call's copy)
    taken: int = 0                      # rows handed to workers so far
    pending: int = 0                    # rows not computed yet
    outputs: dict[str, np.ndarray] | None = None   # name -> [n, ...] once computed
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
        self.staged: deque = deque()        # _Request, in arrival order; the first may be partly taken
        self.staged_rows = 0                # rows staged, not yet handed to a worker
        self.lock = threading.Lock()
        self.stopping = False
        self.work = [queue.Queue() for _ in self.policy.engine]
        self.workers = [threading.Thread(target=self._worker, args=(w,), name=f"e3-worker-{w}-b{b}", daemon=True)
                        for w, b in enumerate(self.policy.engine)]
        senders = int(params.get("response_threads", "1"))
        self.outboxes = [ResponseSender("e3 admission") for _ in range(senders)]
        self.outbox = self.outboxes[0]
        for t in self.workers:
            t.start()

    def finalize(self):
        with self.lock:
            self.stopping = True
            left = {id(r): r for r in self.staged}
            self.staged.clear()
            self.staged_rows = 0
        for q in self.work:
            q.put(None)
        for t in self.workers:
            t.join(timeout=5)
        for r in left.values():
            self._fail(r, "the admission stage is unloading")
        for o in self.outboxes:
            o.close()

    def execute(self, requests):
        got = gather(requests, self.inputs)
        senders = [sender_of(r) for r in requests]   # taken inside execute; no request object is kept
        for sender, response in zip(senders, got.responses):
            if response is not None:  # malformed: answered now, the others go on
                self.outbox.put(sender, response)
        start = 0
        with self.lock:
            for i, n in zip(got.valid, got.sizes):
                self.staged.append(_Request(senders[i], n, {k: v[start:start + n] for k, v in got.arrays.items()},
                                            pending=n))
                self.staged_rows += n
                start += n
            self._pump()
        return None

    # -- scheduling (caller holds the lock) ------------------------------------------------------------
    def _pump(self) -> None:
        if self.stopping:
            return
        for w, size in self.policy.launch(self.staged_rows):
            self.staged_rows -= size
            parts = []                      # (request, first row, rows): the next `size` staged rows
            while size:
                r = self.staged[0]
                k = min(size, r.n - r.taken)
                parts.append((r, r.taken, k))
                r.taken += k
                size -= k
                if r.taken == r.n:
                    self.staged.popleft()
            self.work[w].put(parts)

    # -- workers --------------------------------------------------------------------------------------
    def _worker(self, w: int) -> None:
        while True:
            parts = self.work[w].get()
            if parts is None:
                return
            try:
                if len(parts) == 1:
                    r, j, k = parts[0]
                    feed = {t.name: r.arrays[t.name][j:j + k] for t in self.inputs}
                else:
                    feed = {t.name: np.concatenate([r.arrays[t.name][j:j + k] for r, j, k in parts])
                            for t in self.inputs}
                out = self._run(feed)
                err = None
            except Exception as e:  # noqa: BLE001 - every failure answers its requests
                out, err = None, f"the admission stage's batch failed: {e}"
            done = []
            with self.lock:
                self.policy.done(w)
                self._pump()
                at = 0
                for r, j, k in parts:
                    if err is not None:
                        r.failed = r.failed or err
                    elif k == r.n:              # the whole request in this batch: its rows of the outputs
                        r.outputs = {name: a[at:at + k] for name, a in out.items()}
                    else:                       # split across batches: its rows fill in part by part
                        if r.outputs is None:
                            r.outputs = {name: np.empty((r.n,) + a.shape[1:], a.dtype) for name, a in out.items()}
                        for name, a in out.items():
                            r.outputs[name][j:j + k] = a[at:at + k]
                    at += k
                    r.pending -= k
                    if r.pending == 0:
                        done.append(r)
            outbox = self.outboxes[w % len(self.outboxes)]
            for r in done:
                outbox.put(r.handle, r.failed if r.failed else r.outputs)

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

