"""`e3 status --url` reads the cluster's controller (issue 39, Deliver 7): the controller's HTTP server (the one
the chart's --metrics-port serves, run in-process here) answers /status with what it wants in force, the pods
per pool and its last window, and `e3 status` prints it; an address that is not a controller (Triton, the
guard) is read as a Triton server, and one with nothing listening is an error that names it. In a cluster the
address is a `kubectl port-forward` of the controller's Service: that part needs a cluster."""

from __future__ import annotations

import json
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from e3.cli.main import main
from e3.controller.loop import StepReport
from e3.controller.metrics import STATUS_KIND, ControllerMetrics
from e3.controller.planner.placement import place
from e3.deploy.pools import load_pools
from e3.deploy.server import free_port
from helpers import make_plan, make_pools


@pytest.fixture
def controller():
    """A controller's metrics server on a free port, after one window that applied a plan."""
    pools = load_pools(make_pools())
    metrics = ControllerMetrics(pools=pools, window_s=10)
    port = metrics.serve(0, host="127.0.0.1")
    try:
        yield metrics, pools, f"127.0.0.1:{port}"
    finally:
        metrics.close()


def test_the_controller_answers_status_as_json(controller):
    metrics, pools, url = controller
    with urllib.request.urlopen(f"http://{url}/status", timeout=5) as r:
        before = json.loads(r.read())
    assert before["kind"] == STATUS_KIND and before["ready"] is False and before["windows"] == 0
    plan = place(make_plan(devices_=("cpu", "t4", "t4"), instances=(1, 2, 1)), pools)
    metrics.started(None)
    metrics.observe(StepReport(window=1, offered_rps=120.0, dropped_rps=4.5, planned_rps=120.0, applied=True,
                               decision="beats the running plan by 30%"), plan)
    with urllib.request.urlopen(f"http://{url}/status", timeout=5) as r:
        after = json.loads(r.read())
    assert after["ready"] is True and after["healthy"] is True
    assert (after["windows"], after["plans_applied"], after["window_errors"]) == (1, 1, 0)
    assert after["wanted_plan"]["plan_id"] == plan.plan_id
    assert after["desired_replicas"] == {"front": 1, "t4": 3, "t4b": 0}
    assert after["last_report"]["offered_rps"] == 120.0


def test_e3_status_url_prints_the_controllers_view(controller, capsys):
    metrics, pools, url = controller
    plan = place(make_plan(devices_=("cpu", "t4", "t4"), instances=(1, 2, 1)), pools)
    metrics.started(plan)
    metrics.observe(StepReport(window=3, offered_rps=120.0, dropped_rps=4.5, planned_rps=130.0, applied=True,
                               decision="beats the running plan by 30%", error=None), plan)
    assert main(["status", "--url", url]) == 0      # no --model: the controller knows its model
    out = capsys.readouterr().out
    assert f"controller at {url}: ready yes, healthy yes; 1 windows (0 failed), 1 plans applied" in out
    assert f"plan it wants in force: {plan.plan_id}" in out
    assert "pods each pool should run: front 1, t4 3, t4b 0" in out
    assert "offered 120.0 inputs/s, dropped 4.5 inputs/s; planned for 130.0 inputs/s" in out
    assert "APPLIED: beats the running plan by 30%" in out
    assert main(["status", "--url", f"http://{url}/"]) == 0   # a scheme and a slash are fine


class _NotAController(BaseHTTPRequestHandler):
    """What Triton or the guard answers on /status: not found."""
    def do_GET(self):  # noqa: N802 - http.server's name
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def test_an_address_that_is_no_controller_is_read_as_triton(capsys):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _NotAController)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"127.0.0.1:{server.server_address[1]}"
    try:
        assert main(["status", "--url", url]) == 2
        assert f"{url} is a Triton server, not a controller: give --model too" in capsys.readouterr().err
    finally:
        server.shutdown()
        server.server_close()


def test_nothing_listening_is_an_error_naming_the_address(capsys):
    url = f"127.0.0.1:{free_port()}"
    assert main(["status", "--url", url]) == 2
    assert f"cannot reach {url}" in capsys.readouterr().err
