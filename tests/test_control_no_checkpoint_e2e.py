"""`e3 control --once --dry-run` with no checkpoint anywhere: the controller plans from the latency profile and
the plan the router serves (or the repository's manifest), never from the model's weights. It runs in a fresh
process whose artifacts folder is empty (no checkpoints) and where importing the model zoo, the checkpoint
reader or torch raises, against a real tritonserver serving tiny-ee under traffic; its window is planned
(a candidate plan is printed) and its metrics endpoint publishes the desired replicas."""

from __future__ import annotations

import http.client
import os
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np
import pytest

from e3.deploy.server import free_port
from helpers import synthetic_profile

pytestmark = pytest.mark.e2e
ROUTER = "tiny_ee_router"

# Run in the child: no zoo, no checkpoints, no torch; then `e3 control ...` with the arguments given.
GUARD = """
import sys
BLOCKED = ("e3.models.zoo", "e3.models.checkpoints", "torch")
class Block:
    def find_spec(self, name, path=None, target=None):
        if name in BLOCKED or name.startswith(tuple(b + "." for b in BLOCKED)):
            raise ImportError(f"blocked in this test: {name} (the controller must not need the model)")
sys.meta_path.insert(0, Block())
from e3.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    from e3.deploy.server import TritonServer
    from e3.export.repository import ExportSettings, export_repository
    from e3.paths import artifacts_dir
    repo = tmp_path_factory.mktemp("nockpt-repo")
    export_repository("tiny-ee", "2", repo, settings=ExportSettings(baselines=False), progress=False)
    log = artifacts_dir() / "logs" / f"test-tritonserver-nockpt-{os.getpid()}.log"
    server = TritonServer.on_free_ports(repo, [ROUTER, "tiny_ee_split_1-2", "tiny_ee_split_3-4"], exit_timeout_s=3,
                                        log_file=log)
    with server:
        yield server, repo


def _traffic(url: str, stop: threading.Event) -> None:
    import tritonclient.http as http
    rng = np.random.default_rng(0)
    with http.InferenceServerClient(url) as client:
        while not stop.is_set():
            ids = rng.integers(1, 512, size=(4, 16)).astype(np.int64)
            mask = np.ones((4, 16), dtype=np.int64)
            inputs = []
            for name, value in (("input_ids", ids), ("attention_mask", mask)):
                t = http.InferInput(name, list(value.shape), "INT64")
                t.set_data_from_numpy(value)
                inputs.append(t)
            client.infer(ROUTER, inputs)


def _control(server, tmp_path, *extra):
    """Run the guarded `e3 control --once --dry-run` under traffic; (returncode, output, metrics text)."""
    profile = tmp_path / "profile.json"
    synthetic_profile().save(profile)
    empty = tmp_path / "artifacts"
    empty.mkdir(exist_ok=True)
    port = free_port()
    cmd = [sys.executable, "-c", GUARD, "control", "--model", "tiny-ee", "--latency-profile", str(profile),
           "--devices", "cpu:2", "--slo-ms", "1000", "--rate-rps", "20", "--url", server.http_url,
           "--metrics-url", server.metrics_url, "--once", "--dry-run", "--window-s", "2", "--follow-traffic",
           "--state-dir", str(tmp_path / "state"), "--metrics-port", str(port), *extra]
    stop = threading.Event()
    sender = threading.Thread(target=_traffic, args=(server.http_url, stop), daemon=True)
    sender.start()
    metrics = ""
    try:
        child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path,
                                 env={**os.environ, "E3_ARTIFACTS": str(empty)})
        deadline = time.monotonic() + 60
        while child.poll() is None and time.monotonic() < deadline and "e3_controller_desired_replicas{" not in metrics:
            try:   # the metrics endpoint, while the window runs
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                    metrics = r.read().decode()
            except (OSError, http.client.HTTPException):   # not up yet, or the child exiting mid-read
                time.sleep(0.2)
        out, _ = child.communicate(timeout=90)
    finally:
        stop.set()
        sender.join(timeout=10)
    assert not (empty / "checkpoints").exists()
    return child.returncode, out, metrics


def test_dry_run_needs_no_checkpoint_from_the_routers_plan(tiny_server, tmp_path):
    server, _ = tiny_server
    rc, out, _ = _control(server, tmp_path, "--repo", "")
    assert rc == 0, out
    assert "DRY RUN" in out and "model facts from tiny_ee_router's running plan" in out
    assert "planner's plan" in out and "tiny_ee_split_" in out, out      # the window was planned
    assert "planned for" in out and "blocked in this test" not in out


def test_dry_run_needs_no_checkpoint_from_the_manifest_and_publishes_metrics(tiny_server, tmp_path):
    server, repo = tiny_server
    pools = tmp_path / "pools.json"
    pools.write_text('{"pools": [{"name": "main", "device": "cpu", "deployment": "e3-triton-main", '
                     f'"grpc_url": "{server.grpc_url}", "http_url": "{server.http_url}", '
                     '"devices_per_pod": 2, "router": true}]}')
    rc, out, metrics = _control(server, tmp_path, "--repo", str(repo), "--pools", str(pools))
    assert rc == 0, out
    assert "model facts from the repository's manifest" in out
    assert 'e3_controller_desired_replicas{pool="main"} 1.0' in metrics, metrics


def test_no_plan_and_no_repository_is_a_clear_error(tiny_server, tmp_path):
    """A live server whose router serves no plan, no --plan, no visible repository: an error that says what to
    give; a server that is not there: an error that says so."""
    from e3.deploy.server import free_port
    server, _ = tiny_server
    profile = tmp_path / "p.json"
    synthetic_profile().save(profile)

    def control(url, model):
        return subprocess.run([sys.executable, "-c", GUARD, "control", "--model", model, "--latency-profile",
                               str(profile), "--devices", "cpu:2", "--slo-ms", "1000", "--rate-rps", "20", "--url",
                               url, "--repo", "", "--once", "--dry-run", "--state-dir", str(tmp_path)],
                              capture_output=True, text=True, timeout=120,
                              env={**os.environ, "E3_ARTIFACTS": str(tmp_path)})
    run = control(server.http_url, "absent-ee")        # absent_ee_router is not served there
    assert run.returncode == 2 and "give --plan PLAN.json" in run.stderr, run.stderr
    run = control(f"127.0.0.1:{free_port()}", "tiny-ee")
    assert run.returncode == 2 and "cannot reach the server" in run.stderr, run.stderr
