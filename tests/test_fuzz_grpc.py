"""No gRPC message takes the server down (issue 38): generated ``ModelInfer`` messages against the router and two
splits through the gRPC guard (:mod:`e3.deploy.grpc_guard`), on a server whose gRPC endpoint is a private Unix
socket (as `e3 serve` runs it). Messages are built from protobuf fields (any datatype, shapes with crash-sized
dimensions, raw contents of wrong sizes, typed contents with NaN and out-of-range values, Triton's parameters
with any type) or are bytes of a valid message mutated or cut; a tenth go through ``ModelStreamInfer``, and
some are sent compressed by gRPC (gzip). Every call is answered (no deadline passes), with OK or a client
error, never UNKNOWN or INTERNAL (gRPC's 500s); the server stays live; a 64 MiB-and-more message is refused
with RESOURCE_EXHAUSTED.

`make test` sends E3_FUZZ_MESSAGES (default 150) messages; `make reliability` sends 1,000."""

from __future__ import annotations

import os
import struct
from collections import Counter

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from e3.deploy.grpc_front_process import grpc_port
from e3.deploy.grpc_guard import SERVICE, GrpcGuard, check_infer_message
from e3.deploy.request_check import DATATYPES, RequestError
from helpers import serving

pytestmark = pytest.mark.e2e
MESSAGES = int(os.environ.get("E3_FUZZ_MESSAGES", "150"))
MODELS = ["tiny_ee_split_1-2", "tiny_ee_split_3-4", "tiny_ee_router"]
INPUTS = {"tiny_ee_router": [("input_ids", "INT64", [16]), ("attention_mask", "INT64", [16])],
          "tiny_ee_split_1-2": [("input_ids", "INT64", [16]), ("attention_mask", "INT64", [16])],
          "tiny_ee_split_3-4": [("hidden", "FP32", [16, 32]), ("attention_mask", "INT64", [16])]}
SERVER_ERRORS = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.DEADLINE_EXCEEDED,
                 grpc.StatusCode.DATA_LOSS}
DIMS = st.integers(-3, 20) | st.sampled_from([0, 1, 16, 32, 2**31, 10**12, 2**62, 2**63 - 1])
SCALARS = st.integers(-2**63, 2**64 - 1) | st.floats() | st.booleans() | st.text(max_size=4)


def _pb():
    from tritonclient.grpc import service_pb2
    return service_pb2


def _param(p, value) -> None:
    if isinstance(value, bool):
        p.bool_param = value
    elif isinstance(value, int):
        if value >= 2**63:
            p.uint64_param = value
        else:
            p.int64_param = value
    elif isinstance(value, float):
        p.double_param = value
    else:
        p.string_param = value


def valid_message(target: str, n: int, fp_values=None) -> bytes:
    """A well-formed ModelInferRequest of ``n`` rows of zeros for ``target`` (raw contents)."""
    pb = _pb()
    req = pb.ModelInferRequest(model_name=target)
    for name, dtype, dims in INPUTS[target]:
        t = req.inputs.add(name=name, datatype=dtype, shape=[n, *dims])
        values = np.zeros([n, *dims], np.float32 if dtype == "FP32" else np.int64)
        if fp_values is not None and dtype == "FP32":
            values.flat[:len(fp_values)] = fp_values
        req.raw_input_contents.append(values.tobytes())
        assert t.name == name
    return req.SerializeToString()


@st.composite
def messages(draw) -> tuple[str, bytes]:
    """(target, serialised message) of one call."""
    target = draw(st.sampled_from(list(INPUTS)))
    kind = draw(st.sampled_from(["fields", "fields", "near", "near", "near", "mutated", "raw"]))
    if kind == "raw":
        return target, draw(st.binary(max_size=200))
    if kind == "mutated":
        body = bytearray(valid_message(target, draw(st.integers(1, 3))))
        for _ in range(draw(st.integers(1, 4))):
            body[draw(st.integers(0, len(body) - 1))] = draw(st.integers(0, 255))
        return target, bytes(body[:draw(st.integers(1, len(body)))])
    pb = _pb()
    if kind == "near":   # valid but for one drawn thing, values anywhere (NaN, ids past the vocabulary)
        req = pb.ModelInferRequest.FromString(valid_message(target, draw(st.integers(1, 8))))
        for t, raw in zip(req.inputs, req.raw_input_contents):
            data = bytearray(raw)
            for _ in range(draw(st.integers(0, 3))):
                data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
            req.raw_input_contents[list(req.inputs).index(t)] = bytes(data)
        how = draw(st.sampled_from(["none", "none", "none", "shape", "dtype", "params", "size"]))
        t = req.inputs[draw(st.integers(0, len(req.inputs) - 1))]
        if how == "shape":
            t.shape[draw(st.integers(0, len(t.shape) - 1))] = draw(DIMS.filter(lambda d: d >= 0))
        elif how == "dtype":
            t.datatype = draw(st.sampled_from([*DATATYPES, "STRING"]))
        elif how == "size":
            req.raw_input_contents[0] = req.raw_input_contents[0][:-draw(st.integers(1, 8))]
        for key, value in draw(st.dictionaries(st.sampled_from(["timeout", "priority", "sequence_id", "junk"]),
                                               SCALARS, max_size=2 if how == "params" else 0)).items():
            _param(req.parameters[key], value)
        return target, req.SerializeToString()
    req = pb.ModelInferRequest(model_name=draw(st.sampled_from([target, target, target, "", "../x", "nope"])))
    for name, dtype, dims in draw(st.lists(
            st.tuples(st.sampled_from(["input_ids", "attention_mask", "hidden", ""]),
                      st.sampled_from([*DATATYPES, "STRING", ""]), st.lists(DIMS, max_size=3)), max_size=3)):
        shape = dims
        if draw(st.integers(0, 4)) == 0:
            shape = draw(st.lists(DIMS, max_size=4))
        t = req.inputs.add(name=name, datatype=draw(st.sampled_from([dtype] * 6 + ["FP64", "BYTES", "BOOL"])),
                           shape=[max(0, min(d, 2**63 - 1)) for d in shape])
        count = int(np.prod(shape)) if all(0 <= d < 64 for d in shape) else 3
        source = draw(st.sampled_from(["raw", "raw", "typed", "none", "shm"]))
        if source == "raw":
            size = 8 if t.datatype in ("INT64", "FP64", "UINT64") else 4 if t.datatype in ("FP32", "INT32") else 1
            req.raw_input_contents.append(b"\0" * max(0, count * size + draw(st.sampled_from([0, 0, 0, -1, 3]))))
        elif source == "typed":
            values = draw(st.lists(st.floats(allow_nan=True) | st.integers(-2**40, 2**40),
                                   min_size=count, max_size=count))
            if t.datatype in ("FP32", "FP64"):
                t.contents.fp32_contents.extend(float(v) for v in values) if t.datatype == "FP32" else \
                    t.contents.fp64_contents.extend(float(v) for v in values)
            else:
                ints = [max(-2**31, min(2**31 - 1, int(v))) if not isinstance(v, float) or np.isfinite(v) else 0
                        for v in values]
                (t.contents.int64_contents if t.datatype == "INT64" else t.contents.int_contents).extend(ints)
        elif source == "shm":
            _param(t.parameters["shared_memory_region"], draw(SCALARS))
            _param(t.parameters["shared_memory_byte_size"], draw(SCALARS))
    for key, value in draw(st.dictionaries(st.sampled_from(["timeout", "priority", "sequence_id", "sequence_start",
                                                            "junk"]), SCALARS, max_size=2)).items():
        _param(req.parameters[key], value)
    if draw(st.booleans()):
        req.outputs.add(name=draw(st.sampled_from(["hidden", "ramp_2", "label", ""])))
    return target, req.SerializeToString()


@pytest.fixture(scope="module")
def guarded(tiny_repo):
    with serving(tiny_repo, MODELS, name="fuzz-grpc", private=True) as server, \
            grpc_port(server.grpc_url, port=0) as guard:   # the C++ front where built (make setup), else the guard
        channel = grpc.insecure_channel(guard.url, options=[("grpc.max_send_message_length", -1)])
        yield server, guard, channel
        channel.close()


def test_checker_refuses_the_shapes_that_crash_and_passes_valid_messages():
    pb = _pb()
    crash = pb.ModelInferRequest(model_name="tiny_ee_split_1-2")
    crash.inputs.add(name="input_ids", datatype="INT64", shape=[10**12, 16])
    with pytest.raises(RequestError, match="past the 2147483648 allowed"):
        check_infer_message(crash.SerializeToString())
    with pytest.raises(RequestError, match="not a valid FP32 value"):
        check_infer_message(_typed_fp32([1.0, float("nan")]))
    with pytest.raises(RequestError, match="parameter 'timeout' must be a non-negative integer"):
        req = pb.ModelInferRequest.FromString(valid_message("tiny_ee_split_1-2", 1))
        req.parameters["timeout"].string_param = "abc"
        check_infer_message(req.SerializeToString())
    forwarded, model = check_infer_message(valid_message("tiny_ee_router", 2))
    assert model == "tiny_ee_router" and pb.ModelInferRequest.FromString(forwarded).inputs[0].shape == [2, 16]


def _typed_fp32(values: list[float]) -> bytes:
    pb = _pb()
    req = pb.ModelInferRequest(model_name="tiny_ee_split_3-4")
    req.inputs.add(name="hidden", datatype="FP32", shape=[len(values)]).contents.fp32_contents.extend(values)
    return req.SerializeToString()


def test_generated_messages_get_client_errors_and_the_server_stays_live(guarded):
    server, guard, channel = guarded
    unary = channel.unary_unary(f"/{SERVICE}/ModelInfer")
    stream = channel.stream_stream(f"/{SERVICE}/ModelStreamInfer")
    for target in INPUTS:   # warm: every target answers a valid message
        unary(valid_message(target, 2), timeout=60)
    codes: Counter = Counter()
    errors: list = []
    sent = Counter()

    @settings(max_examples=MESSAGES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(messages(), st.integers(0, 19))
    def one(case, how):
        target, data = case
        try:
            check_infer_message(data)
            sent["past the guard"] += 1
        except RequestError:
            pass
        try:
            if how < 2:
                sent["stream"] += 1
                list(stream(iter([data]), timeout=60))
            else:
                sent["gzip" if how < 4 else "plain"] += 1
                unary(data, timeout=60, compression=grpc.Compression.Gzip if how < 4 else None)
            codes["OK"] += 1
        except grpc.RpcError as err:
            codes[err.code().name] += 1
            if err.code() in SERVER_ERRORS:
                errors.append((target, data[:120], err.code().name, err.details()))
        assert server.alive(), f"tritonserver died on {target} {data[:200]!r}\n{server.log_tail()}"

    one()
    # past the size limit: refused by gRPC in the guard, never forwarded
    with pytest.raises(grpc.RpcError) as big:
        unary(b"\x0a\x03abc" + b"\x3a" + _varint(65 * 2**20) + b"\0" * (65 * 2**20), timeout=120)
    assert big.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # a gzip bomb (80 MiB of zeros, about 80 KB on the wire): gRPC holds the inflated size to the same limit
    with pytest.raises(grpc.RpcError) as bomb:
        unary(b"\x0a\x03abc" + b"\x3a" + _varint(80 * 2**20) + b"\0" * (80 * 2**20), timeout=120,
              compression=grpc.Compression.Gzip)
    assert bomb.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    print(f"fuzz-grpc: {sum(codes.values())} messages ({dict(sent)}), codes {dict(codes)}; a 65 MiB message and "
          "an 80 MiB gzip bomb RESOURCE_EXHAUSTED; tritonserver alive")
    assert sum(codes.values()) >= MESSAGES and not errors, errors[:5]
    assert codes["OK"] > 0 and codes["INVALID_ARGUMENT"] > 0
    assert sent["past the guard"] >= sum(codes.values()) // 12   # the fuzz reaches Triton, not only the guard
    assert server.alive() and server.ready()
    unary(valid_message("tiny_ee_router", 2), timeout=60)   # and it still answers


def _varint(n: int) -> bytes:
    out = b""
    while True:
        byte, n = n & 0x7F, n >> 7
        out += struct.pack("B", byte | (0x80 if n else 0))
        if not n:
            return out


def test_abort_ends_calls_in_flight_to_a_model_with_unavailable():
    """The supervisor's abort (a stub died): a call waiting on Triton ends at once with UNAVAILABLE. Triton is
    stood in for by a gRPC server that never answers (what a dead stub's requests look like)."""
    import asyncio
    import threading
    import time

    from e3.deploy.server import free_port
    port = free_port()
    started = threading.Event()

    def silent_upstream():
        async def main():
            async def never(data, context):
                await asyncio.sleep(3600)

            class Handler(grpc.GenericRpcHandler):
                def service(self, details):
                    return grpc.unary_unary_rpc_method_handler(never)

            server = grpc.aio.server()
            server.add_generic_rpc_handlers([Handler()])
            server.add_insecure_port(f"127.0.0.1:{port}")
            await server.start()
            started.set()
            await server.wait_for_termination(timeout=60)
        asyncio.run(main())

    threading.Thread(target=silent_upstream, daemon=True).start()
    assert started.wait(30)
    with grpc_port(f"127.0.0.1:{port}", port=0) as guard, grpc.insecure_channel(guard.url) as channel:
        call = channel.unary_unary(f"/{SERVICE}/ModelInfer").future(valid_message("tiny_ee_router", 1), timeout=60)
        deadline = time.monotonic() + 10
        while guard.abort("tiny_ee_router") == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(grpc.RpcError) as err:
            call.result(timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "lost its Python stub" in err.value.details()
        assert guard.codes["UNAVAILABLE"] == 1


def _with_id(data: bytes, request_id: str) -> bytes:
    req = _pb().ModelInferRequest.FromString(data)
    req.id = request_id
    return req.SerializeToString()


def test_a_refused_message_inside_a_stream_is_answered_on_the_stream_and_the_stream_goes_on(guarded):
    """A bad message in ModelStreamInfer gets an error response naming the problem and its id (as Triton answers
    the messages it refuses itself); the messages after it are forwarded and answered on the same stream."""
    server, guard, channel = guarded
    pb = _pb()
    crash = pb.ModelInferRequest(model_name="tiny_ee_split_1-2", id="bad")
    crash.inputs.add(name="input_ids", datatype="INT64", shape=[10**12, 16])
    sent = [_with_id(valid_message("tiny_ee_router", 2), "first"), crash.SerializeToString(),
            b"\xff\xff not a message", _with_id(valid_message("tiny_ee_router", 1), "last")]
    before = sum(guard.bad_counts.values())
    answers = [pb.ModelStreamInferResponse.FromString(a)
               for a in channel.stream_stream(f"/{SERVICE}/ModelStreamInfer")(iter(sent), timeout=60)]
    assert len(answers) == 4
    by_id = {a.infer_response.id: a for a in answers}
    assert not by_id["first"].error_message and by_id["first"].infer_response.outputs
    assert not by_id["last"].error_message and by_id["last"].infer_response.outputs
    assert "past the 2147483648 allowed" in by_id["bad"].error_message
    assert "not a ModelInferRequest" in by_id[""].error_message
    assert sum(guard.bad_counts.values()) == before + 2   # counted on /metrics as bad requests
    assert server.alive()


def test_unary_calls_on_the_shared_streams_answer_as_triton_does(guarded):
    """ModelInfer calls carried on the guard's shared streams (``stream_lanes``, grpc_mux): the client's id comes
    back, the outputs are Triton's own for the same message sent straight to its private socket, and an error
    Triton raises keeps Triton's status code and message (the guard asks such a call again on its own call)."""
    server, _, _ = guarded
    pb = _pb()
    with GrpcGuard(server.grpc_url, port=0, stream_lanes=2) as guard, grpc.insecure_channel(guard.url) as channel, \
            grpc.insecure_channel(server.grpc_url) as direct:
        unary = channel.unary_unary(f"/{SERVICE}/ModelInfer")
        message = _with_id(valid_message("tiny_ee_router", 3), "client-7")
        want = pb.ModelInferResponse.FromString(direct.unary_unary(f"/{SERVICE}/ModelInfer")(message, timeout=60))
        unary(message, timeout=60)   # a unary call answered: the model's calls may go on a stream now
        sent = guard._mux.sent
        for _ in range(20):
            got = pb.ModelInferResponse.FromString(unary(message, timeout=60))
            assert got.id == "client-7"
            assert list(got.raw_output_contents) == list(want.raw_output_contents)
            assert [(o.name, list(o.shape)) for o in got.outputs] == [(o.name, list(o.shape)) for o in want.outputs]
        assert guard._mux.sent == sent + 20
        wrong = pb.ModelInferRequest.FromString(message)
        wrong.inputs[0].name = "no_such_input"
        with pytest.raises(grpc.RpcError) as triton_says:
            direct.unary_unary(f"/{SERVICE}/ModelInfer")(wrong.SerializeToString(), timeout=60)
        with pytest.raises(grpc.RpcError) as guard_says:
            unary(wrong.SerializeToString(), timeout=60)
        assert guard._mux.sent == sent + 21   # asked on the stream first, then on its own call
        assert guard_says.value.code() == triton_says.value.code() != grpc.StatusCode.OK
        assert guard_says.value.details() == triton_says.value.details()
        assert guard.codes["OK"] == 21
