"""The front door's pure parts: the strict JSON parse, the canonical re-serialisation the guard forwards, the
routing rule, the output policy and the supervisor's backoff (no server; milliseconds)."""

from __future__ import annotations

import json
import re
import struct
import time

import numpy as np
import pytest

from e3.deploy.request_check import (MAX_ELEMENTS, RequestError, canonical_infer_request,
                                     canonical_repository_request)
from e3.deploy.routes import RouteError, route
from e3.deploy.strict_json import StrictJSONError, dumps_canonical, loads_strict
from e3.deploy.supervisor import backoff_s, death_cause
from e3.serving.output_policy import nonfinite_output

VALID = {"inputs": [{"name": "input_ids", "shape": [1, 4], "datatype": "INT64", "data": [[1, 2], [3, 4]]}]}


def _refused(body: bytes, header_length: str | None = None) -> str:
    with pytest.raises(RequestError) as err:
        canonical_infer_request(body, header_length)
    return str(err.value)


# -- strict parse -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("body, message", [
    (b'{"a": 1, "a": 2}', "duplicate key 'a'"),
    (b'{"inputs": [{"shape": [1], "shape": [2]}]}', "duplicate key 'shape'"),
    (b'\xef\xbb\xbf{"a": 1}', "byte-order mark"),
    ('{"a": 1}'.encode("utf-16"), "byte-order mark"),
    ('{"a": 1}'.encode("utf-16-le"), "NUL byte"),
    ('{"a": 1}'.encode("utf-32-be"), "NUL byte"),
    (b'{"a": "\xff"}', "not valid UTF-8 (byte 7"),
    (b'{"a": "\\ud800"}', "lone UTF-16 surrogate"),
    (b'{"a": "x\\udfff"}', "lone UTF-16 surrogate"),
    (b'{"a": NaN}', "NaN is not a JSON number"),
    (b'{"a": -Infinity}', "-Infinity is not a JSON number"),
    (b'{"a": 1e999}', "out of range"),
    (b'{"a": ' + b"9" * 4301 + b"}", "an integer of 4301 digits"),
    (b"[" * 100_000, "deeper than 64"),
    (b'{"a": 1', "not valid JSON"),
])
def test_strict_parse_refuses_what_two_parsers_could_read_differently(body, message):
    with pytest.raises(StrictJSONError, match=re.escape(message)):
        loads_strict(body)


def test_strict_parse_keeps_what_is_plain_json():
    assert loads_strict(b'{"a": "\\ud83d\\ude00", "b": [1, 2.5, -3e5, true, null], "c": "\\"[{"}') == \
        {"a": "\U0001F600", "b": [1, 2.5, -3e5, True, None], "c": '"[{'}
    assert loads_strict(b'["\\\\", [[1]]]') == ["\\", [[1]]]   # an escaped backslash does not hide a bracket
    assert dumps_canonical({"a": "\u00e9", "b": [1.5]}) == b'{"a":"\\u00e9","b":[1.5]}'


# -- canonical forwarding -------------------------------------------------------------------------------------
def test_json_bodies_are_forwarded_in_one_canonical_form():
    body = json.dumps({"id": "r\u00e9", "inputs": [{"datatype": "INT64", "name": "input_ids", "shape": [2, 2],
                                                   "data": [[1, 2], [3, 4]]}],
                       "outputs": [{"name": "label", "parameters": {"binary_data": False}}]}, indent=2).encode()
    out = canonical_infer_request(body)
    assert out.header_length is None
    assert out.body == (b'{"id":"r\\u00e9","inputs":[{"name":"input_ids","shape":[2,2],"datatype":"INT64",'
                        b'"data":[1,2,3,4]}],"outputs":[{"name":"label","parameters":{"binary_data":false}}]}')
    assert canonical_infer_request(out.body).body == out.body   # a fixed point


def test_binary_bodies_get_a_canonical_header_and_the_same_tensors():
    ids = np.arange(6, dtype=np.int64)
    text = [b"ab", b""]
    strings = b"".join(struct.pack("<I", len(s)) + s for s in text)
    header = json.dumps({"inputs": [
        {"name": "ids", "shape": [2, 3], "datatype": "INT64", "parameters": {"binary_data_size": ids.nbytes}},
        {"name": "TEXT", "shape": [2], "datatype": "BYTES", "parameters": {"binary_data_size": len(strings)}}]},
        indent=1).encode()
    out = canonical_infer_request(header + ids.tobytes() + strings, str(len(header)))
    assert out.header_length < len(header)
    assert json.loads(out.body[:out.header_length])["inputs"][0]["parameters"] == {"binary_data_size": 48}
    assert out.body[out.header_length:] == ids.tobytes() + strings
    # sizes that do not match the shape, a BYTES count that does not, a tail that does not add up
    assert "needs 48" in _refused(header.replace(b'"binary_data_size": 48', b'"binary_data_size": 40')
                                  + ids.tobytes()[:40] + strings, str(len(header)))
    bad = b"".join(struct.pack("<I", 1) + b"x" for _ in range(3))
    h2 = header.replace(f'"binary_data_size": {len(strings)}'.encode(), f'"binary_data_size": {len(bad)}'.encode())
    assert "holds more than 2 BYTES elements" in _refused(h2 + ids.tobytes() + bad, str(len(h2)))
    assert "add up to" in _refused(header + ids.tobytes() + strings + b"x", str(len(header)))


@pytest.mark.parametrize("change, message", [
    ({"datatype": ["INT64"]}, "datatype \"['INT64']\" is not one of"),
    ({"shape": [1, True]}, "dimension 1 is True"),
    ({"shape": [2**33, 16], "data": [1]}, "dimension 0 (8589934592) takes the element count past"),
    ({"shape": [2**16, 2**16]}, "dimension 1 (65536) takes the element count past"),
    ({"extra": 1}, "unknown key 'extra'"),
    ({"data": [1, 2, 3]}, "holds 4 elements, 'data' has 3"),
    ({"data": [1, 2, 3, 2**63]}, "9223372036854775808"),
    ({"parameters": {"binary_data_size": 32}}, "give exactly one of"),
])
def test_inputs_are_refused_naming_the_problem(change, message):
    t = {**VALID["inputs"][0], **change}
    assert message in _refused(json.dumps({"inputs": [t]}).encode())


def test_a_huge_shape_list_costs_its_length_not_its_numbers():
    dims = ",".join(["99999999999999999999"] * 60_000)
    body = ('{"inputs":[{"name":"x","datatype":"INT64","data":[1],"shape":[' + dims + "]}]}").encode()
    began = time.perf_counter()
    assert "60000 dimensions" in _refused(body)
    assert time.perf_counter() - began < 1.0
    # within the dimension limit, the first impossible one stops the product
    assert MAX_ELEMENTS in (2**31,)
    assert "dimension 1" in _refused(json.dumps({"inputs": [{"name": "x", "datatype": "INT64", "data": [1],
                                                             "shape": [2**31, 2, *([10**19] * 30)]}]}).encode())


def test_repository_bodies_are_strict_and_stay_in_the_model_folder():
    assert canonical_repository_request("m_split_1-2", b'{"parameters": {"config": "{}"}}') == \
        b'{"parameters":{"config":"{}"}}'
    for name in ("..", "a..b", ".hidden", "a/b", "..%2Ftmp"):
        with pytest.raises(RequestError, match="is not allowed"):
            canonical_repository_request(name, b"")
    with pytest.raises(RequestError, match="duplicate key 'parameters'"):
        canonical_repository_request("m", b'{"parameters": {}, "parameters": {"file:../x": "eA=="}}')
    with pytest.raises(RequestError, match="must stay inside the model folder"):
        canonical_repository_request("m", b'{"parameters": {"file:../../x": "eA=="}}')


# -- routing ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method, target, status", [
    ("POST", "http://127.0.0.1:8000/v2/models/m/infer", 400),     # absolute-form
    ("OPTIONS", "*", 400), ("CONNECT", "127.0.0.1:8000", 400),
    ("POST", "/v2/repository/models/..%2F..%2Ftmp/load", 400),
    ("POST", "/v2/models/m/infer?x=1", 400), ("POST", "/v2/models/m/../n/infer", 400),
    ("POST", "//v2/models/m/infer", 400),
    ("GET", "/v2/models/m/infer", 405), ("POST", "/v2/health/ready", 405),
    ("POST", "/v2/models/m/generate", 404), ("GET", "/", 404), ("POST", "/v2/models/.m/infer", 404),
])
def test_only_origin_form_targets_naming_an_endpoint_are_routed(method, target, status):
    with pytest.raises(RouteError) as err:
        route(method, target)
    assert err.value.status == status


def test_routes_carry_triton_api_categories():
    r = route("POST", "/v2/models/m_router/versions/1/infer")
    assert (r.kind, r.category, r.model) == ("infer", "inference", "m_router")
    assert route("POST", "/v2/models/m_router/infer").model == "m_router"
    assert route("GET", "/v2/models/stats").category == "statistics"
    assert route("POST", "/v2/logging").category == "logging"
    assert route("POST", "/v2/trace/setting").category == "trace"
    r = route("POST", "/v2/repository/models/m/load")
    assert (r.kind, r.category, r.model) == ("repository", "model-repository", "m")
    assert route("GET", "/v2/systemsharedmemory/region/r/status").category == "shared-memory"
    assert route("GET", "/v2/health/ready/").path == "/v2/health/ready"


# -- output policy, supervisor ------------------------------------------------------------------------------------
def test_non_finite_outputs_are_named():
    logits = np.zeros((3, 2), np.float32)
    assert nonfinite_output({"label": np.array([1, 2, 3]), "ramp_2": logits}) is None
    logits[1, 0] = np.nan
    logits[2, 1] = np.inf
    problem = nonfinite_output({"ramp_2": logits})
    assert "'ramp_2' holds 2 non-finite" in problem and "first in row 1" in problem


def test_backoff_is_bounded_and_the_first_restart_is_immediate():
    assert [backoff_s(n) for n in range(1, 9)] == [0, 0.5, 1, 2, 4, 5, 5, 5]
    assert backoff_s(10**6) == 5
    assert (death_cause(-9), death_cause(-6), death_cause(1), death_cause(None)) == \
        ("SIGKILL", "SIGABRT", "exit_1", "hung")


# -- issue 38: bodies inflated once with a cap, Triton's parameters, rate-limited refusals, the user's unloads ----
def test_compressed_bodies_are_inflated_once_and_capped():
    import gzip
    import zlib

    import brotli

    from e3.deploy.guard import InflateError, inflate
    body = json.dumps(VALID).encode() * 50
    for encoding, packed in (("gzip", gzip.compress(body)), ("deflate", zlib.compress(body)),
                             ("deflate", zlib.compress(body)[2:-4]), ("br", brotli.compress(body)),
                             ("GZip", gzip.compress(body)), ("identity", body), ("", body)):
        assert inflate(packed, encoding, len(body)) == body, encoding
    for packed, encoding, status in ((gzip.compress(body), "gzip", 413), (brotli.compress(body), "br", 413),
                                     (body, "gzip", 400), (body, "br", 400), (gzip.compress(body)[:-8], "gzip", 400),
                                     (gzip.compress(body) + b"tail", "gzip", 400), (body, "compress", 415)):
        with pytest.raises(InflateError) as err:
            inflate(packed, encoding, len(body) - 1 if status == 413 else len(body))
        assert err.value.status == status, (encoding, status, str(err.value))
    bomb = gzip.compress(b"\0" * (256 * 2**20), compresslevel=1)   # 256 MiB in about 250 KB
    began = time.perf_counter()
    with pytest.raises(InflateError, match="inflates past the limit"):
        inflate(bomb, "gzip", 2**20)
    assert time.perf_counter() - began < 1.0   # stops at the limit, not at the end of the bomb


@pytest.mark.parametrize("params, message", [
    ({"timeout": "abc"}, "parameter 'timeout' must be a non-negative integer"),
    ({"timeout": -1}, "parameter 'timeout' must be"), ({"priority": 1.5}, "parameter 'priority' must be"),
    ({"binary_data_output": 1}, "parameter 'binary_data_output' must be true or false"),
    ({"sequence_id": -3}, "'sequence_id' must be a non-negative integer or a string"),
    ({"sequence_end": "yes"}, "'sequence_end' must be true or false"),
])
def test_triton_parameters_are_refused_with_their_type(params, message):
    assert message in _refused(json.dumps({**VALID, "parameters": params}).encode())


def test_triton_parameters_of_the_right_type_pass():
    for params in ({"timeout": 0}, {"timeout": 2**64 - 1}, {"priority": 3}, {"sequence_id": "s1"},
                   {"sequence_id": 7, "sequence_start": True, "sequence_end": False}, {"custom": 1.5}):
        canonical_infer_request(json.dumps({**VALID, "parameters": params}).encode())
    body = {**VALID, "outputs": [{"name": "o", "parameters": {"binary_data": "yes"}}]}
    assert "parameter 'binary_data' must be true or false" in _refused(json.dumps(body).encode())


def test_refusals_are_counted_and_their_log_lines_rate_limited(caplog):
    import logging

    from e3.deploy.guard import BadRequestLog
    bad = BadRequestLog(logging.getLogger("e3.test.bad"), interval_s=60)
    with caplog.at_level(logging.WARNING, logger="e3.test.bad"):
        for _ in range(1000):
            bad("400", "malformed inference request: x")
    assert bad.counts["400"] == 1000 and len(caplog.records) == 1
    assert 'e3_guard_bad_requests_total{protocol="http",reason="400"} 1000' in bad.metrics("http")


@pytest.mark.serial
def test_a_deep_bracket_body_costs_a_fraction_of_a_second():
    body = b'{"inputs":[' + b",".join([b"[]"] * 1_000_000) + b"]}"
    began = time.perf_counter()
    assert "must be an object" in _refused(body)
    deep = b"[" * 3_000_000 + b"]" * 3_000_000
    with pytest.raises(StrictJSONError, match="deeper than 64"):
        loads_strict(deep)
    assert time.perf_counter() - began < 3.0   # was 11 s for 8 MiB of brackets when the scan ran in Python


def test_the_users_unload_is_kept_and_only_deaths_are_repaired():
    from e3.deploy.supervisor import Snapshot, Supervisor

    class Server:   # the supervisor reads only its snapshot here
        pass

    sup = Supervisor(Server())
    sup.snapshot = Snapshot({"a": {}, "b": {}}, {"a": {1}, "b": {2}})
    done = sup.control("a", "unload")
    assert "a" in sup.changing   # its stubs are not watched while the call runs
    done(True)
    assert "a" not in sup.changing and "a" in sup.unloaded and "a" not in sup.snapshot.configs
    sup.control("a", "load")(True)
    assert "a" not in sup.unloaded
    sup.control("b", "unload")(False)   # refused by Triton: still watched, still restored
    assert "b" in sup.snapshot.configs and "b" not in sup.unloaded
