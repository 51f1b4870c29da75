"""A split whose Python stub dies (Triton 2.51 does not restart it): requests fail with an explicit
error, the controller's probe recognises the dead stub, a reload brings the split back."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from e3.client.sdk import ClientError, E3Client
from e3.deploy.stubs import is_dead_stub
from e3.controller.triton_applier import TritonApplier
from e3.deploy.server import TritonServer

pytestmark = pytest.mark.e2e
SPLIT = "tiny_ee_split_3-4"


def _stub_pids(model: str, shm_prefix: str) -> list[int]:
    """This server's stub processes for ``model`` (its shm prefix is on their command line)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "triton_python_backend_stub" in cmd and f"/{model}/" in cmd and shm_prefix in cmd:
            pids.append(int(proc.name))
    return pids


def test_dead_stub_is_detected_and_reloaded(tiny_repo, tiny_model):
    ids, mask = (x.numpy() for x in tiny_model.example_inputs(6, seed=3))
    inputs = {"input_ids": ids, "attention_mask": mask}
    models = ["tiny_ee_split_1-2", SPLIT, "tiny_ee_router"]
    with TritonServer.on_free_ports(tiny_repo, models) as server:
        with E3Client(server.http_url) as client:
            before = client.infer("tiny_ee_router", inputs)
        pids = _stub_pids(SPLIT, server.shm_prefix)
        assert pids, "the split's stub process should be running"
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        with E3Client(server.http_url) as client:
            with pytest.raises(ClientError) as err:  # an explicit error, not a hang or a lost request
                client.infer("tiny_ee_router", inputs)
        assert SPLIT in str(err.value)
        applier = TritonApplier(server.http_url, metrics_url=server.metrics_url, repo=tiny_repo)
        try:
            message = applier.probe(SPLIT)
            assert is_dead_stub(message), message
            applier.reload(SPLIT)
            assert applier.probe(SPLIT) is None
        finally:
            applier.close()
        with E3Client(server.http_url) as client:
            after = client.infer("tiny_ee_router", inputs)
        assert (after.label == before.label).all() and (after.exit_ramp == before.exit_ramp).all()
