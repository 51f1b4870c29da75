"""benchmarks/threaded_answer_probe.py: the probe's models, its reading of the server's log, and a short run on
this CPU through the real tritonserver (the variants that take the sender inside execute, numpy and torch, answer
every request and leave no fatal line at unload; a model that crashes at unload is caught and named)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from e3.benchmarks import threaded_answer_model as probe_models
from e3.benchmarks import threaded_answer_probe as probe

ROOT = Path(__file__).resolve().parents[1]


def test_each_variant_is_written_as_its_own_model_for_either_instance_kind(tmp_path):
    for variant, (sender, torch) in probe.VARIANTS.items():
        name = probe.write_probe_model(tmp_path / "gpu", "gpu", variant)
        assert name == probe.model_name(variant) == "probe_" + variant.replace("-", "_")
        code = (tmp_path / "gpu" / name / "1" / "model.py").read_text()
        compile(code, name, "exec")   # the template filled in is valid Python
        assert f'SENDER = "{sender}"' in code and f"USE_TORCH = {torch}" in code
        config = (tmp_path / "gpu" / name / "config.pbtxt").read_text()
        assert f'name: "{name}"' in config and "KIND_GPU gpus: [0]" in config
    assert {"execute", "thread"} == {s for s, _ in probe.VARIANTS.values()}
    assert {True, False} == {t for _, t in probe.VARIANTS.values()}
    cpu = probe.write_probe_model(tmp_path / "cpu", "cpu")   # callers of before: (repo, kind)
    assert "KIND_CPU" in (tmp_path / "cpu" / cpu / "config.pbtxt").read_text()
    with pytest.raises(ValueError, match="cpu or gpu"):
        probe.write_probe_model(tmp_path, "tpu")
    with pytest.raises(ValueError, match="unknown variant"):
        probe.write_probe_model(tmp_path, "cpu", "thread-jax")


def test_the_execute_variant_keeps_no_request_and_the_thread_variant_takes_the_sender_late():
    body = probe.MODEL_PY.split("def execute", 1)[1]
    # execute: the sender inside execute where SENDER says so, the request object otherwise
    assert 'r.get_response_sender() if SENDER == "execute" else r' in body
    answer = probe.MODEL_PY.split("def answer", 1)[1].split("def poll", 1)[0]
    assert 'handle if SENDER == "execute" else handle.get_response_sender()' in answer
    assert "self.send_label(sender" in answer
    send = probe.MODEL_PY.split("def send_label", 1)[1].split("def answer", 1)[0]
    assert "flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL" in send


FAULT = """I1127 12:00:00.1 1 model_lifecycle.cc:624] "successfully unloaded 'probe_execute_numpy' version 1"
Fatal Python error: Segmentation fault

Thread 0x00007f (most recent call first):
  File "/tmp/e3-probe-repo-x/probe_thread_torch/1/model.py", line 58 in answer
  File "/usr/lib/python3.12/threading.py", line 1010 in run

Current thread 0x00007e (most recent call first):
  Garbage-collecting
terminate called after throwing an instance of 'boost::interprocess::lock_exception'
"""


def test_fatal_lines_are_found_and_given_to_the_variant_whose_stack_names_its_model():
    assert probe.fatal_lines(FAULT) == ["Fatal Python error: Segmentation fault",
                                        "terminate called after throwing an instance of "
                                        "'boost::interprocess::lock_exception'"]
    assert probe.fatal_lines("I1127 successfully loaded 'probe_thread_torch'\nSegmentation fault (core dumped)") \
        == ["Segmentation fault (core dumped)"]
    models = {v: probe.model_name(v) for v in probe.VARIANTS}
    found = probe.attribute_fatal(FAULT, models)
    # the stack names thread-torch's file; execute-numpy is named only in a log line before the crash
    assert found == {"thread-torch": ["Fatal Python error: Segmentation fault"],
                     "": ["terminate called after throwing an instance of 'boost::interprocess::lock_exception'"]}
    assert probe.attribute_fatal("I1127 all well\n", models) == {}


def _rows(doc):
    return {r["variant"]: r for r in doc["variants"]}


@pytest.mark.e2e
def test_senders_taken_in_execute_answer_every_request_and_unload_cleanly_with_numpy_and_torch(tmp_path):
    # a child process, as on a GPU host: the CLI's exit code is the verdict
    out = tmp_path / "probe"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "threaded_answer_probe.py"), str(out),
                           "--variants", "execute-numpy,execute-torch", "--rates", "300,900", "--seconds", "1",
                           "--no-shutdown-loaded"], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == sorted([probe.JSON_NAME, probe.LOG_NAME])   # no repository there
    doc = json.loads((out / probe.JSON_NAME).read_text())
    assert doc["ok"] and "survived" in proc.stdout
    assert doc["uname"].startswith("Linux") and doc["python"] and doc["torch"] and doc["cuda_available"] is False
    rows = _rows(doc)
    assert list(rows) == ["execute-numpy", "execute-torch"]
    for v, row in rows.items():
        assert row["sender"] == "execute" and row["torch"] == (v == "execute-torch") and row["instance_kind"] == "cpu"
        (cyc,) = row["cycles"]
        assert [r["requests"] for r in cyc["runs"]] == [300, 900] and all(r["failed"] == 0 for r in cyc["runs"])
        assert all(r["p50_ms"] is not None and r["p99_ms"] >= r["p50_ms"] for r in cyc["runs"])
        assert cyc["answers"] == {"checked": 8, "wrong": 0, "failed": 0}
        # the unload really happened: one stub ran the model, Triton reports it unloaded, the stub has exited
        assert cyc["stubs_before_unload"] == 1
        assert cyc["unload"]["ok"] and cyc["unload"]["state"] == "UNAVAILABLE" and cyc["unload"]["stubs_left"] == 0
        assert row["fatal_lines"] == [] and row["unload_ok"] and row["ok"]
    # what each stub ran, from its own PROBE line in the log
    assert "torch=no" in doc["stubs"]["probe_execute_numpy"]
    assert "torch=2." in doc["stubs"]["probe_execute_torch"] and "cuda=False" in doc["stubs"]["probe_execute_torch"]
    assert "sender=execute" in doc["stubs"]["probe_execute_torch"]


@pytest.mark.e2e
def test_a_model_that_crashes_at_unload_fails_the_probe_and_is_named(tmp_path, monkeypatch):
    # the thread variant made to die in finalize; the execute variant beside it stays clean
    crash = probe.MODEL_PY.replace("    def finalize(self):", "    def finalize(self):\n"
                                   "        if SENDER == \"thread\":\n            faulthandler._sigsegv()")
    assert crash != probe.MODEL_PY
    monkeypatch.setattr(probe_models, "MODEL_PY", crash)   # the template write_probe_model fills in
    rc = probe.main([str(tmp_path / "probe"), "--variants", "execute-numpy,thread-numpy", "--rates", "200",
                     "--seconds", "0.5", "--no-shutdown-loaded"])
    assert rc == 1
    doc = json.loads((tmp_path / "probe" / probe.JSON_NAME).read_text())
    rows = _rows(doc)
    assert not doc["ok"]
    assert rows["execute-numpy"]["ok"] and rows["execute-numpy"]["fatal_lines"] == []
    bad = rows["thread-numpy"]
    assert not bad["ok"] and bad["failed"] == 0   # it answered; it died at unload
    assert any("Fatal Python error: Segmentation fault" in line for line in bad["cycles"][0]["unload_fatal"])
    assert "Segmentation fault" in (tmp_path / "probe" / probe.LOG_NAME).read_text()
