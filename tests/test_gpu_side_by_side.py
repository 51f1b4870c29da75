"""The GPU side-by-side runner in its CPU mode, end to end on the real tritonserver (so it cannot rot between GPU
runs): every system served, answers equal to the reference through Triton, the saturating and SLO rows written,
and the report rendered from the file it wrote."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.e2e
def test_runner_cpu_mode_serves_every_system_and_writes_what_the_report_renders(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_side_by_side.py"), str(out), "--cpu",
                           "--batches", "8", "--instances", "1"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((out / "side_by_side.json").read_text())
    assert doc["device"] == "cpu" and not doc.get("failed")
    # every served system answered as the reference (CPU, FP32): labels and exit ramps
    checks = doc["answers"]["tiny-ee"]
    assert {c["system"] for c in checks.values()} == {"stock", "ee", "e3", "check"}
    assert all(c["label_equal"] == 1.0 and c["exit_ramp_equal"] == 1.0 for c in checks.values()), checks
    # a saturating row per system and mix, with goodput, and one row per SLO
    sat = [r for r in doc["rows"] if r["slo_ms"] is None]
    assert {(r["system"], r["mix"]) for r in sat} == {(s, m) for s in ("e3", "stock", "ee") for m in ("80-20", "50-50")}
    assert all(r["goodput"] > 0 and r["p99_ms"] > 0 and r["config"]["errors"] == 0 for r in sat)
    assert {r["slo_ms"] for r in doc["rows"]} == {None, 5, 10, 20, 50}
    # no request failed in any run, and the forced mix reached the server: about 20% answered at the head
    runs = [r for r in doc["runs"] if r["system"] == "e3" and r["mix"] == "80-20"]
    assert all(r["errors"] == 0 for r in doc["runs"])
    exits = {}
    for r in runs:
        for k, v in r["exits"].items():
            exits[int(k)] = exits.get(int(k), 0) + v
    head = exits.get(4, 0) / sum(exits.values())
    assert 0.1 < head < 0.3, exits
    # a split boundary priced inside Triton at every B: a BLS call costs more than the device-resident hand-off
    (hop,) = doc["hops"]
    assert hop["max_batch"] == 8 and hop["bls_ms"] > hop["handoff_ms"] > 0 and hop["host_ms"] > 0
    # E3's plan and the in-process limit are recorded beside the runs
    assert doc["plans"] and doc["limit"] and all(l["e3"] > 0 for l in doc["limit"])
    from e3.benchmarks import gpu_side_by_side_report as report
    text = report.render_side_by_side(report.load_side_by_side(out))
    assert "| tiny-ee | 80-20 | 8 |" in text and "not measured" not in text and "| tiny-ee | 8 |" in text


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
