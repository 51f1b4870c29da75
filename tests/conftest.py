"""Shared fixtures: one export and one real tritonserver per test session."""

from __future__ import annotations

import pytest
import torch

from helpers import serving

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
    """The real embedded tritonserver serving ``tiny_repo``, on free loopback ports; every e2e
    test that needs no server configuration of its own uses this one."""
    with serving(tiny_repo) as srv:
        yield srv
