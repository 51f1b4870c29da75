"""The front door probed from outside (reliability, items 11, 12 and 14): the real tritonserver with its HTTP
port locked by the guard's per-start secret (as `e3 serve` runs it) behind the guard (short timeouts).

* One parse: duplicate keys (the first one crash-shaped), UTF-16/UTF-32/BOM bodies, lone surrogates, wrong
  types and huge integers get 400 naming the problem; the server stays up; a valid body sent in an odd but
  legal form gets the same answer as its canonical form.
* No way around: absolute-form targets, traversal-style names, Triton's own HTTP port without the secret
  (the crash body included), logging and trace without the key are refused; the secret is not on Triton's
  command line.
* Connections: half-sent and idle connections are closed after the header timeout while valid requests
  are answered; a slow body gets 408; a 60,000-dimension shape list is refused at once; bodies over the
  limits get 413 before they are read."""

from __future__ import annotations

import json
import socket
import threading
import time

import numpy as np
import pytest

from e3.deploy.guard import Guard
from e3.deploy.server import GUARD_HEADER
from helpers import http_call, serving

pytestmark = pytest.mark.e2e
MODELS = ["tiny_ee_split_1-2", "tiny_ee_split_3-4", "tiny_ee_router"]
SPLIT = "tiny_ee_split_1-2"
KEY = ("e3-api-key", "front-door-key")
HEADER_TIMEOUT_S, BODY_TIMEOUT_S = 1.0, 1.0
CRASH_INPUT = {"name": "input_ids", "shape": [2**33, 16], "datatype": "INT64", "data": [1]}


def _valid(n: int = 2) -> dict:
    ids = np.arange(n * 16).reshape(n, 16) % 50
    return {"inputs": [{"name": "input_ids", "shape": [n, 16], "datatype": "INT64", "data": ids.tolist()},
                       {"name": "attention_mask", "shape": [n, 16], "datatype": "INT64", "data": [[1] * 16] * n}]}


def _call(address, method: str, target: str, body: bytes | None = None, headers: dict | None = None,
          timeout: float = 60) -> tuple[int, str]:
    return http_call(address, method, target, body, headers, timeout=timeout)


@pytest.fixture(scope="module")
def door(tiny_repo):
    with serving(tiny_repo, MODELS, name="front-door", guard_secret=True) as server, \
            Guard(server.http_url, port=0, upstream_headers=server.http_headers, api_key=KEY,
                  header_timeout_s=HEADER_TIMEOUT_S, body_timeout_s=BODY_TIMEOUT_S) as guard:
        yield server, guard, (guard.host, guard.port)


def _alive(server, address) -> bool:
    return server.alive() and server.ready() and _call(address, "POST", f"/v2/models/{SPLIT}/infer",
                                                       json.dumps(_valid()).encode())[0] == 200


def test_one_parse_refuses_what_triton_would_read_differently(door):
    server, guard, address = door
    valid = _valid()
    tail = json.dumps(valid)[1:]
    probes = {
        "duplicate inputs": b'{"inputs":[' + json.dumps(CRASH_INPUT).encode() + b"]," + tail.encode(),
        "duplicate shape": json.dumps(valid).replace('"shape": [2, 16]', '"shape": [8589934592, 16], "shape": [2, 16]',
                                                     1).encode(),
        "UTF-16": json.dumps(valid).encode("utf-16"),
        "UTF-16-LE": json.dumps(valid).encode("utf-16-le"),
        "UTF-32": json.dumps(valid).encode("utf-32"),
        "BOM": b"\xef\xbb\xbf" + json.dumps(valid).encode(),
        "lone surrogate": json.dumps(valid).replace('"input_ids"', '"input_ids\\ud800"', 1).encode(),
        "datatype list": json.dumps(valid).replace('"datatype": "INT64"', '"datatype": ["INT64"]', 1).encode(),
        "4,301-digit integer": json.dumps(valid).replace("[[0, 1,", "[[" + "9" * 4301 + ", 1,", 1).encode(),
        "NaN literal": json.dumps(valid).replace("[[0, 1,", "[[NaN, 1,", 1).encode(),
    }
    answers = {}
    for name, body in probes.items():
        status, text = _call(address, "POST", f"/v2/models/{SPLIT}/infer", body)
        answers[name] = (status, text)
        assert status == 400 and "malformed inference request" in text, (name, status, text)
        assert server.alive(), name
    assert "duplicate key 'inputs'" in answers["duplicate inputs"][1]
    assert "duplicate key 'shape'" in answers["duplicate shape"][1]
    assert "not one of" in answers["datatype list"][1]
    # the same request in a legal but odd form (spaces, key order, nested data) answers as its canonical form
    odd = ('{ "outputs" : [ {"name":"ramp_2"} ] ,"inputs":' + json.dumps(valid["inputs"], indent=3) + "}").encode()
    status, text = _call(address, "POST", f"/v2/models/{SPLIT}/infer", odd)
    flat = {"inputs": [{**t, "data": np.ravel(t["data"]).tolist()} for t in valid["inputs"]],
            "outputs": [{"name": "ramp_2"}]}
    status2, text2 = _call(address, "POST", f"/v2/models/{SPLIT}/infer", json.dumps(flat).encode())
    assert status == status2 == 200 and json.loads(text)["outputs"] == json.loads(text2)["outputs"]
    assert _alive(server, address)
    print(f"front door: one parse: {len(probes)} probes ({', '.join(probes)}) answered 400 naming the problem, "
          "0 server deaths; an odd legal body answered as its canonical form")


def test_no_way_around_the_guard(door):
    server, guard, address = door
    crash = json.dumps({"inputs": [CRASH_INPUT]}).encode()
    refused = []
    status, text = _call(address, "POST", f"http://{guard.url}/v2/models/{SPLIT}/infer", crash)
    assert status == 400 and "absolute-form" in text, text
    refused.append("absolute-form")
    status, text = _call(address, "POST", "/v2/repository/models/..%2F..%2Ftmp/load", b"{}", dict([KEY]))
    assert status == 400 and "percent-encoded" in text, text
    refused.append("traversal name")
    direct = (server.http_host, server.http_port)
    for name, method, target, body in [("direct crash body", "POST", f"/v2/models/{SPLIT}/infer", crash),
                                       ("direct valid infer", "POST", f"/v2/models/{SPLIT}/infer",
                                        json.dumps(_valid()).encode()),
                                       ("direct health", "GET", "/v2/health/ready", None),
                                       ("direct logging", "POST", "/v2/logging", b'{"log_verbose_level": 1}')]:
        status, text = _call(direct, method, target, body, dict([KEY]))
        assert status == 403 and "This API is restricted" in text, (name, status, text)
        refused.append(name)
    assert server.alive() and server.ready()
    for method, target, body in [("POST", "/v2/logging", b'{"log_verbose_level": 0}'), ("GET", "/v2/trace/setting",
                                                                                         None)]:
        status, text = _call(address, method, target, body)
        assert status == 403 and "This API is restricted" in text, (target, status, text)
        refused.append(f"{target} without the key")
        assert _call(address, method, target, body, dict([KEY]))[0] == 200
    secret = server.http_headers()[GUARD_HEADER]
    cmdline = open(f"/proc/{server.process.pid}/cmdline", "rb").read()
    assert secret.encode() not in cmdline and b"--http-restricted-api=health,metadata,inference" in cmdline
    assert _alive(server, address)
    print(f"front door: no way around: {len(refused)} of {len(refused)} refused ({', '.join(refused)}); the "
          "secret is not on tritonserver's command line; 0 server deaths")


def _half_sent(address, data: bytes) -> socket.socket:
    s = socket.create_connection(address)
    s.sendall(data)
    return s


def _closed_within(s: socket.socket, seconds: float) -> bool:
    s.settimeout(seconds)
    try:
        while s.recv(4096):
            pass
        return True
    except socket.timeout:
        return False
    except OSError:
        return True
    finally:
        s.close()


def test_slow_half_sent_and_oversized_requests_do_not_hold_the_guard(door):
    server, guard, address = door
    infer = f"/v2/models/{SPLIT}/infer"
    valid = json.dumps(_valid()).encode()
    idle = [_half_sent(address, b"") for _ in range(10)]
    half = [_half_sent(address, f"POST {infer} HTTP/1.1\r\nHost: x\r\nContent-Le".encode()) for _ in range(20)]
    began = time.monotonic()
    assert _call(address, "POST", infer, valid)[0] == 200
    answered_s = time.monotonic() - began
    closed = sum(_closed_within(s, HEADER_TIMEOUT_S + 3) for s in idle + half)
    assert closed == 30
    # a body that stops coming: 408
    s = _half_sent(address, f"POST {infer} HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{{\"in".encode())
    s.settimeout(BODY_TIMEOUT_S + 5)
    assert s.recv(4096).startswith(b"HTTP/1.1 408")
    s.close()
    # a 60,000-dimension shape list is refused at once while a valid request is answered beside it
    deep = ('{"inputs":[{"name":"input_ids","datatype":"INT64","data":[1],"shape":[' +
            ",".join(["99999999999"] * 60_000) + "]}]}").encode()
    beside: list[int] = []
    t = threading.Thread(target=lambda: beside.append(_call(address, "POST", infer, valid)[0]))
    began = time.monotonic()
    t.start()
    status, text = _call(address, "POST", infer, deep)
    deep_s = time.monotonic() - began
    t.join(30)
    assert status == 400 and "60000 dimensions" in text and beside == [200]
    assert deep_s < 2.0
    # bodies over the limits: 413 from the headers alone, before a byte of the body is read
    for length, headers in ((57 * 2**20, {}), (65 * 2**20, {"Inference-Header-Content-Length": "100"})):
        s = _half_sent(address, f"POST {infer} HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\n".encode() +
                       "".join(f"{k}: {v}\r\n" for k, v in headers.items()).encode() + b"\r\n")
        s.settimeout(5)
        assert s.recv(4096).startswith(b"HTTP/1.1 413")
        s.close()
    status, text = _call(address, "POST", infer, b"{" + b"x" * 100 + b"}", {"Transfer-Encoding": "chunked"})
    assert status in (400, 411)
    assert _alive(server, address)
    print(f"front door: connections: 10 idle and 20 half-sent connections closed after the {HEADER_TIMEOUT_S:g} s "
          f"header timeout while a valid request was answered in {answered_s * 1e3:.0f} ms; a stalled body 408; "
          f"a 60,000-dimension shape refused in {deep_s * 1e3:.0f} ms with a valid request answered beside it; "
          "57 MiB JSON and 65 MiB binary bodies 413 before reading; 0 server deaths")
