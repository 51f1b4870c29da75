"""The C++ gRPC front (``deploy/grpc_front/``, :mod:`e3.deploy.grpc_front_process`), `e3 serve`'s public gRPC port:
its checks agree with the Python guard's (:func:`e3.deploy.grpc_guard.check_infer_message`) on the gRPC fuzz
corpus and on hand-made corner cases (a differential test through the binary's ``--check`` door); a 512 MiB
message is refused with RESOURCE_EXHAUSTED and tritonserver's memory does not move; Triton's own gRPC port
refuses a direct call; without the binary, the Python guard serves alone and says so. The fuzzed calls, the
stream, the abort and the key go through the front in tests/test_fuzz_grpc.py and tests/test_security.py.

Where the front is not built (no compiler), these tests skip, except under CI (``CI`` set), where `make setup`
must have built it."""

from __future__ import annotations

import logging
import os
import struct
import subprocess

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from e3.deploy import grpc_front_process
from e3.deploy.grpc_front_process import GrpcFront, front_binary, grpc_port, limit_args
from e3.deploy.grpc_guard import SERVICE, GrpcGuard, check_infer_message
from e3.deploy.request_check import RequestError
from helpers import serving
from test_fuzz_grpc import MODELS, _varint, messages, valid_message

BINARY = front_binary()
needs_front = pytest.mark.skipif(BINARY is None, reason="the C++ gRPC front is not built (no g++/libgrpc++-dev)")
DIFFERENTIAL = int(os.environ.get("E3_FRONT_DIFFERENTIAL", "1000"))


def test_the_front_is_built_where_ci_runs():
    """CI's `make setup` installs the build packages and builds the front: there the tests below must run."""
    if BINARY is None and not os.environ.get("CI"):
        pytest.skip("not CI, and the front is not built here")
    assert BINARY is not None, "the C++ gRPC front is not built: see `bash deploy/grpc_front/build.sh`'s line"
    assert subprocess.run([str(BINARY), "--help"], capture_output=True, timeout=30).returncode == 0


def _pb():
    from tritonclient.grpc import service_pb2
    return service_pb2


def _front_verdicts(bodies: list[bytes]) -> list[tuple[str, bytes]]:
    """The front's verdict on each message: ('A', the message it forwards) or ('R', its reason)."""
    framed = b"".join(struct.pack("<I", len(b)) + b for b in bodies)
    out = subprocess.run([str(BINARY), "--check", *limit_args()], input=framed, capture_output=True, timeout=120,
                         check=True).stdout
    verdicts, at = [], 0
    while at < len(out):
        kind, n = chr(out[at]), struct.unpack_from("<I", out, at + 1)[0]
        verdicts.append((kind, out[at + 5:at + 5 + n]))
        at += 5 + n
    assert len(verdicts) == len(bodies)
    return verdicts


def _python_verdict(body: bytes) -> tuple[str, bytes | str]:
    try:
        return "A", check_infer_message(body)[0]
    except RequestError as err:
        return "R", str(err)


def _corner_cases() -> list[bytes]:
    pb = _pb()
    cases = []

    def case(edit) -> None:
        req = pb.ModelInferRequest.FromString(valid_message("tiny_ee_split_3-4", 2))
        edit(req)
        cases.append(req.SerializeToString())

    case(lambda r: setattr(r, "model_name", "tiny_ee_router\n"))            # Python's '$' matches before '\n'
    case(lambda r: setattr(r, "model_name", "a..b"))
    case(lambda r: setattr(r, "model_name", "x" * 201))
    case(lambda r: setattr(r, "model_version", "\u0663"))                   # an Arabic-Indic digit: not decimal
    case(lambda r: setattr(r, "model_version", "1" * 19))
    case(lambda r: setattr(r, "model_version", "12"))
    case(lambda r: r.parameters["timeout"].__setattr__("double_param", 1e16))
    case(lambda r: r.parameters["priority"].__setattr__("double_param", 0.0001))
    case(lambda r: r.parameters["sequence_id"].__setattr__("string_param", "it's \"quoted\"\t\u00e9\x7f"))
    case(lambda r: r.parameters["x"].__setattr__("double_param", float("-inf")))
    case(lambda r: r.parameters["sequence_start"].__setattr__("uint64_param", 2**64 - 1))
    case(lambda r: r.inputs[0].shape.extend([1] * 31))
    case(lambda r: r.inputs[1].parameters["shared_memory_region"].__setattr__("string_param", "r"))
    case(lambda r: r.outputs.add(name="x").parameters["classification"].__setattr__("int64_param", -1))
    for dtype, field, values in (("INT8", "int_contents", [1, 128]), ("UINT16", "uint_contents", [65536]),
                                 ("FP32", "fp32_contents", [1.0, float("nan")]), ("FP64", "fp64_contents", [-1e308 * 10]),
                                 ("BOOL", "bool_contents", [True]), ("FP16", "fp32_contents", [1.0]),
                                 ("INT32", "int64_contents", [1])):
        req = pb.ModelInferRequest(model_name="m")
        t = req.inputs.add(name="x", datatype=dtype, shape=[len(values)])
        getattr(t.contents, field).extend(values)
        cases.append(req.SerializeToString())
    for blob, count in ((struct.pack("<I", 3) + b"abc" + struct.pack("<I", 0), 2), (struct.pack("<I", 9) + b"ab", 1),
                        (b"\1\0", 1), (struct.pack("<I", 1) + b"a" * 2, 1), (b"", 0)):
        req = pb.ModelInferRequest(model_name="m", raw_input_contents=[blob])
        req.inputs.add(name="TEXT", datatype="BYTES", shape=[count])
        cases.append(req.SerializeToString())
    return cases


@needs_front
def test_the_front_and_the_python_guard_give_the_same_verdicts():
    """Every message of the gRPC fuzz corpus (and the corner cases above) gets the same verdict from both
    checkers; where both accept, they forward the same message; where both refuse, the same reason, word for word
    (except where a quoted value holds a rare code point whose printability the front does not know)."""
    bodies: list[bytes] = []

    @settings(max_examples=DIFFERENTIAL, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(messages())
    def collect(case):
        bodies.append(case[1])

    collect()
    bodies += _corner_cases()
    pb = _pb()
    same_reason = refused = accepted = 0
    for body, (kind, got) in zip(bodies, _front_verdicts(bodies)):
        want_kind, want = _python_verdict(body)
        assert kind == want_kind, (body[:300], want, got[:300])
        if kind == "A":
            assert pb.ModelInferRequest.FromString(got) == pb.ModelInferRequest.FromString(want)
            accepted += 1
            continue
        refused += 1
        if got.decode() == want:
            same_reason += 1
        else:
            assert not want.isascii(), (want, got.decode())
    print(f"front vs guard: {len(bodies)} messages, {accepted} accepted by both (same forwarded message), {refused} "
          f"refused by both, {same_reason} with the same reason word for word")
    assert accepted > len(bodies) // 20 and same_reason >= 0.98 * refused


@pytest.fixture(scope="module")
def fronted(tiny_repo):
    if BINARY is None:
        pytest.skip("the C++ gRPC front is not built")
    with serving(tiny_repo, MODELS, name="grpc-front", private=True) as server, \
            GrpcFront(server.grpc_url, port=0) as front:
        yield server, front


def test_a_512_mib_message_is_refused_and_tritonserver_does_not_grow(fronted):
    server, front = fronted
    unary = grpc.insecure_channel(front.url, options=[("grpc.max_send_message_length", -1)]).unary_unary(
        f"/{SERVICE}/ModelInfer")
    unary(valid_message("tiny_ee_router", 2), timeout=60)
    before = server.rss_bytes()
    size = 512 * 2**20
    with pytest.raises(grpc.RpcError) as big:
        unary(b"\x0a\x0etiny_ee_router\x3a" + _varint(size) + bytes(size), timeout=120)
    assert big.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, big.value
    growth = server.rss_bytes() - before
    unary(valid_message("tiny_ee_router", 2), timeout=60)   # and the next call is answered
    print(f"grpc front: a 512 MiB message RESOURCE_EXHAUSTED; tritonserver RSS {growth / 2**20:+.1f} MB")
    assert growth < 100 * 2**20 and server.alive()


def test_tritons_own_grpc_port_refuses_a_direct_call(fronted):
    """Behind the front, Triton's gRPC endpoint is a Unix socket in a 0700 folder: its TCP port answers nothing
    (another user's connect to the socket: tests/test_security.py)."""
    server, front = fronted
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as direct:
        with pytest.raises(grpc.RpcError) as refused:
            direct.unary_unary(f"/{SERVICE}/ModelInfer")(valid_message("tiny_ee_router", 1), timeout=10)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert (server.socket_dir.stat().st_mode & 0o777) == 0o700
    with grpc.insecure_channel(front.url) as through:
        assert through.unary_unary(f"/{SERVICE}/ServerReady")(b"", timeout=10) is not None   # via the guard


def test_without_the_binary_the_python_guard_serves_alone_and_says_so(monkeypatch, caplog):
    monkeypatch.setattr(grpc_front_process, "front_binary", lambda: None)
    with caplog.at_level(logging.WARNING):
        port = grpc_port("unix:/nonexistent", port=0)
    assert isinstance(port, GrpcGuard)
    assert [r for r in caplog.records if "C++ gRPC front is not built" in r.getMessage()]


@needs_front
def test_the_front_refuses_to_start_on_a_taken_port():
    with GrpcFront("unix:/nonexistent", port=0) as first:
        with pytest.raises(OSError, match="cannot listen"):
            GrpcFront("unix:/nonexistent", port=first.port).start()
