"""The router's Prometheus counters, exported as Triton custom metrics (names: :mod:`e3.core.telemetry`).

Each ``Metric`` call is a message to the server process, so counts are summed
locally and a background thread hands them to Triton every ``FLUSH_S`` (and at
once on a drop): cheap per batch, and the last batches' counts are reported
even when traffic stops.
"""

from __future__ import annotations

import threading

import triton_python_backend_utils as pb_utils

from e3.core import telemetry
from e3.serving.policy import BatchRoute

__all__ = ["RouterMetrics"]


class RouterMetrics:
    """The router's Prometheus counters (Triton custom metrics), labelled by model and ramp."""

    def __init__(self, model: str, plan_id: str):
        # A Metric is only valid while its MetricFamily object is alive: keep every family.
        self._families = []

        def family(name, doc, kind=pb_utils.MetricFamily.COUNTER):
            self._families.append(pb_utils.MetricFamily(name=name, description=doc, kind=kind))
            return self._families[-1]

        self.model = model
        self.inputs = family(telemetry.INPUTS, "inputs that entered split 1").Metric({"model": model})
        self.batches = family(telemetry.BATCHES, "input batches (batches dispatched to split 1)").Metric({"model": model})
        self._reached = family(telemetry.RAMP_REACHED, "inputs not yet answered when they reached ramp k")
        self._exited = family(telemetry.RAMP_EXITED, "inputs answered at ramp k")
        self._dropped = family(telemetry.DROPPED, "inputs answered with an error")
        self.rejected_requests = family(telemetry.REJECTED, "requests refused at admission (max_queue_inputs)"
                                        ).Metric({"model": model})
        self.rejected_inputs = family(telemetry.REJECTED_INPUTS, "inputs of requests refused at admission"
                                      ).Metric({"model": model})
        self.overhead = family(telemetry.ROUTER_OVERHEAD_US, "router's own Python work (us)").Metric({"model": model})
        self.bls = family(telemetry.ROUTER_BLS_US, "router time waiting on splits (us)").Metric({"model": model})
        self._plan = family(telemetry.PLAN_INFO, "plan in force", pb_utils.MetricFamily.GAUGE)
        self._plan_metric = self._plan.Metric({"model": model, "plan_id": plan_id})
        self._plan_metric.set(1)
        self._cache: dict = {}
        # Each Metric call is a message to the server process; counts are summed locally and
        # handed over by a background thread every FLUSH_S (and at once on a drop), which keeps
        # them cheap per batch and never leaves the last batches' counts unreported when
        # traffic stops.
        self._pending: dict = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._soon = threading.Event()
        self._flusher = threading.Thread(target=self._flush_loop, name="e3-metrics-flush", daemon=True)
        self._flusher.start()

    FLUSH_S = 0.2

    def _flush_loop(self) -> None:
        while not self._stop.is_set():
            self._soon.wait(self.FLUSH_S)
            self._soon.clear()
            self.flush()

    def close(self) -> None:
        self._stop.set()
        self._soon.set()
        self._flusher.join(timeout=2)
        self.flush()

    def _labelled(self, fam, **labels):
        """A key for the counter of ``fam`` with ``labels``; its Metric is made by :meth:`flush`."""
        return fam, tuple(sorted(labels.items()))

    def _metric(self, key):
        if isinstance(key, tuple):
            if key not in self._cache:
                fam, labels = key
                self._cache[key] = fam.Metric({"model": self.model, **dict(labels)})
            return self._cache[key]
        return key

    def _add(self, key, n: float) -> None:
        with self._lock:
            self._pending[key] = self._pending.get(key, 0) + n

    def record(self, route: BatchRoute, new_inputs: int) -> None:
        """One executed batch's ramp counts; ``new_inputs`` > 0 for a batch of split 1 (inputs that
        entered, and one more input batch), 0 for later splits."""
        if new_inputs:
            self._add(self.inputs, new_inputs)
            self._add(self.batches, 1)
        for k, n in route.counts.reached.items():
            self._add(self._labelled(self._reached, ramp=str(k)), n)
        for k, n in route.counts.exited.items():
            self._add(self._labelled(self._exited, ramp=str(k)), n)

    def dropped(self, reason: str, n: int) -> None:
        """Count ``n`` dropped inputs; flushed at once by the flushing thread (Metric calls are made
        from that one thread only: several threads calling into Triton at once are not safe)."""
        self._add(self._labelled(self._dropped, reason=reason), n)
        self._soon.set()

    def rejected(self, n: int) -> None:
        """Count one request of ``n`` inputs refused at admission (flushed with the others, within
        ``FLUSH_S``: a storm of refusals must not turn into a storm of calls into Triton)."""
        self._add(self.rejected_requests, 1)
        self._add(self.rejected_inputs, n)

    def timing(self, overhead_us: float, bls_us: float) -> None:
        self._add(self.overhead, overhead_us)
        self._add(self.bls, bls_us)

    def flush(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
        for key, n in pending.items():
            if n:
                self._metric(key).increment(n)
