"""Reconfiguration under load, the short versions of reliability items 4 and 5 (`make test`), at once on the
session's shared server while 16 client threads send 3-input requests to the router:

* item 4: each split is resized 1 -> 4 -> 2 -> 8 -> 1 instances (Triton's model-repository API, as the
  controller does it), both splits at the same time, one controller thread each, each size held
  ``HOLD_S`` under load;
* item 5: the router's plan is switched 4 times, changing the cuts every time (``LAYOUTS``, then back to
  the session's own plan and its exact config), each plan serving ``SERVED`` requests before the next.
  The shared server's only split models are 1-2 and 3-4, so the plans mix those constant splits with
  compact ones (blocks the router runs itself).

No request may fail, and every request gets the same label and exit (probabilities may differ in their
last bits between a compact and a constant split). The two run together because each is mostly waiting on
Triton, and a controller does both to a live server too. Measured: taking a split from 8 instances to 1
took 8.6 s with no load, the same for a Python model that does nothing: Triton's Python backend sleeps 1 s
for every instance it removes (``StubLauncher::UpdateHealth``, called as an instance is torn down,
``src/stub_launcher.cc``), one instance after the other, so the 18 removals here cost at least 18 s; a
router reload takes 2-3 s. The long versions
(tests/test_reliability_resize.py, tests/test_reliability_replans.py: 100 re-plans) run in
`make reliability`, which skips this file's test."""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from e3.controller.triton_api import TritonControl
from e3.core.plan import COMPACT, CONSTANT, Plan, default_plan
from helpers import json_request, post_until
from polling import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(bool(os.environ.get("E3_RELIABILITY")),
                                                  reason="make reliability runs the long versions")]
ROUTER = "tiny_ee_router"
SPLITS = ["tiny_ee_split_1-2", "tiny_ee_split_3-4"]
STEPS = (4, 2, 8, 1)
HOLD_S = 0.1       # time at each size under load
CLIENTS = 16
SERVED = 50        # requests each plan answers before the next switch
# block ranges and their forms; the constant ones are the shared server's split models
LAYOUTS = ([((1, 1), COMPACT), ((2, 4), COMPACT)],
           [((1, 2), CONSTANT), ((3, 3), COMPACT), ((4, 4), COMPACT)],
           [((1, 3), COMPACT), ((4, 4), COMPACT)])


def _plans(card, original: Plan) -> list[Plan]:
    """``LAYOUTS`` as plans (the session's SLO and exit rule), then ``original``."""
    plans = []
    for layout in LAYOUTS:
        plan = default_plan(original.model, card.num_blocks, [r for r, _ in layout], exit_rule=card.exit_rule,
                            ramp_blocks=card.ramp_blocks, batch_size=4, slo_ms=original.slo_ms)
        plans.append(dataclasses.replace(plan, splits=tuple(
            dataclasses.replace(s, form=form) for s, (_, form) in zip(plan.splits, layout))))
    return [*plans, original]


def _cuts(plan: Plan) -> tuple[int, ...]:
    return tuple(s.last_block for s in plan.splits[:-1])


def test_resizing_every_split_and_replanning_the_cuts_under_16_clients_fails_no_request(server, tiny_model):
    ids, mask = (x.numpy() for x in tiny_model.example_inputs(3, seed=5))
    body = json_request(ids, mask)
    outcomes: list[tuple[int, str]] = []
    stop = threading.Event()
    took: dict[str, float] = {}
    with TritonControl(server.http_url) as control:
        configs = {m: control.model_config(m) for m in (*SPLITS, ROUTER)}   # put back if the test fails midway
        counts = {s: configs[s]["instance_group"][0]["count"] for s in SPLITS}
        assert counts == dict.fromkeys(SPLITS, 1), counts   # the steps start and end at 1
        original = control.current_plan(ROUTER)
    plans = _plans(tiny_model.card, original)
    cuts = [_cuts(p) for p in (original, *plans)]
    assert all(a != b for a, b in zip(cuts, cuts[1:])), cuts   # every switch changes the cuts

    def resize(split: str) -> None:
        began = time.monotonic()
        with TritonControl(server.http_url) as control:
            for count in STEPS:
                control.set_instances(split, count)
                assert control.model_config(split)["instance_group"][0]["count"] == count
                time.sleep(HOLD_S)
        took[split] = time.monotonic() - began

    def replan() -> None:
        began = time.monotonic()
        with TritonControl(server.http_url) as control:
            for plan in plans:
                control.switch_plan(ROUTER, plan)
                served = len(outcomes)
                wait_until(lambda: len(outcomes) >= served + SERVED, 60, f"plan {plan.plan_id} serving the load")
            took["replans"] = time.monotonic() - began
            took["final"] = control.current_plan(ROUTER).plan_id

    threads = [threading.Thread(target=post_until, args=(server.http_port, ROUTER, body, stop, outcomes), daemon=True)
               for _ in range(CLIENTS)]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: len(outcomes) >= SERVED, 60, "the session's plan serving the load")
        began = time.monotonic()
        with ThreadPoolExecutor(len(SPLITS) + 1) as pool:
            jobs = [pool.submit(resize, s) for s in SPLITS] + [pool.submit(replan)]
            for job in jobs:
                job.result()
        total_s = time.monotonic() - began
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=150)
        with TritonControl(server.http_url) as control:   # the tests after this one share the server
            for model, config in configs.items():
                if control.model_config(model) != config:
                    control.load(model, config)
    failed = [text for status, text in outcomes if status != 200]
    answers = {json.dumps(sorted((o["name"], o["data"]) for o in json.loads(text)["outputs"] if o["name"] != "probs"))
               for status, text in outcomes if status == 200}
    print(f"resize (short): {len(SPLITS)} splits at once through {' -> '.join(map(str, (1, *STEPS)))} instances in "
          f"{max(took[s] for s in SPLITS):.1f} s while the router was re-planned; replans (short): {len(plans)} "
          f"switches through cuts {' -> '.join(map(str, cuts))} (constant and compact splits) in "
          f"{took['replans']:.1f} s; together {total_s:.1f} s under {CLIENTS} clients: {len(outcomes)} requests, "
          f"{len(failed)} failed")
    assert took["final"] == original.plan_id
    assert outcomes and not failed, failed[:3]
    assert len(answers) == 1, answers   # resizing and re-planning change where compute happens, never the answer
