"""The controller's own endpoint: Prometheus metrics and its health, for probes and autoscalers.

``/metrics`` (Prometheus text format, ``prometheus_client``):

* ``e3_controller_desired_replicas{pool}`` -- pods each pool should run for the plan the controller wants
  in force (:func:`e3.controller.signals.desired_replicas`): the signal an HPA (External metric, target
  AverageValue 1) or a KEDA ScaledObject (Prometheus trigger) scales a pool's Deployment on, when the chart
  gives the replicas to one of them instead of the controller;
* ``e3_controller_dropped_rate`` -- inputs/s the router dropped in the last window (the desired replicas'
  drop rate: drops mean the plan did not serve the traffic in time);
* ``e3_controller_offered_rate`` and ``e3_controller_planned_rate`` -- inputs/s offered in the last window and
  the rate its plan was made for;
* ``e3_controller_windows_total``, ``e3_controller_window_errors_total`` (telemetry or planner failures),
  ``e3_controller_plans_applied_total``, ``e3_controller_last_window_timestamp_seconds``.

``/healthz`` (liveness): 200 while the control loop has finished a window within ``stale_after_s`` (default
three windows plus a minute, plus ``pod_wait_s``: the longest an apply may wait for pods, so a legitimate
scale-up never looks wedged), else 503, so a wedged loop is restarted.
``/readyz`` (readiness): 200 once the loop runs (the model's facts are known and the first window began).
``/status`` (JSON, what ``e3 status --url`` prints): ready and healthy, the window counts, the plan the controller
wants in force, the pods each pool should run and the last window's report.

Decisions: one registry per controller (not the process-wide default), so tests can run several; the server
is a ``ThreadingHTTPServer`` in a daemon thread on the port the chart names (``controller.metricsPort``).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import asdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from e3.controller.signals import desired_replicas
from e3.core.plan import Plan
from e3.deploy.pools import Pools

__all__ = ["ControllerMetrics", "STATUS_KIND"]

STATUS_KIND = "e3-controller-status"   # /status's "kind": what tells a controller from a Triton server


class ControllerMetrics:
    """Gauges and counters of one controller; :meth:`observe` after every window, :meth:`serve` to expose."""

    def __init__(self, *, pools: Pools | None, window_s: float, stale_after_s: float | None = None,
                 pod_wait_s: float = 0.0, clock: Callable[[], float] = time.monotonic):
        self.pools, self.clock = pools, clock
        self.stale_after_s = stale_after_s if stale_after_s is not None else 3 * window_s + 60.0 + pod_wait_s
        self.registry = r = CollectorRegistry()
        self.desired = Gauge("e3_controller_desired_replicas", "Pods each pool should run for the plan the "
                             "controller wants in force", ["pool"], registry=r)
        self.dropped = Gauge("e3_controller_dropped_rate", "Inputs per second dropped in the last window", registry=r)
        self.offered = Gauge("e3_controller_offered_rate", "Inputs per second offered in the last window", registry=r)
        self.planned = Gauge("e3_controller_planned_rate", "Inputs per second the last plan was made for",
                             registry=r)
        self.windows = Counter("e3_controller_windows", "Control windows closed", registry=r)
        self.errors = Counter("e3_controller_window_errors", "Windows whose telemetry or planning failed",
                              registry=r)
        self.applied = Counter("e3_controller_plans_applied", "Plans applied", registry=r)
        self.last = Gauge("e3_controller_last_window_timestamp_seconds", "Unix time of the last window",
                          registry=r)
        self.ready = False
        self._beat = clock()
        self._status: dict = {"windows": 0, "window_errors": 0, "plans_applied": 0, "last_window_unix_s": None,
                              "wanted_plan": None, "desired_replicas": {}, "last_report": None}
        self._server: ThreadingHTTPServer | None = None

    def started(self, plan: Plan | None) -> None:
        """The loop runs: ready, and the desired replicas of the running plan published."""
        self.ready, self._beat = True, self.clock()
        self.publish_plan(plan)

    def publish_plan(self, plan: Plan | None) -> None:
        self._status["wanted_plan"] = plan.to_dict() if plan is not None else None
        if self.pools is not None:
            wanted = desired_replicas(plan, self.pools)
            self._status["desired_replicas"] = wanted
            for pool, n in wanted.items():
                self.desired.labels(pool=pool).set(n)

    def observe(self, report, wanted: Plan | None) -> None:
        """One window's :class:`~e3.controller.loop.StepReport`, and the plan the controller now wants."""
        self._beat = self.clock()
        self.windows.inc()
        now = time.time()
        self.last.set(now)
        st = self._status
        st["windows"] += 1
        st["last_window_unix_s"] = now
        st["last_report"] = asdict(report)
        if report.error:
            self.errors.inc()
            st["window_errors"] += 1
        if report.applied:
            self.applied.inc()
            st["plans_applied"] += 1
        for gauge, value in ((self.dropped, report.dropped_rps), (self.offered, report.offered_rps),
                             (self.planned, report.planned_rps)):
            if value is not None:
                gauge.set(value)
        self.publish_plan(wanted)

    def healthy(self) -> bool:
        return self.clock() - self._beat <= self.stale_after_s

    def text(self) -> bytes:
        return generate_latest(self.registry)

    def status(self) -> dict:
        """What ``/status`` answers (JSON): ``kind`` (:data:`STATUS_KIND`), ``ready``, ``healthy``, ``windows``,
        ``window_errors``, ``plans_applied``, ``last_window_unix_s`` (Unix s), ``wanted_plan`` (a plan's dict),
        ``desired_replicas`` (pool -> pods) and ``last_report`` (a StepReport's fields)."""
        return {"kind": STATUS_KIND, "ready": self.ready, "healthy": self.healthy(), **self._status}

    def serve(self, port: int, host: str = "0.0.0.0") -> int:
        """Serve /metrics, /healthz, /readyz and /status on ``port`` (0: any free one) in a daemon thread; the port."""
        metrics = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    code, body, kind = 200, metrics.text(), CONTENT_TYPE_LATEST
                elif path in ("/healthz", "/readyz"):
                    ok = metrics.healthy() if path == "/healthz" else metrics.ready
                    code, body, kind = (200 if ok else 503), (b"ok\n" if ok else b"not ok\n"), "text/plain"
                elif path == "/status":
                    code, body, kind = 200, json.dumps(metrics.status()).encode(), "application/json"
                else:
                    code, body, kind = 404, b"not found: /metrics, /healthz, /readyz, /status\n", "text/plain"
                self.send_response(code)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):   # probes every few seconds: keep the controller's log for windows
                pass

        self._server = ThreadingHTTPServer((host, port), Handler)
        threading.Thread(target=self._server.serve_forever, name="e3-controller-metrics", daemon=True).start()
        return self._server.server_address[1]

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
