"""ExeGPT's WAA schedule (WAA-C) run over two generation engines: an encode worker and a decode worker.

The encode worker is a :class:`~e3.generation.engine.GenerationEngine` over its own stateless split models
(the cache comes back with each prefill), driven by a thread of its own; the decode worker is another engine
over the split models that keep the cache, driven by the caller's thread (the front door's engine thread,
``generation/exegpt/router.py``, or a test in process). One decode iteration of the caller's loop:

1. :meth:`WaaPair.collect`: the batch the encode worker is prefilling is waited for and taken, and the decode
   engine :meth:`~e3.generation.engine.GenerationEngine.adopt` s it (its prompt k/v travel with each split's
   next call);
2. :meth:`WaaPair.hand`: if the encode worker is free, the next ``B_E`` waiting prompts are handed to it; it
   prefills them *while* the decode worker runs step 3;
3. the decode engine's ``step()``: one token for every live row.

So B_E prompts join the decode batch per decode iteration, as ``simulate_waa`` assumes. Decisions where the
paper (§4.1) leaves the mapping open:

* **Lock-step, as WAA-C.** While prompts are being encoded, every decode iteration starts with the hand-over
  of the B_E prompts the encode worker took at the previous one's start, waiting for it if the encode pass is
  the slower: the period is max(encode pass, decode iteration), as ``simulate_waa`` has it. (Tried first: a
  decode worker that never waits while it has rows. When encoding was the slower, as on SmolLM2 here, it ran
  many small iterations between hand-overs, so neither its batch nor its latency was WAA-C's and the simulator
  could not predict it.) With nothing waiting to be encoded, the decode worker runs on alone.
* **Micro-batches.** With one decode worker the simulator's ``B_m`` is 1 (``simulate_waa`` clamps it to the
  decode workers), so the decode worker decodes its whole live batch per iteration. More decode workers would
  each hold a pipeline stage; this machine's two cores give one encoder and one decoder.
* **Timing.** An encode pass is timed from the hand-over of its prompts to the end of their prefill (the
  simulator's ``enc_pass``); the caller times its decode iterations without the wait for the hand-over (the
  simulator's decode iteration; the period is the slower of the two).

No Triton here: the engines' ``run`` functions decide where the splits are (BLS in the door, ONNX Runtime in
tests).
"""

from __future__ import annotations

import logging
import threading
import time

from e3.generation.engine import Finished, GenerationEngine, GenRequest

__all__ = ["WaaPair", "Encoded"]

log = logging.getLogger(__name__)


class Encoded:
    """One finished encode pass: the prefilled sequences (for ``adopt``), the failed requests, and its size
    and time (prompt tokens as the prefill chunk holds them: rows x padded length; wall ms). ``first``: the
    worker's first pass, whose time includes ONNX Runtime's warm-up of every split (200-300 ms on tiny-gen
    against ~11 ms after), so it is not a sample of the encode cost."""

    def __init__(self, seqs: list, failed: list[Finished], tokens: int, ms: float, first: bool = False):
        self.seqs, self.failed, self.tokens, self.ms, self.first = seqs, failed, tokens, ms, first


class WaaPair:
    """The encode worker (its own thread over ``encoder``) beside the caller's decode engine. Thread-safe for
    one caller thread: :meth:`hand`, :meth:`collect`, :meth:`busy` and :meth:`close` are the caller's."""

    def __init__(self, encoder: GenerationEngine):
        if encoder.spec.kv_in_splits:
            raise ValueError("WAA's encode worker needs stateless splits (kv_in_splits False): the prefill's "
                             "k/v must come back to be handed over")
        self.encoder = encoder
        self._cv = threading.Condition()
        self._todo: list[GenRequest] | None = None
        self._done: Encoded | None = None
        self._closed = False
        self.passes = 0            # encode passes run (the worker thread's count)
        self._thread = threading.Thread(target=self._run, name="e3-waa-encoder", daemon=True)
        self._thread.start()

    def busy(self) -> bool:
        """Whether a hand-over is being prefilled or waits to be collected."""
        with self._cv:
            return self._todo is not None or self._done is not None

    def hand(self, requests: list[GenRequest]) -> None:
        """Give the encode worker ``requests`` to prefill together (it must not be :meth:`busy`). They were
        checked by the caller (``GenRequest.check``); their admission time is now."""
        if not requests:
            return
        with self._cv:
            if self._todo is not None or self._done is not None:
                raise RuntimeError("the encode worker is busy: collect its hand-over first")
            self._todo = list(requests)
            self._cv.notify_all()

    def collect(self, wait: bool = False, timeout_s: float | None = None) -> Encoded | None:
        """The finished encode pass, if any (with ``wait``: block until the one in progress ends, or
        ``timeout_s``); None if nothing is ready."""
        with self._cv:
            if wait:
                self._cv.wait_for(lambda: self._done is not None or self._todo is None or self._closed,
                                  timeout=timeout_s)
            done, self._done = self._done, None
            return done

    def pending(self) -> list:
        """The ``request_id`` of every request handed over and not yet collected (to answer them when the door
        unloads)."""
        with self._cv:
            out = [r.request_id for r in self._todo or []]
            if self._done is not None:
                out += [s.req.request_id for s in self._done.seqs] + [f.request_id for f in self._done.failed]
            return out

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the encode worker: a :meth:`collect` waiting returns at once; an encode pass in progress ends
        first (joined for up to ``timeout_s``; 0: do not wait)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout=timeout_s)

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._todo is not None or self._closed)
                if self._closed:
                    return
                todo = self._todo
            t0 = time.perf_counter()
            tokens = len(todo) * max(len(r.prompt) for r in todo)
            try:
                for r in todo:
                    self.encoder.submit(r)
                seqs, failed = self.encoder.encode()
            except Exception as e:   # never lose a hand-over: its requests fail with the reason
                log.exception("WAA encode pass failed")
                self.encoder.waiting.clear()
                seqs, failed = [], [Finished(r.request_id, [], [], 0.0, 0.0, error=f"generation failed: {e}")
                                    for r in todo]
            done = Encoded(seqs, failed, tokens, 1e3 * (time.perf_counter() - t0), first=self.passes == 0)
            self.passes += 1
            with self._cv:
                self._todo, self._done = None, done
                self._cv.notify_all()
