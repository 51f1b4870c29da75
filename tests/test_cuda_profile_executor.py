"""`e3 profile --cuda` times the serving executor: the same prepare_model + make_executor that serve a split, at each
batch size as a bucket; run here on the CPU (eager executors, FP32), and on a GPU where there is one."""

from __future__ import annotations

import time

import numpy as np
import pytest

from e3.cli.main import main
from e3.profiling.cuda_profile import profile_cuda
from e3.core.profile import LatencyProfile
from e3.profiling.cuda_profile import CudaSettings, cuda_available
from e3.serving.device import executor
from e3.serving.device.timing import time_blocks, timed

NO_GPU = "needs an NVIDIA GPU that PyTorch can use (torch.cuda.is_available() is False here)"
CPU = dict(torch_device="cpu", graphs=False, precision="fp32")


def _counting(monkeypatch):
    """Record every prepare_model and make_executor call made through the executor module."""
    calls = {"prepare": [], "make": []}
    prepare, make = executor.prepare_model, executor.make_executor

    def counted_prepare(model, settings):
        calls["prepare"].append(settings)
        return prepare(model, settings)

    def counted_make(model, first, last, *, ramps, settings):
        calls["make"].append((first, last, tuple(ramps), settings))
        return make(model, first, last, ramps=ramps, settings=settings)

    monkeypatch.setattr(executor, "prepare_model", counted_prepare)
    monkeypatch.setattr(executor, "make_executor", counted_make)
    return calls


def test_the_cuda_profile_runs_the_serving_executor_for_every_block_and_the_stock_split(monkeypatch):
    """Once prepare_model with the executor's settings (the batch sizes as its buckets), then make_executor for
    block k alone without and with its ramp and for the stock split 1..L; a valid profile that says so."""
    calls = _counting(monkeypatch)
    p = profile_cuda("tiny-ee", CudaSettings(**CPU, repeats=3, warmup=1, batch_sizes=(1, 4)), progress=False)
    p.validate()
    assert len(calls["prepare"]) == 1
    (settings,) = calls["prepare"]
    assert (settings.device, settings.precision, settings.batch_buckets) == ("cpu", "fp32", (1, 4))
    made = [(first, last, ramps) for first, last, ramps, _ in calls["make"]]
    assert made == [(1, 1, ()), (1, 1, (1,)), (2, 2, ()), (2, 2, (2,)), (3, 3, ()), (3, 3, (3,)), (4, 4, ()),
                    (1, 4, ())]
    assert all(s == settings for *_, s in calls["make"])
    d = "cpu-eager-fp32"
    assert list(p.devices) == [d] and not p.devices[d].modelled and p.batch_sizes == [1, 4]
    assert "EagerExecutor: prepare_model + make_executor" in p.source and "buckets [1, 4]" in p.source
    assert all(v > 0 for row in p.block_ms[d] for v in row) and all(v > 0 for v in p.stock_ms[d])
    assert p.ramp_ms[d][3] == [0.0, 0.0] and all(v >= 0 for row in p.ramp_ms[d][:3] for v in row)
    assert all(v >= 0.2 for v in p.tx_ms[d]) and p.check_ms[d][0] > 0 and p.router_ms[d][0] > 0


@pytest.mark.serial
def test_the_profile_holds_what_the_executor_took(monkeypatch):
    """A block whose executor is slowed by 20 ms per call shows 20 ms more in the profile, in its own row only:
    the figures are the executor's calls, not another harness's."""
    run = executor.EagerExecutor.run

    def slow_block_2(self, chunks, n):
        if (self.module.first, self.module.last, self.module.ramps) == (2, 2, ()):
            time.sleep(0.02)
        return run(self, chunks, n)

    monkeypatch.setattr(executor.EagerExecutor, "run", slow_block_2)
    p = profile_cuda("tiny-ee", CudaSettings(**CPU, repeats=3, warmup=1, batch_sizes=(1, 2)), progress=False)
    block = np.asarray(p.block_ms["cpu-eager-fp32"])
    assert (block[1] >= 20).all()
    assert (np.delete(block, 1, axis=0) < 15).all()
    assert p.ramp_ms["cpu-eager-fp32"][1] == [0.0, 0.0]   # block 2 with its ramp ran unslowed: floored at 0


def test_time_blocks_gives_every_block_and_bucket_its_repeats():
    from e3.models.zoo import resolve_architecture
    t = time_blocks(resolve_architecture("tiny-ee"), executor.DeviceSettings(max_batch=4, buckets=(1, 2, 4)),
                    repeats=4, warmup=0)
    assert t.batch_sizes == (1, 2, 4)
    assert [len(row) for row in t.block_ms] == [3] * 4 and all(s.shape == (4,) for row in t.block_ms for s in row)
    assert [r is None for r in t.block_ramp_ms] == [False, False, False, True]
    assert len(t.stock_ms) == 3 and all((s > 0).all() for s in t.stock_ms)


def test_timed_alternates_the_calls_and_skips_warmup_in_the_samples():
    order = []
    out = timed({"a": lambda: order.append("a"), "b": lambda: order.append("b")}, repeats=3, warmup=2,
                sync=lambda: order.append("sync"))
    assert order[:4] == ["a", "a", "b", "b"]
    assert order[4:] == ["sync"] + ["a", "sync", "b", "sync"] * 3
    assert set(out) == {"a", "b"} and out["a"].shape == (3,)
    with pytest.raises(ValueError, match="repeats"):
        timed({}, repeats=0, warmup=0, sync=lambda: None)


def test_e3_profile_cuda_runs_on_the_cpu_with_torch_device_cpu(tmp_path, capsys):
    out = tmp_path / "p.json"
    rc = main(["profile", "tiny-ee", "--cuda", "--torch-device", "cpu", "--untrained", "--batch-sizes", "1,2",
               "--repeats", "3", "--warmup", "1", "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    p = LatencyProfile.load(out)
    assert list(p.devices) == ["cpu-eager-fp32"] and p.batch_sizes == [1, 2]
    assert "EagerExecutor: prepare_model + make_executor" in p.source and "3 repeats" in p.source
    assert main(["profile", "tiny-ee", "--torch-device", "cpu"]) == 2
    assert "go with --cuda" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason=NO_GPU)
def test_the_cuda_profile_on_a_gpu_times_the_graph_executor(monkeypatch):   # pragma: no cover - GPU hosts only
    calls = _counting(monkeypatch)
    p = profile_cuda("tiny-ee", CudaSettings(batch_sizes=(1, 8), repeats=5, warmup=2), progress=False)
    (d,) = p.devices
    assert not p.devices[d].modelled and "CudaGraphExecutor" in p.source and "model.half()" in p.source
    assert calls["prepare"][0].precision == "fp16" and calls["prepare"][0].batch_buckets == (1, 8)
    assert len(calls["make"]) == 8 and all(v > 0 for row in p.block_ms[d] for v in row)
