"""Inputs that cannot meet the SLO are dropped with an explicit error and counted; none vanishes."""

from __future__ import annotations

import time
import urllib.request

import pytest

from e3.client.sdk import ClientError, E3Client
from e3.deploy.server import TritonServer
from e3.export.repository import ExportSettings, export_repository

pytestmark = pytest.mark.e2e


def test_requests_past_their_slo_are_dropped_explicitly_and_counted(tmp_path, tiny_model):
    # An SLO of 0.5 ms: the budget (floored at 1 ms) runs out before a batch gets through two
    # BLS hops, so (nearly) every request must come back as a "dropped" error, never silently.
    export_repository("tiny-ee", "2", tmp_path, ExportSettings(slo_ms=0.5), progress=False)
    ids, mask = (x.numpy() for x in tiny_model.example_inputs(30, seed=4))
    answered, dropped = 0, 0
    with TritonServer.on_free_ports(tmp_path, ["tiny_ee_split_1-2", "tiny_ee_split_3-4", "tiny_ee_router"]) as server:
        with E3Client(server.http_url) as client:
            for i in range(0, 30, 3):
                try:
                    got = client.infer("tiny_ee_router", {"input_ids": ids[i:i + 3], "attention_mask": mask[i:i + 3]})
                    answered += len(got.label)
                except ClientError as err:
                    assert "dropped: tiny_ee cannot answer within its SLO of 0 ms" in str(err) or \
                           "dropped: tiny_ee cannot answer within its SLO of 1 ms" in str(err), str(err)
                    dropped += 3
        from e3.controller.telemetry import parse_snapshots
        time.sleep(0.5)  # the router hands its counts to Triton every 0.2 s, also when traffic has stopped
        text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
        snap = parse_snapshots(text)["tiny_ee"]
    assert answered + dropped == 30
    assert dropped >= 15, f"only {dropped} of 30 inputs dropped with a 0.5 ms SLO"
    assert snap.dropped == dropped
    assert snap.inputs == answered  # answered inputs are counted in the batch profile, dropped ones are not
