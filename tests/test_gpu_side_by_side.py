"""The GPU side-by-side runner in its CPU mode, end to end on the real tritonserver (so it cannot rot between GPU
runs): every system served, answers equal to the reference through Triton, the saturating and SLO rows written,
and the report rendered from the file it wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


ROW_KEYS = {"model", "mix", "max_batch", "slo_ms", "system", "goodput", "p99_ms", "config"}


@pytest.mark.skipif(not os.environ.get("E3_RELIABILITY"),
                    reason="a minute of the 2-core budget: make reliability (item 21); the GPU session runs it for real")
@pytest.mark.e2e
def test_runner_cpu_mode_serves_every_system_and_writes_what_the_report_renders(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_side_by_side.py"), str(out), "--cpu",
                           "--instances", "1"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((out / "side_by_side.json").read_text())
    assert doc["device"] == "cpu" and not doc.get("failed")
    assert doc["budget_info"]["precision"] == "fp32" and doc["budget_info"]["torch"] and "torch" in doc["budget"]
    # every served system answered as the reference (CPU, FP32): labels and exit ramps
    checks = doc["answers"]["tiny-ee"]
    assert {c["system"] for c in checks.values()} == {"stock", "ee", "e3", "check"}
    assert all(c["label_equal"] == 1.0 and c["exit_ramp_equal"] == 1.0 for c in checks.values()), checks
    # the rows' schema; a saturating row and one per SLO for every system, each at its best configuration
    assert all(set(r) == ROW_KEYS for r in doc["rows"]), doc["rows"][0]
    main = [r for r in doc["rows"] if not r["config"].get("extra")]
    assert {(r["system"], r["mix"], r["max_batch"], r["slo_ms"]) for r in main} == \
        {(s, "80-20", 8, slo) for s in ("e3", "stock", "ee") for slo in (None, 20, 50)}
    sat = {r["system"]: r for r in main if r["slo_ms"] is None}
    assert all(r["goodput"] > 0 and r["p99_ms"] > 0 and r["config"]["errors"] == 0 for r in sat.values())
    assert all(r["config"]["goodput_min"] <= r["goodput"] <= r["config"]["goodput_max"] for r in sat.values())
    assert sat["e3"]["config"]["answering"] == "continuous" and sat["e3"]["config"]["cuts"]
    # the baselines' batcher delays were tried at their best instance count, and which won is recorded
    for system in ("stock", "ee"):
        assert set(sat[system]["config"]["tried"]) == {"x1 delay 0 us", "x1 delay 500 us"}
        assert sat[system]["config"]["queue_delay_us"] in (0, 500)
    # E3 answering inline: a labelled extra row, never E3's figure
    extra = [r for r in doc["rows"] if r["config"].get("extra")]
    assert extra and all(r["system"] == "e3" and r["config"]["answering"] == "inline" for r in extra)
    # the client's bound: measured against the null model, stored, printed beside every figure
    (bound,) = doc["client_bound"]
    assert bound["inputs_per_s"] > 0 and bound["reps"] >= 3 and bound["errors"] == 0 and bound["processes"] == 2
    assert bound["ratio"] == pytest.approx(bound["inputs_per_s"] / max(r["goodput"] for r in sat.values()))
    assert doc["client_bound_ok"] is bound["ok"] is (bound["ratio"] >= 3)
    assert all(r["config"]["client_bound_ips"] == bound["inputs_per_s"] for r in doc["rows"])
    assert proc.stdout.count("client bound") >= len(doc["rows"])
    # every point repeated, each window 10 x its p50 unless the cap stopped it; no request failed anywhere
    points = doc["runs"]
    assert all(p["reps"] >= 3 and p["errors"] == 0 for p in points)
    assert all(p["window_over_p50"] >= 10 or p["window_s"] == pytest.approx(1.0) for p in points)
    # the forced mix reached the server: about 20% answered at the head
    exits = {}
    for p in points:
        if p["system"] == "e3":
            for k, v in p["exits"].items():
                exits[int(k)] = exits.get(int(k), 0) + v
    head = exits.get(4, 0) / sum(exits.values())
    assert 0.1 < head < 0.3, exits
    # E3's through-Triton share of its in-process figure, beside the figures
    (share,) = doc["e3_triton_over_in_process"]
    assert share["ratio"] == pytest.approx(sat["e3"]["goodput"] / share["in_process"])
    # a split boundary priced inside Triton at every B: a BLS call costs more than the device-resident hand-off
    (hop,) = doc["hops"]
    assert hop["max_batch"] == 8 and hop["bls_ms"] > hop["handoff_ms"] > 0 and hop["host_ms"] > 0
    # E3's plan and the in-process limit are recorded beside the runs
    assert doc["plans"] and doc["limit"] and all(l["e3"] > 0 and l["stock"] > 0 for l in doc["limit"])
    from e3.benchmarks import gpu_side_by_side_report as report
    text = report.render_side_by_side(report.load_side_by_side(out))
    assert "| tiny-ee | 80-20 | 8 |" in text and "not measured" not in text and "| tiny-ee | 8 |" in text
    assert "client's bound" in text and "labelled fallback" in text


def test_the_baselines_in_process_with_two_batches_in_flight_answer_as_the_served_runners():
    """The overlapped stock and naive runners (two batches in flight, as E3's pipeline on a GPU), driven at depth
    2 on the CPU, give the answers of StockRunner and NaiveRunner batch by batch."""
    import numpy as np
    import torch

    from e3.benchmarks.gpu_in_process import _batches, mixed_pool, naive_batch, overlapped, stock_batch
    from e3.benchmarks.gpu_side_by_side import _rule_and_ramps
    from e3.serving.device.executor import DeviceSettings, build_model, prepare_model
    from e3.serving.device.pipeline import NaiveRunner, StockRunner

    torch.set_num_threads(1)
    settings = DeviceSettings(device="cpu", precision="fp32", max_batch=8)
    model = prepare_model(build_model("tiny-ee", seed=0, trained=False), settings)
    rule, enabled = _rule_and_ramps("tiny-ee")
    batches = _batches(mixed_pool(model, rule, 0.5, size=64, seed=3), 8, 5)
    stock, naive = StockRunner(model, settings), NaiveRunner(model, enabled_ramps=enabled, rule=rule, settings=settings)
    order = []

    def traced(start):
        def gen(batch):
            i = len(order)
            order.append(("start", i))
            result = yield from start(batch)
            order.append(("end", i))
            return result
        return gen
    for runner, start in ((stock, stock_batch), (naive, naive_batch)):
        order.clear()
        got = overlapped(batches, traced(lambda b: start(runner, b)), depth=2)
        for batch, answer in zip(batches, got):
            want = runner.run(batch)
            assert np.array_equal(answer.label, want.label) and np.array_equal(answer.exit_ramp, want.exit_ramp)
            assert np.allclose(answer.probs, want.probs, atol=1e-6)
        # two in flight: the second batch starts before the first ends, and never three at once
        assert order.index(("start", 1)) < order.index(("end", 0))
        live = peak = 0
        for what, _ in order:
            live += 1 if what == "start" else -1
            peak = max(peak, live)
        assert peak == 2
    assert len({int(e) for a in overlapped(batches, lambda b: naive_batch(naive, b), 2) for e in a.exit_ramp}) > 1


def test_each_system_keeps_its_best_configuration_per_slo_and_a_low_client_bound_is_said_loudly():
    from types import SimpleNamespace

    import numpy as np

    from e3.benchmarks.gpu_load import aggregate
    from e3.benchmarks.gpu_sweep import Config, Sweep

    def point(c, rate, p99):
        lat = np.full(int(rate / 8), p99 / 2)
        return aggregate([{"concurrency": c, "requests": len(lat), "inputs_per_s": rate * f, "duration_s": 1.0,
                           "p50_ms": p99 / 2, "p99_ms": p99, "latencies_ms": lat, "answer_latencies_ms": lat,
                           "errors": 0} for f in (0.9, 1.0, 1.1)], (10, 20))
    settings = SimpleNamespace(mixes=("80-20",), slos_ms=(20, 10))
    doc = {"rows": [], "plans": [{"model": "m", "mix": "80-20", "max_batch": 32, "cuts": [2], "batch_sizes": [32, 32]}],
           "limit": [{"model": "m", "mix": "80-20", "max_batch": 32, "e3": 4000.0}]}
    results = SimpleNamespace(doc=doc, save=lambda: None)
    said = []
    sweep = Sweep(reported="m", settings=settings, results=results, load=None, url="", repo=Path("."), card=None,
                  base={}, plans={}, names={}, pools={}, echo=said.append)
    sweep.bound = {"inputs_per_s": 5000.0, "processes": 12}
    one, two = Config("stock", 1), Config("stock", 2)
    sweep.curves = {("stock", None, 32, one): [point(4, 800, 8), point(24, 1600, 30)],     # x1: the best at 10 ms
                    ("stock", None, 32, two): [point(4, 600, 12), point(24, 2400, 18)],    # x2: at 20 ms and saturating
                    ("e3", "80-20", 32, Config("e3", 1, 0, "continuous")): [point(8, 3000, 9)],
                    ("e3", "80-20", 32, Config("e3", 1, 0, "inline")): [point(8, 2000, 9)],
                    ("ee", "80-20", 32, Config("ee", 4, 500)): [point(8, 1000, 25)]}
    sweep.rows(32)
    rows = {(r["system"], r["slo_ms"], bool(r["config"].get("extra"))): r for r in doc["rows"]}
    assert rows[("stock", 10, False)]["config"]["instances"] == 1 and rows[("stock", 10, False)]["goodput"] == 800
    assert rows[("stock", 20, False)]["config"]["instances"] == 2 and rows[("stock", None, False)]["goodput"] == 2400
    assert rows[("stock", None, False)]["config"]["tried"] == {"x1 delay 0 us": 1600, "x2 delay 0 us": 2400}
    assert rows[("ee", None, False)]["config"]["queue_delay_us"] == 500 and rows[("ee", 10, False)]["goodput"] == 0.0
    assert rows[("e3", None, False)]["config"]["answering"] == "continuous" and rows[("e3", None, False)]["goodput"] == 3000
    assert rows[("e3", None, True)]["config"]["answering"] == "inline" and rows[("e3", None, True)]["config"]["extra"]
    assert rows[("e3", None, False)]["config"]["cuts"] == [2]
    # the bound (5,000) is under 3 x the best system (E3's 3,000; the inline extra is not a figure): said loudly
    assert doc["client_bound_ok"] is False and sweep.bound["ok"] is False
    assert sweep.bound["ratio"] == pytest.approx(5000 / 3000)
    assert any("THE CLIENT MAY BE THE LIMIT" in line for line in said)
    assert doc["e3_triton_over_in_process"] == [{"model": "m", "mix": "80-20", "max_batch": 32, "through_triton": 3000,
                                                 "in_process": 4000.0, "ratio": 0.75}]
    sweep.bound = {"inputs_per_s": 9000.0, "processes": 12}
    doc["rows"].clear()
    del doc["client_bound_ok"]
    sweep.rows(32)
    assert doc["client_bound_ok"] is True


def test_report_says_what_was_not_measured_and_refuses_other_files(tmp_path):
    from e3.benchmarks import gpu_side_by_side_report as report
    doc = {"device": "NVIDIA H200", "rows": [], "failed": ["bert-base-ee"],
           "limit": [{"model": "bert-base", "mix": "80-20", "max_batch": 32, "stock": 100.0, "ee": 150.0, "e3": 210.0,
                      "ideal": 3.0, "cuts": [2]}]}
    text = report.render_side_by_side(doc)
    assert "not measured" in text and "Stopped early" in text and "2.10x" in text and "1.40x" in text
    bad = tmp_path / "x.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match="not a GPU side-by-side"):
        report.load_side_by_side(bad)
    with pytest.raises(FileNotFoundError):
        report.load_side_by_side(tmp_path / "nothing")


def test_e3_bench_gpu_measured_renders_a_run_folder_into_its_section(tmp_path):
    """The CLI tells a side-by-side run from a latency profile and writes its section, the rest kept."""
    from e3.benchmarks import gpu_side_by_side_report as report
    results = tmp_path / "RESULTS.md"
    results.write_text("# Results\n\nkept\n")
    text = report.write_side_by_side_section(ROOT / "docs" / "data" / "h200", results)
    assert report.is_side_by_side(ROOT / "docs" / "data" / "h200")
    assert not report.is_side_by_side(ROOT / "docs" / "data" / "h200" / "bert_ee.h200.json")
    written = results.read_text()
    assert written.startswith("# Results\n\nkept\n") and text.strip() in written
    report.write_side_by_side_section(ROOT / "docs" / "data" / "h200", results)   # again: replaced, not appended
    assert results.read_text() == written


def test_the_standing_gpu_run_times_out_a_hung_step_keeps_what_it_wrote_and_brings_back_at_most_8_files(tmp_path):
    """benchmarks/gpu_host.py's steps are children with their own timeouts: a hung one is killed after writing
    a file, which still comes back; the next step runs; past 8 files the rest stay in the work folder."""
    from e3.benchmarks import gpu_host
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    out.mkdir()
    log = gpu_host._Log(work / "gpu_host.log")
    py = sys.executable
    hung = gpu_host.Step("hung", [py, "-c", "import pathlib, time; pathlib.Path('a.json').write_text('{}'); "
                                          "print('wrote', flush=True); time.sleep(60)"], 3.0,
                         [("a.json", "a.json", False)])
    many = gpu_host.Step("many", [py, "-c", "import pathlib\nfor i in range(9): pathlib.Path(f'f{i}.log')"
                                            ".write_text('\\n'.join(map(str, range(5000))))"], 30.0,
                         [(f"f{i}.log", f"f{i}.log", True) for i in range(9)])
    t = time.monotonic()
    assert gpu_host.run_step(hung, work, log) == "timed out"
    assert time.monotonic() - t < 20
    assert gpu_host.run_step(many, work, log) == "ok"
    copied = gpu_host.collect([hung, many], work, out, log, first=["gpu.txt", "gpu_host.log"])
    assert len(copied) == gpu_host.MAX_FILES and copied[2] == "a.json" and (out / "a.json").read_text() == "{}"
    assert len(list(out.iterdir())) == gpu_host.MAX_FILES - 2          # the two written there first are not here
    assert len((out / "f0.log").read_text().splitlines()) == gpu_host.LOG_TAIL_LINES   # logs come back as tails
    text = (work / "gpu_host.log").read_text()
    assert "wrote" in text and "hung: timed out" in text and "not copied" in text and "f8.log" in text


def test_the_standing_gpu_run_plans_the_probe_first_and_the_headline_side_by_side():
    from e3.benchmarks import gpu_host
    steps = gpu_host.plan_steps(list(gpu_host.DEFAULT_STEPS), Path("/tmp/w"), {"reported": "bert-base"})
    assert [s.name for s in steps] == ["probe", "side-by-side"]
    assert {name for s in steps for _, name, _ in s.files} == {
        "threaded_answer_probe.json", "threaded_answer_probe.log", "side_by_side.json", "side_by_side.server.log"}
    assert gpu_host.DEFAULT_BUDGET_S <= 420 and gpu_host.STEP_TIMEOUT_S["probe"] <= 120
    from e3.benchmarks.gpu_side_by_side import Settings
    s = Settings(Path("."))
    assert (s.models, s.batches, s.mixes, s.slos_ms) == (("bert-base-ee",), (32,), ("80-20",), (20, 10))
    assert s.instances == (1, 2, 4) and s.delays_us == (0, 500, 2000) and s.processes == 12 and s.reps >= 3
