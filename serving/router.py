"""``<m>_router``: E3's router as a Triton Python-backend model (BLS).

Per batch (the router's own dynamic batcher merges client requests): run the
first split, apply the exit rule at every enabled ramp the split computed,
answer the inputs that exit, send the survivors on to the next split, and so
on to the last split, which answers everything left. Decisions live in
:mod:`e3.serving.policy` (exits, survivors, drops); this file only moves tensors and counts.

Re-batching: the router is non-decoupled (DESIGN §4), so one instance serves
one batch at a time; survivors of several router instances meet in the next
split's dynamic batcher (preferred batch size and queue delay from the plan).

Deadlines: every BLS call carries the batch's remaining SLO budget as its
timeout; splits reject requests whose timeout expired in their queue, and the
router answers those inputs with an explicit "dropped" error (counted in
``e3_dropped_total{reason="deadline"}``). No input is lost silently. BLS
failures arrive typed (:class:`~e3.serving.triton_io.BlsTimeout` vs
:class:`~e3.serving.triton_io.BlsError`); the drop itself is decided by
:func:`e3.serving.policy.drop_for`.

The plan arrives in the model config's ``plan`` parameter (JSON, see
:mod:`e3.core.plan`) and is validated against the model card at load; a load
with a malformed plan fails and Triton keeps serving the previous version.
Telemetry: :class:`~e3.serving.router_metrics.RouterMetrics` (names in :mod:`e3.core.telemetry`).
"""

from __future__ import annotations

import json
import time
from functools import partial

from e3.core.exits import make_exit_rule
from e3.core.plan import Plan, SplitPlan
from e3.core.spec import ModelCard
from e3.serving.policy import BatchRoute, deadline_budget_ms, drop_for
from e3.serving.router_metrics import RouterMetrics
from e3.serving.triton_io import BlsError, BlsTimeout, answer_responses, bls, error_response, gather, model_parameters


class _BudgetSpent(Exception):
    """The batch's SLO budget ran out before its next split."""


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
        self.metrics = RouterMetrics(self.plan.model, self.plan.plan_id)

    def finalize(self):
        self.metrics.close()

    def execute(self, requests):
        # Overhead is the router thread's CPU time outside BLS calls (its own Python work, immune to
        # waiting for a core on a busy machine); BLS time is wall time inside the calls.
        start, cpu_start = time.perf_counter(), time.thread_time()
        self._waited, self._waited_cpu = 0.0, 0.0
        got = gather(requests, self.card.inputs)
        if not got.valid:
            return got.responses
        route = BatchRoute(got.rows, self.card.num_classes, self.card.num_blocks, self.rule)
        steps = ((self.card.split_ramps(s.first_block, s.last_block, s.enabled_ramps), partial(self._call, s, start))
                 for s in self.plan.splits)
        try:
            route.follow(got.arrays, steps, [t.name for t in self.card.state])
        except (BlsError, _BudgetSpent) as err:
            drop = drop_for(self.plan, late=isinstance(err, (BlsTimeout, _BudgetSpent)), detail=str(err))
            for i in got.valid:
                got.responses[i] = error_response(drop.message)
            self.metrics.dropped(drop.reason, got.rows)
        else:
            self.metrics.record(route, got.rows)
            answer_responses(got, route)
        self.metrics.timing((time.thread_time() - cpu_start - self._waited_cpu) * 1e6, self._waited * 1e6)
        return got.responses

    def _call(self, split: SplitPlan, start: float, feed: dict) -> dict:
        """One split by BLS, with the batch's remaining SLO budget as the call's timeout."""
        left_us = int((self.budget_ms - (time.perf_counter() - start) * 1e3) * 1e3)
        if left_us <= 0:
            raise _BudgetSpent(f"the SLO budget of {self.budget_ms:.1f} ms ran out before {split.model}")
        called, called_cpu = time.perf_counter(), time.thread_time()
        try:
            return bls(split.model, feed, self.card.split_outputs(split.first_block, split.last_block,
                                                                  split.enabled_ramps), timeout_us=left_us)
        finally:
            self._waited += time.perf_counter() - called
            self._waited_cpu += time.thread_time() - called_cpu
