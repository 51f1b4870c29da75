"""The gRPC guard: a proxy in front of Triton's gRPC endpoint with the HTTP guard's limits (:mod:`e3.deploy.guard`).

Where it stands: `e3 serve` (and the chart's guard container) put the C++ gRPC front (``deploy/grpc_front/``,
:mod:`e3.deploy.grpc_front_process`) on the public gRPC port; the front checks and forwards ``ModelInfer`` and
``ModelStreamInfer`` itself, with this module's rules (:func:`check_infer_message`: its C++ twin is compared with
it message by message in tests/test_grpc_front.py), and sends every other method here, to this guard listening on
a private Unix socket (``host="unix:/path"``). Why: this guard costs 0.74-0.96 ms of CPU per call on 2 cores
(grpc.aio's runtime, not the checks: 42 us), which held gRPC at 0.52-0.71x Triton's own port at 64 clients; the
front costs a fraction of that. Where the front is not built (no compiler), this guard is the public port alone,
as it was, and `e3 serve` says so. Everything below holds either way.

Why (probed on main at fdc2edc): gRPC went to Triton directly, and Triton 2.51 has no flag for a message size
limit: one 512 MiB message was accepted (tritonserver 75 -> 1,575 MB, 1,169 MB still held afterwards), three
of 256 MiB at once peaked at 2,456 MB. The user's key went to Triton on its command line
(``--grpc-restricted-protocol``), readable by every local user. Now Triton's gRPC endpoint is a Unix socket in
``e3 serve``'s private folder (:class:`e3.deploy.server.TritonServer`'s ``private``), and this guard is the
only way in:

* **Size**: a message over ``max_message_bytes`` (Triton's HTTP limit, 64 MiB, by default) is refused by gRPC
  itself with RESOURCE_EXHAUSTED (``grpc.max_receive_message_length``; gRPC's own ``gzip``/``deflate`` message
  compression is inflated by gRPC and held to the same limit).
* **Methods**: the 20 methods of ``inference.GRPCInferenceService`` (Triton 2.51), raw bytes in and out
  (identity serialisers: a generic handler, no generated servicer), parsed only where a check needs it;
  any other method is UNIMPLEMENTED.
* **Key**: with a user API key, model repository, model config, shared memory, trace and logging methods
  need it in the metadata, as ``<header>`` or as Triton's own spelling ``triton-grpc-protocol-<header>``
  (PERMISSION_DENIED "This protocol is restricted ..." otherwise); neither spelling is forwarded, and Triton
  never sees the key.
* **Inference** (``ModelInfer``, each message of ``ModelStreamInfer``): the model name as
  :data:`e3.deploy.request_check.MODEL_NAME`, known datatypes, shapes checked dimension by dimension against
  :data:`~e3.deploy.request_check.MAX_ELEMENTS` (the huge-shape crash of the HTTP side), exactly one source of
  data per input, raw contents of exactly the shape's size (BYTES elements walked), typed contents of the
  shape's count, finite and in the datatype's range, Triton's own parameters (``timeout``, ``priority``,
  ``sequence_*``) of the type Triton reads. A refused message gets INVALID_ARGUMENT naming the problem (on a
  stream: an error response naming it and the request's id, and the stream goes on). What is forwarded is the
  message re-serialised by the guard (unknown fields dropped).
  Messages over 256 KiB are checked on a worker thread, so small calls never wait behind them.
* **Control**: loads and unloads are told to the supervisor (``on_control``), and their names and ``file:``
  overrides checked as on HTTP.
* **Faults**: ``ServerReady``/``ModelReady`` answer not ready while the supervisor knows the server or the model
  to be down; :meth:`GrpcGuard.abort` ends calls in flight to a model whose stub died with UNAVAILABLE;
  Triton unreachable: UNAVAILABLE. Nothing the guard fails on becomes UNKNOWN or INTERNAL: such a failure is
  INVALID_ARGUMENT with a message.

Built on ``grpc.aio`` (one event loop thread of its own), calls to Triton on one channel over the Unix socket.
Optionally (``stream_lanes``), small ``ModelInfer`` calls travel to Triton as messages of a few shared
``ModelStreamInfer`` streams (:mod:`e3.deploy.grpc_mux`: about 11% less guard CPU per call, measured; off by
default because an error answered on a stream is asked again as a unary call for its status code).
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import math
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Callable

import grpc

from e3.deploy.grpc_mux import LaneLost, Mux
from e3.deploy.loop_thread import LoopThread
from e3.deploy.guard import BadRequestLog, Control
from e3.deploy.routes import KEYED
from e3.deploy.request_check import (DATATYPES, MODEL_NAME, RESERVED_PARAMETERS, RequestError, _check_bytes_elements,
                                     check_file_override, check_parameter, element_count)

__all__ = ["GrpcGuard", "SERVICE", "METHODS", "DEFAULT_MAX_MESSAGE_BYTES", "OUTPUT_PARAMETERS", "check_infer_message"]

log = logging.getLogger(__name__)
SERVICE = "inference.GRPCInferenceService"
DEFAULT_MAX_MESSAGE_BYTES = 64 * 2**20   # as the HTTP guard's body limit
_INLINE_CHECK_BYTES = 256 * 2**10
_STREAM_BYTES = 2**20   # ModelInfer messages up to this size may travel on the shared streams (grpc_mux)
# method -> Triton's API category (routes.CATEGORIES' names; the key guards KEYED ones)
METHODS = {
    "ServerLive": "health", "ServerReady": "health", "ModelReady": "health", "ServerMetadata": "metadata",
    "ModelMetadata": "metadata", "ModelInfer": "inference", "ModelStreamInfer": "inference",
    "ModelConfig": "model-config", "ModelStatistics": "statistics", "RepositoryIndex": "model-repository",
    "RepositoryModelLoad": "model-repository", "RepositoryModelUnload": "model-repository",
    "SystemSharedMemoryStatus": "shared-memory", "SystemSharedMemoryRegister": "shared-memory",
    "SystemSharedMemoryUnregister": "shared-memory", "CudaSharedMemoryStatus": "shared-memory",
    "CudaSharedMemoryRegister": "shared-memory", "CudaSharedMemoryUnregister": "shared-memory",
    "TraceSetting": "trace", "LogSettings": "logging",
}
# datatype -> the InferTensorContents field that carries it
_CONTENTS = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
             "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents",
             "UINT32": "uint_contents", "UINT64": "uint64_contents", "FP32": "fp32_contents",
             "FP64": "fp64_contents", "BYTES": "bytes_contents"}
_CONTENT_FIELDS = tuple(sorted(set(_CONTENTS.values())))
OUTPUT_PARAMETERS = {"classification": "uint"}   # output parameters Triton reads over gRPC, and as what


def _pb():
    from tritonclient.grpc import service_pb2   # the generated messages of Triton's service (protobuf, upb)
    return service_pb2


class _Refused(Exception):
    """A call the guard refuses: the gRPC ``code`` and a message."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


def _param_value(p) -> Any:
    which = p.WhichOneof("parameter_choice")
    return None if which is None else getattr(p, which)


def check_infer_message(data: bytes) -> tuple[bytes, str]:
    """(the message to forward, its model's name) for one serialised ``ModelInferRequest``, or
    :class:`~e3.deploy.request_check.RequestError` naming the problem. Work: linear in the message."""
    req = _check_infer(data)
    return req.SerializeToString(), req.model_name


def _check_infer(data: bytes):
    """The checked ``ModelInferRequest`` (unknown fields dropped), or RequestError: :func:`check_infer_message`."""
    pb = _pb()
    try:
        req = pb.ModelInferRequest.FromString(data)
    except Exception:   # noqa: BLE001 - protobuf's DecodeError, whichever implementation
        raise RequestError("the message is not a ModelInferRequest") from None
    if not MODEL_NAME.fullmatch(req.model_name):   # fullmatch: the pattern's '$' also matches before a final '\n'
        raise RequestError(f"model name {req.model_name[:60]!r} is not allowed (letters, digits, '_', '-', '.')")
    if req.model_version and not (req.model_version.isascii() and req.model_version.isdigit()
                                  and len(req.model_version) <= 18):
        raise RequestError(f"model version {req.model_version[:20]!r} is not a decimal number")
    for key, p in sorted(req.parameters.items()):   # in key order: the C++ front reports the same one first
        value = _param_value(p)
        if isinstance(value, float) and not math.isfinite(value):
            raise RequestError(f"parameter {key[:40]!r} is not a finite number")
        check_parameter(key, value, RESERVED_PARAMETERS, "the request")
    if not req.inputs:
        raise RequestError("the request needs at least one input")
    raw = req.raw_input_contents
    uses_raw = [not any(k.startswith("shared_memory") for k in t.parameters) for t in req.inputs]
    if raw and len(raw) != sum(uses_raw):
        raise RequestError(f"raw_input_contents has {len(raw)} entries for {sum(uses_raw)} inputs not in shared "
                           "memory (one per such input, in order)")
    at = 0
    for i, t in enumerate(req.inputs):
        what = f"input {t.name[:40]!r}" if t.name else f"input {i}"
        if not t.name:
            raise RequestError(f"{what} needs a name")
        if t.datatype not in DATATYPES:
            raise RequestError(f"{what}: datatype {t.datatype[:20]!r} is not one of {', '.join(DATATYPES)}")
        count = element_count(list(t.shape), what)
        for key, p in sorted(t.parameters.items()):
            value = _param_value(p)
            if key.startswith("shared_memory_") and key != "shared_memory_region" and not (
                    isinstance(value, int) and not isinstance(value, bool) and value >= 0):
                raise RequestError(f"{what}: {key} must be a non-negative integer")
        typed = [f for f in _CONTENT_FIELDS if len(getattr(t.contents, f))]
        size = DATATYPES[t.datatype][3]
        if not uses_raw[i]:
            if typed:
                raise RequestError(f"{what}: give shared memory or contents, not both")
            n = _param_value(t.parameters["shared_memory_byte_size"]) if "shared_memory_byte_size" in t.parameters \
                else None
            if n is None or (size and n != count * size):
                raise RequestError(f"{what}: shared_memory_byte_size must be the shape's {count} elements of "
                                   f"{t.datatype}")
            continue
        if raw:
            if typed:
                raise RequestError(f"{what}: give raw_input_contents or contents, not both")
            blob = raw[at]
            at += 1
            if size and len(blob) != count * size:
                raise RequestError(f"{what}: raw contents of {len(blob)} bytes, shape {list(t.shape)} of "
                                   f"{t.datatype} needs {count * size}")
            if not size:
                _check_bytes_elements(blob, 0, len(blob), count, what)
            continue
        want = _CONTENTS.get(t.datatype)
        if want is None:
            raise RequestError(f"{what}: {t.datatype} has no typed contents field; send it in raw_input_contents")
        if typed != [want] and count:
            raise RequestError(f"{what}: {t.datatype} data goes in contents.{want} (got "
                               f"{', '.join(typed) or 'none'})")
        values = getattr(t.contents, want)
        if len(values) != count:
            raise RequestError(f"{what}: shape {list(t.shape)} holds {count} elements, contents has {len(values)}")
        _check_values(values, t.datatype, what)
    for j, o in enumerate(req.outputs):
        if not o.name:
            raise RequestError(f"output {j} needs a name")
        for key, p in sorted(o.parameters.items()):
            check_parameter(key, _param_value(p), OUTPUT_PARAMETERS, f"output {o.name[:40]!r}")
    req.DiscardUnknownFields()
    return req


def _check_values(values, datatype: str, what: str) -> None:
    """Typed contents finite and within ``datatype``'s range (numpy over the whole field: C speed)."""
    kind, low, high, _ = DATATYPES[datatype]
    if kind not in ("float", "int") or not len(values):
        return
    import numpy as np   # deferred: numpy loads with the first typed field checked, not with the guard
    a = np.asarray(values, dtype=np.float64 if kind == "float" else np.int64 if datatype != "UINT64"
                   else np.uint64)
    if kind == "float":
        bad = ~np.isfinite(a) | (a < low) | (a > high)
    else:
        bad = (a < low) | (a > high) if datatype in ("INT8", "INT16", "UINT8", "UINT16") else None
    if bad is not None and bad.any():
        raise RequestError(f"{what}: {a[bad][0].item()!r} in contents is not a valid {datatype} value")


def _check_load(data: bytes) -> tuple[bytes, str]:
    pb = _pb()
    try:
        req = pb.RepositoryModelLoadRequest.FromString(data)
    except Exception:   # noqa: BLE001
        raise RequestError("the message is not a RepositoryModelLoadRequest") from None
    if not MODEL_NAME.fullmatch(req.model_name):
        raise RequestError(f"model name {req.model_name[:60]!r} is not allowed (letters, digits, '_', '-', '.'; "
                           "no path)")
    for key in req.parameters:
        check_file_override(key)
    req.DiscardUnknownFields()
    return req.SerializeToString(), req.model_name


def _check_named(message: str) -> Callable[[bytes], tuple[bytes, str]]:
    """Parse a request message with a ``name`` or ``model_name``; refuse a name outside MODEL_NAME."""
    def check(data: bytes) -> tuple[bytes, str]:
        cls = getattr(_pb(), message)
        try:
            req = cls.FromString(data)
        except Exception:   # noqa: BLE001
            raise RequestError(f"the message is not a {message}") from None
        name = getattr(req, "model_name", None) if "model_name" in cls.DESCRIPTOR.fields_by_name else req.name
        if name and not MODEL_NAME.fullmatch(name):
            raise RequestError(f"model name {name[:60]!r} is not allowed (letters, digits, '_', '-', '.')")
        req.DiscardUnknownFields()
        return req.SerializeToString(), name or ""
    return check


def _check_unary_infer(data: bytes) -> tuple[Any, str]:
    req = _check_infer(data)   # the parsed message: serialised where it is forwarded (with the guard's id on a stream)
    return req, req.model_name


_CHECKS: dict[str, Callable[[bytes], tuple[Any, str]]] = {
    "ModelInfer": _check_unary_infer, "ModelStreamInfer": check_infer_message,
    "RepositoryModelLoad": _check_load, "RepositoryModelUnload": _check_named("RepositoryModelUnloadRequest"),
    "ModelReady": _check_named("ModelReadyRequest"), "ModelMetadata": _check_named("ModelMetadataRequest"),
    "ModelConfig": _check_named("ModelConfigRequest"),
}


class GrpcGuard(LoopThread):
    """The gRPC guard on ``host:port`` in front of Triton's gRPC endpoint ``upstream`` (``unix:/path`` or
    ``host:port``); see the module docstring.

        with GrpcGuard(server.grpc_url, port=8001, api_key=("e3-api-key", key)):
            ...   # clients call 127.0.0.1:8001 as they would call Triton

    unhealthy, api_key, on_control: as :class:`e3.deploy.guard.Guard`'s. ``stream_lanes``: how many shared
    streams carry ``ModelInfer`` calls to Triton (:mod:`e3.deploy.grpc_mux`; 0, the default: one unary call
    each, Triton's own status codes without asking twice).
    """

    def __init__(self, upstream: str, host: str = "127.0.0.1", port: int = 8001, *,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, api_key: tuple[str, str] | None = None,
                 unhealthy: Callable[[], set[str]] | None = None, on_control: Control | None = None,
                 stream_lanes: int = 0):
        super().__init__()
        self.stream_lanes = stream_lanes
        self._mux: Mux | None = None
        self.upstream, self.host, self.port = upstream, host, port
        self.max_message_bytes = max_message_bytes
        self.api_key = api_key
        self.unhealthy = unhealthy or set
        self.on_control = on_control
        self.codes: Counter = Counter()   # status code name -> calls answered
        self.bad = BadRequestLog(log)
        self._key_names = () if api_key is None else (api_key[0].lower(), f"triton-grpc-protocol-{api_key[0].lower()}")
        self._server: grpc.aio.Server | None = None
        self._channel: grpc.aio.Channel | None = None
        self._calls: dict[str, Any] = {}
        self._checker = ThreadPoolExecutor(1, thread_name_prefix="e3-grpc-guard-check")

    @property
    def url(self) -> str:
        """``host:port``, or the ``unix:/path`` it was given as ``host`` (behind the C++ front)."""
        return self.host if self.host.startswith("unix:") else f"{self.host}:{self.port}"

    # -- lifecycle --------------------------------------------------------------------------------------------
    thread_name = "e3-grpc-guard"   # grpc.aio wants asyncio's own loop: LoopThread's default

    def start(self) -> "GrpcGuard":
        super().start()
        log.info("gRPC guard on %s in front of %s", self.url, self.upstream)
        return self

    async def _start(self) -> None:
        self._channel = grpc.aio.insecure_channel(self.upstream, options=[
            ("grpc.max_send_message_length", self.max_message_bytes + 2**20),
            ("grpc.max_receive_message_length", -1),   # Triton's answers: as large as they are
            # a restarted Triton is back in seconds: reconnect within a second, not gRPC's default of up to 2 min
            ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000)])
        if self.stream_lanes > 0:
            self._mux = Mux(self._channel, f"/{SERVICE}/ModelStreamInfer", self.stream_lanes)
        self._server = grpc.aio.server(options=[
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.max_send_message_length", -1),
            ("grpc.so_reuseport", 0)])
        self._server.add_generic_rpc_handlers([_Handler(self)])
        port = self._server.add_insecure_port(self.url)
        if not port:
            raise OSError(f"the gRPC guard cannot listen on {self.url}")
        self.port = port
        await self._server.start()

    async def _close(self) -> None:
        if self._server is not None:
            await self._server.stop(grace=1)
        if self._mux is not None:
            await self._mux.close()
        if self._channel is not None:
            await self._channel.close()

    def stop(self) -> None:
        super().stop()
        self._checker.shutdown(wait=False)

    def abort(self, model: str) -> int:
        """End every call in flight to ``model`` with UNAVAILABLE now (from any thread); how many there were."""
        return super().abort(model)

    @property
    def bad_counts(self) -> Counter:
        """Refused calls by reason (as :class:`e3.deploy.grpc_front_process.GrpcFront`'s)."""
        return self.bad.counts

    def metrics_text(self) -> str:
        """The gRPC guard's counters in Prometheus' text format (served on the HTTP guard's ``/metrics``)."""
        lines = ["# HELP e3_guard_grpc_responses_total Answers of the gRPC guard, by status code.",
                 "# TYPE e3_guard_grpc_responses_total counter"]
        lines += [f'e3_guard_grpc_responses_total{{code="{c}"}} {n}' for c, n in sorted(self.codes.items())]
        return "\n".join(lines + self.bad.metrics("grpc")) + "\n"

    # -- one call ---------------------------------------------------------------------------------------------
    def _call(self, method: str, streaming: bool):
        key = (method, streaming)
        if key not in self._calls:
            path = f"/{SERVICE}/{method}"
            self._calls[key] = (self._channel.stream_stream(path) if streaming else self._channel.unary_unary(path))
        return self._calls[key]

    def _metadata(self, method: str, context) -> list[tuple[str, Any]]:
        """The client's metadata to forward (not gRPC's own, not the key); refuses a keyed call without the key."""
        sent = context.invocation_metadata() or ()
        if self.api_key is not None and METHODS[method] in KEYED:
            key = self.api_key[1].encode()
            given = [str(v).encode() for k, v in sent if k in self._key_names]
            if not any(hmac.compare_digest(g, key) for g in given):
                raise _Refused(grpc.StatusCode.PERMISSION_DENIED,
                               f"This protocol is restricted, expecting header '{self.api_key[0]}'")
        return [(k, v) for k, v in sent
                if not k.startswith((":", "grpc-")) and k not in self._key_names and k != "user-agent"]

    async def _checked(self, method: str, data: bytes) -> tuple[bytes, str]:
        check = _CHECKS.get(method)
        if check is None:
            return data, ""
        try:
            if len(data) <= _INLINE_CHECK_BYTES:
                return check(data)
            return await asyncio.get_running_loop().run_in_executor(self._checker, check, data)
        except RequestError as err:
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, f"malformed {method} request: {err}") from None

    def _not_ready(self, method: str, model: str) -> bytes | None:
        """A not-ready answer while the supervisor knows the server or the model to be down, else None."""
        if method not in ("ServerReady", "ModelReady"):
            return None
        bad = self.unhealthy()
        if not bad or (method == "ModelReady" and model not in bad and "tritonserver" not in bad):
            return None
        cls = _pb().ServerReadyResponse if method == "ServerReady" else _pb().ModelReadyResponse
        return cls(ready=False).SerializeToString()

    async def _refuse(self, context, code: grpc.StatusCode, message: str) -> None:
        self.codes[code.name] += 1
        if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.PERMISSION_DENIED):
            self.bad(code.name, message)
        await context.abort(code, message)

    async def unary(self, method: str, data: bytes, context) -> bytes:
        try:
            metadata = self._metadata(method, context)
            forward, model = await self._checked(method, data)
        except _Refused as err:
            await self._refuse(context, err.code, str(err))
        except Exception as err:   # noqa: BLE001 - never UNKNOWN: say what failed
            log.debug("gRPC guard: unexpected failure", exc_info=True)
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT,
                               f"the guard could not handle this call ({err.__class__.__name__}: {str(err)[:200]})")
        not_ready = self._not_ready(method, model)
        if not_ready is not None:
            self.codes["OK"] += 1
            return not_ready
        control = method in ("RepositoryModelLoad", "RepositoryModelUnload")
        if control and self._mux is not None:
            self._mux.forget(model)   # ask it by unary calls again (a reload may change its transaction policy)
        done = self.on_control(model, "load" if method.endswith("Load") else "unload") \
            if self.on_control and control else None
        task = asyncio.current_task()   # this call's own task: abort() cancels it (no task of our own per call)
        held = self._inflight.setdefault(model, set()) if method == "ModelInfer" else None
        if held is not None:
            held.add(task)
        ok = False
        try:
            if method == "ModelInfer":
                answer = await self._infer(forward, model, len(data), metadata, context)
            else:
                answer = await self._call(method, False)(forward, metadata=metadata, timeout=context.time_remaining())
            ok = True
        except asyncio.CancelledError:
            if task not in self._aborted:
                raise
            self._aborted.discard(task)
            task.uncancel()
            await self._refuse(context, grpc.StatusCode.UNAVAILABLE,
                               f"model {model} lost its Python stub while this call was in flight; it is being "
                               "reloaded, retry shortly")
        except grpc.aio.AioRpcError as err:
            self.codes[err.code().name] += 1
            await context.abort(err.code(), err.details() or "")
        except _Refused as err:
            self.codes[err.code.name] += 1
            await context.abort(err.code, str(err))
        finally:
            if held is not None:
                held.discard(task)
            if done is not None:
                done(ok)
        self.codes["OK"] += 1
        return answer

    async def _infer(self, req, model: str, size: int, metadata, context) -> bytes:
        """Triton's answer to a checked ``ModelInferRequest``: on a shared stream where it may go
        (:mod:`e3.deploy.grpc_mux`), else, or where the stream answered an error or broke, as a unary call."""
        mux = self._mux
        if (mux is not None and not metadata and size <= _STREAM_BYTES and mux.trusted(model)
                and not any(k.startswith("sequence") for k in req.parameters)):
            try:
                response = await mux.call(req, context.time_remaining())
            except LaneLost:
                response = None
            except asyncio.TimeoutError:
                raise _Refused(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
            if response is not None:
                return response.SerializeToString()
        answer = await self._call("ModelInfer", False)(req.SerializeToString(), metadata=metadata,
                                                       timeout=context.time_remaining())
        if mux is not None:
            mux.trust(model)
        return answer

    async def stream(self, method: str, requests: AsyncIterator[bytes], context) -> AsyncIterator[bytes]:
        """``ModelStreamInfer``: every message checked; a refused one is answered on the stream with an error
        response naming the problem and its request's id (as Triton answers the messages it refuses itself), and
        the stream goes on."""
        try:
            metadata = self._metadata(method, context)
        except _Refused as err:
            await self._refuse(context, err.code, str(err))
        out: asyncio.Queue = asyncio.Queue()   # Triton's answers and the guard's own, as they come
        ended = object()

        async def checked() -> AsyncIterator[bytes]:
            async for data in requests:
                try:
                    forward, _ = await self._checked(method, data)
                except _Refused as err:
                    out.put_nowait(self._stream_error(data, str(err)))
                    continue
                except Exception as err:   # noqa: BLE001
                    out.put_nowait(self._stream_error(data, f"the guard could not handle this message "
                                                            f"({err.__class__.__name__}: {str(err)[:200]})"))
                    continue
                yield forward

        call = self._call(method, True)(checked(), metadata=metadata)

        async def pump() -> None:
            try:
                async for answer in call:
                    out.put_nowait(answer)
                out.put_nowait(ended)
            except grpc.aio.AioRpcError as err:
                out.put_nowait(err)
            except BaseException:
                out.put_nowait(ended)
                raise

        task = asyncio.ensure_future(pump())
        try:
            while True:
                item = await out.get()
                if item is ended:
                    break
                if isinstance(item, grpc.aio.AioRpcError):
                    self.codes[item.code().name] += 1
                    await context.abort(item.code(), item.details() or "")
                yield item
        finally:
            if not task.done():
                task.cancel()
                call.cancel()
        self.codes["OK"] += 1

    def _stream_error(self, data: bytes, message: str) -> bytes:
        """The stream's answer to a refused message: ``error_message`` and, where the message parses, its id."""
        self.bad(grpc.StatusCode.INVALID_ARGUMENT.name, message)
        pb = _pb()
        try:
            request_id = pb.ModelInferRequest.FromString(data).id
        except Exception:   # noqa: BLE001 - not a message at all: no id to name
            request_id = ""
        return pb.ModelStreamInferResponse(error_message=message,
                                           infer_response=pb.ModelInferResponse(id=request_id)).SerializeToString()


class _Handler(grpc.GenericRpcHandler):
    """Every method of Triton's service, as raw bytes (no (de)serialisers)."""

    def __init__(self, guard: GrpcGuard):
        self.guard = guard
        self._handlers: dict[str, grpc.RpcMethodHandler] = {}
        for method in METHODS:
            if method == "ModelStreamInfer":
                self._handlers[f"/{SERVICE}/{method}"] = grpc.stream_stream_rpc_method_handler(
                    functools.partial(guard.stream, method))   # a partial: grpc.aio sees the coroutine function
            else:
                self._handlers[f"/{SERVICE}/{method}"] = grpc.unary_unary_rpc_method_handler(
                    functools.partial(guard.unary, method))

    def service(self, handler_call_details):
        return self._handlers.get(handler_call_details.method)
