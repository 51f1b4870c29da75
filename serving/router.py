"""``<m>_router``: E3's router and scheduler, as one Triton Python-backend instance.

The front door stays an ordinary (non-decoupled) model: clients call plain
HTTP/gRPC ``infer`` and ``perf_analyzer`` works. Inside, ``execute`` does not
compute: it checks each request, hands its rows to the scheduler
(:mod:`e3.serving.scheduler`, where every decision is made) and returns at once;
each request is later answered through its own response sender (allowed for a
non-decoupled model: exactly one final response per request). So one instance
holds any number of requests in flight, and the merge width is no longer the
number of router instances (measured before: later splits ran batches of 1-6
of a planned 8 because two router instances fed them).

Threads: the scheduler is polled, under one lock, wherever something changed
(``execute`` admitting requests, a worker finishing a batch), and its batches
go straight to the split's workers; a timer thread polls only when a partial
batch's delay or SLO comes due with nothing else happening. Each split has a
pool of ``slots`` worker threads that run its batches:

* a **constant** split (its own Triton model) by a BLS call with the batch's
  remaining SLO as timeout (Triton enforces it only where the split was exported
  with ``--split-queue-policy``; otherwise the watchdog below answers late rows); ``slots = instances + 1``, so that one batch waits
  in Triton's queue while the router handles the last one and no instance
  idles (the split's batcher has the plan's preferred batch and no delay, so
  it runs the router's batches as they come, never merged);
* a **compact** split inside this process: one ONNX Runtime session set per
  plan instance (1 intra-op thread each, so instances mean cores, as for a
  Triton instance), blocks run one by one and exited rows leave the batch
  between them; ``slots = instances``. ONNX Runtime releases the GIL while it
  computes.

Answers are decided by :class:`~e3.serving.policy.BatchRoute` (the same code as
``<m>_ee`` and the reference), drops by the scheduler (late) or by a split's
failure (:func:`e3.serving.policy.drop_for`); every dropped request gets an
explicit error and is counted by its inputs in ``e3_dropped_total``.

A split call that does not return (a hung execute: the BLS timeout only
covers the split's queue, not an execute that never ends) is caught by the
scheduler's watchdog (:meth:`~e3.serving.scheduler.Scheduler.expire`): the
timer thread polls at the earliest deadline of a batch in flight (plus a
grace of ``WATCHDOG_GRACE_S``, 50 ms, in which a split's own queue timeout
reports first), and each request still waiting on the stuck batch is answered
then with the explicit deadline error (naming the split). The model config's
string parameter ``watchdog_grace_ms`` changes the grace. The stuck worker thread keeps its slot
until the call returns; when it does, its answers for those requests are
dropped (each request has had its one response) and the slot serves again.
Unloading waits at most ``UNLOAD_WAIT_S`` for stuck calls, then answers
everything still in flight with an error.

Bounded admission: the model config's string parameter ``max_queue_inputs``
(``e3 export --max-queue-inputs``; unset: unbounded) caps the inputs of the
requests admitted and not yet answered. ``execute`` refuses a request that
would exceed it at once, with UNAVAILABLE (HTTP 503 / gRPC UNAVAILABLE, as
Triton answers for a full queue) and a message naming the limit, and counts it
in ``e3_rejected_total`` (requests) and ``e3_rejected_inputs_total``; the
decision is the scheduler's (:meth:`~e3.serving.scheduler.Scheduler.refusal`).
It survives plan switches (a switch keeps the config's other parameters).
With several router instances (inline) each instance bounds its own
requests, and requests waiting in Triton's queue in front of them are not
counted.

The plan arrives in the model config's ``plan`` parameter and is validated at
load; a load with a malformed plan fails and Triton keeps serving the previous
version. Telemetry: :class:`~e3.serving.router_metrics.RouterMetrics`.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from e3.core.exits import SHIPPED_RULES_DIR, make_exit_rule
from e3.core.names import block_file
from e3.core.plan import COMPACT, Plan, SplitPlan
from e3.core.rows import request_slices
from e3.core.spec import ModelCard
from e3.serving.compact import CompactRunner, feed_for
from e3.serving.policy import DEADLINE, ERROR, BatchRoute, drop_for
from e3.serving.remote import RemoteSplit
from e3.serving.router_metrics import RouterMetrics
from e3.serving.scheduler import MAX_QUEUE_INPUTS, WATCHDOG_GRACE_S, Dispatch, Job, Scheduler, queue_limit
from e3.serving.triton_io import (BlsTimeout, ResponseSender, bls, checked_response, error_response, gather,
                                  model_parameters, sender_of)

log = logging.getLogger(__name__)


class _Inline:
    """Where a worker leaves an inline request's answers (a dict) or error (a message) for its execute."""
    __slots__ = ("what",)

    def __init__(self):
        self.what = None
SWITCH_INTERVAL_S = 0.0005
UNLOAD_WAIT_S = 5.0   # longest finalize waits for split calls still running (a hung one may never return)


class TritonPythonModel:
    def initialize(self, args):
        # Worker threads come back from ONNX Runtime (which releases the GIL) wanting it at once; with
        # Python's default 5 ms switch interval a thread doing Python holds it that long.
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        _, params = model_parameters(args)
        self.card = ModelCard.from_dict(json.loads(params["model_card"]))
        self.plan = Plan.from_json(params["plan"])
        self.plan.validate(self.card.ramp_blocks)
        if self.plan.num_blocks != self.card.num_blocks:
            raise ValueError(f"plan is for {self.plan.num_blocks} blocks, the model has {self.card.num_blocks}")
        self.version_dir = os.path.join(args["model_repository"], args["model_version"])
        # a user's rule: its module shipped beside the router by export (e3.export.rules)
        self.rule = make_exit_rule(self.plan.exit_rule, paths=[os.path.join(self.version_dir, SHIPPED_RULES_DIR)])
        self.state_names = [t.name for t in self.card.state]
        # what each part (a block file, a constant split's Triton model) reads: recorded by export
        self.reads = {part: io["reads"] for part, io in json.loads(params.get("part_io") or "{}").items()}
        self.metrics = RouterMetrics(self.plan.model, self.plan.plan_id)
        self.remotes: list[RemoteSplit] = []   # splits the plan places on other servers (gRPC)
        # Several router instances only for plans of compact splits (Plan.router_instances): each runs its
        # share of the workers and answers inline: its execute waits for its own requests' answers and
        # returns them, as <m>_ee's instances do, so Triton hands the next requests to an instance with
        # room and batches them in its queue meanwhile. Measured (bert-ee 80:20, 16 clients x 1 input):
        # one instance answering every request through its response senders ran at 0.84x <m>_ee.
        self.share = self.plan.router_instances
        self.inline = self.share > 1
        self.runners = [self._runner(s) for s in self.plan.splits]
        self.sched = Scheduler.for_plan(
            self.plan, watchdog_grace_s=float(params.get("watchdog_grace_ms") or WATCHDOG_GRACE_S * 1e3) / 1e3,
            max_queue_inputs=queue_limit(params.get(MAX_QUEUE_INPUTS)))
        self.pools = [ThreadPoolExecutor(n, thread_name_prefix=f"e3-{s.model}")
                      for s, n in zip(self.plan.splits, self.sched.slots)]
        # Inline with one worker per split: the execute thread is that worker (no hand-over per batch).
        self.direct = self.sched.direct
        self.ready: list[Dispatch] = []
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)   # the timer thread waits on it
        self.room = threading.Condition(self.lock)      # an inline execute waits on it for its answers
        self.wake_at: float | None = None   # when the timer must poll next (None: only events matter)
        self.stopping = False
        # Every response leaves through one thread (ResponseSender: concurrent sends crashed the server).
        self.outbox = ResponseSender("e3 router")
        self.loop = threading.Thread(target=self._loop, name="e3-scheduler", daemon=True)
        self.loop.start()

    def finalize(self):
        with self.lock:
            self.stopping = True
            self.changed.notify_all()
            self.room.notify_all()
        self.loop.join(timeout=5)
        for pool in self.pools:   # batches already handed over still run; a hung call is not waited for
            pool.shutdown(wait=False)
        end = time.monotonic() + UNLOAD_WAIT_S
        while time.monotonic() < end:
            with self.lock:
                if not self.sched.running:
                    break
            time.sleep(0.01)
        with self.lock:
            left = self.sched.fail_all(ERROR)
        self._answer_failed(left, "the router is unloading")
        self.outbox.close()
        for remote in self.remotes:
            remote.close()
        self.metrics.close()

    # -- Triton's call: admit and return ---------------------------------------------------------------
    def execute(self, requests):
        now = time.monotonic()
        cpu = time.thread_time()
        got = gather(requests, self.card.inputs)
        # Continuous answering (serving.triton_io.ResponseSender): each request's sender is taken here, inside
        # execute, and nothing keeps the request objects once execute returns.
        senders = None if self.inline else [sender_of(r) for r in requests]
        requests = None
        if senders is not None:
            for sender, response in zip(senders, got.responses):
                if response is not None:  # malformed: answered now, the others go on
                    self.outbox.put(sender, response)
        handles = {i: (_Inline() if self.inline else senders[i]) for i in got.valid}
        refused = []   # (request index, inputs, Refusal): over max_queue_inputs, answered at once
        with self.lock:
            for i, rows in zip(got.valid, request_slices(got.sizes)):
                n = rows.stop - rows.start
                refusal = self.sched.refusal(n)
                if refusal is not None:
                    refused.append((i, n, refusal))
                    continue
                job = self.sched.job(handles[i], n, now, self.card.num_classes)
                self.sched.admit(job, {k: v[rows] for k, v in got.arrays.items()}, self.rule.init_state(n), now)
            dropped = self._pump()
        for i, n, refusal in refused:
            # a full router is UNAVAILABLE (HTTP 503, as Triton's full queue); a request that can never fit is
            # the client's error (400)
            response = error_response(refusal.message, client_error=refusal.permanent, unavailable=True)
            self.metrics.rejected(n)
            if self.inline:
                del handles[i]
                got.responses[i] = response
            else:
                self.outbox.put(senders[i], response)
        self._answer_failed(dropped, "it would finish after its deadline")
        self.metrics.timing((time.thread_time() - cpu) * 1e6, 0.0)
        if not self.inline:
            return None
        while True:   # inline: this execute answers its own requests, as <m>_ee's instances do
            with self.lock:
                if self.stopping or all(h.what is not None for h in handles.values()):
                    break
                if not self.ready:
                    self.room.wait(0.1)
                    continue
                d = self.ready.pop(0)
            self._run(d)   # direct: this thread is the split's worker
        for i, h in handles.items():
            got.responses[i] = checked_response(h.what) if isinstance(h.what, dict) else \
                error_response(h.what or "the router is unloading")
        return got.responses

    # -- dispatching -------------------------------------------------------------------------------------
    def _pump(self) -> list[Job]:
        """Poll the scheduler (caller holds the lock) and hand its batches to the splits' workers at once,
        in the calling thread (a finished batch's worker, or execute): no hand-over to another thread on
        the way. Returns the jobs it dropped (to be answered outside the lock); the timer thread is told
        when the scheduler must be polled next even if nothing happens."""
        now = time.monotonic()
        expired = self.sched.expire(now)   # the watchdog: jobs whose batch is still running past their deadline
        dispatches, dropped, wake = self.sched.poll(now)
        due = self.sched.next_expiry()
        if due is not None and (wake is None or due < wake):
            wake = due
        for d in dispatches:
            if self.direct:
                self.ready.append(d)
            else:
                self.pools[d.split].submit(self._run, d)
        if self.direct and dispatches:
            self.room.notify_all()
        if wake is not None and (self.wake_at is None or wake < self.wake_at):
            self.wake_at = wake
            self.changed.notify()
        return expired + dropped

    def _loop(self) -> None:
        """The timer: polls when a partial batch's delay or its SLO forces it and nothing else happened."""
        while True:
            with self.lock:
                if self.stopping:
                    return
                now = time.monotonic()
                if self.wake_at is not None and now >= self.wake_at:
                    self.wake_at = None
                    dropped = self._pump()
                else:
                    self.changed.wait(None if self.wake_at is None else self.wake_at - now)
                    continue
            self._answer_failed(dropped, "it would finish after its deadline")

    # -- worker threads ----------------------------------------------------------------------------------
    def _run(self, d: Dispatch) -> None:
        cpu = time.thread_time()
        feed, rule_state = Scheduler.stack(d.rows)
        left_us = int((min(r.job.deadline for r in d.rows) - time.monotonic()) * 1e6)
        start, call_cpu = time.perf_counter(), time.thread_time()
        try:
            if left_us <= 0:
                raise BlsTimeout(f"the SLO ran out before {self.plan.splits[d.split].model}")
            route, survivors = self.runners[d.split](feed, rule_state, left_us)
        except Exception as err:  # noqa: BLE001 - every failure answers its requests, none is lost
            with self.lock:
                failed = self.sched.abandon(d, DEADLINE if isinstance(err, BlsTimeout) else ERROR)
                dropped = self._pump()
            self._answer_failed(failed, str(err))
            self._answer_failed(dropped, "it would finish after its deadline")
            return
        ms = (time.perf_counter() - start) * 1e3
        call_cpu = time.thread_time() - call_cpu
        with self.lock:
            # a late return of an abandoned batch: finish frees its slot and answers only jobs still live
            done = self.sched.finish(d, route, survivors, ms, time.monotonic())
            dropped = self._pump()
        self._answer_failed(dropped, "it would finish after its deadline")
        if d.abandoned_at is None:   # an abandoned batch's exits are not counted: its requests were dropped
            self.metrics.record(route, new_inputs=len(d.rows) if d.split == 0 else 0)
        for job in done:
            self._deliver(job, {"label": job.label[:, None], "exit_ramp": job.exit_ramp[:, None],
                                "probs": job.probs})
        # The router's own work: this thread's CPU time outside the split itself (its ONNX Runtime
        # calls for a compact split, the wait for a BLS call otherwise).
        self.metrics.timing((time.thread_time() - cpu - call_cpu) * 1e6, ms * 1e3)

    def _answer_failed(self, jobs: list[Job], detail: str) -> None:
        """Answer dropped jobs with their explicit error and count their inputs."""
        for job in jobs:
            why = detail if job.stuck_in is None else (   # the watchdog's drop: say which split hung
                f"{self.plan.splits[job.stuck_in].model} had not returned by the deadline; its call was abandoned")
            drop = drop_for(self.plan, late=job.failed == DEADLINE, detail=why)
            job.answered = True
            self._deliver(job, drop.message)
            self.metrics.dropped(drop.reason, job.n)

    def _deliver(self, job: Job, what) -> None:
        """A request's answers (a dict) or error (a message): to the execute that holds it (inline), else
        to the sending thread. The job lets go of its sender here (only the sending thread holds it then,
        until it has sent): no sender outlives its answer in the router's bookkeeping."""
        handle, job.handle = job.handle, None
        if handle is None:   # delivered once already
            return
        if isinstance(handle, _Inline):
            with self.lock:
                handle.what = what
                self.room.notify_all()
        else:
            self.outbox.put(handle, what)


    # -- how a split runs ----------------------------------------------------------------------------------
    def _runner(self, split: SplitPlan):
        """``run(feed, rule_state, timeout_us) -> (route, survivors' inputs or None)`` for one split."""
        C, L = self.card.num_classes, self.card.num_blocks
        if split.form == COMPACT:
            return self._compact_runner(split)
        ramps = self.card.split_ramps(split.first_block, split.last_block, split.enabled_ramps)
        outputs = self.card.split_outputs(split.first_block, split.last_block, split.enabled_ramps)
        # On the router's own server by BLS; on another server (pool) over gRPC, as the plan places it.
        remote = RemoteSplit(split.server, split.model) if split.server else None
        if remote is not None:
            self.remotes.append(remote)

        reads = self.reads.get(split.model)
        if reads is None:   # a split exported after this router (e3 control): what its first block's file reads
            first = block_file(split.first_block, ramp=split.first_block in split.enabled_ramps)
            reads = self.reads.get(first)
            log.warning("%s: export recorded no inputs for it; sending what %s reads (%s)", split.model, first,
                        "every state tensor" if reads is None else ", ".join(reads))

        def run(feed, rule_state, timeout_us):
            feed = feed if reads is None else feed_for(reads, feed, split.model)
            out = remote.infer(feed, outputs, timeout_us) if remote is not None else \
                bls(split.model, feed, outputs, timeout_us=timeout_us)
            route = BatchRoute(len(next(iter(feed.values()))), C, L, self.rule, rule_state)
            return route, route.advance(out, ramps, self.state_names)
        return run

    def _compact_runner(self, split: SplitPlan):
        """Blocks first..last in this process, the batch shrinking at every enabled ramp: one composed graph
        (:mod:`e3.serving.fused_split`) where the exit rule allows, else block by block
        (:class:`~e3.serving.compact.CompactRunner`, which ``<m>_ee`` runs too)."""
        # one session (set) per instance: instances mean cores
        runner = CompactRunner(self.version_dir, self.card, self.rule, split.first_block, split.last_block,
                               split.enabled_ramps, copies=split.instances // self.share, reads=self.reads)
        return lambda feed, rule_state, timeout_us: runner(feed, rule_state)

