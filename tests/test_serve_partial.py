"""`e3 serve` with a model that does not load: the others are served, and the one that failed is named with
Triton's reason (before, one bad model kept tritonserver from starting at all)."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest

from e3.client.sdk import E3Client
from e3.deploy.server import free_port
from helpers import read_until_serving

pytestmark = pytest.mark.e2e

BROKEN_CONFIG = """name: "broken"
backend: "python"
max_batch_size: 8
input [ { name: "x" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 1 ] } ]
"""


def test_e3_serve_serves_what_loads_and_names_what_did_not(tiny_repo, tiny_model, tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copytree(tiny_repo / "tiny_ee_stock", repo / "tiny_ee_stock")
    (repo / "broken" / "1").mkdir(parents=True)
    (repo / "broken" / "config.pbtxt").write_text(BROKEN_CONFIG)
    (repo / "broken" / "1" / "model.py").write_text(
        "class TritonPythonModel:\n    def initialize(self, args):\n        raise RuntimeError('no weights here')\n")
    http = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "e3.cli", "serve", "--repo", str(repo),
                             "--models", "broken,tiny_ee_stock", "--http-port", str(http),
                             "--grpc-port", str(free_port()), "--metrics-port", str(free_port()), "--no-restart"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = read_until_serving(proc)
        text = "".join(lines)
        assert any(l.startswith("serving ") for l in lines), text[-3000:]
        named = [l for l in lines if "broken did not load and is not served" in l]
        assert named and "no weights here" in named[0], text[-3000:]
        ids, mask = (x.numpy() for x in tiny_model.example_inputs(2, seed=1))
        with E3Client(f"127.0.0.1:{http}") as client:
            answers = client.infer("tiny_ee_stock", {"input_ids": ids, "attention_mask": mask})
        assert answers.label.shape == (2,) and np.isfinite(answers.probs).all()
    finally:
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, rest
