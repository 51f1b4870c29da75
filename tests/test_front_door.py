"""The front door probed from outside (reliability, items 11, 12 and 14): the real tritonserver with its HTTP
and gRPC endpoints on private Unix sockets (as `e3 serve` runs it) behind the guards (short timeouts).

* One parse: duplicate keys (the first one crash-shaped), UTF-16/UTF-32/BOM bodies, lone surrogates, wrong
  types and huge integers get 400 naming the problem; the server stays up; a valid body sent in an odd but
  legal form gets the same answer as its canonical form.
* No way around: absolute-form targets, traversal-style names, logging and trace without the key are
  refused; Triton listens on no TCP port but its metrics, its sockets' folder is 0700, and its command line
  holds neither a secret nor the key.
* Body forms (issue 38): gzip, deflate (zlib and raw) and br bodies answered as their plain form, mislabelled
  ones 400, unknown encodings 415, a bomb 413; malformed Triton parameters 400 (not Triton's 500); a client
  that half-closes after sending gets its answer; refused requests are counted on /metrics and their log
  lines rate-limited.
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
    with serving(tiny_repo, MODELS, name="front-door", private=True) as server, \
            Guard(server.http_url, port=0, api_key=KEY, header_timeout_s=HEADER_TIMEOUT_S,
                  body_timeout_s=BODY_TIMEOUT_S) as guard:
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
    # Triton itself: no TCP port but metrics; its sockets in a folder only their owner enters
    listening = _tcp_listeners(server.group_pids())
    assert listening == {server.metrics_port}, listening
    assert (server.socket_dir.stat().st_mode & 0o777) == 0o700
    refused.append("Triton on no TCP port but metrics")
    assert server.alive() and server.ready()
    for method, target, body in [("POST", "/v2/logging", b'{"log_verbose_level": 0}'), ("GET", "/v2/trace/setting",
                                                                                         None)]:
        status, text = _call(address, method, target, body)
        assert status == 403 and "This API is restricted" in text, (target, status, text)
        refused.append(f"{target} without the key")
        assert _call(address, method, target, body, dict([KEY]))[0] == 200
    cmdline = open(f"/proc/{server.process.pid}/cmdline", "rb").read()
    assert b"restricted" not in cmdline and KEY[1].encode() not in cmdline
    assert b"--http-address=unix:" in cmdline and b"--grpc-address=unix:" in cmdline
    assert _alive(server, address)
    print(f"front door: no way around: {len(refused)} of {len(refused)} refused ({', '.join(refused)}); "
          "tritonserver's command line holds no secret and no key; 0 server deaths")


def _tcp_listeners(pids: list[int]) -> set[int]:
    """TCP ports the processes ``pids`` listen on (their socket inodes in /proc/net/tcp and tcp6)."""
    import os
    inodes = set()
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).readlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:   # LISTEN
                ports.add(int(f[1].rsplit(":", 1)[1], 16))
    return ports


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


def test_compressed_bodies_are_inflated_once_and_capped(door):
    import brotli
    import gzip
    import zlib
    server, guard, address = door
    infer = f"/v2/models/{SPLIT}/infer"
    plain = json.dumps(_valid()).encode()
    status, expected = _call(address, "POST", infer, plain)
    assert status == 200
    forms = {"gzip": gzip.compress(plain), "deflate": zlib.compress(plain), "deflate (raw)": zlib.compress(plain)[2:-4],
             "br": brotli.compress(plain), "GZIP (upper case)": gzip.compress(plain)}
    for name, body in forms.items():
        status, text = _call(address, "POST", infer, body, {"Content-Encoding": name.split()[0]})
        assert status == 200 and json.loads(text)["outputs"] == json.loads(expected)["outputs"], (name, status, text)
    refused = {
        "gzip label on a plain body": (plain, "gzip", 400), "br label on a plain body": (plain, "br", 400),
        "deflate label on gzip": (gzip.compress(plain), "deflate", 400),
        "truncated gzip": (gzip.compress(plain)[:-9], "gzip", 400),
        "compress": (plain, "compress", 415),
        "bomb (80 MiB)": (gzip.compress(b" " * (80 * 2**20)), "gzip", 413),
        "br bomb (80 MiB)": (brotli.compress(b" " * (80 * 2**20), quality=1), "br", 413),
    }
    for name, (body, encoding, want) in refused.items():
        status, text = _call(address, "POST", infer, body, {"Content-Encoding": encoding})
        assert status == want and "error" in text, (name, status, text)
    assert _alive(server, address)
    print(f"front door: {len(forms)} compressed forms answered as the plain body; {len(refused)} bad ones "
          f"({', '.join(refused)}) answered 4xx; 0 server deaths")


@pytest.mark.parametrize("params", [{"timeout": "abc"}, {"timeout": -1}, {"timeout": 1.5}, {"priority": -1},
                                    {"priority": "x"}, {"binary_data_output": "yes"}, {"sequence_id": 1.5},
                                    {"sequence_start": 1}])
def test_triton_parameters_are_checked_by_the_one_parse(door, params):
    server, guard, address = door
    body = {**_valid(), "parameters": params}
    status, text = _call(address, "POST", f"/v2/models/{SPLIT}/infer", json.dumps(body).encode())
    assert status == 400 and f"parameter '{next(iter(params))}'" in text, (status, text)


def test_half_closed_clients_get_their_answer_and_bad_requests_are_counted(door):
    server, guard, address = door
    body = json.dumps({**_valid(), "parameters": {"timeout": 1000000, "priority": 1}}).encode()
    answers = []
    for _ in range(5):
        s = socket.create_connection(address)
        s.sendall(f"POST /v2/models/{SPLIT}/infer HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
                  .encode() + body)
        s.shutdown(socket.SHUT_WR)
        s.settimeout(30)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
        s.close()
        answers.append(data.split(b" ", 2)[1])
    assert answers == [b"200"] * 5, answers
    # an idle connection that half-closes is closed at once
    s = socket.create_connection(address)
    s.shutdown(socket.SHUT_WR)
    assert _closed_within(s, 2)
    before = guard.bad.counts.copy()
    for _ in range(200):
        _call(address, "POST", f"/v2/models/{SPLIT}/infer", b'{"inputs": 1}')
    assert guard.bad.counts["400"] - before["400"] == 200
    # requests aiohttp itself cannot parse (a header line without a colon): counted, not logged with a traceback
    import logging
    records: list[logging.LogRecord] = []
    catch = logging.Handler(logging.DEBUG)
    catch.emit = records.append
    server_log = logging.getLogger("aiohttp.server")
    server_log.addHandler(catch)
    try:
        for _ in range(50):
            s = _half_sent(address, b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n")
            s.settimeout(10)
            assert s.recv(4096).split(b" ", 2)[1] == b"400"   # aiohttp answers these in HTTP/1.0
            s.close()
    finally:
        server_log.removeHandler(catch)
    assert guard.bad.counts["unparsable"] >= 50 and not [r for r in records if r.exc_info]
    metrics = _call(address, "GET", "/metrics")[1]
    assert f'e3_guard_bad_requests_total{{protocol="http",reason="400"}} {guard.bad.counts["400"]}' in metrics
    print("front door: 5 of 5 half-closed clients answered 200; 200 bad requests and 50 unparsable ones counted on "
          "/metrics, no traceback logged")
