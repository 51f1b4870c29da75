"""A small client over tritonclient (HTTP or gRPC) that returns E3's answers.

Every E3 front door (``<m>_router``, ``<m>_ee``) answers ``label``,
``exit_ramp`` and ``probs`` per input (DESIGN §2). The stock baseline
(``<m>_stock``) is a plain ONNX model returning ``logits``; the client turns
them into the same :class:`Answers` with ``exit_ramp = -1`` (no ramps).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from e3.core.closing import ClosingClient
from e3.core.exits import softmax

__all__ = ["Answers", "E3Client", "ClientError"]


class ClientError(RuntimeError):
    """The server refused or failed a request; the message is the server's."""


@dataclass
class Answers:
    label: np.ndarray      # [N] int64
    exit_ramp: np.ndarray  # [N] int32, block whose ramp answered; -1 for a model without ramps
    probs: np.ndarray      # [N, C] float32


class E3Client(ClosingClient):
    """One connection to a Triton server; not thread-safe (use one per thread)."""

    def __init__(self, url: str, protocol: str = "http", timeout_s: float = 60.0):
        if protocol == "http":
            import tritonclient.http as api
            self._client = api.InferenceServerClient(url, connection_timeout=timeout_s, network_timeout=timeout_s)
        elif protocol == "grpc":
            import tritonclient.grpc as api
            self._client = api.InferenceServerClient(url)
        else:
            raise ValueError(f"unknown protocol {protocol!r}; use 'http' or 'grpc'")
        self._api, self.protocol, self.timeout_s = api, protocol, timeout_s
        self._outputs: dict[str, list[str]] = {}

    def model_config(self, model: str) -> dict:
        from tritonclient.utils import InferenceServerException
        try:
            if self.protocol == "http":
                return self._client.get_model_config(model)
            return json.loads(_to_json(self._client.get_model_config(model).config))
        except InferenceServerException as err:
            raise ClientError(err.message()) from None

    def infer(self, model: str, inputs: dict[str, np.ndarray]) -> Answers:
        """Send one request carrying ``inputs`` (name -> batch-first array)."""
        from tritonclient.utils import InferenceServerException, np_to_triton_dtype
        if model not in self._outputs:
            self._outputs[model] = [o["name"] for o in self.model_config(model).get("output", [])]
        empty = [name for name, array in inputs.items() if array.ndim == 0 or array.shape[0] == 0]
        if empty:
            raise ClientError(f"empty batch: input(s) {', '.join(empty)} carry no rows; send at least one input")
        tensors = []
        for name, array in inputs.items():
            t = self._api.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
            t.set_data_from_numpy(array)
            tensors.append(t)
        try:
            kwargs = {"timeout": int(self.timeout_s * 1e6)} if self.protocol == "http" else {
                "client_timeout": self.timeout_s}
            result = self._client.infer(model, tensors, **kwargs)
        except InferenceServerException as err:
            raise ClientError(err.message()) from None
        names = self._outputs[model]
        if "logits" in names and "label" not in names:
            probs = softmax(result.as_numpy("logits"))
            return Answers(probs.argmax(axis=1), np.full(len(probs), -1, np.int32), probs)
        return Answers(result.as_numpy("label").reshape(-1), result.as_numpy("exit_ramp").reshape(-1),
                       result.as_numpy("probs"))


def _to_json(message) -> str:
    from google.protobuf import json_format
    return json_format.MessageToJson(message, preserving_proto_field_name=True)
