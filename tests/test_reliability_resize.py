"""Instance resizing under load (reliability, item 4): each split goes 1 -> 4 -> 2 -> 8 -> 1 instances
(Triton's model-repository API, as the controller does it) while 16 client threads send requests to the
router; no request fails and every answer equals the answer before the resizing.

Runs in `make reliability` only (E3_RELIABILITY=1): about a minute. The short version (`make test`), both
splits at once while the router is re-planned, is tests/test_reliability_reconfigure.py."""

from __future__ import annotations

import http.client
import json
import os
import threading
import time

import pytest

from e3.controller.triton_api import TritonControl
from helpers import json_request, post_until, serving

pytestmark = [pytest.mark.e2e, pytest.mark.reliability,
              pytest.mark.skipif(not os.environ.get("E3_RELIABILITY"), reason="about a minute: make reliability")]
SPLITS = ["tiny_ee_split_1-2", "tiny_ee_split_3-4"]
ROUTER = "tiny_ee_router"
STEPS = (4, 2, 8, 1)
THREADS = 16


def test_resizing_every_split_under_16_clients_fails_no_request(tiny_repo, tiny_model):
    ids, mask = (x.numpy() for x in tiny_model.example_inputs(4, seed=21))
    body = json_request(ids, mask)
    outcomes: list[tuple[int, str]] = []
    stop = threading.Event()

    def client(port: int):
        post_until(port, ROUTER, body, stop, outcomes)

    with serving(tiny_repo, [*SPLITS, ROUTER], name="resize") as server, TritonControl(server.http_url) as control:
        expected = json.loads(_one(server.http_port, body))["outputs"]
        threads = [threading.Thread(target=client, args=(server.http_port,), daemon=True) for _ in range(THREADS)]
        for t in threads:
            t.start()
        began = time.monotonic()
        for split in SPLITS:
            for count in STEPS:
                control.set_instances(split, count)
                assert control.model_config(split)["instance_group"][0]["count"] == count
        took = time.monotonic() - began
        stop.set()
        for t in threads:
            t.join(timeout=150)
    failed = [text for status, text in outcomes if status != 200]
    answers = {json.dumps(json.loads(text)["outputs"], sort_keys=True) for status, text in outcomes if status == 200}
    print(f"resize: {len(SPLITS)} splits through {' -> '.join(map(str, (1, *STEPS)))} instances in {took:.1f} s "
          f"under {THREADS} clients: {len(outcomes)} requests, {len(failed)} failed")
    assert outcomes and not failed, failed[:3]
    assert answers == {json.dumps(expected, sort_keys=True)}


def _one(port: int, body: str) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", f"/v2/models/{ROUTER}/infer", body=body)
        r = conn.getresponse()
        assert r.status == 200
        return r.read().decode()
    finally:
        conn.close()
