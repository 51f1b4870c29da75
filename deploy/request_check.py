"""Is an HTTP request well formed, and what exactly reaches Triton? The guard's (:mod:`e3.deploy.guard`)
one parse and canonical re-serialisation of inference and model-repository bodies (pure: bytes in,
canonical bytes or a :class:`RequestError` naming the problem out).

Why (measured on the embedded Triton 2.51): one JSON body whose declared
shape is large (``"shape": [1000000000000, 16]``) kills the whole server:
its parser sizes a buffer from the shape before it looks at the data and
dies of ``std::bad_alloc`` (SIGABRT), taking every model with it. A guard
that checks a body and forwards the original bytes is talked past by any
difference between its parser and Triton's (a duplicate key: Python keeps
the last, Triton uses the first; see :mod:`e3.deploy.strict_json`). So the
guard parses once, strictly, checks, and forwards **only bytes it produced**:

* the JSON header (the whole body, or its first ``Inference-Header-Content-Length``
  bytes for the binary tensor extension) is strict JSON
  (:func:`e3.deploy.strict_json.loads_strict`), an object with the protocol's
  keys only (an unknown key is refused, naming it), a non-empty ``inputs`` list;
* every input has a non-empty string ``name``, a known ``datatype`` string, a
  ``shape`` list of at most :data:`MAX_DIMS` integers checked one dimension at
  a time and refused at the first one that is not a non-negative integer or
  takes the element count past :data:`MAX_ELEMENTS` (so checking costs at most
  the body's length, never the numbers' size), and exactly one source of data:
  ``data`` (nested lists whose element count equals the shape's product, read
  only up to that count, with the datatype's JSON type and range),
  ``binary_data_size`` (equal to the element count times the element size; for
  BYTES, the length-prefixed elements are walked and must be as many as the
  shape says), or a shared-memory region (its byte size likewise);
* the binary sizes add up to the bytes that follow the header;
* ``id``, ``parameters`` and ``outputs`` have the protocol's types; Triton's own request parameters
  (:data:`RESERVED_PARAMETERS`: ``timeout``, ``priority``, ``sequence_*``, ``binary_data_output``) and
  output parameters (``binary_data``, ``classification``) have the type Triton reads them as (measured on
  Triton 2.51: a ``timeout`` of ``"abc"``, ``-1`` or ``1.5`` got 500 "Unable to parse 'timeout'").

What is forwarded: the header re-serialised by
:func:`e3.deploy.strict_json.dumps_canonical` (ASCII, compact, ``data``
flattened to one list, keys in the protocol's order), then the binary tensors
exactly as checked, with ``Inference-Header-Content-Length`` set to the new
header's length. Names and shapes against the model config, and values
against the model's input policy, Triton and the model check themselves.
"""

from __future__ import annotations

import math
import posixpath
import re
from dataclasses import dataclass
from typing import Any

from e3.deploy.strict_json import StrictJSONError, dumps_canonical, loads_strict

__all__ = ["RequestError", "Canonical", "canonical_infer_request", "check_infer_request",
           "canonical_repository_request", "check_repository_request", "check_parameter", "check_file_override",
           "element_count", "DATATYPES", "MAX_ELEMENTS", "MAX_DIMS", "MODEL_NAME", "RESERVED_PARAMETERS"]

# datatype -> (JSON kind, low, high, bytes per element; 0: variable, BYTES);
# kind "int" (not bool), "float" (int or float, not bool), "bool", "str"
DATATYPES: dict[str, tuple[str, float, float, int]] = {
    "BOOL": ("bool", 0, 1, 1),
    "UINT8": ("int", 0, 2**8 - 1, 1), "UINT16": ("int", 0, 2**16 - 1, 2),
    "UINT32": ("int", 0, 2**32 - 1, 4), "UINT64": ("int", 0, 2**64 - 1, 8),
    "INT8": ("int", -2**7, 2**7 - 1, 1), "INT16": ("int", -2**15, 2**15 - 1, 2),
    "INT32": ("int", -2**31, 2**31 - 1, 4), "INT64": ("int", -2**63, 2**63 - 1, 8),
    "FP16": ("float", -65504.0, 65504.0, 2), "FP32": ("float", -3.4028234663852886e38, 3.4028234663852886e38, 4),
    "FP64": ("float", -math.inf, math.inf, 8), "BF16": ("float", -3.38953139e38, 3.38953139e38, 2),
    "BYTES": ("str", 0, 0, 0),
}
# Elements one input may declare (2^31): far above any batch this project serves, far below what
# makes Triton's buffer arithmetic overflow.
MAX_ELEMENTS = 2**31
MAX_DIMS = 32               # dimensions of one shape (no served model has more than 4)
# Request parameters Triton itself reads, and as what ("uint": 0..2^64-1; "id": that or a string)
RESERVED_PARAMETERS = {"timeout": "uint", "priority": "uint", "binary_data_output": "bool", "sequence_id": "id",
                       "sequence_start": "bool", "sequence_end": "bool"}
_OUTPUT_PARAMETERS = {"binary_data": "bool", "classification": "uint"}
_SHM_KEYS = ("shared_memory_region", "shared_memory_byte_size", "shared_memory_offset")
_TOP_KEYS = ("id", "parameters", "inputs", "outputs")
_INPUT_KEYS = ("name", "shape", "datatype", "parameters", "data")
_OUTPUT_KEYS = ("name", "parameters")


class RequestError(ValueError):
    """The request is malformed; the message names the problem (for an HTTP 400)."""


@dataclass(frozen=True)
class Canonical:
    body: bytes                  # what Triton receives: the canonical header, then the checked binary tensors
    header_length: int | None    # Inference-Header-Content-Length to send (None: a pure JSON body)


def canonical_infer_request(body: bytes, header_length: str | None = None) -> Canonical:
    """The canonical form of ``body`` (a POST to ``/v2/models/<m>/infer``), or :class:`RequestError`.

    header_length: the ``Inference-Header-Content-Length`` header as sent (None: pure JSON body).
    """
    if header_length is None:
        header, tail = body, b""
    else:
        text = header_length.strip()
        if not text.isdigit() or len(text) > 12:
            raise RequestError(f"Inference-Header-Content-Length must be an integer, got {header_length[:40]!r}")
        n = int(text)
        if not 0 < n <= len(body):
            raise RequestError(f"Inference-Header-Content-Length {n} is outside the body's {len(body)} bytes")
        header, tail = body[:n], body[n:]
    try:
        request = loads_strict(header, what="the request header")
    except StrictJSONError as err:
        raise RequestError(str(err)) from None
    if not isinstance(request, dict):
        raise RequestError("the request JSON must be an object with an 'inputs' list")
    _known_keys(request, _TOP_KEYS, "the request")
    out: dict[str, Any] = {}
    if "id" in request:
        if not isinstance(request["id"], str):
            raise RequestError("'id' must be a string")
        out["id"] = request["id"]
    if "parameters" in request:
        out["parameters"] = _parameters(request["parameters"], "the request")
        for key, value in out["parameters"].items():
            check_parameter(key, value, RESERVED_PARAMETERS, "the request")
    inputs = request.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise RequestError("the request needs a non-empty 'inputs' list")
    offset = 0
    out["inputs"] = []
    for i, t in enumerate(inputs):
        canonical, offset = _input(t, i, tail, offset)
        out["inputs"].append(canonical)
    if offset != len(tail):
        raise RequestError(f"the inputs' binary_data_size add up to {offset} bytes, the body carries {len(tail)} "
                           "after the header")
    if "outputs" in request:
        out["outputs"] = _outputs(request["outputs"])
    new_header = dumps_canonical(out)
    if header_length is None:
        return Canonical(new_header, None)
    return Canonical(new_header + tail, len(new_header))


def check_infer_request(body: bytes, header_length: str | None = None) -> str | None:
    """None if ``body`` is well formed (:func:`canonical_infer_request` accepts it), else why not."""
    try:
        canonical_infer_request(body, header_length)
    except RequestError as err:
        return str(err)
    return None


def _known_keys(obj: dict, known: tuple[str, ...], what: str) -> None:
    for key in obj:
        if key not in known:
            raise RequestError(f"{what}: unknown key {key[:40]!r} (the protocol's keys here: {', '.join(known)})")


def check_parameter(key: str, value: Any, rules: dict[str, str], what: str) -> None:
    """Refuse ``value`` of parameter ``key`` unless it has the type ``rules[key]`` says (``bool``, ``uint``:
    an integer 0..2^64-1, ``id``: that or a string); keys not in ``rules`` pass."""
    rule = rules.get(key)
    if rule is None:
        return
    if rule == "bool" and isinstance(value, bool):
        return
    if rule in ("uint", "id") and _uint(value, 2**64):
        return
    if rule == "id" and isinstance(value, str):
        return
    want = {"bool": "true or false", "uint": "a non-negative integer",
            "id": "a non-negative integer or a string"}[rule]
    raise RequestError(f"{what}: parameter {key!r} must be {want}, got {str(value)[:30]!r}")


def element_count(shape: Any, what: str) -> int:
    """The element count of ``shape`` (a list of non-negative integers, see :func:`_shape`)."""
    return _shape(shape, what)[1]


def _shape(shape: Any, what: str) -> tuple[list[int], int]:
    """(shape, element count); refuses at the first dimension that is not a non-negative integer or takes the
    count past MAX_ELEMENTS, so the work is bounded by the list's length, never by its numbers."""
    if not isinstance(shape, list):
        raise RequestError(f"{what}: shape must be a list of non-negative integers")
    if len(shape) > MAX_DIMS:
        raise RequestError(f"{what}: shape has {len(shape)} dimensions, more than the {MAX_DIMS} allowed")
    count = 1
    for k, d in enumerate(shape):
        if not isinstance(d, int) or isinstance(d, bool) or d < 0:
            raise RequestError(f"{what}: shape dimension {k} is {str(d)[:24]}, not a non-negative integer")
        if d > MAX_ELEMENTS or count * d > MAX_ELEMENTS:
            raise RequestError(f"{what}: shape dimension {k} ({d}) takes the element count past the "
                               f"{MAX_ELEMENTS} allowed")
        count *= d
    return shape, count


def _input(t: Any, i: int, tail: bytes, offset: int) -> tuple[dict, int]:
    """The canonical form of input ``i`` and the offset in ``tail`` past its binary data."""
    if not isinstance(t, dict) or not isinstance(t.get("name"), str) or not t["name"]:
        raise RequestError(f"input {i} must be an object with a non-empty string 'name'")
    what = f"input {t['name'][:40]!r}"
    _known_keys(t, _INPUT_KEYS, what)
    dtype = t.get("datatype")
    if not isinstance(dtype, str) or dtype not in DATATYPES:
        raise RequestError(f"{what}: datatype {str(dtype)[:20]!r} is not one of {', '.join(DATATYPES)}")
    shape, count = _shape(t.get("shape"), what)
    params = _parameters(t.get("parameters"), what)
    sources = [k for k, present in (("data", "data" in t), ("binary_data_size", "binary_data_size" in params),
                                    ("shared memory", "shared_memory_region" in params)) if present]
    if len(sources) != 1:
        raise RequestError(f"{what}: give exactly one of 'data', parameters.binary_data_size or a shared-memory "
                           f"region (got {', '.join(sources) or 'none'})")
    kind, low, high, size = DATATYPES[dtype]
    out = {"name": t["name"], "shape": shape, "datatype": dtype}
    if params:
        out["parameters"] = params
    if sources[0] == "binary_data_size":
        n = params["binary_data_size"]
        if not _uint(n, 2**63):
            raise RequestError(f"{what}: binary_data_size must be a non-negative integer")
        if offset + n > len(tail):
            raise RequestError(f"{what}: binary_data_size {n} runs past the body's end")
        if size and n != count * size:
            raise RequestError(f"{what}: binary_data_size is {n} bytes, shape {shape} of {dtype} needs "
                               f"{count * size}")
        if not size:
            _check_bytes_elements(tail, offset, n, count, what)
        return out, offset + n
    if sources[0] == "shared memory":
        _shm(params, what)
        n = params.get("shared_memory_byte_size")
        if not _uint(n, 2**63):
            raise RequestError(f"{what}: a shared-memory input needs shared_memory_byte_size")
        if size and n != count * size:
            raise RequestError(f"{what}: shared_memory_byte_size is {n} bytes, shape {shape} of {dtype} needs "
                               f"{count * size}")
        return out, offset
    flat = _flatten(t["data"], count, what)
    if len(flat) != count:
        raise RequestError(f"{what}: shape {shape} holds {count} elements, 'data' has {len(flat)}")
    for x in flat:
        if not _fits(x, kind, low, high):
            raise RequestError(f"{what}: {str(x)[:30]!r} in 'data' is not a valid {dtype} value")
    out["data"] = flat
    return out, offset


def _check_bytes_elements(tail: bytes, offset: int, n: int, count: int, what: str) -> None:
    """BYTES in the binary extension: ``count`` elements, each a 4-byte little-endian length and its bytes,
    filling exactly ``n`` bytes (walked element by element: at most n / 4 steps)."""
    at, end, seen = offset, offset + n, 0
    while at < end:
        if at + 4 > end:
            raise RequestError(f"{what}: BYTES element {seen} has a truncated 4-byte length")
        length = int.from_bytes(tail[at:at + 4], "little")
        at += 4 + length
        seen += 1
        if at > end:
            raise RequestError(f"{what}: BYTES element {seen - 1} of {length} bytes runs past its binary data")
        if seen > count:
            break
    if seen != count:
        raise RequestError(f"{what}: the binary data holds {seen if seen <= count else 'more than ' + str(count)} "
                           f"BYTES elements, the shape says {count}")


def _flatten(data: Any, limit: int, what: str) -> list:
    """The elements of ``data`` (nested lists, as the protocol allows) in order; stops past ``limit``."""
    if not isinstance(data, list):
        raise RequestError(f"{what}: 'data' must be a list")
    out: list = []
    stack = [iter(data)]
    while stack:
        for x in stack[-1]:
            if isinstance(x, list):
                if len(stack) > MAX_DIMS:
                    raise RequestError(f"{what}: 'data' is nested deeper than {MAX_DIMS} levels")
                stack.append(iter(x))
                break
            out.append(x)
            if len(out) > limit:
                return out
        else:
            stack.pop()
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
        raise RequestError(f"{what}: 'parameters' must be an object")
    for k, v in params.items():
        if isinstance(v, (bool, str)):
            continue
        if isinstance(v, int) and -2**63 <= v < 2**64:
            continue
        if isinstance(v, float) and math.isfinite(v):
            continue
        raise RequestError(f"{what}: parameter {k[:40]!r} must be a string, a boolean or a number")
    return params


def _outputs(outputs: Any) -> list[dict]:
    if not isinstance(outputs, list):
        raise RequestError("'outputs' must be a list")
    out = []
    for j, o in enumerate(outputs):
        if not isinstance(o, dict) or not isinstance(o.get("name"), str):
            raise RequestError(f"output {j} must be an object with a string 'name'")
        what = f"output {o['name'][:40]!r}"
        _known_keys(o, _OUTPUT_KEYS, what)
        params = _parameters(o.get("parameters"), what)
        for key, value in params.items():
            check_parameter(key, value, _OUTPUT_PARAMETERS, what)
        if "classification" in params and not _uint(params["classification"], 2**31):
            raise RequestError(f"{what}: classification must be a non-negative integer below 2^31")
        _shm(params, what)
        out.append({"name": o["name"], **({"parameters": params} if params else {})})
    return out


def _shm(params: dict, what: str) -> None:
    if "shared_memory_region" in params and not isinstance(params["shared_memory_region"], str):
        raise RequestError(f"{what}: shared_memory_region must be a string")
    for key in _SHM_KEYS[1:]:
        if key in params and not _uint(params[key], 2**63):
            raise RequestError(f"{what}: {key} must be a non-negative integer")


# A model name as the exporter writes them: letters, digits, '_', '-', '.', not starting with '.', no "..".
MODEL_NAME = re.compile(r"^(?!.*\.\.)[A-Za-z0-9_][A-Za-z0-9_.\-]{0,199}$")


def canonical_repository_request(name: str, body: bytes) -> bytes:
    """The canonical body of a model-repository call on model ``name`` (``/v2/repository/models/<name>/
    load|unload``; the name as it stands in the path), or :class:`RequestError`.

    Measured on Triton 2.51: a load of a traversal-style name (``..%2F..%2Fetc``) is refused with 500,
    but leaves an UNAVAILABLE entry that turns the server's readiness false. Refused here: names other
    than :data:`MODEL_NAME` (no '%', '/', '\\', '..' or leading '.'), bodies that are not strict JSON
    objects, and ``file:`` overrides whose path is absolute or climbs out of the model folder.
    """
    if not MODEL_NAME.match(name):
        raise RequestError(f"model name {name[:60]!r} is not allowed (letters, digits, '_', '-', '.'; no path)")
    if not body:
        return b""
    try:
        request = loads_strict(body, what="the request body")
    except StrictJSONError as err:
        raise RequestError(str(err)) from None
    if not isinstance(request, dict):
        raise RequestError("the request body must be a JSON object")
    params = request.get("parameters", {})
    if not isinstance(params, dict):
        raise RequestError("'parameters' must be an object")
    for key, value in params.items():
        check_file_override(key)
        if key == "unload_dependents" and isinstance(value, bool):   # tritonclient's unload_model sends it
            continue
        if not isinstance(value, str):
            raise RequestError(f"parameter {key[:40]!r} must be a string")
    return dumps_canonical(request)


def check_file_override(key: str) -> None:
    """Refuse a load parameter ``file:<path>`` whose path is absolute or climbs out of the model folder."""
    if key.startswith("file:"):
        rel = key[len("file:"):]
        norm = posixpath.normpath(rel)
        if not rel or rel.startswith(("/", "\\")) or norm.startswith("..") or "\\" in rel:
            raise RequestError(f"file override {rel[:80]!r} must stay inside the model folder")


def check_repository_request(path: str, body: bytes) -> str | None:
    """None if a model-repository call on ``path`` (``/v2/repository/models/<name>/...``) with ``body`` is
    well formed (:func:`canonical_repository_request`), else why not."""
    parts = path.split("?", 1)[0].split("/")
    if len(parts) < 6 or parts[1:4] != ["v2", "repository", "models"]:
        return None
    try:
        canonical_repository_request(parts[4], body)
    except RequestError as err:
        return str(err)
    return None
