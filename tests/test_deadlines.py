"""Inputs that cannot meet the SLO are dropped with an explicit error and counted; none vanishes."""

from __future__ import annotations

import re
import urllib.request

import pytest

from e3.client.sdk import ClientError, E3Client
from e3.controller.telemetry import parse_snapshots
from e3.controller.triton_api import TritonControl
from e3.core.telemetry import metric_samples
from e3.export.repository import ExportSettings, export_repository
from helpers import serving
from polling import wait_until

pytestmark = pytest.mark.e2e


def test_requests_past_their_slo_are_dropped_explicitly_and_counted(tmp_path, tiny_model):
    # An SLO of 0.5 ms: a batch cannot get through two BLS hops in time, so (nearly) every request
    # must come back as a "dropped" error (from a split's queue, or from the scheduler once it knows
    # what a split takes), never silently.
    export_repository("tiny-ee", "2", tmp_path, settings=ExportSettings(slo_ms=0.5), progress=False)
    ids, mask = (x.numpy() for x in tiny_model.example_inputs(30, seed=4))
    with serving(tmp_path, ["tiny_ee_split_1-2", "tiny_ee_split_3-4", "tiny_ee_router"], name="deadlines") as server:
        # the configured SLO, written as configured (not rounded to "0 ms" or "1 ms"), and why
        answered, dropped = _send_in_threes(server, ids, mask, r"dropped: tiny_ee cannot answer within its SLO of "
                                            r"0\.5 ms \(.*(tiny_ee_split_\d-\d|deadline)",
                                            lambda got: (got.exit_ramp > 0).all())

        def router_counters():
            text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
            handled = sum(v for name, labels, v in metric_samples(text) if labels.get("model") == "tiny_ee_router"
                          and name in ("nv_inference_request_success", "nv_inference_request_failure"))
            return parse_snapshots(text)["tiny_ee"], handled

        def settled():
            got = router_counters()
            return got if got[0].dropped >= dropped and got[0].inputs >= answered else None

        # the router hands its counts to Triton every 0.2 s: wait until this traffic's counts are there
        snap, handled = wait_until(settled, 10, "the router's counters")
    assert dropped >= 15, f"only {dropped} of 30 inputs dropped with a 0.5 ms SLO"
    assert snap.dropped == dropped          # the drop metric counts exactly the inputs the client saw dropped
    assert snap.inputs >= answered          # every input that entered split 1 is counted (some were dropped later)
    assert handled == 10                    # Triton saw all 10 requests answered (a per-request error response
    #                                         counts as a success for Triton: the Python backend answered it)


def test_a_split_queue_rejecting_an_expired_call_is_a_deadline_drop(tmp_path, tiny_model):
    # Split 3-4's own Triton batcher is made to wait 0.4 s for a batch of 8 (a config override: a split
    # queue slower than the SLO), while one client sends 3 inputs at a time: the scheduler sends split
    # 3-4 the survivors at once (nothing upstream can fill the batch), with 200 ms of SLO left at most,
    # so their BLS call expires in split 3-4's queue, where Triton rejects it. The router must read that
    # rejection as a deadline drop (BlsTimeout), not a failing split; a batch that exits whole in split
    # 1-2 is answered.
    # The splits' queue policy is opt-in (ExportSettings.split_queue_policy; off by default, see there).
    export_repository("tiny-ee", "2", tmp_path, settings=ExportSettings(slo_ms=200, queue_delay_us=0, split_queue_policy=True),
                      progress=False)
    # Triton rejects the expired call only when its batcher wakes (0.4 s), after the router's watchdog
    # would have answered it at the deadline (+50 ms; tests/test_hung_split.py): the watchdog's grace is
    # lengthened here so that the rejection itself is what the router reads.
    router_config = tmp_path / "tiny_ee_router" / "config.pbtxt"
    router_config.write_text(router_config.read_text() +
                             'parameters {\n  key: "watchdog_grace_ms"\n  value {\n    string_value: "5000"\n  }\n}\n')
    ids, mask = (x.numpy() for x in tiny_model.example_inputs(24, seed=5))
    with serving(tmp_path, ["tiny_ee_split_1-2", "tiny_ee_split_3-4", "tiny_ee_router"], name="queue-timeout") as server:
        with TritonControl(server.http_url) as control:
            config = control.model_config("tiny_ee_split_3-4")
            config["dynamic_batching"].update(preferred_batch_size=[8], max_queue_delay_microseconds=400_000)
            control.load("tiny_ee_split_3-4", config)
        answered, dropped = _send_in_threes(server, ids, mask, r"(?i)dropped: tiny_ee cannot answer within its SLO "
                                            r"of 200 ms \(tiny_ee_split_3-4: .*timeout expired",
                                            lambda got: (got.exit_ramp <= 2).all())  # never needed split 3-4

        def drops_by_reason():
            text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
            return {labels["reason"]: v for name, labels, v in metric_samples(text)
                    if name == "e3_dropped" and labels.get("model") == "tiny_ee"}

        drops = wait_until(lambda: sum(drops_by_reason().values()) >= dropped and drops_by_reason(), 10,
                           "the router's drop counters")
    assert dropped >= 6, f"only {dropped} of 24 inputs needed split 3-4; the test needs survivors"
    assert answered + dropped == 24
    assert drops == {"deadline": dropped}


def _send_in_threes(server, ids, mask, drop_pattern: str, answer_ok) -> tuple[int, int]:
    """Send the inputs three per request from one client. Each request must come back either answered
    (three answers, ``answer_ok(answers)`` true) or dropped with a message matching ``drop_pattern``.
    Returns (inputs answered, inputs dropped)."""
    answered, dropped = 0, 0
    with E3Client(server.http_url) as client:
        for i in range(0, len(ids), 3):
            try:
                got = client.infer("tiny_ee_router", {"input_ids": ids[i:i + 3], "attention_mask": mask[i:i + 3]})
            except ClientError as err:
                assert re.match(drop_pattern, str(err)), str(err)
                dropped += 3
            else:
                assert len(got.label) == 3 and answer_ok(got), got.exit_ramp
                answered += 3
    return answered, dropped
