"""The GPU analogue of the admission bench and the GPU profiler: the serving loop's bookkeeping and the
baselines' batcher rule on the CPU (a deterministic clock, launches that finish after a latency model);
the real runs on CUDA, skipped without a GPU."""

from __future__ import annotations

import numpy as np
import pytest

from e3.benchmarks.admission_gpu import Ebird, GpuAdmissionSettings, TritonBatcher, poisson, serve
from e3.profiling.cuda_profile import profile_cuda
from e3.profiling.cuda_profile import CudaSettings, cuda_available, device_label
from e3.serving.batcher import dynamic_batch
from e3.serving.ebird.policy import make_policy

NO_GPU = "needs an NVIDIA GPU that PyTorch can use (torch.cuda.is_available() is False here)"


def test_dynamic_batch_takes_a_full_batch_at_once_and_less_only_after_the_delay():
    assert dynamic_batch(0, 1e9, 8, delay_us=0) == 0
    assert dynamic_batch(3, 0, 8, delay_us=0) == 3            # no delay: what is queued, at once
    assert dynamic_batch(20, 0, 8, delay_us=0) == 8           # never more than the max batch
    assert dynamic_batch(3, 100, 8, delay_us=500) == 0        # the oldest has waited 100 of 500 us: wait
    assert dynamic_batch(3, 500, 8, delay_us=500) == 3
    assert dynamic_batch(8, 0, 8, delay_us=500) == 8          # a full batch does not wait
    with pytest.raises(ValueError, match="max_batch"):
        dynamic_batch(1, 0, 0, delay_us=0)


class _Clock:
    """A clock that advances ``step`` s every time it is read: the loop is deterministic."""

    def __init__(self, step: float):
        self.t, self.step = 0.0, step

    def __call__(self) -> float:
        self.t += self.step
        return self.t


class _Launch:
    """Launches that finish ``fixed + per_row * b`` s after they start (on the clock), recording them."""

    def __init__(self, clock: _Clock, fixed: float, per_row: float):
        self.clock, self.fixed, self.per_row, self.log = clock, fixed, per_row, []

    def __call__(self, e: int, b: int):
        end = self.clock.t + self.fixed + self.per_row * b
        self.log.append((e, b))
        clock = self.clock

        class Handle:
            def query(self) -> bool:
                return clock.t >= end
        return Handle()


def _run(system, rate, seconds=0.2, fixed=1e-3, per_row=1e-4):
    clock = _Clock(2e-5)
    launch = _Launch(clock, fixed, per_row)
    arrivals = poisson(rate, seconds, seed=1)
    latency, failed, batches = serve(system, launch, arrivals, drain_s=5.0, clock=clock)
    return arrivals, latency, failed, batches, launch.log


def test_every_input_is_answered_once_by_every_system():
    for system in (TritonBatcher(1, 16), TritonBatcher(1, 16, 500.0), TritonBatcher(4, 16),
                   Ebird(make_policy("n-ebird", engine=[8, 4, 2, 1, 1], max_inflight=16)),
                   Ebird(make_policy("e-ebird", confs={4: [2, 2], 8: [4, 4], 16: [8, 8]}, max_inflight=16))):
        arrivals, latency, failed, batches, log = _run(system, rate=3000)
        assert not failed.any() and sum(batches) == len(arrivals)
        assert np.isfinite(latency).all() and (latency > 0).all()
        # the fake's launch costs 1 ms + 0.1 ms per row: no input can be answered sooner than its batch ran
        assert latency.min() >= 1.0 + 0.1 * min(batches) - 1e-9
        for e, b in log:                      # each launch used its executor's own batch size
            assert b in system.executors[e]


def test_no_wait_serialises_on_one_instance_and_falls_behind_where_concurrent_workers_keep_up():
    # a launch costs 1 ms + 0.1 ms per row; one instance of max batch 8 sustains 8 / 1.8 ms = 4,400 inputs/s,
    # four workers of 8 at once four times that (the GPU's spare parallelism, which the fake gives for free)
    _, no_wait, *_ = _run(TritonBatcher(1, 8), rate=6000)
    _, ebird, *_ = _run(Ebird(make_policy("n-ebird", engine=[8, 8, 8, 8], max_inflight=32)), rate=6000)
    assert np.percentile(no_wait, 99) > 5 * np.percentile(ebird, 99)


def test_a_delay_makes_the_batcher_wait_for_a_fuller_batch_at_low_load():
    *_, no_delay, _ = _run(TritonBatcher(1, 16), rate=2000)
    *_, delayed, _ = _run(TritonBatcher(1, 16, 2000.0), rate=2000)
    assert np.mean(delayed) > np.mean(no_delay)


def test_a_system_that_launches_what_is_not_staged_is_refused():
    class Greedy(TritonBatcher):
        def plan(self, staged, wait_us, idle):
            return [(idle[0], staged + 1)]
    with pytest.raises(RuntimeError, match="more than are staged"):
        _run(Greedy(1, 64), rate=1000)


def test_device_labels_name_the_gpu_and_the_way_it_was_run():
    assert device_label("NVIDIA H100 80GB HBM3") == "h100"
    assert device_label("NVIDIA H200") == "h200"
    assert device_label("NVIDIA A100-SXM4-40GB", "fp32", graphs=False) == "a100-eager-fp32"
    assert device_label("Tesla V100-SXM2-16GB") == "v100"
    assert device_label("NVIDIA GeForce RTX 4090") == "rtx4090"


def test_the_cuda_profiler_assembles_a_valid_profile_when_run_on_the_cpu():
    """The same code path eagerly on the CPU (torch_device='cpu'): curves for every block, the stock graph,
    hops with their fixed part, the check and the router."""
    p = profile_cuda("tiny-ee", CudaSettings(torch_device="cpu", graphs=False, precision="fp32", repeats=3,
                                                   warmup=1, batch_sizes=(1, 4)), progress=False)
    d = "cpu-eager-fp32"
    assert list(p.devices) == [d] and not p.devices[d].modelled
    assert len(p.block_ms[d]) == p.num_blocks and all(v > 0 for row in p.block_ms[d] for v in row)
    assert all(v >= 0.2 for v in p.tx_ms[d]) and all(v >= 0.2 for v in p.tx_in_ms[d])
    assert p.stock_ms[d][1] > 0 and p.check_ms[d][0] > 0 and p.router_ms[d][0] > 0
    with pytest.raises(ValueError, match="graphs=False"):
        CudaSettings(torch_device="cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason=NO_GPU)
def test_cuda_profile_on_the_gpu_is_measured_and_named_after_it():   # pragma: no cover - GPU hosts only
    p = profile_cuda("tiny-ee", CudaSettings(batch_sizes=(1, 8), repeats=5, warmup=2), progress=False)
    (d,) = p.devices
    assert not p.devices[d].modelled and "measured on" in p.source
    assert all(v > 0 for row in p.block_ms[d] for v in row)


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason=NO_GPU)
def test_gpu_admission_runs_every_system_on_the_gpu():   # pragma: no cover - GPU hosts only
    from e3.benchmarks.admission_gpu import run_gpu_admission
    doc = run_gpu_admission(GpuAdmissionSettings(models=("tiny-ee",), batches=(1, 2, 4, 8, 16, 32),
                                                 totals=(4, 8), rate_fractions=(0.3, 0.6), run_s=0.2,
                                                 phase_s=0.2, repeats=3), echo=lambda m: None)
    m = doc["models"]["tiny-ee"]
    assert {r["system"] for r in m["throughput"]} >= {"NO_Wait", "N-Ebird", "E-Ebird"}
    assert all(r["requests"] > 0 for r in m["burst"])


def test_worker_sets_can_be_capped_at_the_largest_worker():
    from e3.serving.ebird.policy import worker_sets
    assert (64,) in worker_sets(64, 4)
    capped = worker_sets(64, 4, largest=32)
    assert (32, 32) in capped and (32, 16, 16) in capped and all(max(w) <= 32 for w in capped)
    assert worker_sets(128, 4, largest=32) == [(32, 32, 32, 32)]


def test_e_ebirds_cap_on_inputs_in_flight_is_the_largest_total_whose_set_ends_within_half_the_target():
    from e3.serving.ebird.policy import max_inflight_for_qos
    confs = {16: [16], 32: [32], 64: [32, 32], 96: [32, 32, 32]}
    slowest = {(16,): 0.7, (32,): 0.9, (32, 32): 1.0, (32, 32, 32): 1.3}
    assert max_inflight_for_qos(slowest, confs, qos_ms=2.2, max_bs=32) == 64
    assert max_inflight_for_qos(slowest, confs, qos_ms=3.0, max_bs=32) == 96
    # a profile whose concurrent sets are no faster than serial work leaves the paper's cap
    assert max_inflight_for_qos({**slowest, (32, 32): 1.8, (32, 32, 32): 2.7}, confs, qos_ms=2.2, max_bs=32) == 32


@pytest.mark.skipif(cuda_available(), reason="checks the refusal on a host without a GPU")
def test_the_gpu_commands_refuse_clearly_without_a_gpu_or_with_a_bad_file(tmp_path, capsys):
    from e3.cli import main
    assert main(["profile", "tiny-ee", "--cuda"]) == 2
    assert "needs an NVIDIA GPU" in capsys.readouterr().err
    assert main(["profile", "tiny-ee", "--eager"]) == 2
    assert "go with --cuda" in capsys.readouterr().err
    assert main(["bench", "admission", "--cuda"]) == 2
    assert "needs an NVIDIA GPU" in capsys.readouterr().err
    bad = tmp_path / "run.json"
    bad.write_text("[1]")
    assert main(["bench", "admission", "--cuda", "--report", str(bad)]) == 2
    assert "not a saved" in capsys.readouterr().err
    assert main(["bench", "gpu", "--measured", str(tmp_path / "missing.json"), "--no-docs"]) == 2
    assert "cannot read latency profile" in capsys.readouterr().err


def test_a_saved_gpu_admission_run_renders_its_section_with_both_claims(tmp_path):
    """The H200 run kept in docs/data renders: every system's row, the lower-bound mark, both verdicts."""
    import json
    from pathlib import Path

    from e3.benchmarks.admission_gpu import gpu_admission_markdown
    doc = json.loads((Path(__file__).parent.parent / "docs" / "data" / "h200" / "admission_gpu.json").read_text())
    text = gpu_admission_markdown(doc, "e3 bench admission --cuda")
    assert text.count("| E-Ebird |") == 2 * (1 + 3) and "≥ 283109" in text   # per model: throughput + 3 phases
    assert "E-Ebird's throughput at the target 1.77x OPT_Wait's (**>=**)" in text
    assert "E-Ebird's throughput at the target 0.59x OPT_Wait's (**<**)" in text


def test_the_measured_profile_sits_beside_the_modelled_one_in_one_table():
    """Rows per device, measured ones say how, modelled ones without a stock graph show the blocks' sum."""
    from pathlib import Path

    from dataclasses import replace

    from e3.core.profile import DeviceConfig, LatencyProfile
    from e3.benchmarks.gpu_sim import beside_table
    data = Path(__file__).parent.parent / "docs" / "data" / "h200"
    measured = LatencyProfile.load(data / "bert_ee.h200.json")
    modelled = replace(measured, devices={"v100": DeviceConfig("v100", 3.06, modelled=True)},
                       block_ms={"v100": measured.block_ms["h200"]})   # no stock curve: the blocks' sum
    lines = beside_table([measured], modelled).splitlines()
    h200 = next(r for r in lines if r.startswith("| h200 |"))
    v100 = next(r for r in lines if r.startswith("| v100 |"))
    assert "measured (PyTorch, FP16 CUDA graphs)" in h200 and "| 0.086 |" in h200 and "| 1.128 |" in h200
    assert "MODELLED" in v100 and f"{sum(r[0] for r in measured.block_ms['h200']):.3f} (sum)" in v100


def test_goodput_ratios_divide_e3_by_each_baseline_per_request_size():
    from e3.benchmarks.gpu_clusters import Cell, goodput_ratios
    cells = [Cell("e3", 8, 300.0, 1.0, ""), Cell("stock", 8, 200.0, 1.0, ""), Cell("ee", 8, 150.0, 1.0, ""),
             Cell("e3", 32, 100.0, 1.0, ""), Cell("stock", 32, 0.0, 1.0, "")]
    assert goodput_ratios(cells, [8, 32]) == {"8": {"e3_over_ee": 2.0, "e3_over_stock": 1.5}}
    cells.append(Cell("ee", 32, 50.0, 1.0, ""))
    assert goodput_ratios(cells, [32])["32"] == {"e3_over_ee": 2.0, "e3_over_stock": None}
