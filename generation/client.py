"""Calling a served generation router: one request per sequence, over HTTP (plain infer) or gRPC streaming.

    out = generate(url, "smollm2_ee_generate", prompt_ids, max_new_tokens=32, mode="calm", tau=0.9)
    out.tokens, out.exit_layers, out.text

Nothing in the server imports this module.
"""

from __future__ import annotations

import queue
from dataclasses import dataclass

import numpy as np

__all__ = ["Generated", "generate", "generate_stream", "GenerationError"]


class GenerationError(RuntimeError):
    """The server refused or failed a generation; the message is the server's."""


@dataclass
class Generated:
    tokens: list[int]         # new token ids
    exit_layers: list[int]    # per token, the layer whose head chose it
    text: str                 # decoded tokens ("" when the model has no tokenizer)
    ttft_ms: float = 0.0      # server: admission to first token
    total_ms: float = 0.0     # server: admission to last token


def _inputs(module, prompt, max_new_tokens: int, mode: str, tau: float | None, draft_tokens: int,
            min_agreement: float | None = None, measure: str | None = None) -> list:
    items = []
    if isinstance(prompt, str):
        items.append(("text", np.array([prompt.encode("utf-8")], dtype=object), "BYTES"))
    else:
        items.append(("input_ids", np.asarray(prompt, dtype=np.int64).reshape(-1), "INT64"))
    items += [("max_new_tokens", np.array([max_new_tokens], np.int32), "INT32"),
              ("mode", np.array([mode.encode()], dtype=object), "BYTES"),
              ("draft_tokens", np.array([draft_tokens], np.int32), "INT32")]
    if min_agreement is not None:     # the quality target replaces the raw threshold
        items.append(("min_agreement", np.array([min_agreement], np.float32), "FP32"))
    elif tau is not None:
        items.append(("tau", np.array([tau], np.float32), "FP32"))
    if measure is not None:
        items.append(("measure", np.array([measure.encode()], dtype=object), "BYTES"))
    out = []
    for name, arr, dtype in items:
        t = module.InferInput(name, list(arr.shape), dtype)
        t.set_data_from_numpy(arr)
        out.append(t)
    return out


def generate(url: str, model: str, prompt: list[int] | str, *, max_new_tokens: int = 32, mode: str = "calm",
             tau: float | None = 0.9, draft_tokens: int = 4, min_agreement: float | None = None,
             measure: str | None = None, client=None) -> Generated:
    """One non-streaming generation over HTTP (``url`` = host:port); ``client`` reuses a connection.
    ``min_agreement`` (a calibrated model's CALM quality target) is sent instead of ``tau``; ``measure`` picks
    the confidence ``tau`` applies to (softmax, saturation, classifier)."""
    from tritonclient import http
    from tritonclient.utils import InferenceServerException
    client = client or http.InferenceServerClient(url)
    try:
        r = client.infer(model, _inputs(http, prompt, max_new_tokens, mode, tau, draft_tokens, min_agreement, measure))
    except InferenceServerException as err:
        raise GenerationError(err.message()) from None
    text = r.as_numpy("text_out")
    return Generated(r.as_numpy("tokens").tolist(), r.as_numpy("exit_layers").tolist(),
                     text[0].decode("utf-8") if text is not None and len(text) else "",
                     float(r.as_numpy("ttft_ms")[0]), float(r.as_numpy("total_ms")[0]))


def generate_stream(url: str, model: str, prompt: list[int] | str, *, max_new_tokens: int = 32, mode: str = "calm",
                    tau: float = 0.9, draft_tokens: int = 4, timeout_s: float = 120.0):
    """Yield (tokens, exit_layers) chunks as the decoupled ``model`` streams them over gRPC (``url`` = host:port)."""
    from tritonclient import grpc
    got: queue.Queue = queue.Queue()
    client = grpc.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    try:
        client.async_stream_infer(model, _inputs(grpc, prompt, max_new_tokens, mode, tau, draft_tokens),
                                  enable_empty_final_response=True)
        while True:
            result, error = got.get(timeout=timeout_s)
            if error is not None:
                raise GenerationError(str(error))
            final = result.get_response().parameters.get("triton_final_response")
            tokens = result.as_numpy("tokens")
            if tokens is not None and len(tokens):
                yield tokens.tolist(), result.as_numpy("exit_layers").tolist()
            if final is not None and final.bool_param:
                return
    finally:
        client.stop_stream()
        client.close()
