"""``<m>_generate`` (and ``_naive``, ``_stream``): the generation router, one Triton Python-backend instance.

Inputs per request (one sequence): ``input_ids`` INT64 [n] or ``text`` BYTES [1] (tokenized with the
model's tokenizer, no template added), and optionally ``max_new_tokens`` INT32 [1] (default 32), ``mode``
BYTES [1] (``calm`` default, ``full``, ``speculative``), ``min_agreement`` FP32 [1] (CALM's quality target,
resolved against the calibration recorded in the router's engine spec; the default for a calibrated model
when ``tau`` is not given: 0.9), or ``tau`` FP32 [1] (a raw threshold, default 0.9) with ``measure`` BYTES
[1] (``softmax`` default, ``saturation``, ``classifier``), ``draft_tokens`` INT32 [1] (default 4: the most
a speculative round drafts; with measured costs the router chooses fewer, or none, see
:mod:`e3.generation.policy`), ``on_slower`` BYTES [1] (``fallback`` default: CALM exits predicted slower than
plain decoding under the served costs are not taken, the request is decoded plainly; ``refuse``: a 400 with
the prediction; ``serve``: exits as asked). Outputs: ``tokens`` INT64 [m], ``exit_layers`` INT32 [m] (the layer
whose head chose each token; L for the final head), ``text_out`` BYTES [1] (empty without a tokenizer), and
the server's timings ``ttft_ms`` / ``total_ms`` FP32 [1] (from the request's admission to its first / last
token), and ``served_as`` BYTES [1]: how it was served, a JSON object of response parameters (this Triton's
Python backend cannot set a response's own parameters): ``e3_mode`` (``calm``, ``full``, ``speculative``),
``e3_fallback`` and ``e3_reason`` when exits were not taken, ``e3_predicted_speedup`` (over plain decoding),
and ``e3_costs`` (the cost table as served; see :class:`e3.generation.policy.CostMeter`). The streaming router
sends it in its final response.

``execute`` only checks and queues requests and returns; one engine thread runs
:class:`e3.generation.engine.GenerationEngine` steps (continuous batching across all queued sequences, exits
per token, survivors re-batched between splits) with BLS calls to the split models, and answers each
request through its response sender when its sequence finishes (the non-decoupled front door: exactly one
final response, so plain HTTP/gRPC ``infer`` works). With ``decoupled`` = 1 (the ``_stream`` model, gRPC
streaming) each step's new tokens go out as they are made, then an empty final flag. All responses leave from
the engine thread. A bad request gets its own error; a failed split call fails the sequences of that step
with an error naming the split, and the router keeps serving.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading

import numpy as np
import triton_python_backend_utils as pb_utils
from tokenizers import Tokenizer

from e3.generation.engine import EngineSpec, GenerationEngine, GenRequest
from e3.serving.triton_io import bls, error_response, model_parameters, tensor_response

log = logging.getLogger(__name__)
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
SPLIT_OUTPUTS = ["hidden_out", "new_kv", "token", "confidence", "exit_scores"]
FILL_OUTPUTS = ["new_kv", "token", "confidence"]
DEFAULT_MIN_AGREEMENT = 0.9   # a calibrated model's CALM requests without tau or min_agreement


def bls_runner(kv_in_splits: bool):
    """The engine's ``run``: a BLS call asking for the outputs each kind of model gives."""
    split_outputs = [o for o in SPLIT_OUTPUTS if not (kv_in_splits and o == "new_kv")]

    def run(name: str, inputs: dict) -> dict:
        if "release_ids" in inputs:
            return bls(name, inputs, [])
        return bls(name, inputs, FILL_OUTPUTS if "_kvfill_" in name else split_outputs)
    return run


def scalar_input(request, name: str, default):
    t = pb_utils.get_input_tensor_by_name(request, name)
    if t is None:
        return default
    a = t.as_numpy().reshape(-1)
    if a.size != 1:
        raise ValueError(f"input {name} must hold exactly one value, got {a.size}")
    v = a[0]
    return v.decode("utf-8") if isinstance(v, bytes) else v.item()


class InboxFrontDoor:
    """What the generation front doors share: ``execute`` only queues requests for the engine thread
    (``self.inbox``, ``self.loop``, ``self.stopping`` are the subclass's) and returns; :meth:`stop_loop` ends it."""

    def execute(self, requests):
        for request in requests:
            self.inbox.put(request)
        return None

    def stop_loop(self) -> None:
        self.stopping.set()
        self.inbox.put(None)
        self.loop.join(timeout=10)


def prompt_of(request, tokenizer) -> list[int]:
    """The request's prompt as token ids: its ``input_ids`` (INT64 [n]) or its ``text`` (BYTES [1], tokenized with
    ``tokenizer``, no template added). ValueError naming the problem otherwise."""
    ids = pb_utils.get_input_tensor_by_name(request, "input_ids")
    text = pb_utils.get_input_tensor_by_name(request, "text")
    if (ids is None) == (text is None):
        raise ValueError("give exactly one of input_ids (INT64 [n]) or text (BYTES [1])")
    if ids is not None:
        return [int(x) for x in ids.as_numpy().reshape(-1)]
    if tokenizer is None:
        raise ValueError("this model has no tokenizer: send input_ids")
    raw = text.as_numpy().reshape(-1)
    if raw.size != 1:
        raise ValueError(f"text must hold one string, got {raw.size}")
    try:
        s = raw[0].decode("utf-8") if isinstance(raw[0], bytes) else str(raw[0])
    except UnicodeDecodeError:
        raise ValueError("text is not valid UTF-8") from None
    return tokenizer.encode(s).ids


class TritonPythonModel(InboxFrontDoor):
    def initialize(self, args):
        _, params = model_parameters(args)
        self.spec = EngineSpec.from_dict(json.loads(params["engine"]))
        self.streaming = params.get("decoupled", "0") == "1"
        self.tokenizer = None
        if params.get("tokenizer"):
            self.tokenizer = Tokenizer.from_file(os.path.join(args["model_repository"], params["tokenizer"]))
        self.engine = GenerationEngine(self.spec, bls_runner(self.spec.kv_in_splits))
        self.inbox: queue.Queue = queue.Queue()
        self.stopping = threading.Event()
        self.sent: dict[int, int] = {}
        # streaming: each step's chunks leave from a sender thread, in order, while the engine decodes the next
        self.outbox: queue.Queue = queue.Queue()
        self.sender = threading.Thread(target=self._send_loop, name="e3-generate-send", daemon=True)
        self.sender.start()
        self.loop = threading.Thread(target=self._loop, name="e3-generate", daemon=True)
        self.loop.start()

    def finalize(self):
        self.stop_loop()
        self.outbox.put(None)
        self.sender.join(timeout=10)

    def _send_loop(self) -> None:
        """Sends what the engine thread queued, in order: (request, a callable building its response, flags)."""
        while (item := self.outbox.get()) is not None:
            request, build, flags = item
            try:
                request.get_response_sender().send(build(), flags=flags)
            except Exception:   # one failed send must not stop the others
                log.exception("sending a generation response failed")

    # -- engine thread -------------------------------------------------------------------------------
    def _parse(self, request) -> GenRequest:
        prompt = prompt_of(request, self.tokenizer)
        tau = scalar_input(request, "tau", None)
        target = scalar_input(request, "min_agreement", None)
        if tau is not None and target is not None:
            raise ValueError("give min_agreement (a quality target) or tau (a raw threshold), not both")
        if tau is None and target is None and self.spec.calibration:
            target = DEFAULT_MIN_AGREEMENT
        req = GenRequest(request_id=request, prompt=prompt,
                         max_new_tokens=int(scalar_input(request, "max_new_tokens", 32)),
                         mode=str(scalar_input(request, "mode", "calm")),
                         tau=float(0.9 if tau is None else tau), measure=str(scalar_input(request, "measure", "softmax")),
                         min_agreement=None if target is None else float(target),
                         draft_tokens=int(scalar_input(request, "draft_tokens", 4)),
                         on_slower=str(scalar_input(request, "on_slower", "fallback")))
        return req

    def _admit(self, request) -> None:
        try:
            self.engine.submit(self._parse(request))
        except (ValueError, TypeError) as err:
            if self.streaming:
                refusal = error_response(str(err), client_error=True)
                self.outbox.put((request, lambda: refusal, FINAL))
            else:
                request.get_response_sender().send(error_response(str(err), client_error=True), flags=FINAL)

    def _loop(self) -> None:
        while not self.stopping.is_set():
            block = self.engine.idle
            try:
                while True:
                    item = self.inbox.get(block=block)
                    block = False
                    if item is None:
                        return
                    self._admit(item)
            except queue.Empty:
                pass
            if self.engine.idle:
                continue
            for done in self.engine.step():
                try:
                    self._answer(done)
                except Exception:   # one answer failing must not end the engine thread
                    log.exception("answering a generation request failed")
            if self.streaming:
                for s in self.engine.active:
                    self._stream(s.req.request_id, s.tokens, s.exits)

    def _outputs(self, tokens: list[int], exits: list[int], ttft_s: float = 0.0, total_s: float = 0.0) -> dict:
        text = self.tokenizer.decode(tokens) if self.tokenizer is not None else ""
        return {"tokens": np.array(tokens, np.int64), "exit_layers": np.array(exits, np.int32),
                "text_out": np.array([text.encode("utf-8")], dtype=object),
                "ttft_ms": np.array([1e3 * ttft_s], np.float32), "total_ms": np.array([1e3 * total_s], np.float32)}

    def _stream(self, request, tokens, exits) -> None:
        start = self.sent.get(id(request), 0)
        if len(tokens) > start:
            chunk = (tokens[start:], exits[start:])
            self.outbox.put((request, lambda: tensor_response(self._outputs(*chunk)), 0))
            self.sent[id(request)] = len(tokens)

    def _served_as(self, note: dict) -> np.ndarray:
        """``served_as``: how the request was served (``note``) and the costs as served, as JSON."""
        costs = self.engine.costs()
        params = {**note, **({"e3_costs": costs.to_dict()} if costs is not None else {})}
        return np.array([json.dumps(params, separators=(",", ":")).encode()], dtype=object)

    def _answer(self, done) -> None:
        request = done.request_id
        if self.streaming:   # after the request's chunks, from the same queue
            if not done.error:
                self._stream(request, done.tokens, done.exit_layers)
            final = (error_response(done.error) if done.error else
                     tensor_response({"served_as": self._served_as(done.note)}))
            self.outbox.put((request, lambda: final, FINAL))
            self.sent.pop(id(request), None)
            return
        sender = request.get_response_sender()
        if done.error:
            sender.send(error_response(done.error), flags=FINAL)
        else:
            outputs = self._outputs(done.tokens, done.exit_layers, done.ttft_s, done.total_s)
            sender.send(tensor_response({**outputs, "served_as": self._served_as(done.note)}), flags=FINAL)
        self.sent.pop(id(request), None)
