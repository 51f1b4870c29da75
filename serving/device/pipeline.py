"""E3's constant splits on one device, in one process, and the two baselines in the same engine.

:class:`DevicePipeline` (E3, docs/design.md §2b):

* A request's inputs join split 1's queue as they came (host arrays; they are copied to the device once, into
  split 1's graph input, when their batch runs).
* Every split has a queue of rows. A split's queue after split 1 holds the survivors' cut state as **device
  tensors** (chunks, one per upstream run), with host arrays beside them for each row's request, index,
  target and exit-rule state. Survivors of any number of requests are merged to the plan's batch.
* When a split runs (:mod:`~e3.serving.device.dispatch` says which, and how many rows), its executor runs the
  rows at their bucket; the logits of the split's computed ramps are copied to the host in one copy: the
  **one sync per split execution**. The exit rule (:class:`~e3.serving.policy.BatchRoute`, the very code of
  the reference and of ``<m>_ee``) decides on the host; the decided rows are answered at once (a request
  when its last row is decided); the survivors' state is gathered on the device (``index_select``) into the
  next split's queue. No hidden state crosses to the host.

  Decision: the exit test's arithmetic (a softmax over C classes per row) is done on the host after the one
  copy every design needs (the host must learn which requests to answer), on the same float32 logits the
  device computed: the rule code stays one (dependent rules such as PABEE's patience carry their state
  unchanged) and the copy is B x C floats per ramp. The survivors' indices go back to the device as one
  small copy.
* Drops, and the time model, are the CPU router's (``serving/scheduler.py``, the same code): a split's
  expected run time is a line fitted to its runs (the first not learnt, outliers clipped once
  ``WARM_BATCHES`` are learnt); a request is answered with an explicit error and counted when even its
  split's run would end past its deadline (before ``WARM_BATCHES`` runs, only once the deadline has passed).
  The dispatch rule (``dispatch.py``) forces a partial batch by the expected time of its split and every
  later one, as the scheduler does.

:class:`StockRunner` (``<m>_stock`` on the device): the model without ramps, one captured graph per bucket,
behind Triton's dynamic batcher. :class:`NaiveRunner` (``<m>_ee`` on the device): one batch through the model,
a segment (the blocks up to the next enabled ramp, one graph) at a time, compacting the survivors on the
device after every enabled ramp: the strongest naive form, with the composed segments E3's splits get.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from e3.core.exits import EntropyRule, ExitRule
from e3.core.names import ranges_from_cuts
from e3.models.api import EarlyExitModel
from e3.serving.device.dispatch import QueueView, choose
from e3.serving.device.executor import DeviceSettings, make_executor
from e3.serving.policy import DEADLINE, ERROR, BatchRoute
from e3.serving.scheduler import WARM_BATCHES, SplitQueue

__all__ = ["DevicePipeline", "StockRunner", "NaiveRunner", "Answer", "segments_at", "head_answer"]

log = logging.getLogger(__name__)

DEPTH = 2          # split runs in flight on a GPU: the device runs one while the host decides the other


@dataclass
class Answer:
    """The answers of one request, over its rows (docs/design.md §2's front door)."""
    label: np.ndarray       # [n] int64
    exit_ramp: np.ndarray   # [n] int32
    probs: np.ndarray       # [n, C] float32

    def outputs(self) -> dict[str, np.ndarray]:
        return {"label": self.label[:, None], "exit_ramp": self.exit_ramp[:, None], "probs": self.probs}


@dataclass(eq=False)
class _Job:
    handle: Any
    answer: Answer
    pending: int
    deadline: float
    live: bool = True


@dataclass(eq=False)
class _Chunk:
    """Rows waiting in one queue: their tensors (device tensors, or host tensors at split 1) and bookkeeping."""
    tensors: tuple              # aligned with the split's inputs, rows first
    jobs: np.ndarray            # [n] object: the _Job of each row
    index: np.ndarray           # [n] int64: the row's index in its request
    target: np.ndarray          # [n] float64: arrival + SLO x (1 - slack)
    rule: dict[str, np.ndarray] = field(default_factory=dict)   # exit-rule state per row

    def __len__(self) -> int:
        return len(self.index)

    def cut(self, m: int) -> tuple["_Chunk", "_Chunk"]:
        """The first ``m`` rows, and the rest."""
        head = _Chunk(tuple(t[:m] for t in self.tensors), self.jobs[:m], self.index[:m], self.target[:m],
                      {k: v[:m] for k, v in self.rule.items()})
        tail = _Chunk(tuple(t[m:] for t in self.tensors), self.jobs[m:], self.index[m:], self.target[m:],
                      {k: v[m:] for k, v in self.rule.items()})
        return head, tail


@dataclass(eq=False)
class _Run:
    """One split run launched on the device and not yet decided."""
    split: int
    n: int
    jobs: np.ndarray
    index: np.ndarray
    target: np.ndarray
    rule_state: dict
    started: float
    state: tuple = ()                        # the state it hands on (device; its own copy on CUDA)
    logits: torch.Tensor | None = None       # [ramps, n, C] float32 on the host (pinned on CUDA)
    event: Any = None                        # CUDA event after the logits' copy (None on the CPU)
    error: str | None = None


class _Queue:
    def __init__(self, batch: int):
        self.batch = batch
        self.chunks: deque[_Chunk] = deque()
        self.rows = 0
        # The CPU router's time model, the same code (serving/scheduler.SplitQueue): a line fitted to the runs,
        # the first run not learnt, an outlier clipped once WARM_BATCHES runs are learnt.
        self.times = SplitQueue(batch, slots=1, queue_delay_s=0.0)

    @property
    def expected_s(self) -> float:
        """Expected time of a run at the plan's batch (s); 0 before any run is learnt."""
        return self.times.expected_ms(self.batch) / 1e3

    @property
    def trusted(self) -> bool:
        """Enough runs learnt to drop on the expectation (before that, only rows already past their deadline)."""
        return self.times.batches >= WARM_BATCHES

    def push(self, chunk: _Chunk) -> None:
        if len(chunk):
            self.chunks.append(chunk)
            self.rows += len(chunk)

    def take(self, n: int) -> list[_Chunk]:
        out, want = [], n
        while want and self.chunks:
            c = self.chunks.popleft()
            if len(c) > want:
                c, rest = c.cut(want)
                self.chunks.appendleft(rest)
            out.append(c)
            want -= len(c)
        self.rows -= n - want
        return out

    def oldest_target(self) -> float | None:
        heads = [c.target.min() for c in itertools.islice(self.chunks, 4)]
        return float(min(heads)) if heads else None

    def learn(self, rows: int, seconds: float) -> None:
        self.times.observe(rows, seconds * 1e3)

    @torch.inference_mode()
    def drop_dead(self) -> None:
        """Forget rows of requests already answered with an error."""
        kept = deque()
        for c in self.chunks:
            live = np.fromiter((j.live for j in c.jobs), bool, len(c))
            if live.all():
                kept.append(c)
            elif live.any():
                idx = np.flatnonzero(live)
                t = torch.from_numpy(idx)
                kept.append(_Chunk(tuple(x.index_select(0, t.to(x.device)) for x in c.tensors), c.jobs[idx],
                                   c.index[idx], c.target[idx], {k: v[idx] for k, v in c.rule.items()}))
        self.chunks = kept
        self.rows = sum(len(c) for c in kept)


def segments_at(num_blocks: int, cuts: tuple[int, ...]) -> list[tuple[int, int]]:
    """Block ranges of ``cuts`` (blocks after which the model is cut)."""
    return [tuple(r) for r in ranges_from_cuts(list(cuts), num_blocks)]


class DevicePipeline:
    """E3's constant splits of ``model`` on one device (module docstring), driven by one thread: :meth:`admit`
    requests, then :meth:`run_until_idle` (or :meth:`step` at a time). ``answer(handle, outputs_dict)`` or
    ``fail(handle, message)`` is called exactly once for every admitted request."""

    def __init__(self, model: EarlyExitModel, *, cuts: tuple[int, ...], batch_sizes: list[int],
                 enabled_ramps: tuple[int, ...], rule: ExitRule, settings: DeviceSettings, slo_ms: float,
                 slack: float = 0.2, answer: Callable[[Any, dict], None], fail: Callable[[Any, str], None],
                 clock: Callable[[], float] = time.monotonic, depth: int | None = None,
                 on_run: Callable[[int, BatchRoute], None] | None = None,
                 on_drop: Callable[[str, int], None] | None = None):
        card = model.card
        # telemetry hooks (the router's metrics): every decided run (split index, its route), every request
        # dropped (reason as e3.serving.policy names them, its inputs)
        self.on_run, self.on_drop = on_run, on_drop
        self.card, self.rule, self.settings = card, rule, settings
        self.ranges = segments_at(card.num_blocks, cuts)
        if len(batch_sizes) != len(self.ranges):
            raise ValueError(f"{len(self.ranges)} splits need {len(self.ranges)} batch sizes, got {batch_sizes}")
        if max(batch_sizes) > settings.max_batch:
            raise ValueError(f"split batches {batch_sizes} exceed the executors' max batch {settings.max_batch}")
        self.ramps = [card.split_ramps(a, b, enabled_ramps) for a, b in self.ranges]
        self.executors = [make_executor(model, a, b, ramps=r, settings=settings) for (a, b), r in zip(self.ranges, self.ramps)]
        self.queues = [_Queue(b) for b in batch_sizes]
        self.state_count = len(card.state)
        self.slo_s, self.slack = slo_ms / 1e3, slack
        self.answer_cb, self.fail_cb, self.clock = answer, fail, clock
        self.inbox: deque = deque()
        self.pending: deque[_Run] = deque()   # runs launched, not yet decided (at most ``depth``)
        self.depth = depth or (DEPTH if settings.cuda else 1)
        self.counts = {"runs": [0] * len(self.ranges), "rows": [0] * len(self.ranges), "dropped": 0}

    # -- admission (any thread) ------------------------------------------------------------------------
    def admit(self, handle: Any, arrays: dict[str, np.ndarray]) -> None:
        """Queue one request's inputs (name -> [n, ...] host arrays). Safe from any thread while another steps
        (a deque's append and popleft are atomic)."""
        self.inbox.append((handle, arrays, self.clock()))

    def _drain(self) -> None:
        """Queue what arrived for split 1: one chunk per request; the exit rule's initial state computed once for
        all of them (a rule that reads the inputs hashes every row: once per drain, not once per request)."""
        items = []
        while self.inbox:   # popleft, not a swap of the deque: admit() may append from another thread meanwhile
            items.append(self.inbox.popleft())
        if not items:
            return
        C = self.card.num_classes
        sizes = [len(next(iter(arrays.values()))) for _, arrays, _ in items]
        names = list(items[0][1])
        whole = {k: np.concatenate([arrays[k] for _, arrays, _ in items]) for k in names} if len(items) > 1 \
            else items[0][1]
        rule_state = self.rule.init_state_for(whole, sum(sizes))
        at = 0
        for (handle, arrays, arrival), n in zip(items, sizes):
            job = _Job(handle, Answer(np.full(n, -1, np.int64), np.zeros(n, np.int32), np.zeros((n, C), np.float32)),
                       n, arrival + self.slo_s)
            tensors = tuple(torch.from_numpy(np.ascontiguousarray(arrays[s.name])) for s in self.card.inputs)
            jobs = np.empty(n, dtype=object)
            jobs[:] = [job] * n
            self.queues[0].push(_Chunk(tensors, jobs, np.arange(n), np.full(n, arrival + self.slo_s * (1 - self.slack)),
                                       {k: v[at:at + n] for k, v in rule_state.items()}))
            at += n

    # -- driving it ------------------------------------------------------------------------------------------
    def run_until_idle(self) -> None:
        """Step until every admitted request is answered or dropped (the Triton model's execute, the tests and the
        in-process bench: each admits its requests, then runs them out)."""
        while self.step():
            pass

    def fail_all(self, message: str) -> None:
        """Answer every request still queued or in flight with ``message`` (a failed or unloading model)."""
        self._drain()
        for run in self.pending:
            self._fail_rows(run.jobs, message)
        self.pending.clear()
        for q in self.queues:
            for c in q.take(q.rows):
                self._fail_rows(c.jobs, message)

    def step(self) -> bool:
        """Admit what arrived, drop what can no longer make it, then launch one split run or complete the
        oldest one in flight. Returns whether it did either (False: nothing is queued or in flight).

        Up to ``DEPTH`` runs are in flight: while the host decides one run's exits, the device already runs
        the next full batch (its rows do not depend on the run being decided). A partial batch is launched only
        when nothing is in flight, since a run in flight may still add rows to its queue."""
        self._drain()
        now = self.clock()
        self._drop_late(now)
        views = [QueueView(q.rows, q.batch, q.oldest_target(), q.expected_s) for q in self.queues]
        choice = choose(views, now)
        if choice.split is not None and (not self.pending or (len(self.pending) < self.depth
                                                              and choice.rows == self.queues[choice.split].batch)):
            self.pending.append(self._launch(choice.split, self.queues[choice.split].take(choice.rows)))
            return True
        if self.pending:
            self._complete(self.pending.popleft())
            return True
        return False

    def idle(self) -> bool:
        return not self.inbox and not self.pending and all(q.rows == 0 for q in self.queues)

    # -- one split execution -------------------------------------------------------------------------------
    @torch.inference_mode()
    def _launch(self, s: int, chunks: list[_Chunk]) -> _Run:
        """Enqueue one run of split ``s`` on the device: its rows into the executor, the state it hands on into
        a buffer of its own (the executor's next replay overwrites its outputs), the ramps' logits into host
        memory, an event after them. Nothing here waits for the device."""
        n = sum(len(c) for c in chunks)
        run = _Run(s, n, np.concatenate([c.jobs for c in chunks]), np.concatenate([c.index for c in chunks]),
                   np.concatenate([c.target for c in chunks]),
                   {k: np.concatenate([c.rule[k] for c in chunks]) for k in chunks[0].rule}, time.perf_counter())
        try:
            outs = self.executors[s].run([c.tensors for c in chunks], n)
            last = s == len(self.ranges) - 1
            state = () if last else outs[:self.state_count]
            ramp_out = outs[len(state):]
            run.state = tuple(t.clone() for t in state) if self.settings.cuda else state
            if ramp_out:
                logits = torch.stack([o.float() for o in ramp_out])
                if self.settings.cuda:
                    run.logits = torch.empty(logits.shape, dtype=torch.float32, pin_memory=True)
                    run.logits.copy_(logits, non_blocking=True)
                    run.event = torch.cuda.Event()
                    run.event.record()
                else:
                    run.logits = logits
        except Exception as err:  # noqa: BLE001 - a failed run answers its requests, the rest go on
            log.exception("split %d-%d failed", *self.ranges[s])
            run.error = f"split {self.ranges[s][0]}-{self.ranges[s][1]} failed: {err}"
        return run

    @torch.inference_mode()
    def _complete(self, run: _Run) -> None:
        """Wait for a launched run (the one sync), decide its exits on the host, answer the requests whose last
        row it decided, gather the survivors' state on the device into the next split's queue."""
        s, n = run.split, run.n
        try:
            if run.event is not None:
                run.event.synchronize()
            logits = run.logits.numpy() if run.logits is not None else None
        except Exception as err:  # noqa: BLE001
            run.error = f"split {self.ranges[s][0]}-{self.ranges[s][1]} failed: {err}"
        if run.error is not None:
            self._fail_rows(run.jobs, run.error)
            return
        route = BatchRoute(n, self.card.num_classes, self.card.num_blocks, self.rule, run.rule_state)
        keep = route.observe({k: logits[i] for i, k in enumerate(self.ramps[s])}) if logits is not None \
            else np.ones(n, bool)
        decided = np.flatnonzero(~keep)
        if decided.size:
            # one group per request (rows of a request are few and mostly adjacent)
            order = decided[np.argsort(np.fromiter((id(j) for j in run.jobs[decided]), np.int64, decided.size),
                                       kind="stable")]
            ids = np.fromiter((id(j) for j in run.jobs[order]), np.int64, order.size)
            for group in np.split(order, np.flatnonzero(np.diff(ids)) + 1):
                job = run.jobs[group[0]]
                if not job.live:
                    continue
                r = run.index[group]
                job.answer.label[r], job.answer.exit_ramp[r], job.answer.probs[r] = \
                    route.label[group], route.exit_ramp[group], route.probs[group]
                job.pending -= group.size
                if job.pending == 0:
                    job.live = False
                    self.answer_cb(job.handle, job.answer.outputs())
        if keep.any():
            idx = np.flatnonzero(keep)
            where = torch.from_numpy(idx).to(self.settings.device, non_blocking=True)
            survivors = tuple(t.index_select(0, where) for t in run.state)
            self.queues[s + 1].push(_Chunk(survivors, run.jobs[idx], run.index[idx], run.target[idx],
                                           {k: v[idx] for k, v in route.rule_state.items()}))
        self.counts["runs"][s] += 1
        self.counts["rows"][s] += n
        self.queues[s].learn(n, time.perf_counter() - run.started)
        if self.on_run is not None:
            self.on_run(s, route)

    # -- drops -------------------------------------------------------------------------------------------------
    def _drop_late(self, now: float) -> None:
        """Answer with an error every request with a row near a queue's head that will miss its deadline: by
        the CPU router's rule (serving/scheduler.py), when even this split's run would end after the deadline
        (its expected time, once ``WARM_BATCHES`` runs are learnt; before that, only once the deadline has
        passed). Later splits are not charged: the row may exit in this one."""
        dead = False
        for q in self.queues:
            at_end = now + (q.expected_s if q.trusted else 0.0)
            for c in itertools.islice(q.chunks, 4):
                for job in set(c.jobs[:8]):
                    if job.live and at_end > job.deadline:
                        self._fail_rows(np.array([job], dtype=object), "it would finish after its deadline",
                                        DEADLINE)
                        self.counts["dropped"] += 1
                        dead = True
        if dead:
            for q in self.queues:
                q.drop_dead()

    def _fail_rows(self, jobs: np.ndarray, message: str, reason: str = ERROR) -> None:
        for job in set(jobs):
            if job.live:
                job.live = False
                if self.on_drop is not None:
                    self.on_drop(reason, len(job.answer.label))
                self.fail_cb(job.handle, message)


class StockRunner:
    """The model's head path (no ramps) as one graph per bucket: ``run(arrays) -> Answer`` over all rows."""

    def __init__(self, model: EarlyExitModel, settings: DeviceSettings):
        self.card, self.settings = model.card, settings
        L = model.card.num_blocks
        self.executor = make_executor(model, 1, L, ramps=(L,), settings=settings)

    @torch.inference_mode()
    def run(self, arrays: dict[str, np.ndarray]) -> Answer:
        n = len(next(iter(arrays.values())))
        L, C = self.card.num_blocks, self.card.num_classes
        answer = Answer(np.zeros(n, np.int64), np.full(n, L, np.int32), np.zeros((n, C), np.float32))
        step = self.settings.max_batch
        for at in range(0, n, step):
            m = min(step, n - at)
            chunk = tuple(torch.from_numpy(np.ascontiguousarray(arrays[s.name][at:at + m])) for s in self.card.inputs)
            (logits,) = self.executor.run([chunk], m)
            part = head_answer(logits.float().cpu().numpy(), self.card)
            answer.label[at:at + m], answer.probs[at:at + m] = part.label, part.probs
        return answer


def head_answer(logits: np.ndarray, card) -> Answer:
    """The front door's answers of rows that ran the head alone ([n, C] logits): the stock model's, and the
    admission stage's, by the reference's own code (a :class:`BatchRoute` that observes only the head)."""
    n, L = len(logits), card.num_blocks
    route = BatchRoute(n, card.num_classes, L, EntropyRule(0.0), {})   # the rule is never consulted at the head
    route.observe({L: np.asarray(logits, np.float32)})
    return Answer(route.label, np.full(n, L, np.int32), route.probs)


class NaiveRunner:
    """The early-exit model as its authors run it, on the device: one batch, compacting at every enabled ramp."""

    def __init__(self, model: EarlyExitModel, *, enabled_ramps: tuple[int, ...], rule: ExitRule,
                 settings: DeviceSettings):
        self.card, self.rule, self.settings = model.card, rule, settings
        cuts = tuple(k for k in sorted(enabled_ramps) if k < model.card.num_blocks)
        self.ranges = segments_at(model.card.num_blocks, cuts)
        self.ramps = [model.card.split_ramps(a, b, enabled_ramps) for a, b in self.ranges]
        self.executors = [make_executor(model, a, b, ramps=r, settings=settings) for (a, b), r in zip(self.ranges, self.ramps)]

    @torch.inference_mode()
    def run(self, arrays: dict[str, np.ndarray]) -> Answer:
        n = len(next(iter(arrays.values())))
        L, C = self.card.num_blocks, self.card.num_classes
        answer = Answer(np.zeros(n, np.int64), np.zeros(n, np.int32), np.zeros((n, C), np.float32))
        step = self.settings.max_batch
        for at in range(0, n, step):
            m = min(step, n - at)
            part = {k: v[at:at + m] for k, v in arrays.items()}
            route = BatchRoute(m, C, L, self.rule, self.rule.init_state_for(part, m))
            feed = tuple(torch.from_numpy(np.ascontiguousarray(part[s.name])) for s in self.card.inputs)
            for s, executor in enumerate(self.executors):
                rows = len(route.active)
                outs = executor.run([feed], rows)
                last = s == len(self.executors) - 1
                state = () if last else outs[:len(self.card.state)]
                logits = torch.stack([o.float() for o in outs[len(state):]]).cpu().numpy()   # one sync
                keep = route.observe({k: logits[i] for i, k in enumerate(self.ramps[s])})
                if route.done:
                    break
                where = torch.from_numpy(np.flatnonzero(keep)).to(self.settings.device, non_blocking=True)
                feed = tuple(t.index_select(0, where) for t in state)
            answer.label[at:at + m], answer.exit_ramp[at:at + m], answer.probs[at:at + m] = \
                route.label, route.exit_ramp, route.probs
        return answer
