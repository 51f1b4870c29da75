"""Shared fixtures: one export and one real tritonserver per test session."""

from __future__ import annotations

import os

import pytest
import torch

from e3.paths import artifacts_dir

torch.set_num_threads(1)  # the machine has 2 cores; Triton gets the rest

TINY = "tiny-ee"
TINY_CUTS = "2"


@pytest.fixture(scope="session")
def tiny_model():
    from e3.export.zoo import resolve_model
    return resolve_model(TINY)


@pytest.fixture(scope="session")
def tiny_repo(tmp_path_factory):
    """tiny-ee exported with one cut in the middle (splits 1-2 and 3-4), router and baselines."""
    from e3.export.repository import ExportSettings, export_repository
    repo = tmp_path_factory.mktemp("repo")
    export_repository(TINY, TINY_CUTS, repo, ExportSettings(), progress=False)
    return repo


@pytest.fixture(scope="session")
def server(tiny_repo):
    """The real embedded tritonserver serving ``tiny_repo``, on free loopback ports."""
    from e3.deploy.server import TritonServer
    log = artifacts_dir() / "logs" / f"test-tritonserver-{os.getpid()}.log"
    with TritonServer.on_free_ports(tiny_repo, log_file=log) as srv:
        yield srv
