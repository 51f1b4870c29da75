"""`e3 control` on the real tritonserver: the workload switches from an easy mix (most inputs exit at
ramp 1) to a hard mix (most reach the head) while the controller runs with 2.5 s windows. Within two
windows after the switch the router's live plan is the planner's plan for the observed forecast, and
no request fails across any reconfiguration.

tiny-ee has random weights, so "easy" and "hard" inputs are chosen by their exit ramp under the
model's own rule (the PyTorch reference). The latency profile is synthetic (tests/test_controller.py):
the point is the control loop, and under it the two mixes have different optimal plans.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from e3.client.loadgen import closed_loop
from e3.controller.decisions import layout
from e3.controller.forecast import make_forecaster
from e3.controller.loop import Controller, ProfilePlanner
from e3.controller.settings import ControlSettings
from e3.controller.telemetry import TelemetryReader
from e3.controller.triton_applier import TritonApplier
from e3.controller.triton_api import TritonControl
from e3.core.exits import make_exit_rule
from e3.core.profile import BatchProfile
from e3.models.reference import reference_answers
from helpers import serving_every_range
from polling import wait_until
from helpers import DEVICES, RATE_RPS, SLO_MS, synthetic_profile

pytestmark = pytest.mark.e2e
WINDOW_S = 2.5
EASY_RANGES = [(1, 1, 1), (2, 4, 1)]
HARD_RANGES = [(1, 4, 2)]


def _ranges(plan):
    return [(s.first_block, s.last_block, s.instances) for s in plan.splits]


@pytest.fixture(scope="module")
def control_server(tmp_path_factory):
    with serving_every_range(tmp_path_factory, "control-repo") as server:
        yield server


def _pools(tiny_model, n=600, share=0.85, size=200):
    """Easy and hard input pools: ``share`` of inputs exiting at ramp 1 (easy) or reaching the head (hard)."""
    ids, mask = (x.numpy() for x in tiny_model.example_inputs(n, seed=5))
    ref = reference_answers(tiny_model, (ids, mask), make_exit_rule(tiny_model.card.exit_rule))
    clear = ref.min_margin > 1e-5
    L = tiny_model.card.num_blocks
    easy, hard = np.nonzero(clear & (ref.exit_ramp == 1))[0], np.nonzero(clear & (ref.exit_ramp == L))[0]
    major, minor = int(size * share), size - int(size * share)
    assert len(easy) >= major and len(hard) >= major, "not enough easy/hard inputs: raise n"
    rng = np.random.default_rng(0)
    pools = {}
    for name, idx in (("easy", np.concatenate([easy[:major], hard[:minor]])),
                      ("hard", np.concatenate([hard[:major], easy[:minor]]))):
        idx = rng.permutation(idx)
        pools[name] = {"input_ids": ids[idx], "attention_mask": mask[idx]}
    return pools


def test_controller_follows_a_mix_switch_without_failed_requests(control_server, tiny_model, tmp_path):
    card = tiny_model.card
    latency = synthetic_profile()
    # constant splits only (as tests/test_controller.py): with compact splits this CPU-like profile gives
    # both mixes one compact split, and the point here is a switch between two plans
    planner = ProfilePlanner(latency, exit_rule=card.exit_rule, ramp_blocks=card.ramp_blocks, slo_ms=SLO_MS,
                             rate_rps=RATE_RPS, forms=("constant",))
    # The synthetic profile separates the two mixes (checked here with the planner directly).
    L = card.num_blocks
    easy_reach, hard_reach = [1.0] + [0.15] * (L - 1), [1.0] + [0.85] * (L - 1)
    assert _ranges(planner.plan(BatchProfile("tiny_ee", 8, easy_reach), DEVICES)) == EASY_RANGES
    assert _ranges(planner.plan(BatchProfile("tiny_ee", 8, hard_reach), DEVICES)) == HARD_RANGES
    pools = _pools(tiny_model)

    url = control_server.http_url
    settings = ControlSettings(model="tiny_ee", devices=dict(DEVICES), slo_ms=SLO_MS, rate_rps=RATE_RPS,
                               window_s=WINDOW_S, state_dir=tmp_path)
    applier = TritonApplier(url, metrics_url=control_server.metrics_url, repo=control_server.repo,
                            zoo_model="tiny-ee")
    controller = Controller(settings, telemetry=TelemetryReader(control_server.metrics_url, "tiny_ee",
                                                                window_s=WINDOW_S, num_blocks=L),
                            forecaster=make_forecaster("arima"), planner=planner, view=applier)
    results, rounds_at, phase_start = [], [], {}
    stop_load, stop_control = threading.Event(), threading.Event()
    mix = {"name": "easy"}

    def drive():
        while not stop_load.is_set():
            name = mix["name"]
            begun = time.monotonic()
            results.append(closed_loop(url, "tiny_ee_router", pools[name], concurrency=4, batch=4, requests=40))
            rounds_at.append((begun, time.monotonic()))

    watcher = TritonControl(url)      # one HTTP client per thread: the controller's runs in its own

    def live():
        return watcher.current_plan("tiny_ee_router")

    start = time.monotonic()
    loader = threading.Thread(target=drive, daemon=True)
    loop = threading.Thread(target=lambda: controller.run(stop_control), daemon=True)
    loader.start()
    loop.start()
    try:
        # the easy plan serves, and the window whose step applied it has been reported
        easy_window = wait_until(
            lambda: _ranges(live()) == EASY_RANGES and next((r.window for r in controller.reports if r.applied), 0),
            20, poll_s=0.2, what=lambda: f"the easy plan; decisions: {[r.decision for r in controller.reports]}")
        # one steady window with traffic under the easy plan: the next window after the one that applied it
        wait_until(lambda: any(r.window > easy_window and r.observed for r in controller.reports),
                   2 * WINDOW_S + 6, "a window under the easy plan")
        mix["name"] = "hard"
        switch_at = phase_start["hard"] = time.monotonic()
        wait_until(lambda: _ranges(live()) == HARD_RANGES, 3 * WINDOW_S + 6, poll_s=0.2,
                   what=lambda: f"the hard plan; decisions: {[r.decision for r in controller.reports]}")
        applied_at = time.monotonic()
        # traffic keeps flowing after the switch: two more load rounds end under the new plan, then stop
        rounds = len(results)
        wait_until(lambda: len(results) >= rounds + 2, 60, "load rounds after the switch")
    finally:
        stop_load.set()
        loader.join(timeout=60)
        stop_control.set()
        loop.join(timeout=60)

    reports = controller.reports
    after = [r for r in reports if r.closed_at_s > switch_at]
    applied = [r for r in after if r.applied]
    summary = [(r.window, round(r.closed_at_s - start, 1), r.observed and [round(x, 2) for x in r.observed],
                r.applied, r.decision) for r in reports]
    assert applied, f"no plan applied after the switch: {summary}"
    windows_until = after.index(applied[0]) + 1
    assert windows_until <= 2, summary
    # The router's live plan is the one the controller applied last, and it is the planner's plan for
    # the forecast the controller made from the observed window.
    with watcher:
        final = watcher.current_plan("tiny_ee_router")
        loaded = {name for name, state in watcher.loaded().items() if state == "READY" and "_split_" in name}
    assert final.plan_id == controller.history.last_good.plan_id == applied[0].candidate["plan_id"]
    forecast = BatchProfile("tiny_ee", 8, applied[0].forecast)
    assert layout(final) == layout(planner.plan(forecast, DEVICES))
    assert _ranges(final) == HARD_RANGES
    assert loaded >= {s.model for s in final.splits}
    # No request failed, over the whole run and across every reconfiguration.
    total = sum(r.requests for r in results)
    errors = sum(r.errors for r in results)
    messages = sum((r.error_messages for r in results), start=type(results[0].error_messages)())
    # on failure: when the failing rounds ran, from the switch, and their slowest answers
    failing = [(round(a - switch_at, 2), round(b - switch_at, 2), r.errors, round(max(r.latencies_ms, default=0)))
               for (a, b), r in zip(rounds_at, results) if r.errors]
    assert errors == 0, (messages.most_common(3), failing, summary)
    assert total > 200
    print(f"\ncontrol e2e: {len(reports)} windows, switch at {switch_at - start:.1f} s, hard plan applied "
          f"{applied_at - switch_at:.1f} s later at window {windows_until} after the switch; "
          f"{total} requests, {errors} failed; plans applied: {len(controller.history.entries)}")
