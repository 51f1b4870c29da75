"""End to end on the real embedded tritonserver: same answers as PyTorch, bad input, clean stop."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from e3.client.sdk import ClientError, E3Client
from helpers import mixed_sizes, read_until_serving, send_concurrently
from e3.core.exits import make_exit_rule
from e3.models.api import SplitModule
from e3.models.reference import reference_answers

pytestmark = pytest.mark.e2e

TIE_BAND = 1e-5
N_INPUTS = 120


@pytest.fixture(scope="module")
def inputs(tiny_model):
    ids, mask = tiny_model.example_inputs(N_INPUTS, seed=42)
    return {"input_ids": ids.numpy(), "attention_mask": mask.numpy()}


@pytest.fixture(scope="module")
def reference(tiny_model, inputs):
    rule = make_exit_rule(tiny_model.card.exit_rule)
    return reference_answers(tiny_model, (inputs["input_ids"], inputs["attention_mask"]), rule)


def _rows(inputs):
    return lambda a, b: {k: v[a:b] for k, v in inputs.items()}


@pytest.mark.parametrize("model, protocol, seed", [("tiny_ee_router", "http", 1), ("tiny_ee_router", "grpc", 2),
                                                   ("tiny_ee_ee", "http", 3)])
def test_served_answers_equal_the_pytorch_reference(server, inputs, reference, model, protocol, seed):
    url = server.http_url if protocol == "http" else server.grpc_url
    label, ramp = send_concurrently(url, model, _rows(inputs), mixed_sizes(N_INPUTS, 11, seed), workers=8,
                                    protocol=protocol)
    clear = reference.min_margin > TIE_BAND
    assert (~clear).sum() <= 2, "tie band must stay tiny"
    assert (ramp[clear] == reference.exit_ramp[clear]).all()
    assert (label[clear] == reference.label[clear]).all()
    # The workload exercises every exit: ramps 1..3 and the head.
    assert set(np.unique(ramp)) == {1, 2, 3, 4}


def test_the_ee_baseline_runs_as_one_composed_graph(server):
    """<m>_ee runs E3's compact split code over the whole model: one graph under tiny-ee's entropy rule (its
    answers are checked above; tests/test_compact.py checks both forms in process)."""
    assert "tiny_ee_ee: blocks 1-4 run composed (one graph)" in server.log_file.read_text()


def test_stock_baseline_equals_pytorch_final_head(server, tiny_model, inputs):
    split = SplitModule(tiny_model, 1, tiny_model.card.num_blocks, ())
    with torch.no_grad():
        logits = torch.cat([split(*(torch.as_tensor(inputs[k][i:i + 1]) for k in ("input_ids", "attention_mask")))[0]
                            for i in range(N_INPUTS)]).numpy()
    label, ramp = send_concurrently(server.http_url, "tiny_ee_stock", _rows(inputs), mixed_sizes(N_INPUTS, 11, 5),
                                    workers=8)
    assert (ramp == -1).all()
    top2 = np.sort(logits, axis=1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > TIE_BAND
    assert (label[clear] == logits.argmax(1)[clear]).all()


def _batch_counts(server, model: str) -> dict[int, int]:
    """Batch size -> executions so far (Triton's cumulative ``batch_stats``)."""
    stats = server.model_statistics(model)["model_stats"][0]
    return {int(b["batch_size"]): int(b["compute_infer"]["count"]) for b in stats["batch_stats"]}


def test_split_models_batch_what_the_router_sends(server, inputs):
    """This test's own traffic (single-input requests from 16 clients) reaches split 1 merged into
    batches of several inputs: measured as the change of Triton's batch statistics, not their total."""
    before = _batch_counts(server, "tiny_ee_split_1-2")
    send_concurrently(server.http_url, "tiny_ee_router", _rows(inputs), [1] * N_INPUTS, workers=16)
    after = _batch_counts(server, "tiny_ee_split_1-2")
    delta = {b: after.get(b, 0) - before.get(b, 0) for b in after}
    assert sum(b * n for b, n in delta.items()) == N_INPUTS   # every input ran through split 1 once
    assert max(b for b, n in delta.items() if n > 0) > 1       # and single-input requests were merged


def _bad_requests(inputs):
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    return {
        "wrong dtype": ({"input_ids": ids[:2].astype(np.float32), "attention_mask": mask[:2]},
                        "input 'input_ids' data-type is 'FP32'"),
        "wrong shape": ({"input_ids": ids[:2, :7], "attention_mask": mask[:2, :7]}, "unexpected shape for input"),
        "oversized batch": ({"input_ids": ids[:65], "attention_mask": mask[:65]}, "batch-size must be <= 64"),
        "missing input": ({"input_ids": ids[:2]}, "missing required input(s) ['attention_mask']"),
    }


@pytest.mark.parametrize("model", ["tiny_ee_router", "tiny_ee_ee", "tiny_ee_stock"])
@pytest.mark.parametrize("case", ["wrong dtype", "wrong shape", "oversized batch", "missing input"])
def test_bad_input_gets_a_clear_error_and_serving_goes_on(server, inputs, reference, model, case):
    request, expected = _bad_requests(inputs)[case]
    if case == "wrong dtype":
        # E3Client converts a dtype when no value changes (e3.core.spec.cast_exact): the server's own refusal is
        # what a plain Triton client meets, so this case is sent with one
        import tritonclient.http as httpclient
        from tritonclient.utils import InferenceServerException, np_to_triton_dtype
        raw = httpclient.InferenceServerClient(server.http_url)
        typed = []
        for name, array in request.items():
            typed.append(httpclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype)))
            typed[-1].set_data_from_numpy(array)
        with pytest.raises(InferenceServerException) as err:
            raw.infer(model, typed)
        raw.close()
    else:
        with E3Client(server.http_url) as client, pytest.raises(ClientError) as err:
            client.infer(model, request)
    assert expected.lower() in str(err.value).lower(), str(err.value)
    with E3Client(server.http_url) as client:
        good = client.infer(model, {k: v[:3] for k, v in inputs.items()})
    assert len(good.label) == 3


def test_the_sdk_refuses_an_empty_batch_before_sending(server, inputs):
    with E3Client(server.http_url) as client:
        with pytest.raises(ClientError, match="empty batch"):
            client.infer("tiny_ee_router", {k: v[:0] for k, v in inputs.items()})


@pytest.mark.parametrize("model", ["tiny_ee_router", "tiny_ee_ee", "tiny_ee_stock", "tiny_ee_split_1-2"])
def test_empty_batch_sent_raw_is_refused_by_the_server(server, inputs, model):
    """Sent straight through tritonclient (the SDK would refuse it first), a zero-row request reaches
    the server, which refuses it with its own message and keeps serving that model."""
    import tritonclient.http as http
    from tritonclient.utils import InferenceServerException
    client = http.InferenceServerClient(server.http_url)
    try:
        tensors = []
        for name in ("input_ids", "attention_mask"):
            t = http.InferInput(name, [0, 16], "INT64")
            t.set_data_from_numpy(inputs[name][:0])
            tensors.append(t)
        # Triton's core refuses it before any model code runs, naming the input, the model and the 0 bytes sent
        with pytest.raises(InferenceServerException,
                           match=rf"input byte size mismatch for input '\w+' for model '{model}'\. Expected \d+, got 0"):
            client.infer(model, tensors)
        for name, t in zip(("input_ids", "attention_mask"), tensors):
            t.set_shape([2, 16])
            t.set_data_from_numpy(inputs[name][:2])
        assert client.infer(model, tensors).get_response()["outputs"]    # still serving
    finally:
        client.close()


def test_unknown_model_is_named(server, inputs):
    with E3Client(server.http_url) as client:
        with pytest.raises(ClientError, match="no_such_model"):
            client.infer("no_such_model", {k: v[:1] for k, v in inputs.items()})


def test_e3_infer_prints_answers(server):
    out = subprocess.run([sys.executable, "-m", "e3.cli", "infer", "tiny-ee", "-n", "3", "--url", server.http_url],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert lines[0].split() == ["input", "label", "exit", "ramp", "p(label)", "latency", "ms"]
    assert len(lines) == 4


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_perf_analyzer_runs_plain_infer_against_the_router(server, protocol):
    """The front door answers a plain perf_analyzer run (no streaming), through `e3 perf`."""
    url = server.http_url if protocol == "http" else server.grpc_url
    out = subprocess.run([sys.executable, "-m", "e3.cli", "perf", "--", "-m", "tiny_ee_router", "-u", url,
                          "-i", protocol, "-b", "4", "--input-data", "zero", "--concurrency-range", "4",
                          "--measurement-mode", "count_windows", "--measurement-request-count", "40",
                          "--stability-percentage", "999", "--max-trials", "3"],
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "Throughput:" in out.stdout


def _tritonservers_in_group(pgid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:
            found.append(int(stat.parent.name))
    return found


def test_e3_serve_stops_cleanly_on_sigterm(tiny_repo):
    """`e3 serve` under SIGTERM: exit 0, no tritonserver or stub left, no shm regions left."""
    from e3.deploy.server import free_port
    http, grpc = free_port(), free_port()
    proc = subprocess.Popen([sys.executable, "-m", "e3.cli", "serve", "--repo", str(tiny_repo),
                             "--models", "tiny_ee_split_1-2,tiny_ee_split_3-4,tiny_ee_router",
                             "--http-port", str(http), "--grpc-port", str(grpc),
                             "--metrics-port", str(free_port())],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = read_until_serving(proc)
    assert any(l.startswith("serving ") for l in lines), "".join(lines[-20:])
    server_pids = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()
                   and _cmdline(p).startswith(str(Path(sys.prefix))) and f"--grpc-port={grpc}" in _cmdline(p)]
    assert len(server_pids) == 1
    pgid = os.getpgid(server_pids[0])
    shm_prefix = f"e3_{proc.pid}_"   # Triton's own HTTP port sits behind the guard
    assert list(Path("/dev/shm").glob(f"{shm_prefix}*")), "the server's Python backend uses our shm prefix"
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, rest
    assert "tritonserver stopped" in rest
    assert _tritonservers_in_group(pgid) == []
    assert list(Path("/dev/shm").glob(f"{shm_prefix}*")) == []


def _cmdline(p: Path) -> str:
    try:
        return (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
