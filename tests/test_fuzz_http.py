"""No request takes the server down (reliability, item 1): generated HTTP bodies, JSON and the binary tensor
protocol, against the router (tiny-ee's front door) and two splits through the HTTP guard, on a server whose
HTTP endpoint is a private Unix socket (as `e3 serve` runs it). A sixth of the bodies are the probes that
talked past the guard of before (`probe_bodies`: a duplicate "inputs" or "shape" key whose first copy is
crash-shaped, UTF-16/UTF-32/BOM encodings, lone surrogates, huge integers, list-typed datatypes, long shape
lists), a tenth of all requests use an absolute-form target, a twelfth are compressed (gzip, deflate, br;
sometimes mislabelled, truncated or in an unknown encoding), a twelfth are sent by a client that half-closes
its connection after sending (and must still get its answer), and request parameters include Triton's own
(``timeout``, ``priority``, ``sequence_*``, ``binary_data_output``) with any value. Every answer is
a client error (4xx; a body that happens to be well formed may be answered 200), never a 5xx; the server
stays live; its RSS grows by less than 1 MiB per 100 bad requests (over the second half of a run of 2,500;
the short run bounds it coarsely, see RSS_BOUND_MIB_PER_100).

`make test` sends E3_FUZZ_BODIES (default 300) bodies; `make reliability` sends 5,000."""

from __future__ import annotations

import http.client
import json
import os
import struct
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from e3.deploy.guard import Guard
from e3.deploy.request_check import DATATYPES, check_infer_request
from helpers import serving

pytestmark = pytest.mark.e2e
BODIES = int(os.environ.get("E3_FUZZ_BODIES", "300"))
# RSS bound over the run's second half, MiB per 100 requests. The figure (1) holds from about a
# thousand requests on (measured: allocators still settle over the first few hundred, +1.7 MiB per 100 over
# requests 150-300, +0.3 over 200-1,200); the short run keeps a coarse bound that a leaked batch per request
# would still break.
RSS_BOUND_MIB_PER_100 = 1.0 if BODIES >= 2000 else 3.0
TARGETS = ["tiny_ee_router", "tiny_ee_split_1-2", "tiny_ee_split_3-4"]
MODELS = ["tiny_ee_split_1-2", "tiny_ee_split_3-4", "tiny_ee_router"]
MIB = 2**20
# Killed the embedded Triton 2.51 (std::bad_alloc in its JSON parser) before the guard.
CRASH_BODY = json.dumps({"inputs": [{"name": "input_ids", "shape": [10**12, 16], "datatype": "INT64",
                                     "data": [1] * 16}]}).encode()

# -- bodies -------------------------------------------------------------------------------------------------
NAMES = st.sampled_from(["input_ids", "attention_mask", "hidden", "TEXT", ""]) | st.text(max_size=6)
DTYPES = st.sampled_from([*DATATYPES, "STRING", "int64", "FP8", ""]) | st.integers(-1, 3) | st.none()
DIMS = st.integers(-3, 20) | st.sampled_from([0, 1, 16, 32, 64, 65, 2**31, 2**32 + 1, 10**12, 2**62, 2**63 - 1,
                                              2**63, 2**64, -2**63]) | st.floats(-2, 20) | st.text(max_size=2)
SHAPES = st.lists(DIMS, max_size=4) | st.sampled_from([[1, 16], [2, 16], [1, 16, 32], [0, 16]]) | DIMS
SCALARS = (st.integers(-2**70, 2**70) | st.sampled_from([0, 1, 511, 512, -1, 2**63 - 1]) | st.floats()
           | st.booleans() | st.text(max_size=4) | st.none())
DATA = st.recursive(st.lists(SCALARS, max_size=24), lambda inner: st.lists(inner, max_size=3), max_leaves=64) | SCALARS
JUNK = st.dictionaries(st.text(max_size=6), SCALARS, max_size=3)
PARAMS = st.dictionaries(st.sampled_from(["timeout", "priority", "sequence_id", "sequence_start", "sequence_end",
                                          "binary_data_output"]) | st.text(max_size=6), SCALARS, max_size=3)


@st.composite
def tensors(draw, binary: bool):
    """One input object: name, datatype, shape and a data source that may or may not agree with them."""
    shape = draw(SHAPES)
    t = {"name": draw(NAMES), "datatype": draw(DTYPES), "shape": shape}
    for key in draw(st.sets(st.sampled_from(["name", "datatype", "shape"]), max_size=1)):
        del t[key]   # sometimes a required field is missing
    count = int(np.prod(shape)) if isinstance(shape, list) and all(isinstance(d, int) and 0 <= d < 64
                                                                      for d in shape) else 0
    source = draw(st.sampled_from(["binary", "binary_exact", "data", "data_count", "both", "none"] if binary
                                  else ["data", "data_count", "data_count", "none", "binary"]))
    if source in ("data", "both"):
        t["data"] = draw(DATA)
    if source == "data_count":   # the right number of elements, values anywhere (ids past the vocabulary)
        t["data"] = draw(st.lists(st.integers(-5, 600) | st.floats(-1e3, 1e3) | st.sampled_from([2**40, True]),
                                  min_size=count, max_size=count))
    if source in ("binary", "both"):
        t["parameters"] = {"binary_data_size": draw(st.integers(-8, 600) | st.sampled_from([2**40, 2**64]) | SCALARS)}
    if source == "binary_exact":
        t["parameters"] = {"binary_data_size": count * 8}
    if draw(st.booleans()) and draw(st.booleans()):
        t.setdefault("parameters", {}).update(draw(JUNK))
    return t


@st.composite
def bodies(draw) -> tuple[str, bytes, dict]:
    """(target model, body, headers) of one request: JSON, binary protocol, raw bytes, a mutated valid body or
    a probe; the target sometimes in absolute form (``http://...`` in ``headers["target"]``)."""
    target = draw(st.sampled_from(TARGETS))
    target, body, headers = draw(_bodies(target))
    if draw(st.integers(0, 9)) == 0:
        headers = {**headers, "target": "absolute"}
    form = draw(st.integers(0, 11))
    if form == 0:   # compressed: the label right, wrong, unknown; the data whole or cut
        import brotli
        import gzip
        import zlib
        how = draw(st.sampled_from(["gzip", "deflate", "br"]))
        packed = {"gzip": gzip.compress, "deflate": zlib.compress, "br": brotli.compress}[how](body)
        if draw(st.integers(0, 3)) == 0:
            packed = packed[:draw(st.integers(0, len(packed)))]
        label = draw(st.sampled_from([how, how, how, "gzip", "br", "deflate", "x-gzip", "compress", "identity"]))
        headers = {**headers, "Content-Encoding": label, "plain": body if label == how else None}
        body = packed
    elif form == 1:
        headers = {**headers, "halfclose": True}
    return target, body, headers


@st.composite
def _bodies(draw, target: str) -> tuple[str, bytes, dict]:
    # three in eight near-valid: the guard refuses more than it did (exact binary sizes, absolute-form targets),
    # and a fuzz that never reaches Triton and the models would test only the guard
    kind = draw(st.sampled_from(["json", "binary", "raw", "mutated", "near", "near", "near", "probe"]))
    if kind == "probe":
        return (target, *draw(probe_bodies(target)))
    if kind == "near":
        return (target, *draw(near_bodies(target)))
    if kind == "raw":
        return target, draw(st.binary(max_size=300)), {}
    if kind == "mutated":
        body = bytearray(_valid_json(draw(st.integers(1, 3))))
        for _ in range(draw(st.integers(1, 4))):
            i = draw(st.integers(0, len(body) - 1))
            body[i] = draw(st.integers(0, 255))
        return target, bytes(body[:draw(st.integers(1, len(body)))]), {}
    request = {"inputs": draw(st.lists(tensors(kind == "binary"), min_size=0, max_size=3))}
    if draw(st.booleans()):
        request["outputs"] = draw(st.lists(st.fixed_dictionaries({"name": NAMES}, optional={
            "parameters": st.fixed_dictionaries({}, optional={"binary_data": SCALARS, "classification": SCALARS})}),
            max_size=2))
    if draw(st.booleans()):
        request.update(draw(st.fixed_dictionaries({}, optional={"id": SCALARS, "parameters": PARAMS | SCALARS,
                                                                  "inputs": SCALARS})))
    header = json.dumps(request).encode()   # floats may come out as NaN/Infinity: not JSON, on purpose
    if kind == "json":
        return target, header, {}
    tail = draw(st.binary(max_size=300) | st.builds(lambda n: struct.pack("<q", 1) * n, st.integers(0, 40)))
    length = len(header) + draw(st.sampled_from([0, 0, 0, -1, 1, -len(header), 10**9]) | st.integers(-50, 50))
    return target, header + tail, {"Inference-Header-Content-Length": str(length)}


@st.composite
def probe_bodies(draw, target: str) -> tuple[bytes, dict]:
    """A near body (:func:`near_bodies`) bent the way the issue's probes were: duplicate keys whose first copy
    declares a crash-sized shape, other encodings, a lone surrogate, a huge integer, a list datatype, a long
    shape list."""
    body, headers = draw(near_bodies(target))
    n = int(headers.get("Inference-Header-Content-Length", len(body)))
    header, tail = body[:n], body[n:]
    how = draw(st.sampled_from(["dup_inputs", "dup_shape", "utf16", "utf32", "bom", "surrogate", "bigint",
                                "dtype_list", "long_shape"]))
    crash = json.dumps([{"name": INPUTS[target][0][0], "shape": [draw(st.sampled_from([2**33, 10**12, 2**62])), 16],
                         "datatype": "INT64", "data": [1]}]).encode()
    if how == "dup_inputs":
        header = b'{"inputs":' + crash + b"," + header[1:]
    elif how == "dup_shape":
        header = header.replace(b'"shape": [', b'"shape": [8589934592, 16], "shape": [', 1)
    elif how in ("utf16", "utf32"):
        header = header.decode().encode(draw(st.sampled_from([how.replace("utf", "utf-"),
                                                              how.replace("utf", "utf-") + "-le"])))
    elif how == "bom":
        header = b"\xef\xbb\xbf" + header
    elif how == "surrogate":
        header = header.replace(b'"name": "', b'"name": "\\udc00', 1)
    elif how == "bigint":
        header = header.replace(b'"shape": [', b'"shape": [' + b"9" * draw(st.integers(21, 6000)) + b", ", 1)
    elif how == "dtype_list":
        header = header.replace(b'"datatype": "', b'"datatype": ["', 1).replace(b'", "shape"', b'"], "shape"', 1)
    else:
        header = header.replace(b'"shape": [', b'"shape": [' + b"99999999999, " * draw(st.integers(20, 60_000)), 1)
    if headers:
        headers = {"Inference-Header-Content-Length": str(len(header))}
    return header + tail, headers


# What each target takes (name, datatype, shape without the batch, element size): "near" bodies start here.
INPUTS = {"tiny_ee_router": [("input_ids", "INT64", [16], 8), ("attention_mask", "INT64", [16], 8)],
          "tiny_ee_split_1-2": [("input_ids", "INT64", [16], 8), ("attention_mask", "INT64", [16], 8)],
          "tiny_ee_split_3-4": [("hidden", "FP32", [16, 32], 4), ("attention_mask", "INT64", [16], 8)]}


@st.composite
def near_bodies(draw, target: str) -> tuple[bytes, dict]:
    """A body that matches ``target``'s inputs except for what is drawn: values (any bytes: ids past the
    vocabulary, NaN), one declared dimension, datatype or byte size; JSON or binary."""
    n = draw(st.integers(0, 66))
    binary = draw(st.booleans())
    inputs, tail = [], b""
    for name, dtype, dims, size in INPUTS[target]:
        shape = [n, *dims]
        if draw(st.integers(0, 5)) == 0:
            shape[draw(st.integers(0, len(shape) - 1))] = draw(DIMS)
        if draw(st.integers(0, 7)) == 0:
            dtype = draw(DTYPES)
        count = n * int(np.prod(dims))
        t = {"name": name, "datatype": dtype, "shape": shape}
        values = _values(draw(st.integers(0, 2**32 - 1)), draw(st.sampled_from(["valid", "valid", "edge", "bytes"])),
                         dims, count)
        if binary:
            data = values.tobytes()
            declared = len(data) + (draw(st.integers(-9, 9)) if draw(st.integers(0, 5)) == 0 else 0)
            t["parameters"] = {"binary_data_size": declared}
            tail += data
        else:
            t["data"] = values.reshape(-1).tolist()
        inputs.append(t)
    header = json.dumps({"inputs": inputs}).encode()
    return header + tail, ({"Inference-Header-Content-Length": str(len(header))} if binary else {})


def _values(seed: int, how: str, dims: list[int], count: int) -> np.ndarray:
    """``count`` values for an input of element shape ``dims`` (INT64 ids/mask or FP32 hidden): "valid" (in
    range), "edge" (a few just outside: -1, 512, 2, NaN, Inf) or "bytes" (random bit patterns)."""
    rng = np.random.default_rng(seed)
    fp = len(dims) == 2
    if how == "bytes":
        raw = rng.integers(0, 256, count * (4 if fp else 8), dtype=np.uint8)
        return raw.view(np.float32 if fp else np.int64)
    values = rng.normal(size=count).astype(np.float32) if fp else rng.integers(0, 2, count)
    if how == "edge" and count:
        at = rng.integers(0, count, 1 + count // 50)
        values[at] = rng.choice([np.nan, np.inf, -np.inf, 1e38], len(at)) if fp else rng.choice([-1, 2, 512, 2**40],
                                                                                                   len(at))
    return values


def _exact_body(target: str, n: int, binary: bool) -> tuple[bytes, dict]:
    """A well-formed request of ``n`` valid rows for ``target``."""
    inputs, tail = [], b""
    for k, (name, dtype, dims, _) in enumerate(INPUTS[target]):
        values = _values(k, "valid", dims, n * int(np.prod(dims)))
        t = {"name": name, "datatype": dtype, "shape": [n, *dims]}
        if binary:
            t["parameters"] = {"binary_data_size": values.nbytes}
            tail += values.tobytes()
        else:
            t["data"] = values.tolist()
        inputs.append(t)
    header = json.dumps({"inputs": inputs}).encode()
    return header + tail, ({"Inference-Header-Content-Length": str(len(header))} if binary else {})


def _valid_json(n: int) -> bytes:
    ids = [[7] * 16 for _ in range(n)]
    return json.dumps({"inputs": [{"name": "input_ids", "shape": [n, 16], "datatype": "INT64", "data": ids},
                                  {"name": "attention_mask", "shape": [n, 16], "datatype": "INT64",
                                   "data": [[1] * 16] * n}]}).encode()


# -- the run ----------------------------------------------------------------------------------------------------
@dataclass
class Record:
    statuses: Counter = field(default_factory=Counter)
    server_errors: list = field(default_factory=list)   # (target, body head, status, answer) of every 5xx
    past_guard: int = 0                                  # bodies the guard let through to Triton
    probes: int = 0                                      # duplicate-key and BOM probes among them (a floor)
    forms: Counter = field(default_factory=Counter)      # compressed / half-closed requests sent


def post(address: tuple[str, int], target: str, body: bytes, headers: dict) -> tuple[int, bytes]:
    """One request on a fresh connection: (status, answer body); status 0: no answer at all. Pseudo-headers:
    ``target: absolute`` (absolute-form target), ``halfclose`` (shutdown(SHUT_WR) after sending), ``plain``
    (the body before compression; not sent)."""
    headers = dict(headers)
    absolute = headers.pop("target", None) == "absolute"
    headers.pop("plain", None)
    if headers.pop("halfclose", False):
        return _post_half_closed(address, target, body, headers, absolute)
    conn = http.client.HTTPConnection(*address, timeout=60)
    try:
        path = f"/v2/models/{target}/infer"
        conn.request("POST", f"http://{address[0]}:{address[1]}{path}" if absolute else path, body=body,
                     headers=headers)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def _post_half_closed(address, target: str, body: bytes, headers: dict, absolute: bool) -> tuple[int, bytes]:
    import socket
    path = f"/v2/models/{target}/infer"
    line = f"http://{address[0]}:{address[1]}{path}" if absolute else path
    head = f"POST {line} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n" + \
        "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
    with socket.create_connection(address, timeout=60) as s:
        s.sendall(head.encode() + body)
        s.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    if not data.startswith(b"HTTP/1.1 "):
        return 0, data
    return int(data[9:12]), data.split(b"\r\n\r\n", 1)[-1]


@pytest.fixture(scope="module")
def guarded(tiny_repo):
    with serving(tiny_repo, MODELS, name="fuzz", private=True) as server, Guard(server.http_url, port=0) as guard:
        yield server, guard


@pytest.mark.reliability
@pytest.mark.skipif(not os.environ.get("E3_RELIABILITY"), reason="kills a server on purpose: make reliability")
def test_without_the_guard_one_body_kills_triton(tiny_repo):
    """The positive control: the body the guard refuses does kill Triton 2.51 when it reaches its parser.
    If a Triton upgrade survives it, this test says so (and the guard's docstring needs updating)."""
    with serving(tiny_repo, ["tiny_ee_split_1-2"], name="crash") as server:
        status = None
        try:
            status, _ = post((server.host, server.http_port), "tiny_ee_split_1-2", CRASH_BODY, {})
        except (OSError, http.client.HTTPException):
            pass
        died = not server.alive() or not server.ready()
        print(f"fuzz: unguarded server {'died' if died else 'survived'} on the crash body (status {status})")
        assert died


def test_checker_refuses_the_body_that_kills_triton():
    assert "past the 2147483648 allowed" in check_infer_request(CRASH_BODY)
    assert check_infer_request(_valid_json(2)) is None


def test_generated_bodies_get_client_errors_and_the_server_stays_live(guarded):
    server, guard = guarded
    address = (guard.host, guard.port)
    record = Record()
    # Warm up allocators (ONNX Runtime's arenas, Triton's and numpy's buffers grow to the largest batch
    # seen) with every target at batch sizes up to the limit, then count growth only over the second half
    # of the run, as Triton's own memory-growth test does.
    for target in TARGETS:
        for n in (1, 8, 33, 64):
            for binary in (False, True):
                body, headers = _exact_body(target, n, binary)
                assert post(address, target, body, headers)[0] == 200
    rss = {}

    @settings(max_examples=BODIES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(bodies())
    def one(case):
        target, body, headers = case
        status, answer = post(address, target, body, headers)
        record.statuses[status] += 1
        plain = headers.get("plain", body if "Content-Encoding" not in headers else None)
        record.past_guard += headers.get("target") != "absolute" and plain is not None and \
            check_infer_request(plain, headers.get("Inference-Header-Content-Length")) is None
        record.forms["compressed"] += "Content-Encoding" in headers
        record.forms["half-closed"] += bool(headers.get("halfclose"))
        record.probes += b"8589934592, 16], \"shape\"" in body or body.startswith((b'{"inputs":[{"name', b"\xef"))
        if not (400 <= status < 500 or status == 200):   # 0: unanswered
            record.server_errors.append((target, body[:200], status, answer[:300]))
        assert server.alive(), f"tritonserver died on {target} {body[:300]!r} {headers}\n{server.log_tail()}"
        sent = sum(record.statuses.values())
        if sent in (BODIES // 2, BODIES):
            rss[sent] = server.rss_bytes()

    one()
    sent = sum(record.statuses.values())
    rss_before, rss_after = rss[BODIES // 2], server.rss_bytes()
    growth_mib_per_100 = (rss_after - rss_before) / MIB / ((sent - BODIES // 2) / 100)
    print(f"fuzz: {sent} bodies ({record.past_guard} reached Triton, at least {record.probes} duplicate-key/BOM "
          f"probes, {record.forms['compressed']} compressed, {record.forms['half-closed']} half-closed), "
          f"statuses {dict(record.statuses)} (0: unanswered), "
          f"server RSS over the second half "
          f"{rss_before / MIB:.1f} -> {rss_after / MIB:.1f} MiB ({growth_mib_per_100:+.3f} MiB per 100 requests)")
    assert sent >= BODIES
    # The fuzz reaches Triton's checks and the models', not only the guard. A floor, not a figure: with the
    # front-door probes (encodings, duplicate keys, absolute-form targets) in the mix, 35-43 of 300 bodies got
    # past the guard in runs on 2026-11-26 (1/8 = 37 failed one of them); 1/12 keeps the check's point.
    assert record.past_guard >= sent // 12
    assert not record.server_errors, record.server_errors[:5]
    # each form drawn often enough to count (hypothesis draws small integers more often than 1 in 12: 39
    # compressed and 11 half-closed of 300 in one run on 2026-11-27, so the floor is 1 in 40)
    assert record.forms["compressed"] >= sent // 40 and record.forms["half-closed"] >= sent // 40
    assert server.alive() and server.ready()
    assert growth_mib_per_100 < RSS_BOUND_MIB_PER_100
    status, _ = post(address, "tiny_ee_router", _valid_json(2), {})   # and it still answers
    assert status == 200
