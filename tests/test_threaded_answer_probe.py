"""benchmarks/threaded_answer_probe.py on this CPU through the real tritonserver: the threaded-answer pattern
of the CPU router survives open-loop load, and the probe says so from the requests and the server's log."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from e3.benchmarks.threaded_answer_probe import write_probe_model

ROOT = Path(__file__).resolve().parents[1]


def test_the_probe_model_is_written_for_either_instance_kind(tmp_path):
    write_probe_model(tmp_path / "cpu", "cpu")
    write_probe_model(tmp_path / "gpu", "gpu")
    assert "KIND_CPU" in (tmp_path / "cpu" / "thread_echo" / "config.pbtxt").read_text()
    assert "KIND_GPU gpus: [0]" in (tmp_path / "gpu" / "thread_echo" / "config.pbtxt").read_text()
    with pytest.raises(ValueError, match="cpu or gpu"):
        write_probe_model(tmp_path, "tpu")


@pytest.mark.e2e
def test_threaded_answers_survive_open_loop_load_on_the_cpu(tmp_path):
    # a child process: the runner moves its working folder to the run's (as on a bare host)
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "threaded_answer_probe.py"), str(tmp_path / "probe"),
                           "--rates", "300,900", "--seconds", "2"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((tmp_path / "probe" / "threaded_answer_probe.json").read_text())
    assert doc["ok"] and "survived" in proc.stdout
    assert [r["requests"] for r in doc["runs"]] == [600, 1800] and all(r["failed"] == 0 for r in doc["runs"])
    assert doc["fatal_errors"] == 0 and doc["not_healthy"] == 0
