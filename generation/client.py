"""Calling a served generation router: one request per sequence, over HTTP (plain infer) or gRPC streaming.

    out = generate(url, "smollm2_ee_generate", prompt_ids, max_new_tokens=32)
    out.tokens, out.exit_layers, out.text, out.parameters["e3_mode"]

Both calls send only the knobs given: left out, the server's defaults apply (for a calibrated model, CALM at
its calibrated quality target min_agreement 0.9, which decodes plainly where exits would not pay). The
router says how each request was served (its ``served_as`` output, ``Generated.parameters`` here:
``e3_mode``, ``e3_fallback``, ``e3_reason``, ``e3_predicted_speedup``, ``e3_costs``; see
:mod:`e3.generation.generate_router`). Nothing in the server imports this
module.
"""

from __future__ import annotations

import json
import queue
from dataclasses import dataclass, field

import numpy as np

__all__ = ["Generated", "GenerationStream", "generate", "generate_stream", "GenerationError"]


class GenerationError(RuntimeError):
    """The server refused or failed a generation; the message is the server's."""


@dataclass
class Generated:
    tokens: list[int]         # new token ids
    exit_layers: list[int]    # per token, the layer whose head chose it
    text: str                 # decoded tokens ("" when the model has no tokenizer)
    ttft_ms: float = 0.0      # server: admission to first token
    total_ms: float = 0.0     # server: admission to last token
    parameters: dict = field(default_factory=dict)   # how it was served (the router's ``served_as``)

    @property
    def costs(self) -> dict | None:
        """The server's cost table as served when it answered (``e3_costs``), else None."""
        return self.parameters.get("e3_costs")


# name -> (Triton datatype, numpy dtype); every knob the generation routers take, each sent only when given
_KNOBS = {"max_new_tokens": ("INT32", np.int32), "mode": ("BYTES", object), "tau": ("FP32", np.float32),
          "measure": ("BYTES", object), "min_agreement": ("FP32", np.float32),
          "draft_tokens": ("INT32", np.int32), "on_slower": ("BYTES", object)}


def _inputs(module, prompt, knobs: dict) -> list:
    items = []
    if isinstance(prompt, str):
        items.append(("text", np.array([prompt.encode("utf-8")], dtype=object), "BYTES"))
    else:
        items.append(("input_ids", np.asarray(prompt, dtype=np.int64).reshape(-1), "INT64"))
    for name, value in knobs.items():
        if value is None:
            continue
        dtype, np_type = _KNOBS[name]
        items.append((name, np.array([value.encode() if dtype == "BYTES" else value], dtype=np_type), dtype))
    out = []
    for name, arr, dtype in items:
        t = module.InferInput(name, list(arr.shape), dtype)
        t.set_data_from_numpy(arr)
        out.append(t)
    return out


def _served_as(result) -> dict:
    """The router's ``served_as`` output (JSON: how the request was served), {} when absent."""
    try:
        raw = result.as_numpy("served_as")
    except Exception:   # a router that does not give it
        return {}
    return json.loads(raw[0]) if raw is not None and len(raw) else {}


def generate(url: str, model: str, prompt: list[int] | str, max_new_tokens: int | None = None, *,
             mode: str | None = None, min_agreement: float | None = None, tau: float | None = None,
             measure: str | None = None, draft_tokens: int | None = None, on_slower: str | None = None,
             client=None) -> Generated:
    """One non-streaming generation over HTTP (``url`` = host:port); ``client`` reuses a connection.

    Every knob left out takes the server's default. ``mode``: calm, full or speculative; ``min_agreement``:
    CALM's quality target (calibrated models) or ``tau``: a raw threshold on ``measure`` (softmax,
    saturation, classifier); ``draft_tokens``: the most a speculative round drafts; ``on_slower``: fallback
    (default), refuse or serve, for CALM exits predicted slower than plain decoding."""
    # deferred: each protocol loads its own client (http: gevent, 400 ms; grpc: 350 ms)
    from tritonclient import http
    from tritonclient.utils import InferenceServerException
    client = client or http.InferenceServerClient(url)
    knobs = dict(max_new_tokens=max_new_tokens, mode=mode, min_agreement=min_agreement, tau=tau, measure=measure,
                 draft_tokens=draft_tokens, on_slower=on_slower)
    try:
        r = client.infer(model, _inputs(http, prompt, knobs))
    except InferenceServerException as err:
        raise GenerationError(err.message()) from None
    text = r.as_numpy("text_out")
    return Generated(r.as_numpy("tokens").tolist(), r.as_numpy("exit_layers").tolist(),
                     text[0].decode("utf-8") if text is not None and len(text) else "",
                     float(r.as_numpy("ttft_ms")[0]), float(r.as_numpy("total_ms")[0]),
                     parameters=_served_as(r))


class GenerationStream:
    """Iterates (tokens, exit_layers) chunks, one per decode step; once exhausted, :attr:`parameters` holds the
    final response's parameters (how it was served)."""

    def __init__(self, chunks):
        self._chunks = chunks
        self.parameters: dict = {}

    def __iter__(self):
        yield from self._chunks(self)


def generate_stream(url: str, model: str, prompt: list[int] | str, max_new_tokens: int | None = None, *,
                    mode: str | None = None, min_agreement: float | None = None, tau: float | None = None,
                    measure: str | None = None, draft_tokens: int | None = None, on_slower: str | None = None,
                    timeout_s: float = 120.0) -> GenerationStream:
    """The same knobs as :func:`generate`, streamed by the decoupled ``model`` over gRPC (``url`` = host:port):
    iterate the returned :class:`GenerationStream` for (tokens, exit_layers) chunks as they are made."""
    knobs = dict(max_new_tokens=max_new_tokens, mode=mode, min_agreement=min_agreement, tau=tau, measure=measure,
                 draft_tokens=draft_tokens, on_slower=on_slower)

    def chunks(stream: GenerationStream):
        from tritonclient import grpc   # deferred: each protocol loads its own client (see generate)
        got: queue.Queue = queue.Queue()
        client = grpc.InferenceServerClient(url)
        client.start_stream(callback=lambda result, error: got.put((result, error)))
        try:
            client.async_stream_infer(model, _inputs(grpc, prompt, knobs), enable_empty_final_response=True)
            while True:
                result, error = got.get(timeout=timeout_s)
                if error is not None:
                    raise GenerationError(error.message() if hasattr(error, "message") else str(error))
                final = result.get_response().parameters.get("triton_final_response")
                tokens = result.as_numpy("tokens")
                if tokens is not None and len(tokens):
                    yield tokens.tolist(), result.as_numpy("exit_layers").tolist()
                stream.parameters = _served_as(result) or stream.parameters
                if final is not None and final.bool_param:
                    return
        finally:
            client.stop_stream()
            client.close()
    return GenerationStream(chunks)
