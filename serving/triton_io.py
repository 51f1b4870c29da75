"""Glue shared by the project's Python-backend models: parameters, inputs, responses, BLS calls.

Only imported inside Triton's Python-backend stub (it needs
``triton_python_backend_utils``). Requests that cannot be served get their own
error response (a client error, HTTP 400 / gRPC INVALID_ARGUMENT, that names
the problem; the checks are :mod:`e3.serving.input_policy`'s); the others in
the same batch are still answered.

BLS calls raise typed errors (:class:`BlsTimeout`, :class:`BlsError`), decided
here once (:func:`bls_error`), so callers never match error text.
"""

from __future__ import annotations

import faulthandler
import json
import os
import queue
import threading
from dataclasses import dataclass
from typing import Callable

import numpy as np
import triton_python_backend_utils as pb_utils

from e3.core.names import INPUT_BOUNDS
from e3.core.rows import request_slices, split_rows
from e3.core.spec import TensorSpec, dtype_from_config
from e3.serving.input_policy import InputError, check_request
from e3.serving.output_policy import nonfinite_output

__all__ = ["ResponseSender", "Reply", "sender_of", "InputError", "BlsError", "BlsTimeout", "Gathered", "model_parameters", "io_specs", "gather",
           "error_response", "tensor_response", "checked_response", "answer_responses", "split_responses", "bls",
           "bls_error", "EXPIRED_IN_QUEUE", "INPUT_BOUNDS", "INTERNAL_ID"]


# Triton's text for a request rejected because its timeout expired in a model's queue.
EXPIRED_IN_QUEUE = "Request timeout expired"
# The request id of this project's own BLS calls (:func:`bls`): a model called by another one answers such a
# request's non-finite outputs as they are, so that one client's overflowing rows do not fail the rows of
# other clients merged into the same call; the front door refuses them per client request.
INTERNAL_ID = "e3-internal"
# INPUT_BOUNDS (e3.core.names): a model config's parameter holding {input name: [low, high]}, the value bounds of
# its inputs (TensorSpec.bounds), which config.pbtxt's input fields cannot carry.


class BlsError(RuntimeError):
    """A BLS call to another model failed; the message names the model and carries Triton's."""


class BlsTimeout(BlsError):
    """A BLS call's timeout expired while the request waited in the callee's queue (its deadline passed)."""


def model_parameters(args: dict) -> tuple[dict, dict[str, str]]:
    """(model config, its string parameters) from ``initialize``'s args.

    Every model of this project calls it first in ``initialize``, so it also turns on ``faulthandler`` for the
    model's process: a fatal signal (a segmentation fault in the backend's C++, say) then leaves every thread's
    Python stack in the server's log instead of a bare "Stub process ... is not healthy"; with
    ``E3_STACKS_EVERY_S`` set in the server's environment (a diagnostic run), every thread's stack every that
    many seconds as well."""
    try:
        faulthandler.enable()
        if os.environ.get("E3_STACKS_EVERY_S"):
            faulthandler.dump_traceback_later(float(os.environ["E3_STACKS_EVERY_S"]), repeat=True)
    except (OSError, ValueError, AttributeError):   # a standard error without a file descriptor: serve anyway
        pass
    config = json.loads(args["model_config"])
    params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
    return config, params


def io_specs(config: dict, key: str) -> tuple[TensorSpec, ...]:
    """Input or output specs ("input"/"output") of a model config, as TensorSpecs (with the
    ``input_bounds`` parameter's bounds, if any)."""
    bounds = json.loads(config.get("parameters", {}).get(INPUT_BOUNDS, {}).get("string_value") or "{}")
    return tuple(TensorSpec(t["name"], dtype_from_config(t["data_type"]), tuple(int(d) for d in t["dims"]),
                            tuple(bounds[t["name"]]) if key == "input" and t["name"] in bounds else None)
                 for t in config.get(key, []))


@dataclass
class Gathered:
    arrays: dict[str, np.ndarray]  # inputs of the valid requests, concatenated along the batch
    sizes: list[int]               # rows per valid request
    valid: list[int]               # indices (into requests) of the valid requests
    responses: list                # one slot per request; error responses already filled in
    internal: frozenset = frozenset()   # indices of requests from this project's BLS calls (INTERNAL_ID)

    @property
    def rows(self) -> int:
        return int(sum(self.sizes))


def gather(requests: list, specs: tuple[TensorSpec, ...]) -> Gathered:
    """Concatenate the inputs of ``requests``; reject those :func:`~e3.serving.input_policy.check_request`
    refuses with their own client error."""
    parts = {t.name: [] for t in specs}
    sizes, valid, responses, internal = [], [], [None] * len(requests), set()
    for i, request in enumerate(requests):
        if request.request_id() == INTERNAL_ID:
            internal.add(i)
        try:
            arrays = {}
            for t in specs:
                tensor = pb_utils.get_input_tensor_by_name(request, t.name)
                arrays[t.name] = None if tensor is None else tensor.as_numpy()
            n = check_request(specs, arrays)
        except InputError as err:
            responses[i] = error_response(str(err), client_error=True)
            continue
        for name, a in arrays.items():
            parts[name].append(a)
        sizes.append(n)
        valid.append(i)
    arrays = {name: np.concatenate(p) if p else np.zeros(0) for name, p in parts.items()}
    return Gathered(arrays, sizes, valid, responses, frozenset(internal))


def error_response(message: str, client_error: bool = False, unavailable: bool = False):
    """A response carrying only an error; ``client_error``: the request was at fault (INVALID_ARG,
    HTTP 400); ``unavailable``: refused for now, worth a retry (UNAVAILABLE, HTTP 503 / gRPC UNAVAILABLE,
    what Triton answers for a full queue); else the server failed to serve it (INTERNAL, HTTP 500)."""
    code = pb_utils.TritonError.INVALID_ARG if client_error else \
        pb_utils.TritonError.UNAVAILABLE if unavailable else pb_utils.TritonError.INTERNAL
    return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(message, code))


def tensor_response(outputs: dict[str, np.ndarray]):
    return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(k, np.ascontiguousarray(v))
                                                      for k, v in outputs.items()])


def checked_response(outputs: dict[str, np.ndarray]):
    """:func:`tensor_response`, or a client error when a float output is not finite
    (:func:`e3.serving.output_policy.nonfinite_output`): what every answer and split output goes through."""
    problem = nonfinite_output(outputs)
    return error_response(problem, client_error=True) if problem else tensor_response(outputs)


def answer_responses(got: Gathered, answers) -> list:
    """Fill ``got.responses`` with the front-door answers (docs/design.md §2) of each valid request.

    answers: anything with ``label`` [N] int64, ``exit_ramp`` [N] int32 and
    ``probs`` [N, C] float32 over the concatenated batch (a BatchRoute).
    """
    for i, rows in zip(got.valid, request_slices(got.sizes)):
        respond = tensor_response if i in got.internal else checked_response
        got.responses[i] = respond({"label": answers.label[rows, None], "exit_ramp": answers.exit_ramp[rows, None],
                                    "probs": answers.probs[rows]})
    return got.responses


def split_responses(got: Gathered, outputs: dict[str, np.ndarray]) -> list:
    """Fill ``got.responses`` with each valid request's rows of ``outputs`` (arrays over the concatenated batch)."""
    for i, part in zip(got.valid, split_rows(outputs, got.sizes)):
        got.responses[i] = tensor_response(part) if i in got.internal else checked_response(part)
    return got.responses


def bls(model: str, inputs: dict[str, np.ndarray], outputs: list[str], *, timeout_us: int = 0) -> dict[str, np.ndarray]:
    """Run ``model`` on ``inputs`` through BLS and return the requested ``outputs``.

    Raises :class:`BlsTimeout` when the callee's queue rejected the request because
    ``timeout_us`` expired, :class:`BlsError` for any other failure (both carry the
    callee's message), so a caller can never read outputs of a failed response.
    """
    request = pb_utils.InferenceRequest(
        model_name=model, requested_output_names=outputs, request_id=INTERNAL_ID,
        inputs=[pb_utils.Tensor(k, np.ascontiguousarray(v)) for k, v in inputs.items()],
        **({"timeout": int(timeout_us)} if timeout_us else {}))
    response = request.exec()
    if response.has_error():
        raise bls_error(model, response.error().message())
    result = {}
    for name in outputs:
        tensor = pb_utils.get_output_tensor_by_name(response, name)
        if tensor is None:
            raise BlsError(f"{model}: response lacks output '{name}'")
        result[name] = tensor.as_numpy()
    return result


def bls_error(model: str, message: str) -> BlsError:
    """The typed error for a failed BLS call to ``model`` whose response error reads ``message``.

    Triton rejects a request whose timeout expired in a queue (the split's queue
    policy REJECT with ``allow_timeout_override``) with UNAVAILABLE and the text
    ``EXPIRED_IN_QUEUE``. The Python backend's BLS response does not keep that code
    (measured with this project's Triton: the error arrives as INTERNAL), so the code
    cannot tell an expired request from a failing split and the text decides; this
    is the one place that reads it.
    """
    text = f"{model}: {message}"
    if EXPIRED_IN_QUEUE.lower() in message.lower():
        return BlsTimeout(text)
    return BlsError(text)


class Reply:
    """A request's response sender, taken inside ``execute``, with the outputs its client asked for: what a model
    that answers after ``execute`` keeps instead of the request (:class:`ResponseSender`'s docstring).

    Only the requested outputs are sent. On an H100 (2026-11-27) the device router's stubs died inside ``send``
    at the first requests of a load that asked for one output of three, after answering every request that asked
    for all of them; ``benchmarks/threaded_answer_probe.py``'s ``unrequested-torch`` variant probes that. A
    response built in ``execute`` and returned is pruned by the backend with the interpreter lock held; one sent
    later is not ours to prune, so nothing unrequested is put in it."""

    __slots__ = ("sender", "wanted")

    def __init__(self, sender, wanted=()):
        self.sender = sender
        self.wanted = frozenset(wanted)   # empty: every output (Triton fills a request that names none)

    def send(self, response, flags=0):
        return self.sender.send(response, flags=flags)

    def requested(self, outputs: dict) -> dict:
        """``outputs`` less what the client did not ask for."""
        return {k: v for k, v in outputs.items() if k in self.wanted} if self.wanted else outputs


def sender_of(request) -> Reply:
    """The request's response sender and the outputs it asked for, taken inside ``execute`` (:class:`Reply`)."""
    return Reply(request.get_response_sender(), request.requested_output_names())


def admit_continuously(engine, outbox: "ResponseSender", requests: list, got: Gathered, *, on_refused=None) -> None:
    """The continuous form's ``execute`` (``ContinuousEngine`` of :mod:`e3.serving.device.continuous`): take every
    request's sender here, answer the malformed ones now, submit each valid one's rows (copies of ``got``'s) and
    answer a refusal (the engine's bound) at once with UNAVAILABLE. ``on_refused(rows)`` counts refused inputs.
    The caller returns ``None`` from ``execute`` and keeps no request object."""
    senders = [sender_of(r) for r in requests]
    for sender, response in zip(senders, got.responses):
        if response is not None:   # malformed: answered now, the others go on
            outbox.put(sender, response)
    for i, rows in zip(got.valid, request_slices(got.sizes)):
        refusal = engine.submit(senders[i], {k: v[rows] for k, v in got.arrays.items()})
        if refusal is not None:
            if on_refused is not None:
                on_refused(rows.stop - rows.start)
            outbox.put(senders[i], error_response(refusal.message, client_error=refusal.permanent, unavailable=True))


class ResponseSender:
    """The one thread that answers a model's requests after ``execute`` returned (continuous answering).

    The pattern Triton supports for a non-decoupled Python model (python_backend >= 24.06; the embedded
    2.51 is 24.10, and Triton's own QA test ``test_non_decoupled_one_response_post_return`` does exactly
    this): ``execute`` takes each request's response sender *inside* ``execute``
    (:func:`sender_of`), keeps the sender and a copy of the inputs, **keeps no request object**, and
    returns ``None``; one thread sends exactly one response per sender, with the FINAL flag.

    Why each part:

    * one thread: responses and error responses sent from several threads at once crashed the server
      (SIGSEGV, or ``boost::interprocess::lock_exception`` in the Python backend) under a burst of drops;
    * the sender taken in ``execute``: models that took it in their answering thread after ``execute``
      returned (keeping the request objects alive) stopped answering under load on an H200 host, died in
      ``InferenceResponseSender.send`` there, and their stubs died with "Segmentation fault
      (Garbage-collecting)" at unload on the CPU. :meth:`put` refuses a request object, so that pattern
      cannot come back by accident.

    ``put(sender, what)``: ``what`` is an outputs dict, an error message or a ready response.

    ``thread=False``: no thread of its own; the owner's thread sends what is queued when it calls :meth:`drain`,
    and ``wake`` (if set) is called after every ``put`` so that owner knows to. The device router sends this way,
    from its engine thread between two steps: on an H100 (2026-11-27) its stubs died with a segmentation fault
    inside ``send`` under load while the engine thread was running the GPU, and the threaded-answer probe's
    ``engine-torch`` / ``engine-sends-torch`` variants (``benchmarks/threaded_answer_probe.py``) test that shape
    against one where the thread that runs the device is the one that sends.
    """

    def __init__(self, who: str, *, thread: bool = True):
        self.who = who
        self.wake: Callable[[], None] | None = None
        self._outbox: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="e3-responses", daemon=True) if thread else None
        if self._thread is not None:
            self._thread.start()

    def put(self, sender, what) -> None:
        if not hasattr(sender, "send"):
            raise TypeError(f"{self.who}: answer through the response sender taken inside execute "
                            f"(serving.triton_io.sender_of(request)), not through a {type(sender).__name__}")
        self._outbox.put((sender, what))
        if self.wake is not None:
            self.wake()

    def close(self, timeout_s: float = 5.0) -> None:
        """Send what is queued, then stop the thread (without one: send what is queued, here)."""
        if self._thread is None:
            self.drain()
            return
        self._outbox.put(None)
        self._thread.join(timeout=timeout_s)

    def drain(self) -> int:
        """Send, in this thread, everything queued now; returns how many (``thread=False``'s owner calls it)."""
        sent = 0
        while True:
            try:
                item = self._outbox.get_nowait()
            except queue.Empty:
                return sent
            if item is not None:
                self._send(*item)
                sent += 1

    def _loop(self) -> None:
        while True:
            item = self._outbox.get()
            if item is None:
                return
            self._send(*item)
            # nothing keeps a sender past its answer (a blocked get() would hold the last one till the next)
            item = None

    def _send(self, sender, what) -> None:
        if isinstance(what, dict):
            response = checked_response(sender.requested(what) if isinstance(sender, Reply) else what)
        elif isinstance(what, str):
            response = error_response(what)
        else:
            response = what
        try:
            sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception as err:  # noqa: BLE001 - e.g. the client went away; the others go on
            pb_utils.Logger.log_warn(f"{self.who}: could not send a response: {err}")
