"""The device side of E²bird's pool and workers (:class:`~e3.serving.ebird.engine.DeviceOps`) for a model served
from one ONNX file on the CPU: the ring as host arrays, each worker a thread of its own that runs its batches
through ``run`` (an outputs dict from an inputs dict) and signals its completion.

What ``run`` is, the stage chooses (:mod:`e3.serving.ebird.model`):

* **worker processes** (what :func:`~e3.serving.ebird.repository.write_admission` writes by default): a batch
  runs by BLS on a free instance of ``<stage>_workers``, a model of ``slots`` Triton instances of one intra-op
  thread each, so the workers' Python work never shares one interpreter lock (measured before on bert, 2 cores:
  the workers as threads of the stage's process reached ~110 inputs/s, where two Triton instances reached 128);
* **one shared session** (``worker_processes=None``): the workers call the same ONNX Runtime session from their
  threads, one copy of the weights, the paper's sharing.

Either way a worker's thread blocks in ONNX Runtime or in the BLS call with the interpreter lock released, so
the engine thread keeps admitting arrivals into the ring while workers compute; a completion wakes the engine
(``on_done``) instead of being polled for.

Decisions: the ring holds fixed shapes (the model's declared input dims; a model with a variable dimension is
refused at load, naming it): E²bird stages *rows* of one shape, as the paper's pool does. A worker's batch is a
view of the ring where its rows lie side by side, and one gathered copy where they wrap past the last slot. An
exception in ``run`` is kept and raised by :meth:`HostOps.result`, so the engine answers that batch's requests
with it and goes on.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Sequence

import numpy as np

from e3.core.spec import NUMPY_DTYPES, TensorSpec
from e3.serving.ebird.engine import DeviceOps
from e3.serving.ebird.pool import Taken

__all__ = ["HostOps"]


class HostOps(DeviceOps):
    """The ring for ``specs`` (inputs, fixed shapes) and one thread per worker of ``engine`` (module docstring)."""

    def __init__(self, specs: Sequence[TensorSpec], engine: Sequence[int], *, capacity: int,
                 run: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]],
                 on_done: Callable[[], None] = lambda: None):
        for s in specs:
            if any(d < 1 for d in s.shape):
                raise ValueError(f"input '{s.name}' has a variable dimension {list(s.shape)}: E²bird's memory pool "
                                 "stages rows of fixed shape; export the model with fixed input dims")
        self.ring = {s.name: np.empty((capacity, *s.shape), NUMPY_DTYPES[s.dtype]) for s in specs}
        self.run, self.on_done = run, on_done
        self._jobs: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in engine]
        self._out: list[tuple[dict | None, BaseException | None]] = [(None, None)] * len(engine)
        self._threads = [threading.Thread(target=self._work, args=(w,), name=f"e3-ebird-worker-{w}-b{b}", daemon=True)
                         for w, b in enumerate(engine)]
        for t in self._threads:
            t.start()

    def copy_in(self, segments: Sequence[tuple[int, int]], arrays: dict[str, np.ndarray]) -> None:
        for name, ring in self.ring.items():
            src, at = arrays[name], 0
            for a, b in segments:
                ring[a:b] = src[at:at + b - a]
                at += b - a

    def mark_copied(self) -> Any:
        return None   # host memory: a row is readable once copy_in returned

    def launch(self, worker: int, taken: Taken, after: Any) -> Any:
        if len(taken.segments) == 1:
            (a, b), = taken.segments
            feed = {name: ring[a:b] for name, ring in self.ring.items()}
        else:
            feed = {name: np.concatenate([ring[a:b] for a, b in taken.segments]) for name, ring in self.ring.items()}
        done = threading.Event()
        self._jobs[worker].put((feed, done))
        return done

    def ready(self, event: Any) -> bool:
        return event.is_set()

    def wait(self, event: Any) -> None:
        event.wait()

    def result(self, worker: int, rows: int) -> dict[str, np.ndarray]:
        out, err = self._out[worker]
        if err is not None:
            raise err
        return {name: a[:rows] for name, a in out.items()}

    def close(self) -> None:
        for jobs in self._jobs:
            jobs.put(None)
        for t in self._threads:
            t.join(timeout=5)

    def _work(self, w: int) -> None:
        while True:
            job = self._jobs[w].get()
            if job is None:
                return
            feed, done = job
            try:
                self._out[w] = (self.run(feed), None)
            except Exception as err:  # noqa: BLE001 - raised by result(): the batch's requests get it
                self._out[w] = (None, err)
            del feed
            done.set()
            self.on_done()
