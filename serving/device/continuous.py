"""Continuous answering for the device form: ``execute`` admits, one engine thread computes and answers.

The form docs/design.md §2b asks for (and E²bird's stage reuses): Triton calls ``execute`` with whatever its queue
holds; ``execute`` takes each request's response sender there (:func:`e3.serving.triton_io.sender_of`), copies
its inputs, keeps no request object, hands them to :meth:`ContinuousEngine.submit` and returns ``None``. One
engine thread steps the pipeline (:class:`~e3.serving.device.pipeline.DevicePipeline`, or anything with its
``admit`` / ``step`` / ``fail_all``) for as long as anything is queued or in flight: survivors of every
request in flight merge into the splits' constant batches, whichever ``execute`` admitted them, and a request
is answered the moment its last row is decided. Answers leave through one sending thread
(:class:`~e3.serving.triton_io.ResponseSender`), handed over by the pipeline's callbacks.

* **Admission is bounded** by the router's ``max_queue_inputs`` (the CPU router's bound, the one function
  :func:`e3.serving.scheduler.refusal_for`): inputs held (admitted, not yet answered or dropped) plus the
  request's must fit, else the request is refused at once with UNAVAILABLE (HTTP 503) and Triton's own queue
  in front of the model keeps the backpressure. Unbounded when unset, as on the CPU router.
* **Idle**: when the pipeline has nothing queued or in flight (:meth:`step` returns False: a row waiting in
  a queue always has a run it can start, ``dispatch.choose``), the thread sleeps until the next submit.
* **Busy, waiting on the device** (``poll_s``): a pipeline whose step blocks on its device (E3's
  :class:`~e3.serving.device.pipeline.DevicePipeline`) is stepped again at once (``poll_s=0``). One whose
  step only polls work running elsewhere (E²bird's :class:`~e3.serving.ebird.engine.AdmissionEngine`, whose
  workers run on CUDA streams or worker threads) pauses up to ``poll_s`` between steps, woken early by a
  submit or by :meth:`wake` (a worker thread's completion), so it neither spins against ``execute`` for the
  interpreter lock nor sleeps past an arrival. A wake-up is a flag set under the lock, so one that comes
  between a step and the pause is not lost.
* **Failure**: an exception out of a step answers every request held with an explicit error and the engine
  goes on with the next arrivals (no accepted request goes unanswered).
* **Sending from the engine thread** (``drain``): where given, the engine calls it after every step, in its
  own thread, and the caller's ``send`` only queues (:class:`~e3.serving.triton_io.ResponseSender` with
  ``thread=False``, its ``wake`` set to :meth:`wake` so that a refusal queued by ``execute`` is sent at once).
  The device router sends so: its stubs died inside ``send`` on an H100 while a second thread ran the GPU.
* **Unload** (:meth:`close`): the thread stops, every request still held is answered with an error, then
  the sending thread drains.

No torch here: the engine only drives its pipeline, so its bookkeeping is tested with a pure fake.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable

from e3.core.names import ANSWERING
from e3.serving.scheduler import Refusal, refusal_for

__all__ = ["ContinuousEngine", "Held"]

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.5   # an idle engine re-checks this often even without a submit (a lost wake-up costs no more)


@dataclass(eq=False)
class Held:
    """One admitted request as the pipeline sees it (its opaque handle)."""
    sender: Any   # the response sender taken inside execute (or any handle the caller's ``send`` takes)
    n: int        # its inputs (rows)


class ContinuousEngine:
    """Admits requests from any thread and runs ``pipeline`` in one thread of its own (module docstring).

    ``pipeline`` is built by the caller with ``answer=engine.answered`` and ``fail=engine.failed`` as its
    callbacks (use :meth:`bind`); ``send(sender, what)`` delivers an outputs dict or an error message (the
    model's :class:`~e3.serving.triton_io.ResponseSender`'s ``put``)."""

    def __init__(self, send: Callable[[Any, Any], None], *, max_queue_inputs: int | None = None,
                 name: str = "e3-device-engine", poll_s: float = 0.0, drain: Callable[[], Any] | None = None):
        if poll_s < 0:
            raise ValueError(f"poll_s must be >= 0 (seconds between polling steps), got {poll_s}")
        self.send = send
        self.drain = drain
        self.poll_s = poll_s
        self.max_queue_inputs = max_queue_inputs
        self.held_inputs = 0            # inputs admitted and not yet answered or dropped
        self.counts = {"admitted": 0, "answered": 0, "failed": 0, "refused": 0}   # requests
        self.pipeline = None
        self._held: set[int] = set()    # id(Held) of requests admitted and not yet answered
        # reentrant: a pipeline may answer inside admit (a request it can never hold), which releases here
        self._lock = threading.RLock()
        self._work = threading.Condition(self._lock)
        self._kicked = False            # something happened since the last step: a submit or a wake
        self._stopping = False
        self._name = name
        self._thread: threading.Thread | None = None

    def bind(self, pipeline) -> None:
        """Attach the pipeline (built with this engine's :meth:`answered` / :meth:`failed`) and start the thread."""
        self.pipeline = pipeline
        self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
        self._thread.start()

    # -- any thread (Triton's execute) ---------------------------------------------------------------------
    def submit(self, sender: Any, arrays: dict) -> Refusal | None:
        """Admit one request's inputs (name -> [n, ...] host arrays, copies the caller no longer touches), or
        say why not (the request is then answered by the caller, at once). Never blocks on the device."""
        n = len(next(iter(arrays.values())))
        with self._lock:
            if self._stopping:
                return Refusal("the router is unloading; send again", permanent=False)
            refusal = refusal_for(self.max_queue_inputs, self.held_inputs, n)
            if refusal is not None:
                self.counts["refused"] += 1
                return refusal
            held = Held(sender, n)
            self.held_inputs += n
            self._held.add(id(held))
            self.counts["admitted"] += 1
            self.pipeline.admit(held, arrays)
            self._kicked = True
            self._work.notify()
        return None

    def wake(self) -> None:
        """Step again now (any thread: e.g. a worker that finished a batch the pipeline polls for)."""
        with self._lock:
            self._kicked = True
            self._work.notify()

    # -- the pipeline's callbacks (the engine thread) ------------------------------------------------------
    def answered(self, held: Held, outputs: dict) -> None:
        sender = self._release(held, "answered")
        if sender is not None:
            self.send(sender, outputs)

    def failed(self, held: Held, message: str) -> None:
        sender = self._release(held, "failed")
        if sender is not None:
            self.send(sender, message)

    def _release(self, held: Held, how: str):
        """The request's sender, once (None if it was answered already: a request has exactly one response).
        The sender leaves the pipeline's bookkeeping here: only the sending thread holds it from now on and
        drops it once sent, so no sender outlives its answer (one dying with the stub's teardown is the
        lead for the crashes at unload, docs/reliability.md)."""
        with self._lock:
            if id(held) not in self._held:
                return None
            self._held.discard(id(held))
            self.held_inputs -= held.n
            self.counts[how] += 1
            sender, held.sender = held.sender, None
            return sender

    # -- the engine thread ---------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._lock:
                if self._stopping:
                    return
                self._kicked = False
            try:
                busy = self.pipeline.step()
            except Exception as err:  # noqa: BLE001 - every held request gets an error, the engine goes on
                log.exception("the device engine failed a step")
                self.pipeline.fail_all(f"the router failed: {err}")
                busy = True
            if self.drain is not None:
                self.drain()
            pause = self.poll_s if busy else IDLE_WAIT_S
            if pause > 0:
                with self._lock:
                    if not self._stopping and not self._kicked:
                        self._work.wait(pause)

    def close(self, timeout_s: float = 5.0, message: str = "the router is unloading; send again") -> None:
        """Stop the thread and answer every request still held with ``message`` (the model is unloading)."""
        with self._lock:
            self._stopping = True
            self._work.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
        if self.pipeline is not None:
            self.pipeline.fail_all(message)
            self.pipeline = None
        if self.drain is not None:
            self.drain()
