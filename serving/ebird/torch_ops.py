"""The device side of E²bird's pool and workers (:class:`~e3.serving.ebird.engine.DeviceOps`) in
PyTorch: on a GPU, a ring in device memory fed from a pinned host mirror on a copy stream, one CUDA graph and
one stream per worker; on the CPU, the same ring as CPU tensors, no streams, every call synchronous (what ``make
test`` runs, so the engine's bookkeeping meets real tensors on every change).

* **The ring** holds ``capacity`` rows of every model input, in the run's dtype (floats at the run's precision,
  integers as declared). An arriving request's rows are written into the pinned mirror's slots on the host
  (a memcpy, with the float conversion); when the engine marks the round's copies, the slots written since the
  last mark are copied to the same slots on the device with ``non_blocking`` on the copy stream (``InStream``),
  one copy per run of adjacent slots (the requests of one round lie side by side), in arrival order: the host
  does not wait for the copy. (The paper copies each input as it comes, one ``cudaMemcpyAsync`` each; merging a
  round's adjacent rows keeps the order and the overlap and launches fewer copies under load.) A pinned slot is written again only once
  its device slot is free, which is after a worker read it, which is after its copy finished.
* **A worker** is a :class:`~e3.serving.device.executor.SplitExecutor` of the whole model at one batch (its
  graph's input and output are fixed buffers) on its own stream. A launch makes the stream wait for the copy
  event, gathers the ring's slots into the graph's input (one device-to-device copy per segment: a CUDA graph
  reads fixed addresses, so it cannot read the ring where the rows happen to lie; the paper's workers, plain
  kernels, switch their input pointer instead), replays the graph and copies its output (the head's logits) to
  the worker's pinned host buffer, all on its stream, then records the event the engine polls.

Decision: the output copy runs on the worker's stream, not on a separate ``OutStream`` (the paper's): the
worker's next replay overwrites the graph's output buffer, so it must follow the copy anyway, and a worker is
relaunched only after the host has seen the copy done.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np
import torch

from e3.models.api import EarlyExitModel
from e3.serving.device.executor import DeviceSettings, torch_dtype, make_executor
from e3.serving.ebird.engine import DeviceOps
from e3.serving.ebird.pool import Taken

__all__ = ["TorchOps", "LOGITS"]

LOGITS = "logits"   # the one output of a worker: the last head's logits [rows, classes] (head_answer decides)


class TorchOps(DeviceOps):
    """The ring and one executor per worker of ``engine`` (batch sizes) for ``model``'s head path on ``settings``'
    device (module docstring)."""

    def __init__(self, model: EarlyExitModel, engine: Sequence[int], *, capacity: int, settings: DeviceSettings):
        self.settings = settings
        self.cuda = settings.cuda
        self.specs = model.card.inputs
        L = model.card.num_blocks
        float_dtype = torch.float16 if settings.precision == "fp16" else torch.float32
        with torch.inference_mode():
            self.ring = [torch.empty((capacity, *s.shape), dtype=torch_dtype(s.dtype, float_dtype),
                                     device=settings.device) for s in self.specs]
            self.mirror = [torch.empty_like(t, device="cpu").pin_memory() for t in self.ring] if self.cuda else None
            self.workers = [make_executor(model, 1, L, ramps=(L,),
                                          settings=dataclasses.replace(settings, max_batch=b, buckets=(b,)))
                            for b in engine]
            if self.cuda:
                self.copy_stream = torch.cuda.Stream(device=settings.device)
                self.streams = [torch.cuda.Stream(device=settings.device) for _ in engine]
                C = model.card.num_classes
                self.out_host = [torch.empty((b, C), dtype=float_dtype).pin_memory() for b in engine]
                torch.cuda.synchronize(settings.device)
        self.last: list[np.ndarray | None] = [None] * len(engine)   # the CPU's outputs (no host copy to wait for)
        self._dirty: list[tuple[int, int]] = []   # slot runs written to the pinned mirror, not yet copied to the device

    def copy_in(self, segments: Sequence[tuple[int, int]], arrays: dict[str, np.ndarray]) -> None:
        with torch.inference_mode():
            for spec, ring, i in zip(self.specs, self.ring, range(len(self.ring))):
                src = torch.from_numpy(np.ascontiguousarray(arrays[spec.name]))
                at = 0
                for a, b in segments:
                    (self.mirror[i] if self.cuda else ring)[a:b].copy_(src[at:at + b - a])
                    at += b - a
        if self.cuda:
            for a, b in segments:   # adjacent slots merge: one device copy per run of slots, issued at the mark
                if self._dirty and self._dirty[-1][1] == a:
                    self._dirty[-1] = (self._dirty[-1][0], b)
                else:
                    self._dirty.append((a, b))

    def mark_copied(self) -> Any:
        if not self.cuda:
            return None
        with torch.inference_mode(), torch.cuda.stream(self.copy_stream):
            for a, b in self._dirty:
                for ring, mirror in zip(self.ring, self.mirror):
                    ring[a:b].copy_(mirror[a:b], non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.copy_stream)
        self._dirty = []
        return event

    def launch(self, worker: int, taken: Taken, after: Any) -> Any:
        chunks = [tuple(ring[a:b] for ring in self.ring) for a, b in taken.segments]
        with torch.inference_mode():
            if not self.cuda:
                (logits,) = self.workers[worker].run(chunks, taken.rows)
                self.last[worker] = logits.float().numpy().copy()
                return None
            stream = self.streams[worker]
            with torch.cuda.stream(stream):
                if after is not None:
                    stream.wait_event(after)
                (logits,) = self.workers[worker].run(chunks, taken.rows)
                self.out_host[worker][:taken.rows].copy_(logits, non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
        return event

    def ready(self, event: Any) -> bool:
        return event is None or event.query()

    def wait(self, event: Any) -> None:
        if event is not None:
            event.synchronize()   # the interpreter lock is released while the host waits

    def result(self, worker: int, rows: int) -> dict[str, np.ndarray]:
        if not self.cuda:
            return {LOGITS: self.last[worker][:rows]}
        return {LOGITS: self.out_host[worker][:rows].to(torch.float32, copy=True).numpy()}
