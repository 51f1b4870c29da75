"""Is an HTTP inference request well formed? The checks the guard (:mod:`e3.deploy.guard`) makes before
Triton's own HTTP parser sees a body (pure: bytes in, an error message or None out).

Why (measured on the embedded Triton 2.51): one JSON body whose declared
shape is large (``"shape": [1000000000000, 16]``) kills the whole server:
its parser sizes a buffer from the shape before it looks at the data and
dies of ``std::bad_alloc`` (SIGABRT), taking every model with it. Other
malformed bodies (a negative dimension, a float in an INT64 input, a negative
``binary_data_size``, invalid JSON) are refused by Triton, but as HTTP 500,
a server error, though the client is at fault. gRPC requests were not found
to crash it (they are refused with INVALID_ARGUMENT).

The rule: a body passes when Triton can parse it without trusting a number
the body has not backed with bytes. That is:

* the JSON header (the whole body, or its first ``Inference-Header-Content-Length``
  bytes for the binary tensor protocol) is strict JSON (no NaN/Infinity
  literals), an object, with a non-empty ``inputs`` list;
* every input has a string ``name``, a known ``datatype``, a ``shape`` of
  non-negative integers, and exactly one source of data: ``data`` (nested
  lists whose element count equals the shape's product and whose elements
  have the datatype's JSON type and range), ``binary_data_size`` (a
  non-negative integer), or a shared-memory region;
* the binary sizes add up to the bytes that follow the header;
* ``id``, ``parameters`` and ``outputs`` have the protocol's types.

Everything else (names and shapes against the model config, byte sizes
against the shape) Triton checks itself and answers with 400.
"""

from __future__ import annotations

import json
import math
import posixpath
import re
import urllib.parse
from typing import Any

__all__ = ["check_infer_request", "check_repository_request", "DATATYPES", "MAX_ELEMENTS"]

# datatype -> (JSON kind, low, high); kind "int" (not bool), "float" (int or float, not bool), "bool", "str"
DATATYPES: dict[str, tuple[str, float, float]] = {
    "BOOL": ("bool", 0, 1),
    "UINT8": ("int", 0, 2**8 - 1), "UINT16": ("int", 0, 2**16 - 1),
    "UINT32": ("int", 0, 2**32 - 1), "UINT64": ("int", 0, 2**64 - 1),
    "INT8": ("int", -2**7, 2**7 - 1), "INT16": ("int", -2**15, 2**15 - 1),
    "INT32": ("int", -2**31, 2**31 - 1), "INT64": ("int", -2**63, 2**63 - 1),
    "FP16": ("float", -65504.0, 65504.0), "FP32": ("float", -3.4028234663852886e38, 3.4028234663852886e38),
    "FP64": ("float", -math.inf, math.inf), "BF16": ("float", -3.38953139e38, 3.38953139e38),
    "BYTES": ("str", 0, 0),
}
# Elements one input may declare (2^31): far above any batch this project serves, far below what
# makes Triton's buffer arithmetic overflow.
MAX_ELEMENTS = 2**31
_SHM_KEYS = ("shared_memory_region", "shared_memory_byte_size", "shared_memory_offset")


class _Bad(ValueError):
    pass


def check_infer_request(body: bytes, header_length: str | None = None) -> str | None:
    """None if Triton may parse ``body`` (a POST to ``/v2/models/<m>/infer``), else why not (for a 400).

    header_length: the ``Inference-Header-Content-Length`` header as sent (None: pure JSON body).
    """
    try:
        _check(body, header_length)
    except _Bad as err:
        return str(err)
    return None


def _reject_constant(name: str):
    raise _Bad(f"the request JSON holds {name}, which JSON does not allow")


def _check(body: bytes, header_length: str | None) -> None:
    if header_length is None:
        header, rest = body, 0
    else:
        try:
            n = int(header_length.strip())
        except ValueError:
            raise _Bad(f"Inference-Header-Content-Length must be an integer, got {header_length[:40]!r}") from None
        if not 0 < n <= len(body):
            raise _Bad(f"Inference-Header-Content-Length {n} is outside the body's {len(body)} bytes")
        header, rest = body[:n], len(body) - n
    try:
        request = json.loads(header, parse_constant=_reject_constant)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise _Bad(f"the request header is not valid JSON: {str(err)[:120]}") from None
    if not isinstance(request, dict):
        raise _Bad("the request JSON must be an object with an 'inputs' list")
    if "id" in request and not isinstance(request["id"], str):
        raise _Bad("'id' must be a string")
    _parameters(request.get("parameters"), "the request")
    inputs = request.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise _Bad("the request needs a non-empty 'inputs' list")
    binary = sum(_input(t, i) for i, t in enumerate(inputs))
    if binary != rest:
        raise _Bad(f"the inputs' binary_data_size add up to {binary} bytes, the body carries {rest} after the header")
    outputs = request.get("outputs", [])
    if not isinstance(outputs, list):
        raise _Bad("'outputs' must be a list")
    for j, out in enumerate(outputs):
        if not isinstance(out, dict) or not isinstance(out.get("name"), str):
            raise _Bad(f"output {j} must be an object with a string 'name'")
        params = _parameters(out.get("parameters"), f"output {out['name'][:40]!r}")
        if "binary_data" in params and not isinstance(params["binary_data"], bool):
            raise _Bad(f"output {out['name'][:40]!r}: binary_data must be true or false")
        if "classification" in params and not _uint(params["classification"], 2**31):
            raise _Bad(f"output {out['name'][:40]!r}: classification must be a non-negative integer")
        _shm(params, f"output {out['name'][:40]!r}")


def _input(t: Any, i: int) -> int:
    """Check input ``i``; return its binary byte count (0 when its data is JSON or in shared memory)."""
    if not isinstance(t, dict) or not isinstance(t.get("name"), str) or not t["name"]:
        raise _Bad(f"input {i} must be an object with a non-empty string 'name'")
    what = f"input {t['name'][:40]!r}"
    dtype = t.get("datatype")
    if dtype not in DATATYPES:
        raise _Bad(f"{what}: datatype {str(dtype)[:20]!r} is not one of {', '.join(DATATYPES)}")
    shape = t.get("shape")
    if not isinstance(shape, list) or not all(_uint(d, 2**63) for d in shape):
        raise _Bad(f"{what}: shape must be a list of non-negative integers")
    count = math.prod(shape)
    if count > MAX_ELEMENTS:
        raise _Bad(f"{what}: shape {shape} declares {count} elements, more than the {MAX_ELEMENTS} allowed")
    params = _parameters(t.get("parameters"), what)
    sources = [k for k, present in (("data", "data" in t), ("binary_data_size", "binary_data_size" in params),
                                    ("shared memory", "shared_memory_region" in params)) if present]
    if len(sources) != 1:
        raise _Bad(f"{what}: give exactly one of 'data', parameters.binary_data_size or a shared-memory "
                   f"region (got {', '.join(sources) or 'none'})")
    if sources[0] == "binary_data_size":
        size = params["binary_data_size"]
        if not _uint(size, 2**63):
            raise _Bad(f"{what}: binary_data_size must be a non-negative integer")
        return size
    if sources[0] == "shared memory":
        _shm(params, what)
        return 0
    kind, low, high = DATATYPES[dtype]
    flat = _flatten(t["data"], what)
    if len(flat) != count:
        raise _Bad(f"{what}: shape {shape} holds {count} elements, 'data' has {len(flat)}")
    for x in flat:
        if not _fits(x, kind, low, high):
            raise _Bad(f"{what}: {str(x)[:30]!r} in 'data' is not a valid {dtype} value")
    return 0


def _flatten(data: Any, what: str, depth: int = 0) -> list:
    """The elements of ``data`` (nested lists, as the protocol allows) in order."""
    if not isinstance(data, list):
        raise _Bad(f"{what}: 'data' must be a list")
    if depth > 32:
        raise _Bad(f"{what}: 'data' is nested deeper than 32 levels")
    out = []
    for x in data:
        out.extend(_flatten(x, what, depth + 1) if isinstance(x, list) else [x])
    return out


def _fits(x: Any, kind: str, low: float, high: float) -> bool:
    if kind == "bool":
        return isinstance(x, bool)
    if kind == "str":
        return isinstance(x, str)
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return False
    if kind == "int":
        return isinstance(x, int) and low <= x <= high
    return math.isfinite(x) and low <= x <= high


def _uint(x: Any, limit: int) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < limit


def _parameters(params: Any, what: str) -> dict:
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise _Bad(f"{what}: 'parameters' must be an object")
    for k, v in params.items():
        if isinstance(v, bool) or isinstance(v, str):
            continue
        if isinstance(v, int) and -2**63 <= v < 2**64:
            continue
        if isinstance(v, float) and math.isfinite(v):
            continue
        raise _Bad(f"{what}: parameter {k[:40]!r} must be a string, a boolean or a number")
    return params


def _shm(params: dict, what: str) -> None:
    if "shared_memory_region" in params and not isinstance(params["shared_memory_region"], str):
        raise _Bad(f"{what}: shared_memory_region must be a string")
    for key in _SHM_KEYS[1:]:
        if key in params and not _uint(params[key], 2**63):
            raise _Bad(f"{what}: {key} must be a non-negative integer")


# A model name as the exporter writes them: letters, digits, '_', '-', '.', not starting with '.'.
_MODEL_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,199}$")


def check_repository_request(path: str, body: bytes) -> str | None:
    """None if a model-repository call (``/v2/repository/models/<name>/load|unload``) may reach Triton,
    else why not (for a 400).

    Measured on Triton 2.51: a load of a traversal-style name (``..%2F..%2Fetc``) is refused with 500,
    but leaves an UNAVAILABLE entry that turns the server's readiness false. Refused here: names other
    than :data:`_MODEL_NAME` (after URL-decoding: no '/', '\\', '..' or leading '.'), and ``file:``
    overrides whose path is absolute or climbs out of the model folder.
    """
    parts = path.split("?", 1)[0].split("/")
    if len(parts) < 6 or parts[1:4] != ["v2", "repository", "models"]:
        return None
    name = urllib.parse.unquote(parts[4])
    if not _MODEL_NAME.match(name) or ".." in name:
        return f"model name {name[:60]!r} is not allowed (letters, digits, '_', '-', '.'; no path)"
    if not body:
        return None
    try:
        request = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return "the request body is not valid JSON"
    params = request.get("parameters", {}) if isinstance(request, dict) else {}
    if not isinstance(params, dict):
        return "'parameters' must be an object"
    for key in params:
        if key.startswith("file:"):
            rel = key[len("file:"):]
            norm = posixpath.normpath(rel)
            if not rel or rel.startswith(("/", "\\")) or norm.startswith("..") or "\\" in rel:
                return f"file override {rel[:80]!r} must stay inside the model folder"
    return None
