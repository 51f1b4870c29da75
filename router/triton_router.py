"""``<m>_router``: E3's router as a Triton Python-backend model (BLS).

Per batch (the router's own dynamic batcher merges client requests): run the
first split, apply the exit rule at every enabled ramp the split computed,
answer the inputs that exit, send the survivors on to the next split, and so
on to the last split, which answers everything left. Decisions live in
:mod:`e3.router.policy`; this file only moves tensors and counts.

Re-batching: the router is non-decoupled (DESIGN §4), so one instance serves
one batch at a time; survivors of several router instances meet in the next
split's dynamic batcher (preferred batch size and queue delay from the plan).

Deadlines: every BLS call carries the batch's remaining SLO budget as its
timeout; splits reject requests whose timeout expired in their queue, and the
router answers those inputs with an explicit "dropped" error (counted in
``e3_dropped_total{reason="deadline"}``). No input is lost silently.

The plan arrives in the model config's ``plan`` parameter (JSON, see
:mod:`e3.core.plan`) and is validated against the model card at load; a load
with a malformed plan fails and Triton keeps serving the previous version.
Telemetry: the metrics of :mod:`e3.core.telemetry`.
"""

from __future__ import annotations

import json
import threading
import time

import triton_python_backend_utils as pb_utils

from e3.core import telemetry
from e3.core.exits import make_exit_rule
from e3.core.plan import Plan
from e3.core.spec import ModelCard
from e3.export.runtime.triton_io import answer_responses, bls, error_response, gather, model_parameters
from e3.router.policy import BatchRoute, deadline_budget_ms


class _Metrics:
    """The router's Prometheus counters (Triton custom metrics), labelled by model and ramp."""

    def __init__(self, model: str, plan_id: str):
        # A Metric is only valid while its MetricFamily object is alive: keep every family.
        self._families = []

        def family(name, doc, kind=pb_utils.MetricFamily.COUNTER):
            self._families.append(pb_utils.MetricFamily(name=name, description=doc, kind=kind))
            return self._families[-1]

        self.model = model
        self.inputs = family(telemetry.INPUTS, "inputs that entered the router").Metric({"model": model})
        self.batches = family(telemetry.BATCHES, "batches the router executed").Metric({"model": model})
        self._reached = family(telemetry.RAMP_REACHED, "inputs not yet answered when they reached ramp k")
        self._exited = family(telemetry.RAMP_EXITED, "inputs answered at ramp k")
        self._dropped = family(telemetry.DROPPED, "inputs answered with an error")
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
        self._flusher = threading.Thread(target=self._flush_loop, name="e3-metrics-flush", daemon=True)
        self._flusher.start()

    FLUSH_S = 0.2

    def _flush_loop(self) -> None:
        while not self._stop.wait(self.FLUSH_S):
            self.flush()

    def close(self) -> None:
        self._stop.set()
        self._flusher.join(timeout=2)
        self.flush()

    def _metric(self, fam, **labels):
        key = (id(fam), tuple(sorted(labels.items())))
        if key not in self._cache:
            self._cache[key] = fam.Metric({"model": self.model, **labels})
        return self._cache[key]

    def _add(self, metric, n: float) -> None:
        with self._lock:
            self._pending[metric] = self._pending.get(metric, 0) + n

    def record(self, route: BatchRoute, rows: int) -> None:
        self._add(self.inputs, rows)
        self._add(self.batches, 1)
        for k, n in route.counts.reached.items():
            self._add(self._metric(self._reached, ramp=str(k)), n)
        for k, n in route.counts.exited.items():
            self._add(self._metric(self._exited, ramp=str(k)), n)

    def dropped(self, reason: str, n: int) -> None:
        self._add(self._metric(self._dropped, reason=reason), n)
        self.flush()

    def timing(self, overhead_us: float, bls_us: float) -> None:
        self._add(self.overhead, overhead_us)
        self._add(self.bls, bls_us)

    def flush(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
        for metric, n in pending.items():
            if n:
                metric.increment(n)


class TritonPythonModel:
    def initialize(self, args):
        _, params = model_parameters(args)
        self.card = ModelCard.from_dict(json.loads(params["model_card"]))
        self.plan = Plan.from_json(params["plan"])
        self.plan.validate(self.card.ramp_blocks)
        if self.plan.num_blocks != self.card.num_blocks:
            raise ValueError(f"plan is for {self.plan.num_blocks} blocks, the model has {self.card.num_blocks}")
        self.rule = make_exit_rule(self.plan.exit_rule)
        self.budget_ms = deadline_budget_ms(self.plan)
        self.metrics = _Metrics(self.plan.model, self.plan.plan_id)

    def finalize(self):
        self.metrics.close()

    def execute(self, requests):
        # Overhead is the router thread's CPU time outside BLS calls (its own Python work, immune to
        # waiting for a core on a busy machine); BLS time is wall time inside the calls.
        start, cpu_start = time.perf_counter(), time.thread_time()
        waited, waited_cpu = 0.0, 0.0
        got = gather(requests, self.card.inputs)
        if not got.valid:
            return got.responses
        route = BatchRoute(got.rows, self.card.num_classes, self.card.num_blocks, self.rule)
        state_names = [t.name for t in self.card.state]
        feed = got.arrays
        try:
            for split in self.plan.splits:
                span = (split.first_block, split.last_block, split.enabled_ramps)
                left_us = int((self.budget_ms - (time.perf_counter() - start) * 1e3) * 1e3)
                if left_us <= 0:
                    raise TimeoutError(f"the SLO budget of {self.budget_ms:.1f} ms ran out before {split.model}")
                called, called_cpu = time.perf_counter(), time.thread_time()
                try:
                    out = bls(split.model, feed, self.card.split_outputs(*span), timeout_us=left_us)
                finally:
                    waited += time.perf_counter() - called
                    waited_cpu += time.thread_time() - called_cpu
                feed = route.advance(out, self.card.split_ramps(*span), state_names)
                if feed is None:
                    break
        except (RuntimeError, TimeoutError) as err:
            reason = "deadline" if isinstance(err, TimeoutError) or "timeout" in str(err).lower() else "error"
            message = (f"dropped: {self.plan.model} cannot answer within its SLO of {self.plan.slo_ms:.0f} ms ({err})"
                       if reason == "deadline" else f"{self.plan.model} router: {err}")
            for i in got.valid:
                got.responses[i] = error_response(message)
            self.metrics.dropped(reason, got.rows)
            self.metrics.timing((time.thread_time() - cpu_start - waited_cpu) * 1e6, waited * 1e6)
            return got.responses
        self.metrics.record(route, got.rows)
        responses = answer_responses(got, route)
        self.metrics.timing((time.thread_time() - cpu_start - waited_cpu) * 1e6, waited * 1e6)
        return responses
