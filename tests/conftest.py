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
    from e3.models.zoo import resolve_model
    return resolve_model(TINY)


@pytest.fixture(scope="session")
def tiny_repo(tmp_path_factory):
    """tiny-ee exported with one cut in the middle (splits 1-2 and 3-4), router and baselines.

    Its SLO is a generous 10 s, not the export default of 1 s: the tests on this shared server
    check answers, errors and telemetry, and a loaded 2-core CI machine once took over a second
    to get a cold split's first batches through, so the router (rightly) dropped a request and an
    answers test failed on timing. Deadline behaviour is tested on repositories of its own
    (test_deadlines.py, test_hung_split.py, test_scheduler_e2e.py)."""
    from e3.export.repository import ExportSettings, export_repository
    repo = tmp_path_factory.mktemp("repo")
    export_repository(TINY, TINY_CUTS, repo, settings=ExportSettings(slo_ms=10_000.0), progress=False)
    return repo


@pytest.fixture(scope="session")
def server(tiny_repo):
    """The real embedded tritonserver serving ``tiny_repo``, on free loopback ports; every e2e
    test that needs no server configuration of its own uses this one."""
    with serving(tiny_repo) as srv:
        yield srv
