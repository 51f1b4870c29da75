"""E3's scheduler (E3 §4), pure: per-split queues of rows, when to dispatch, whom to drop, who is answered.

The router (:mod:`e3.serving.router`) owns the threads and Triton's I/O; every
decision is made here, on explicit clocks, so it is tested without a server.

* A **job** is one client request: ``n`` rows (inputs), its arrival time, its
  answers so far. It is answered the moment its own last row is decided, not
  when the batch it travelled in finishes.
* Every split has a **queue** of rows waiting for it. Rows of any number of
  jobs are merged into one batch of at most the plan's ``batch_size`` (survivors
  of earlier batches included), oldest first.
* A split **dispatches** a full batch when it has a free slot (``slots``:
  batches it may have in flight at once, from the plan), and a partial batch
  when fewer than ``partial_slots`` are in flight (a constant split gets one
  slot more than its instances, so that a full batch waits in Triton's queue
  while the router handles the last one; a partial batch must not wait there,
  or Triton's batcher would merge it with the batch behind it) and one of:

  - the queue holds a full batch;
  - the oldest row has waited the split's ``queue_delay_us`` (0 for split 1:
    a free slot takes what is there, as Triton's batcher does with no delay);
  - waiting longer would break the SLO minus slack (E3 §4): ``now`` plus the
    expected time of this and every later split reaches the oldest row's
    target, ``arrival + SLO x (1 - slack)``;
  - nothing upstream can add rows soon (no row queued or in flight before this
    split): a fuller batch would only come from new requests, which take at
    least the earlier splits' time to get here.

* A row is **dropped** only when it will miss: when even a batch of the rows
  queued now (at most the plan's batch) would end this split after the job's
  SLO, by the split's expected time. Its whole job is answered with an
  error (a request has one response) and counted by its inputs, so that inputs
  answered + inputs dropped = inputs sent. Decided here, once per poll, for the
  head of every queue (queues are in arrival order up to re-merging).
* **Expected times** are learnt from the batches themselves: a line (fixed
  part + per row) fitted by exponentially weighted least squares to each
  split's observed durations (call or in-process run). Until a split has run,
  its time is 0 (nothing is dropped or forced on a guess). A split's first
  batch is not learnt (it pays one-time costs: ONNX Runtime's first run,
  allocations, a stub warming up; measured as the cause of drops at the start
  of a loaded test session), and until ``WARM_BATCHES`` batches are learnt a
  row is dropped only once its deadline has passed, not on the expected time.
  Once it has run ``WARM_BATCHES`` batches, one observation counts for at most ``OUTLIER_X``
  times what was expected of it: a single stalled batch (a model loading
  beside it on the same cores, a page fault storm) must not make the
  scheduler drop every queued row as if the split had become that slow for
  good; a real slow-down still moves the line within a few batches (each
  clipped batch raises it by up to ``(OUTLIER_X - 1) x EWMA_ALPHA``).
* A **watchdog** (:meth:`Scheduler.expire`) ends the wait of jobs whose batch
  is in flight and whose deadline has passed: a split call that never returns
  (a hung execute; a BLS timeout only covers the callee's queue) must not hold
  its requests past their SLO. Each such job is dropped as late at its
  deadline plus ``WATCHDOG_GRACE_S``, and the router polls again at
  :meth:`Scheduler.next_expiry`. Decisions (the papers are silent on a split
  that hangs):

  - the **grace** (50 ms; the router's ``watchdog_grace_ms``): a call that
    comes back just past the deadline (its answers, or its queue's rejection,
    which says where it waited) is handled as before the watchdog existed; the
    watchdog is the backstop for calls that do not come back. Triton 2.51
    rejects an expired call only when the split's batcher next wakes, which
    can be long after the deadline: such calls are the watchdog's too.
  - the stuck call's **slot stays taken** until the call returns (or raises):
    the split's instance is still busy with it, and counting it free would send
    the next batch to wait behind it. The split's other slots keep serving, so
    a split with one instance hung of two runs on the other; one whose every
    slot is stuck takes nothing, and its queued rows are dropped at their
    deadline (:meth:`next_expiry` covers queued heads too, for want of any
    other event).
  - a **late return** is accounted, never answered: :meth:`finish` frees the
    slot, skips the rows of dropped jobs (their error was their one response),
    still answers and passes on the rows of jobs that had time left, and
    learns the batch's time only up to when it was abandoned (it took at least
    that; a hang's full length would make the split look slow for many
    batches after).

* **Admission** (:meth:`Scheduler.refusal`): with ``max_queue_inputs`` set
  (the router's config parameter of that name), a request is refused at once
  when the inputs the router holds plus its own would exceed it. Held inputs
  are those of the requests admitted and not yet answered or dropped: a
  request counts until its one response is decided, as a request counts in
  Triton's own ``max_queue_size`` until it leaves the queue; inputs, not
  requests, because the router's work grows with rows. Rows of a request the
  watchdog dropped stop counting when it is answered (their stuck call keeps
  its slot, which bounds the work anyway). A request larger than the limit
  itself could never be admitted: it is refused as the client's error, not
  as a full queue. Unset (None): every request is admitted, as before.

The deadline counts from the job's arrival at the router. The router's
``execute`` only hands rows to this scheduler and returns at once, so Triton's
queue in front of it stays empty in practice: what is not charged is the
time Triton takes to call it (and, for text, the preprocess step before it).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from e3.core.plan import COMPACT, Plan
from e3.serving.policy import DEADLINE, BatchRoute

__all__ = ["Job", "Row", "SplitQueue", "Dispatch", "Refusal", "Scheduler", "make_queues", "queue_limit", "refusal_for", "EWMA_ALPHA",
           "OUTLIER_X", "WARM_BATCHES", "WATCHDOG_GRACE_S", "MAX_QUEUE_INPUTS"]

EWMA_ALPHA = 0.1   # decay per batch of the older batches' weight in a split's expected time
WARM_BATCHES = 5   # batches observed before an observation is clipped
OUTLIER_X = 4.0    # an observation counts for at most this many times its expected duration
WATCHDOG_GRACE_S = 0.05   # a running batch's job is dropped this long after its deadline (module docstring)
MAX_QUEUE_INPUTS = "max_queue_inputs"   # the router's config parameter bounding the inputs it holds


@dataclass(eq=False)
class Job:
    """One client request inside the router."""
    handle: Any                 # the caller's way to answer it (a response sender in Triton)
    n: int                      # rows (inputs)
    arrival: float              # seconds, the scheduler's clock
    deadline: float             # arrival + SLO: answered later than this, the SLO is missed
    target: float               # arrival + SLO x (1 - slack): what dispatch decisions aim for
    num_classes: int
    label: np.ndarray = field(init=False)
    exit_ramp: np.ndarray = field(init=False)
    probs: np.ndarray = field(init=False)
    pending: int = field(init=False)   # rows not yet decided
    failed: str | None = None          # the drop reason once the job is dropped
    stuck_in: int | None = None        # split whose call had not returned by the deadline (watchdog drop)
    answered: bool = False             # its response has been handed out (an answer or an error)

    def __post_init__(self) -> None:
        self.label = np.full(self.n, -1, dtype=np.int64)
        self.exit_ramp = np.zeros(self.n, dtype=np.int32)
        self.probs = np.zeros((self.n, self.num_classes), dtype=np.float32)
        self.pending = self.n

    @property
    def live(self) -> bool:
        return self.failed is None and not self.answered


@dataclass(eq=False)
class Row:
    """One input on its way: its job, its index there, its tensors for the next split, its rule state."""
    job: Job
    index: int
    state: dict[str, np.ndarray]   # name -> this row's tensor (no batch axis)
    rule: dict[str, Any]           # exit-rule state of this row (name -> scalar)
    queued_at: float = 0.0         # when it entered its current queue


@dataclass
class SplitQueue:
    """One split's queue and what the scheduler knows about it."""
    batch_size: int                 # the plan's batch (rows per dispatch)
    slots: int                      # batches it may have in flight at once
    queue_delay_s: float            # longest the oldest row waits for a fuller batch
    partial_slots: int | None = None  # in flight at most when a partial batch goes (default: slots)
    rows: deque = field(default_factory=deque)
    in_flight: int = 0
    batches: int = 0                # batches learnt from
    seen: int = 0                   # batches observed (the first is not learnt)
    _sums: np.ndarray = field(default_factory=lambda: np.zeros(5))  # decayed weight, x, y, xx, xy

    @property
    def partial(self) -> int:
        return self.slots if self.partial_slots is None else min(self.partial_slots, self.slots)

    def expected_ms(self, rows: int) -> float:
        """Expected duration (ms) of a batch of ``rows`` rows: a line fitted to the batches seen
        (exponentially weighted least squares); proportional to the rows while every batch had the
        same size; 0 before the first batch."""
        w, sx, sy, sxx, sxy = self._sums
        if w <= 0:
            return 0.0
        mx, my = sx / w, sy / w
        var = sxx / w - mx * mx
        if var > 1e-6:
            slope = max(0.0, (sxy / w - mx * my) / var)
            return max(0.0, my + slope * (rows - mx))
        return my * rows / mx if mx > 0 else my

    def observe(self, rows: int, ms: float) -> None:
        """Learn from a batch of ``rows`` rows that took ``ms``."""
        if rows <= 0 or ms < 0:
            return
        self.seen += 1
        if self.seen == 1:   # the first batch pays one-time costs: not learnt
            return
        if self.batches >= WARM_BATCHES:
            ms = min(ms, OUTLIER_X * max(self.expected_ms(rows), 1e-3))
        self._sums = self._sums * (1 - EWMA_ALPHA) + np.array([1.0, rows, ms, rows * rows, rows * ms])
        self.batches += 1


@dataclass(eq=False)
class Dispatch:
    """A batch to run now: split index and its rows (the router stacks their tensors)."""
    split: int
    rows: list[Row]
    started: float = 0.0                # seconds (scheduler clock) when it was dispatched
    due: float = float("inf")           # earliest deadline (+ grace) of its live jobs: when the watchdog looks
    abandoned_at: float | None = None   # when the watchdog first dropped a job of it (its call still running)


@dataclass(frozen=True)
class Refusal:
    """Why a request is not admitted (:meth:`Scheduler.refusal`)."""
    message: str      # the request's error: names the limit and the counts
    permanent: bool   # the request alone exceeds the limit (the client's error); else the router is full now


def refusal_for(limit: int | None, held_inputs: int, n: int) -> Refusal | None:
    """The admission bound of every router form (the scheduler's, the device engine's): None when a request
    of ``n`` inputs may be admitted with ``held_inputs`` already held under ``limit`` (None: unbounded); else
    why not. A request larger than the limit can never fit (the client's error, ``permanent``); one that does
    not fit now is refused as a full queue (503)."""
    if limit is None:
        return None
    if n > limit:
        return Refusal(f"request of {n} inputs refused: more than the router's {MAX_QUEUE_INPUTS} of {limit}; "
                       f"send at most {limit} inputs per request", permanent=True)
    if held_inputs + n > limit:
        return Refusal(f"router queue full: {held_inputs} inputs held, {MAX_QUEUE_INPUTS} is {limit}, "
                       f"this request's {n} would exceed it; retry later", permanent=False)
    return None


def queue_limit(text: str | None) -> int | None:
    """The router's ``max_queue_inputs`` parameter (a config string) as a limit: None (unbounded) when
    absent or empty, else a positive integer; anything else raises ValueError naming the parameter."""
    if text is None or not str(text).strip():
        return None
    try:
        limit = int(str(text).strip())
    except ValueError:
        raise ValueError(f"{MAX_QUEUE_INPUTS} must be a positive integer (inputs), got {text!r}") from None
    if limit < 1:
        raise ValueError(f"{MAX_QUEUE_INPUTS} must be a positive integer (inputs), got {text!r}; "
                         f"leave it out for no limit")
    return limit


class Scheduler:
    """The per-split queues of one router (see the module docstring). Not thread-safe: the router
    holds one lock around every call."""

    def __init__(self, queues: list[SplitQueue], slo_s: float, slack: float,
                 watchdog_grace_s: float = WATCHDOG_GRACE_S, max_queue_inputs: int | None = None):
        if not queues:
            raise ValueError("a scheduler needs at least one split")
        if max_queue_inputs is not None and max_queue_inputs < 1:
            raise ValueError(f"max_queue_inputs must be at least 1 (or None: no limit), got {max_queue_inputs}")
        self.queues = queues
        self.slo_s = slo_s
        self.slack = slack
        self.grace_s = watchdog_grace_s   # seconds past a deadline before the watchdog drops a running batch's job
        self.max_queue_inputs = max_queue_inputs   # most inputs held at once (None: no limit)
        self.held_inputs = 0              # inputs of admitted jobs not yet answered or dropped
        self.running: dict[int, Dispatch] = {}   # id -> batches dispatched and not yet finished or abandoned
        self.slots = [q.slots for q in queues]   # batches each split may have in flight
        self.inline = False                       # answers its requests inside their execute (for_plan)
        self.direct = False                       # inline with one worker per split: the execute thread runs them

    @classmethod
    def for_plan(cls, plan: Plan, *, stages_per_instance: int = 1, watchdog_grace_s: float = WATCHDOG_GRACE_S,
                 max_queue_inputs: int | None = None) -> "Scheduler":
        """The scheduler of one router instance serving ``plan`` (the router and the simulator both build it
        here). Slots: a compact split gets its instances over the router instances (``plan.router_instances``);
        a constant split one batch in flight per stage per instance (``stages_per_instance``: 1 on Triton, more
        where a copy or the router's host work runs beside the compute) plus one waiting in Triton's queue.
        Several router instances answer inline: no other request can reach an instance while its execute waits,
        so a wait at split 1 could not fill the batch (split 1's delay is 0). A partial batch is sent to a
        split only while one of its instances is free."""
        splits = plan.splits
        inline = plan.router_instances > 1
        slots = [s.instances // plan.router_instances if s.form == COMPACT else stages_per_instance * s.instances + 1
                 for s in splits]
        queues = make_queues([s.batch_size for s in splits], slots,
                             [0 if inline and i == 0 else s.queue_delay_us for i, s in enumerate(splits)],
                             partial_slots=[min(s.instances, n) for s, n in zip(splits, slots)])
        sched = cls(queues, plan.slo_ms / 1e3, plan.slack, watchdog_grace_s, max_queue_inputs)
        sched.inline, sched.direct = inline, inline and all(n == 1 for n in slots)
        return sched

    # -- admission -----------------------------------------------------------------------------------
    def job(self, handle: Any, n: int, now: float, num_classes: int) -> Job:
        return Job(handle, n, now, now + self.slo_s, now + self.slo_s * (1 - self.slack), num_classes)

    def refusal(self, n: int) -> Refusal | None:
        """None when a request of ``n`` inputs may be admitted now; else why not (module docstring,
        "Admission"). Decides only: :meth:`admit` takes the inputs."""
        return refusal_for(self.max_queue_inputs, self.held_inputs, n)

    def admit(self, job: Job, inputs: dict[str, np.ndarray], rule_state: dict[str, np.ndarray], now: float) -> None:
        """Queue the job's rows for split 1 (``inputs``: name -> [n, ...]; ``rule_state``: the exit rule's
        initial state for n rows); its inputs count as held until it is answered or dropped. Admits
        whatever :meth:`refusal` says: the caller asks first."""
        self.held_inputs += job.n
        q = self.queues[0]
        for i in range(job.n):
            q.rows.append(Row(job, i, {k: v[i] for k, v in inputs.items()},
                              {k: v[i] for k, v in rule_state.items()}, now))

    # -- dispatch ------------------------------------------------------------------------------------
    def remaining_ms(self, split: int) -> float:
        """Expected time (ms) from dispatching at ``split`` to the end of the last split, at full batches."""
        return sum(q.expected_ms(q.batch_size) for q in self.queues[split:])

    def poll(self, now: float) -> tuple[list[Dispatch], list[Job], float | None]:
        """What to do at ``now``: (batches to dispatch, jobs newly dropped as late, when to poll next
        at the latest: None if only an event can change anything). Dispatched rows leave their queue
        and count as in flight until :meth:`finish` or :meth:`abandon`."""
        dispatches, dropped, wake = [], [], None
        for s in reversed(range(len(self.queues))):  # later splits first: finish what is started
            q = self.queues[s]
            dropped += self._drop_late(q, now)
            while q.rows and q.in_flight < q.slots:
                if len(q.rows) < q.batch_size and (q.in_flight >= q.partial or not self._forced(s, now)):
                    break
                rows = []
                while q.rows and len(rows) < q.batch_size:
                    row = q.rows.popleft()
                    if row.job.live:   # rows of a dropped job are left behind
                        rows.append(row)
                if not rows:
                    break
                q.in_flight += 1
                d = Dispatch(s, rows, now, min(r.job.deadline for r in rows) + self.grace_s)
                self.running[id(d)] = d
                dispatches.append(d)
                self._skip_dead(q)
            if q.rows and q.in_flight < q.partial:
                at = self._force_time(s)
                wake = at if wake is None else min(wake, at)
        return dispatches, dropped, wake

    def expire(self, now: float) -> list[Job]:
        """The watchdog: live jobs with a row in a batch still running whose deadline plus the grace has
        passed (``now``, seconds) are dropped as late, with ``stuck_in`` naming the split. Their batch
        keeps its slot until :meth:`finish` or :meth:`abandon` (see the module docstring). Returns them,
        each once."""
        expired = []
        for d in self.running.values():
            if d.due > now:
                continue
            for row in d.rows:
                job = row.job
                if job.live and job.deadline + self.grace_s <= now:
                    job.failed, job.stuck_in = DEADLINE, d.split
                    self.held_inputs -= job.n
                    expired.append(job)
                    if d.abandoned_at is None:
                        d.abandoned_at = now
            d.due = min((r.job.deadline + self.grace_s for r in d.rows if r.job.live), default=float("inf"))
        return expired

    def next_expiry(self) -> float | None:
        """When (seconds) a job will next be late with no other event: the earliest deadline (plus the
        grace) in a running batch, or when a queue's head row can no longer make its deadline; None if
        nothing waits."""
        due = min((d.due for d in self.running.values()), default=float("inf"))
        for q in self.queues:
            head = [r.job.deadline for r in _head(q.rows) if r.job.live]
            if head:
                due = min(due, min(head) - q.expected_ms(min(len(q.rows), q.batch_size)) / 1e3)
        return None if due == float("inf") else due

    def _upstream_idle(self, split: int) -> bool:
        return all(not q.rows and q.in_flight == 0 for q in self.queues[:split])

    def _force_time(self, split: int) -> float:
        """When the oldest row of ``split`` must go even if its batch is not full."""
        q = self.queues[split]
        oldest = q.rows[0]
        by_delay = oldest.queued_at + q.queue_delay_s
        by_slo = min(r.job.target for r in _head(q.rows)) - self.remaining_ms(split) / 1e3
        return min(by_delay, by_slo)

    def _forced(self, split: int, now: float) -> bool:
        if split > 0 and self._upstream_idle(split):
            return True
        if split == 0 and self.queues[0].queue_delay_s == 0:
            return True
        return now >= self._force_time(split)

    def _drop_late(self, q: SplitQueue, now: float) -> list[Job]:
        """Drop the jobs of head rows that would end this split after their SLO even in a batch of
        the rows queued now (the fastest the head row can go)."""
        dropped = []
        self._skip_dead(q)
        trusted = q.batches >= WARM_BATCHES   # before that, only rows already past their deadline go
        while q.rows and (now + (q.expected_ms(min(len(q.rows), q.batch_size)) / 1e3 if trusted else 0.0)
                          > q.rows[0].job.deadline):
            job = q.rows.popleft().job
            if job.live:
                job.failed = DEADLINE
                self.held_inputs -= job.n
                dropped.append(job)
            self._skip_dead(q)
        return dropped

    @staticmethod
    def _skip_dead(q: SplitQueue) -> None:
        while q.rows and not q.rows[0].job.live:
            q.rows.popleft()

    # -- completion ----------------------------------------------------------------------------------
    def finish(self, d: Dispatch, route: BatchRoute, survivors: dict[str, np.ndarray] | None, ms: float,
               now: float) -> list[Job]:
        """A dispatched batch ran in ``ms``: record every decided row's answer, queue the survivors
        (``survivors``: name -> [len(route.active), ...], the next split's inputs) for the next split.
        Returns the jobs now fully answered (each exactly once). A batch the watchdog abandoned counts
        for at most the time it had run when abandoned."""
        q = self.queues[d.split]
        q.in_flight -= 1
        self.running.pop(id(d), None)
        if d.abandoned_at is not None:
            ms = min(ms, (d.abandoned_at - d.started) * 1e3)
        q.observe(len(d.rows), ms)
        done = []
        decided = np.flatnonzero(route.exit_ramp > 0)
        for i in decided:
            row = d.rows[i]
            job = row.job
            if not job.live:
                continue
            job.label[row.index] = route.label[i]
            job.exit_ramp[row.index] = route.exit_ramp[i]
            job.probs[row.index] = route.probs[i]
            job.pending -= 1
            if job.pending == 0:
                job.answered = True
                self.held_inputs -= job.n
                done.append(job)
        if route.active.size:
            if d.split + 1 >= len(self.queues):
                raise RuntimeError(f"split {d.split + 1} is the last one, yet {route.active.size} rows are undecided")
            nxt = self.queues[d.split + 1]
            for j, i in enumerate(route.active):
                row = d.rows[i]
                if row.job.live:
                    nxt.rows.append(Row(row.job, row.index, {k: v[j] for k, v in survivors.items()},
                                        {k: v[i] for k, v in route.rule_state.items()}, now))
        return done

    def abandon(self, d: Dispatch, reason: str) -> list[Job]:
        """A dispatched batch failed (``reason``: a drop reason): its live jobs are dropped. Returns them."""
        self.queues[d.split].in_flight -= 1
        self.running.pop(id(d), None)
        failed = []
        for row in d.rows:
            if row.job.live:
                row.job.failed = reason
                self.held_inputs -= row.job.n
                failed.append(row.job)
        return failed

    def fail_all(self, reason: str) -> list[Job]:
        """Every live job still queued or in a running batch (the router is unloading): dropped with
        ``reason``."""
        failed = []
        for d in self.running.values():
            for row in d.rows:
                if row.job.live:
                    row.job.failed = reason
                    self.held_inputs -= row.job.n
                    failed.append(row.job)
        for q in self.queues:
            for row in q.rows:
                if row.job.live:
                    row.job.failed = reason
                    self.held_inputs -= row.job.n
                    failed.append(row.job)
            q.rows.clear()
        return failed

    # -- batches -------------------------------------------------------------------------------------
    @staticmethod
    def stack(rows: list[Row]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """The batch's inputs and exit-rule state, stacked in row order."""
        first = rows[0]
        feed = {k: np.stack([r.state[k] for r in rows]) for k in first.state}
        rule = {k: np.asarray([r.rule[k] for r in rows]) for k in first.rule}
        return feed, rule


def _head(rows: deque, n: int = 8):
    """The first ``n`` rows of a queue (deadlines are nearly in order; looking a little further than
    the oldest row covers survivors that re-entered behind younger rows)."""
    for i, row in enumerate(rows):
        if i >= n:
            return
        yield row


def make_queues(batch_sizes: list[int], slots: list[int], delays_us: list[int],
                *, partial_slots: list[int] | None = None) -> list[SplitQueue]:
    """One :class:`SplitQueue` per split from the plan's numbers."""
    partial = partial_slots or [None] * len(slots)
    return [SplitQueue(b, s, d / 1e6, p) for b, s, d, p in zip(batch_sizes, slots, delays_us, partial)]
