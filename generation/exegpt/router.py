"""``<m>_generate_exegpt``: ExeGPT's RRA and WAA schedules enforced on Triton, one Python-backend instance.

Requests are those of ``<m>_generate`` (:mod:`e3.generation.generate_router`: ``input_ids`` INT64 [n] or
``text`` BYTES [1], optional ``max_new_tokens``, ``mode``, ``tau``, ``draft_tokens``) and its outputs
(``tokens``, ``exit_layers``, ``text_out``, ``ttft_ms``, ``total_ms``; ``total_ms`` runs from the sequence's
admission, its phase start, to its last token). The answers are the same engine's.

``execute`` only queues; one engine thread holds the waiting requests itself and hands them to the same
:class:`~e3.generation.engine.GenerationEngine` (over the ``<m>_kv_split_*`` models, BLS) as the schedule says:
``batch_size`` (B_E) of them at a phase start, prefilled together in the phase's first step, then
``decode_iters`` (N_D) steps before the next admissions. Under WAA the same engine is the decode worker, and
an encode worker (:class:`e3.generation.exegpt.waa.WaaPair`: a second engine over the stateless
``<m>_enc_split_*`` models, in a thread of its own) prefills ``batch_size`` (B_E) waiting prompts while the
decode worker runs an iteration; at the next iteration their sequences, caches included, join the decode
batch. The decisions are :class:`e3.generation.exegpt.scheduler.ExegptScheduler`'s (RRA or WAA by
branch-and-bound, phases, the served profiles from timed steps, re-planning when the output lengths shift);
this module applies them.

A request holding ``control`` BYTES [1], a JSON object, is not a generation: ``{}`` asks for the status,
``{"bound_ms": x}`` sets the latency bound and re-plans (``null``: no bound), ``{"schedule": [B_E, N_D]}``
(or ``["rra", B_E, N_D]``, ``["waa", B_E, B_m]``) pins a schedule (no re-planning), ``{"replan": true}``
re-plans now; each is answered with the status JSON in ``text_out`` (``e3 bench exegpt`` uses them). Custom
metrics: ``e3_exegpt_batch_size``, ``e3_exegpt_decode_iters`` (WAA: 1, new prompts join every iteration) and
``e3_exegpt_waa`` (1 while WAA is in force) (gauges, the schedule in force), ``e3_exegpt_replans_total{reason}``.

Bad requests (and bad control documents) get their own error naming the problem; a failed split call fails
that step's sequences with an error naming it, as in ``<m>_generate``; the door keeps serving. Requests still
waiting or running when the door is unloaded are answered with an error.
"""

from __future__ import annotations

import json
import logging
import math
import os
import queue
import threading
import time
from collections import deque

import numpy as np
import triton_python_backend_utils as pb_utils
from tokenizers import Tokenizer

from e3.generation.engine import EngineSpec, GenerationEngine, GenRequest
from e3.generation.exegpt.scheduler import ExegptScheduler, ReplanPolicy, schedule_from_json
from e3.generation.exegpt.waa import WaaPair
from e3.generation.exegpt.workload import LayerProfile, LengthDistribution
from e3.generation.generate_router import InboxFrontDoor, bls_runner, prompt_of, scalar_input
from e3.serving.triton_io import error_response, model_parameters, tensor_response

log = logging.getLogger(__name__)
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def scheduler_from_doc(doc: dict) -> ExegptScheduler:
    """The scheduler the ``exegpt`` config parameter describes (see ``generation/exegpt/door.py``)."""
    lengths = LengthDistribution(tuple(doc["lengths"]["lengths"]), tuple(doc["lengths"]["probs"]))
    bound = doc.get("bound_ms")
    pinned = doc.get("schedule")
    return ExegptScheduler(LayerProfile.from_dict(doc["profile"]), lengths, doc["prompt_tokens"],
                           tuple(doc["batch_sizes"]), math.inf if bound is None else float(bound),
                           ReplanPolicy(**doc.get("policy", {})),
                           schedule_from_json(pinned) if pinned else None,
                           schedules=tuple(doc.get("schedules", ("rra",))))


class TritonPythonModel(InboxFrontDoor):
    def initialize(self, args):
        _, params = model_parameters(args)
        self.spec = EngineSpec.from_dict(json.loads(params["engine"]))
        self.sched = scheduler_from_doc(json.loads(params["exegpt"]))
        self.tokenizer = None
        if params.get("tokenizer"):
            self.tokenizer = Tokenizer.from_file(os.path.join(args["model_repository"], params["tokenizer"]))
        self.engine = GenerationEngine(self.spec, bls_runner(self.spec.kv_in_splits))
        # WAA's encode worker (idle under RRA); its engine calls the stateless <m>_enc_split_* models
        encoder = EngineSpec.from_dict(json.loads(params["encoder"])) if params.get("encoder") else None
        self.pair = None if encoder is None else WaaPair(GenerationEngine(encoder, bls_runner(False)))
        self.waiting: deque[GenRequest] = deque()
        self.inbox: queue.Queue = queue.Queue()
        self.stopping = threading.Event()
        self._families = []
        fam = self._family
        self.m_batch = fam("e3_exegpt_batch_size", "RRA's B_E in force", pb_utils.MetricFamily.GAUGE).Metric({})
        self.m_iters = fam("e3_exegpt_decode_iters", "decode iterations per admission in force (RRA's N_D; WAA: 1)",
                           pb_utils.MetricFamily.GAUGE).Metric({})
        self.m_waa = fam("e3_exegpt_waa", "1 while WAA is in force, 0 under RRA",
                         pb_utils.MetricFamily.GAUGE).Metric({})
        self.m_replans = fam("e3_exegpt_replans_total", "re-plans, by reason", pb_utils.MetricFamily.COUNTER)
        self._seen_history = len(self.sched.history)
        self._publish()
        self.loop = threading.Thread(target=self._loop, name="e3-exegpt", daemon=True)
        self.loop.start()

    def _family(self, name, doc, kind):
        # a Metric is only valid while its MetricFamily object is alive: keep every family
        self._families.append(pb_utils.MetricFamily(name=name, description=doc, kind=kind))
        return self._families[-1]

    def finalize(self):
        if self.pair is not None:
            self.pair.close(timeout_s=0)    # wakes the engine thread if it waits for a hand-over
        self.stop_loop()
        if self.pair is not None:
            self.pair.close()

    # -- engine thread -------------------------------------------------------------------------------
    def _publish(self) -> None:
        sched = self.sched.schedule
        self.m_batch.set(sched.batch_size)
        self.m_iters.set(sched.decode_iters if sched.kind == "rra" else 1)
        self.m_waa.set(1 if sched.kind == "waa" else 0)
        for h in self.sched.history[self._seen_history:]:
            if h["reason"] not in ("start", "pinned"):
                kind = "lengths" if h["reason"].startswith("lengths") else h["reason"]
                self.m_replans.Metric({"reason": kind}).increment(1)
                log.info("ExeGPT re-planned (%s): %s", h["reason"], h["schedule"])
        self._seen_history = len(self.sched.history)

    def _control(self, request, raw) -> None:
        a = raw.as_numpy().reshape(-1)
        if a.size != 1:
            raise ValueError(f"control must hold one JSON object, got {a.size} values")
        try:
            doc = json.loads(a[0].decode("utf-8") if isinstance(a[0], bytes) else str(a[0]))
        except (UnicodeDecodeError, ValueError) as e:
            raise ValueError(f"control is not a JSON object: {e}") from None
        if not isinstance(doc, dict) or set(doc) - {"bound_ms", "schedule", "replan"}:
            raise ValueError("control takes a JSON object with bound_ms, schedule ([B_E, N_D]) or replan")
        if "bound_ms" in doc:
            b = doc["bound_ms"]
            if b is not None and not (isinstance(b, (int, float)) and b > 0):
                raise ValueError(f"bound_ms must be a number > 0 or null, got {b!r}")
            self.sched.set_bound(math.inf if b is None else float(b))
        if "schedule" in doc:
            sched = schedule_from_json(doc["schedule"])
            if sched.kind == "waa" and self.pair is None:
                raise ValueError("this door was exported without WAA's encode worker: pin an RRA schedule")
            self.sched.pin(sched)
        if doc.get("replan"):
            self.sched.replan("asked")
        self._publish()
        text = json.dumps(self.sched.status())
        request.get_response_sender().send(tensor_response(self._outputs([], [], text=text)), flags=FINAL)

    def _parse(self, request) -> GenRequest | None:
        control = pb_utils.get_input_tensor_by_name(request, "control")
        if control is not None:
            self._control(request, control)
            return None
        prompt = prompt_of(request, self.tokenizer)
        req = GenRequest(request_id=request, prompt=prompt,
                         max_new_tokens=int(scalar_input(request, "max_new_tokens", 32)),
                         mode=str(scalar_input(request, "mode", "full")), tau=float(scalar_input(request, "tau", 0.9)),
                         draft_tokens=int(scalar_input(request, "draft_tokens", 4)))
        req.check(self.spec)   # refused now, not when its phase comes
        return req

    def _take(self, request) -> None:
        try:
            req = self._parse(request)
        except (ValueError, TypeError) as err:
            request.get_response_sender().send(error_response(str(err), client_error=True), flags=FINAL)
            return
        except Exception as err:   # the engine thread must live on: every accepted request gets an answer
            log.exception("ExeGPT door: request failed")
            request.get_response_sender().send(error_response(f"ExeGPT door: {err}"), flags=FINAL)
            return
        if req is not None:
            self.waiting.append(req)

    def _loop(self) -> None:
        # A step is timed from its start to the next step's start (answers sent, new requests taken: the
        # scheduler's StepTimes says why); a step after which the door went idle (or, under WAA, waited for the
        # encode worker) ends when its answers are sent.
        last = None    # (kind, prefill tokens, decode rows, start, end of its answers) of the step before
        while not self.stopping.is_set():
            busy = self.pair is not None and self.pair.busy()
            block = self.engine.idle and not self.waiting and not busy
            if block and last is not None:
                self._record(last, last[4])
                last = None
            try:
                while True:
                    item = self.inbox.get(block=block)
                    block = False
                    if item is None:
                        self._unloading()
                        return
                    self._take(item)
            except queue.Empty:
                pass
            if self.sched.schedule.kind == "waa" or busy:
                last = self._waa_iteration(last)
                continue
            for _ in range(self.sched.admissions(len(self.waiting), len(self.engine.active))):
                self.engine.submit(self.waiting.popleft())
            if self.engine.idle:
                continue
            t0 = time.perf_counter()
            if last is not None:
                self._record(last, t0)
            fresh = [r for r, _ in self.engine.waiting]
            chunk = len(fresh) * max((len(r.prompt) for r in fresh), default=0)
            rows = len(self.engine.active)
            self._step()
            last = ("rra", chunk, rows, t0, time.perf_counter())

    def _waa_iteration(self, last):
        """One WAA decode iteration (lock-step, ``generation/exegpt/waa.py``): wait for and adopt the encode
        worker's hand-over, hand it the next B_E waiting prompts (it prefills them while this thread decodes),
        decode one token for every live row. Also used to collect a hand-over still in flight after a switch to
        RRA. Returns the iteration's timing record."""
        waited = self.pair.busy()
        got = self.pair.collect(wait=waited)
        if got is not None:
            for f in got.failed:
                self._answer(f)
            self.engine.adopt(got.seqs)
            if not got.first and not got.failed:
                self._safe(self.sched.encoded, got.tokens, got.ms)
        n = 0 if self.pair.busy() else self.sched.handover(len(self.waiting))
        if n:
            self.pair.hand([self.waiting.popleft() for _ in range(n)])
        if not self.engine.active:
            if last is not None:   # waited for the encode worker: the iteration before ended with its answers
                self._record(last, last[4])
            return None
        t0 = time.perf_counter()
        if last is not None:
            # a decode iteration runs from its start to the next one's, less any wait for the encode worker
            self._record(last, last[4] if waited or last[0] != "waa" else t0)
        rows = len(self.engine.active)
        self._step()
        return ("waa", 0, rows, t0, time.perf_counter())

    def _record(self, last, end: float) -> None:
        kind, chunk, rows, start, _ = last
        ms = 1e3 * (end - start)
        if kind == "waa":
            self._safe(self.sched.decoded, rows, ms)
        else:
            self._safe(self.sched.stepped, chunk, rows, ms)

    def _step(self) -> None:
        """One engine step; answer what finished and tell the scheduler their lengths."""
        done = self.engine.step()
        for f in done:
            self._answer(f)
            if not f.error:
                self._safe(self.sched.finished, len(f.tokens))
        if done:
            self._safe(self._publish)

    def _unloading(self) -> None:
        """The model is being unloaded: every request still waiting or running gets an error, none vanishes."""
        pending = ([r.request_id for r in self.waiting] + [r.request_id for r, _ in self.engine.waiting]
                   + [q.req.request_id for q in self.engine.active]
                   + (self.pair.pending() if self.pair is not None else []))
        for request in pending:
            try:
                request.get_response_sender().send(
                    error_response(f"{self.spec.model}: the ExeGPT door was unloaded before this request finished"),
                    flags=FINAL)
            except Exception:
                log.exception("answering a request at unload failed")
        self.waiting.clear()

    @staticmethod
    def _safe(fn, *args) -> None:
        """The scheduler's bookkeeping; a failure in it is logged and serving goes on with the schedule in force."""
        try:
            fn(*args)
        except Exception:
            log.exception("ExeGPT scheduler failed in %s", getattr(fn, "__name__", fn))

    def _outputs(self, tokens, exits, ttft_s: float = 0.0, total_s: float = 0.0, text: str | None = None) -> dict:
        if text is None:
            text = self.tokenizer.decode(tokens) if self.tokenizer is not None else ""
        return {"tokens": np.array(tokens, np.int64), "exit_layers": np.array(exits, np.int32),
                "text_out": np.array([text.encode("utf-8")], dtype=object),
                "ttft_ms": np.array([1e3 * ttft_s], np.float32), "total_ms": np.array([1e3 * total_s], np.float32)}

    def _answer(self, done) -> None:
        sender = done.request_id.get_response_sender()
        if done.error:
            sender.send(error_response(done.error), flags=FINAL)
        else:
            sender.send(tensor_response(self._outputs(done.tokens, done.exit_layers, done.ttft_s, done.total_s)),
                        flags=FINAL)
