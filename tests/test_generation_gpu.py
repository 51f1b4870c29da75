"""The GPU generation runner (``benchmarks/generation_gpu.py``): its CPU form end to end as a bare-host script
(so it cannot rot between GPU runs), and its device runner keeping the KV cache where the modules run, equal to
the ONNX splits' engine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def test_runner_cpu_form_writes_every_mode_with_the_full_models_tokens(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "generation_gpu.py"), str(out), "--cpu",
                           "--prompts", "6", "--new-tokens", "8"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((out / "generation_gpu.json").read_text())
    assert doc["device"] == "cpu" and doc["model"].startswith("tiny-gen")
    rows = {r["system"]: r for r in doc["rows"]}
    assert {"full", "speculative (policy)", "CALM min-agreement 0.9"} <= set(rows)
    assert rows["speculative (policy)"]["identical"] == 6          # lossless, drafting or not
    assert len(doc["costs"]["splits"]) == 3 and doc["costs"]["head_s"] >= 0
    assert [t["min_agreement"] for t in doc["calibration"]["targets"]] == [0.8, 0.9, 0.95, 0.99]


def test_device_runner_equals_the_onnx_engine(tmp_path):
    """Same tokens and exits as the engine over the exported ONNX splits, the cache kept by the runner."""
    from e3.benchmarks.generation import engine_tokens
    from e3.generation.device_runner import DeviceRunner
    from e3.generation.decoder import tiny_decoder
    from e3.generation.engine import EngineSpec
    from e3.generation.repository import export_generation_repository, onnx_files
    torch.set_num_threads(1)
    spec = export_generation_repository("tiny-gen", tmp_path, progress=False)
    prompts = [[3, 9, 4], [1], [7, 7, 2, 5, 60, 11]]
    stateful = EngineSpec(**{**spec.__dict__, "kv_in_splits": True})
    for kw in (dict(mode="calm", tau=0.3), dict(mode="calm", tau=2.0, measure="classifier", thresholds=(0.6, 0.4)),
               dict(mode="speculative", tau=2.0, draft_tokens=3)):
        want, _ = engine_tokens(spec, onnx_files(tmp_path, spec), prompts, new_tokens=8, **kw)
        got, _ = engine_tokens(stateful, None, prompts, new_tokens=8, runner=DeviceRunner(tiny_decoder(), spec, "cpu"), **kw)
        assert [(g.tokens, g.exit_layers) for g in got] == [(w.tokens, w.exit_layers) for w in want], kw


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the GPU form runs on a lent GPU host")
def test_runner_on_the_gpu(tmp_path):
    from e3.benchmarks.generation_gpu import run
    doc = run(tmp_path, model="tiny-gen", prompts=4, new_tokens=8)
    assert doc["device"] != "cpu" and {r["system"] for r in doc["rows"]} >= {"full", "speculative (policy)"}
