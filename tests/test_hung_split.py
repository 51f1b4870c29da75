"""Reliability item 7 on the real tritonserver: a split whose execute hangs. The request in the stuck batch
gets the explicit SLO error at its deadline (not when the call returns), the router keeps serving the
other requests meanwhile, and the late return of the stuck call answers nothing twice."""

from __future__ import annotations

import re
import threading
import time
import urllib.request
from dataclasses import replace

import numpy as np
import pytest

from e3.client.sdk import ClientError, E3Client
from e3.controller.triton_api import TritonControl
from e3.core.exits import make_exit_rule
from e3.core.plan import CONSTANT, default_plan
from e3.core.telemetry import metric_samples
from e3.models.reference import reference_answers
from e3.export.repository import ExportSettings, export_repository
from helpers import serving
from polling import wait_until

pytestmark = pytest.mark.e2e
ROUTER, SPLIT = "tiny_ee_router", "tiny_ee_split_1-4"
SLO_MS = 1000.0
HANG_S = 6.0   # far past the SLO: a watchdog answering at the deadline and a late return differ by 5 s

# Test-only split: tiny_ee_split_1-4 whose execute sleeps HANG_S when a row's token ids are all MARKER
# (an input no tokenizer makes), then answers as the real split does; it leaves a file when it wakes.
HANGING_MODEL = '''"""Test-only: {split} that hangs on a marked input (tests/test_hung_split.py)."""
import pathlib
import time

import triton_python_backend_utils as pb_utils

from e3.serving.split import TritonPythonModel as Split


class TritonPythonModel(Split):
    def execute(self, requests):
        for request in requests:
            ids = pb_utils.get_input_tensor_by_name(request, "input_ids").as_numpy()
            if (ids == {marker}).all(axis=1).any():
                time.sleep({hang_s})
                pathlib.Path({woke!r}).touch()
                break
        return super().execute(requests)
'''


def _dropped_deadline(server) -> float:
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    return sum(v for name, labels, v in metric_samples(text)
               if name == "e3_dropped" and labels.get("model") == "tiny_ee" and labels.get("reason") == "deadline")


def test_a_hung_split_answers_its_request_at_the_deadline_and_the_router_keeps_serving(tmp_path, tiny_model):
    card = tiny_model.card
    marker = card.inputs[0].bounds[1]                          # the largest token id, in every position
    repo, woke = tmp_path / "repo", tmp_path / "woke"
    export_repository("tiny-ee", "2", repo, settings=ExportSettings(), progress=False, extra_ranges=[(1, 4)])
    (repo / SPLIT / "1" / "model.py").write_text(
        HANGING_MODEL.format(split=SPLIT, marker=marker, hang_s=HANG_S, woke=str(woke)))
    config = repo / SPLIT / "config.pbtxt"                     # 2 instances: one hangs, one serves
    config.write_text(config.read_text().replace("count: 1", "count: 2"))
    plan = default_plan("tiny_ee", card.num_blocks, [(1, 4)], exit_rule=card.exit_rule, ramp_blocks=card.ramp_blocks,
                        batch_size=4, instances=2, slo_ms=SLO_MS, queue_delay_us=0)
    plan = replace(plan, splits=tuple(replace(s, form=CONSTANT) for s in plan.splits))
    ids, mask = (x.numpy() for x in tiny_model.example_inputs(240, seed=13))
    ref = reference_answers(tiny_model, (ids, mask), make_exit_rule(card.exit_rule), enabled_ramps=plan.enabled_ramps)
    clear = ref.min_margin > 1e-5

    with serving(repo, [SPLIT, ROUTER], name="hung-split") as server:
        log_start = server.log_file.stat().st_size
        with TritonControl(server.http_url) as control:
            control.switch_plan(ROUTER, plan)

        answers: dict[int, tuple[int, int, float]] = {}   # input -> (label, exit ramp, when answered)
        failures: list[str] = []

        def client(rows):
            with E3Client(server.http_url) as c:
                for i in rows:
                    try:
                        got = c.infer(ROUTER, {"input_ids": ids[i:i + 1], "attention_mask": mask[i:i + 1]})
                        answers[i] = int(got.label[0]), int(got.exit_ramp[0]), time.monotonic()
                    except ClientError as err:
                        failures.append(str(err))

        def load(rows, workers=4):
            threads = [threading.Thread(target=client, args=(rows[w::workers],)) for w in range(workers)]
            for t in threads:
                t.start()
            return threads

        for t in load(range(40)):                               # warm-up: the scheduler learns the split's time
            t.join()

        hung: list = []

        def marked():
            with E3Client(server.http_url) as c:
                began = time.monotonic()
                try:
                    c.infer(ROUTER, {"input_ids": np.full_like(ids[:1], marker), "attention_mask": mask[:1]})
                    hung.append(("answered", time.monotonic() - began))
                except ClientError as err:
                    hung.append((str(err), time.monotonic() - began))

        sent = time.monotonic()
        marked_thread = threading.Thread(target=marked)
        marked_thread.start()
        time.sleep(0.3)   # the marked input goes alone into its batch (split 1 dispatches at once, delay 0)
        others = load(range(40, 200))                           # other clients, while the call hangs
        for t in [marked_thread, *others]:
            t.join()
        (message, hung_s), = hung
        during = [i for i, (_, _, at) in answers.items() if i >= 40 and at < sent + HANG_S]
        wait_until(woke.exists, HANG_S + 10, "the hung call to return")
        for t in load(range(200, 240)):                         # after the late return: serving as before
            t.join()
        wait_until(lambda: _dropped_deadline(server) >= 1, 10, "the router's drop counter")
        time.sleep(0.5)                                         # two flushes more: a second drop would show
        dropped = _dropped_deadline(server)
        log = server.log_file.read_text()[log_start:]

    assert re.fullmatch(r"dropped: tiny_ee cannot answer within its SLO of 1000 ms \(tiny_ee_split_1-4 had not "
                        r"returned by the deadline; its call was abandoned\)", message), message
    print(f"hung split: explicit deadline error after {hung_s:.2f} s (SLO {SLO_MS / 1e3:g} s, execute hung "
          f"{HANG_S:g} s); {len(during)} other requests answered meanwhile, {len(answers) - 40} of 200 after warm-up, "
          f"{len(failures)} failed; late return: {dropped:g} input dropped, no second response")
    assert SLO_MS / 1e3 * 0.95 <= hung_s < HANG_S / 2        # at its deadline, not when the call returned
    assert not failures, failures[:3]
    assert len(during) >= 40                                   # the router kept serving during the hang
    got = np.array([answers[i][:2] for i in range(240)])
    assert (got[clear, 0] == ref.label[clear]).all() and (got[clear, 1] == ref.exit_ramp[clear]).all()
    assert dropped == 1                                        # the one marked input, once
    assert "could not send a response" not in log              # the late return sent nothing
