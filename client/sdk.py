"""A small client over tritonclient (HTTP or gRPC) that returns E3's answers.

Every E3 front door (``<m>_router``, ``<m>_ee``) answers ``label``,
``exit_ramp`` and ``probs`` per input (docs/design.md §2). The stock baseline
(``<m>_stock``) is a plain ONNX model returning ``logits``; the client turns
them into the same :class:`Answers` with ``exit_ramp = -1`` (no ramps).
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass
from multiprocessing import shared_memory

import numpy as np

from e3.core.closing import ClosingClient
from e3.core.exits import softmax
from e3.core.spec import cast_exact, dtype_from_config

__all__ = ["Answers", "E3Client", "ClientError", "typed_inputs"]


class ClientError(RuntimeError):
    """The server refused or failed a request; the message is the server's."""


@dataclass
class Answers:
    label: np.ndarray      # [N] int64
    exit_ramp: np.ndarray  # [N] int32, block whose ramp answered; -1 for a model without ramps
    probs: np.ndarray      # [N, C] float32


class E3Client(ClosingClient):
    """One connection to a Triton server; not thread-safe (use one per thread).

    ``shm=True`` (a client on the server's machine): inputs travel through Triton's system shared
    memory instead of the request body. The client owns one region, registered once and grown
    (re-registered) when a request needs more; each request writes its inputs there and names their
    offsets. Closing the client unregisters and removes it.
    """

    def __init__(self, url: str, protocol: str = "http", timeout_s: float = 60.0, shm: bool = False):
        if protocol == "http":
            import tritonclient.http as api   # deferred: each protocol loads its own client (http: gevent, 400 ms)
            self._client = api.InferenceServerClient(url, connection_timeout=timeout_s, network_timeout=timeout_s)
        elif protocol == "grpc":
            import tritonclient.grpc as api   # deferred: each protocol loads its own client (grpc: 350 ms)
            self._client = api.InferenceServerClient(url)
        else:
            raise ValueError(f"unknown protocol {protocol!r}; use 'http' or 'grpc'")
        self._api, self.protocol, self.timeout_s = api, protocol, timeout_s
        self._outputs: dict[str, list[str]] = {}
        self._datatypes: dict[str, dict[str, str]] = {}   # model -> input name -> Triton datatype (its config)
        self.shm = shm
        self._region = None   # (name, handle, size) of this client's shared-memory region

    def close(self) -> None:
        """Unregisters and removes the shared-memory region (if any), then closes the connection."""
        if self._region is not None:
            self._drop_region()
        super().close()

    def _staged(self, inputs: dict[str, np.ndarray]) -> list[tuple[str, int, int]]:
        """Write ``inputs`` into the region (grown if needed): (region name, offset, size) per input.

        The region is a POSIX shared-memory object made with the standard library (the client wheel's
        own helper needs ``pkg_resources``, which current setuptools no longer ships)."""
        text = [k for k, a in inputs.items() if a.dtype == np.object_ or a.dtype.kind in "SU"]
        if text:
            raise ClientError(f"input(s) {', '.join(text)} are text: send text in the request body (shm=False); "
                              "shared memory carries numeric tensors")
        arrays = [np.ascontiguousarray(a) for a in inputs.values()]
        need = sum(a.nbytes for a in arrays)
        if self._region is None or self._region[2] < need:
            if self._region is not None:
                self._drop_region()
            size = max(need, 1 << 16)
            name = f"e3_{os.getpid()}_{uuid.uuid4().hex[:8]}"
            block = shared_memory.SharedMemory(name=name, create=True, size=size)
            try:
                self._client.register_system_shared_memory(name, f"/{name}", size)
            except Exception:
                block.close()
                block.unlink()
                raise
            self._region = (name, block, size)
        name, block, _ = self._region
        places, offset = [], 0
        for a in arrays:
            block.buf[offset:offset + a.nbytes] = a.reshape(-1).view(np.uint8)
            places.append((name, offset, a.nbytes))
            offset += a.nbytes
        return places

    def _drop_region(self) -> None:
        name, block, _ = self._region
        self._region = None
        try:
            self._client.unregister_system_shared_memory(name)
        finally:
            block.close()
            block.unlink()

    def model_config(self, model: str) -> dict:
        from tritonclient.utils import InferenceServerException   # deferred: tritonclient loads with the client
        try:
            if self.protocol == "http":
                return self._client.get_model_config(model)
            return json.loads(_to_json(self._client.get_model_config(model).config))
        except InferenceServerException as err:
            raise ClientError(err.message()) from None

    def infer(self, model: str, inputs: dict[str, np.ndarray]) -> Answers:
        """Send one request carrying ``inputs`` (name -> batch-first array)."""
        from tritonclient.utils import InferenceServerException, np_to_triton_dtype   # deferred: as in model_config
        if model not in self._outputs:
            config = self.model_config(model)
            self._outputs[model] = [o["name"] for o in config.get("output", [])]
            self._datatypes[model] = {i["name"]: i["data_type"] for i in config.get("input", [])}
        inputs = typed_inputs(inputs, self._datatypes[model])
        empty = [name for name, array in inputs.items() if array.ndim == 0 or array.shape[0] == 0]
        if empty:
            raise ClientError(f"empty batch: input(s) {', '.join(empty)} carry no rows; send at least one input")
        tensors = []
        try:
            staged = self._staged(inputs) if self.shm else [None] * len(inputs)
        except InferenceServerException as err:
            raise ClientError(f"cannot register system shared memory: {err.message()}") from None
        for (name, array), place in zip(inputs.items(), staged):
            t = self._api.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
            if place is None:
                t.set_data_from_numpy(array)
            else:
                t.set_shared_memory(place[0], place[2], offset=place[1])
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


def typed_inputs(inputs: dict[str, np.ndarray], datatypes: dict[str, str]) -> dict[str, np.ndarray]:
    """``inputs`` (name -> array) in the datatypes of the model's config (``datatypes``: name -> ``TYPE_FP32``
    ...), each converted only where no value changes (numpy's default float64 holding float32 values, say):
    :func:`e3.core.spec.cast_exact`; :class:`ClientError` naming the input and the values otherwise. An input
    the config does not name is sent as it is (the server names it)."""
    out = {}
    for name, array in inputs.items():
        try:
            out[name] = cast_exact(name, array, dtype_from_config(datatypes[name])) if name in datatypes else array
        except ValueError as err:
            raise ClientError(str(err)) from None
    return out


def _to_json(message) -> str:
    from google.protobuf import json_format   # deferred: protobuf only for the gRPC protocol
    return json_format.MessageToJson(message, preserving_proto_field_name=True)
