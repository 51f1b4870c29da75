"""E²bird's serving loop on one device: arrivals copied into the memory pool, workers launched by N-Ebird or
E-Ebird, completions polled, requests answered. No torch and no Triton here: the device work goes through
:class:`DeviceOps` (:mod:`e3.serving.ebird.torch_ops`: CUDA streams and events on a GPU, torch CPU tensors with
no streams on the CPU; :mod:`e3.serving.ebird.host_ops`: ONNX Runtime on worker threads or worker processes),
so the loop's order of operations is tested with a recording implementation.

One thread does every round (the paper's scheduler, which "monitors the memory pool and the inference engine"):

* **continuous** (the default; what the paper describes): the stage's ``execute`` only submits its requests and
  returns; the thread of :class:`~e3.serving.device.continuous.ContinuousEngine` (the one continuous form of
  the project, shared with E3's device router) runs :meth:`AdmissionEngine.step` whenever something arrived or
  finished, so arrivals enter the pool **while workers compute**, across ``execute`` calls;
* **inline** (the labelled fallback): Triton's ``execute`` thread admits its requests and runs rounds until each
  is answered (:meth:`AdmissionEngine.drive`); requests arriving meanwhile wait in Triton's queue.

A round (:meth:`AdmissionEngine.step`):

1. **Completions.** Every running worker whose completion has come: its outputs (host arrays, by output name)
   go to the requests holding its rows, its slots are released, the policy hears that it is idle. A request
   whose last row is back is answered.
2. **Arrivals.** Queued requests enter the ring in arrival order while slots are free (the first that does not
   fit waits, and so do all behind it); each one's rows are copied on the copy stream (``InStream``) as it
   enters, and one event is recorded after the round's copies (``InEvent``).
3. **Launches.** The policy (:mod:`e3.serving.ebird.policy`) picks idle workers for the staged rows (the paper's
   ``N``: rows whose copy was issued, not yet taken); each takes the next rows in arrival order and its stream
   waits, on the device, for the copy event covering its last row. The host never waits for a copy: that is
   the copy/compute overlap (a copy issued in round k runs while workers launched earlier compute).

Decisions where the paper is silent: slots are released when the host sees the worker's completion (its input
gather is long done then; releasing at the gather would need one more event per batch for slots a full ring
rarely wants back sooner); a request larger than the ring is refused at once with an error naming both sizes;
an engine error answers every request it holds with that error (none vanishes).
"""

from __future__ import annotations

import abc
import logging
import threading
import time
from collections import Counter, deque
from typing import Any, Callable, Sequence

import numpy as np

from e3.serving.ebird.policy import ElasticPolicy
from e3.serving.ebird.pool import Backlog, CopyLog, SlotRing, Staged, Taken

__all__ = ["DeviceOps", "AdmissionEngine"]

log = logging.getLogger(__name__)


class DeviceOps(abc.ABC):
    """The device side of the pool and the workers: the only place that touches tensors, streams and events."""

    @abc.abstractmethod
    def copy_in(self, segments: Sequence[tuple[int, int]], arrays: dict[str, np.ndarray]) -> None:
        """Issue the copy of one request's rows (``arrays``: input name -> host [n, ...]) into the ring's slot
        ranges ``segments`` (in row order) on the copy stream, after every copy issued before it."""

    @abc.abstractmethod
    def mark_copied(self) -> Any:
        """An event recorded on the copy stream after every copy issued so far (what a worker waits on)."""

    @abc.abstractmethod
    def launch(self, worker: int, taken: Taken, after: Any) -> Any:
        """Start worker ``worker``'s batch over the ring's rows ``taken`` on its own stream, once ``after`` (a copy
        event) has fired: gather the slots into its input, run the model, copy its output to host memory.
        Returns the event that fires when the host copy is done."""

    @abc.abstractmethod
    def ready(self, event: Any) -> bool:
        """Whether ``event`` has fired (never blocks)."""

    def wait(self, event: Any) -> None:
        """Block until ``event`` has fired (the inline form's wait for a worker; default: poll :meth:`ready`)."""
        while not self.ready(event):
            time.sleep(0)

    @abc.abstractmethod
    def result(self, worker: int, rows: int) -> dict[str, np.ndarray]:
        """Worker ``worker``'s last outputs on the host, name -> [rows, ...] (fresh arrays the caller may keep);
        raises the batch's error if it failed."""

    def close(self) -> None:
        """Release what the ops hold (threads, device memory); default: nothing."""


class AdmissionEngine:
    """The pool, the policy and the device ops, driven by one thread (module docstring)."""

    def __init__(self, policy: ElasticPolicy, ops: DeviceOps, *, capacity: int, answer: Callable[[Staged], None],
                 poll_s: float = 0.0):
        """``capacity``: ring slots (rows); ``answer(request)``: called once per request, from the thread running
        the rounds, with ``request.outputs`` (name -> [n, ...]) or ``request.failed`` set; ``poll_s``: the inline
        form's pause between rounds when nothing runs (the continuous form's pause is its engine's)."""
        if capacity < max(policy.engine):
            raise ValueError(f"a pool of {capacity} slots cannot feed a worker of {max(policy.engine)} rows")
        self.policy, self.ops, self.answer, self.poll_s = policy, ops, answer, poll_s
        self.ring = SlotRing(capacity)
        self.copies = CopyLog()
        self.book = Backlog()
        self.running: dict[int, tuple[Any, Taken]] = {}      # worker -> (its completion event, its rows)
        self.batches: Counter = Counter()                    # batch size -> batches launched (telemetry)
        self._arrivals: deque[Staged] = deque()
        self._cv = threading.Condition()
        self._stopping = False

    # -- Triton's side ----------------------------------------------------------------------------------------------
    def admit(self, handle: Any, arrays: dict[str, np.ndarray]) -> None:
        """Queue one request (thread-safe; returns at once). One too large for the ring is answered now."""
        n = len(next(iter(arrays.values())))
        r = Staged(handle, arrays, n, pending=n)
        if n > self.ring.capacity:
            r.failed = (f"a request of {n} inputs does not fit the admission pool of {self.ring.capacity} slots: "
                        "send at most that many per request")
            self.answer(r)
            return
        with self._cv:
            if self._stopping:
                r.failed = "the admission stage is stopping"
            else:
                self._arrivals.append(r)
                self._cv.notify()
        if r.failed:
            self.answer(r)

    # -- the engine's round -----------------------------------------------------------------------------------------
    def step(self) -> bool:
        """One round (module docstring). Returns whether anything is left: rows running, staged or waiting."""
        self._complete()
        self._enter()
        self._launch()
        return bool(self.running or self.ring.staged or self.book.waiting or self._arrivals)

    def _complete(self) -> None:
        for w, (event, taken) in list(self.running.items()):
            if not self.ops.ready(event):
                continue
            del self.running[w]
            try:
                out = self.ops.result(w, taken.rows)
                err = None
            except Exception as e:  # noqa: BLE001 - the batch's requests get the error, the engine goes on
                out, err = None, f"the admission stage's batch failed: {e}"
            self._finish(w, taken, out, err)

    def _finish(self, w: int, taken: Taken, out: dict[str, np.ndarray] | None, err: str | None) -> None:
        self.policy.done(w)
        self.ring.release(taken)
        for r, first, rows, at in self.book.parts(taken.start, taken.stop):
            if err is not None:
                r.failed = r.failed or err
            elif rows == r.n:                     # the whole request in this batch: its rows of the outputs
                r.outputs = {name: a[at:at + rows] for name, a in out.items()}
            else:                                 # split across batches: filled in part by part
                if r.outputs is None:
                    r.outputs = {name: np.empty((r.n, *a.shape[1:]), a.dtype) for name, a in out.items()}
                for name, a in out.items():
                    r.outputs[name][first:first + rows] = a[at:at + rows]
            r.pending -= rows
        for r in self.book.finished():
            self.answer(r)

    def _enter(self) -> None:
        with self._cv:
            self.book.waiting.extend(self._arrivals)
            self._arrivals.clear()
        copied = False
        while self.book.waiting and self.book.waiting[0].n <= self.ring.room:
            r = self.book.waiting.popleft()
            taken = self.ring.reserve(r.n)
            r.first = taken.start
            self.book.inside.append(r)
            try:
                self.ops.copy_in(taken.segments, r.arrays)
            except Exception as e:  # noqa: BLE001 - its rows still flow through (their slots are held); answered failed
                r.failed = f"copying the request into the admission pool failed: {e}"
            r.arrays = {}                         # copied once: the host copy is not needed again
            copied = True
        if copied:
            self.copies.record(self.ring.written, self.ops.mark_copied())

    def _launch(self) -> None:
        if not self.ring.staged:
            return
        for w, size in self.policy.launch(self.ring.staged):
            taken = self.ring.take(size)
            try:
                event = self.ops.launch(w, taken, self.copies.covering(taken.stop))
            except Exception as e:  # noqa: BLE001
                self._finish(w, taken, None, f"the admission stage's batch failed to launch: {e}")
                continue
            self.running[w] = (event, taken)
            self.batches[size] += 1
        self.copies.forget_before(self.ring.taken)

    def fail_all(self, message: str) -> None:
        """Answer every request the engine holds with ``message`` (an engine error, or unloading)."""
        with self._cv:
            self.book.waiting.extend(self._arrivals)
            self._arrivals.clear()
        for r in [*self.book.inside, *self.book.waiting]:
            r.failed = r.failed or message
            self.answer(r)
        self.book.inside.clear()
        self.book.waiting.clear()

    # -- the inline form: rounds in the caller's thread ------------------------------------------------------------
    def drive(self, done: Callable[[], bool]) -> None:
        """Run rounds in the calling thread until ``done()`` (the inline form: no engine thread; Triton's
        ``execute`` admits its requests and drives the engine until each is answered). A device error answers
        every request held with it, so ``done()`` becomes true rather than the call hanging.

        No polling: all the call's requests were admitted before it, so after a round only a worker's completion
        can change anything; it blocks on the oldest running worker's event (:meth:`DeviceOps.wait`; on a GPU
        ``cudaEventSynchronize``, the interpreter lock released). (The H200 run in ``docs/admission.md``
        polled with a 50 us pause per round; this form is not yet measured on a GPU.)"""
        try:
            while not done():
                if not self.step() and not done():
                    raise RuntimeError("nothing is left to run while requests wait for answers")
                if done():
                    break
                if self.running:   # nothing arrives inside one call: only a completion changes anything now
                    oldest, _ = next(iter(self.running.values()))   # running is in launch order
                    self.ops.wait(oldest)
                else:
                    time.sleep(self.poll_s)
        except Exception as e:  # noqa: BLE001 - every held request is answered with the error
            log.exception("the admission engine failed")
            self.fail_all(f"the admission engine failed: {e}")

    def close(self, message: str = "the admission stage is unloading") -> None:
        """Refuse new arrivals, answer every request still held with ``message``, release the ops. The caller
        has stopped whatever thread runs the rounds."""
        with self._cv:
            self._stopping = True
        self.fail_all(message)
        self.ops.close()
