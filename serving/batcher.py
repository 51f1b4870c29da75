"""Triton's dynamic batcher, modelled (pure). :class:`TritonBatcher` is the model as the embedded server's source
runs it (payloads that grow until an instance takes them; the simulator's baselines and E3's router instances run
through it). :func:`batch_cut` / :func:`dynamic_batch` are the earlier, simpler rule (an idle instance takes queued
requests), still used by E²bird's emulated baselines (``e3 bench admission --cuda``, one input per request, preferred
batch = max batch), where the two agree except when requests queue behind busy instances with a delay set: moving
that emulation onto :class:`TritonBatcher` is left to do (2026-11-27), so until then the two can disagree there.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

__all__ = ["batch_cut", "dynamic_batch", "TritonBatcher", "Payload"]


def batch_cut(sizes: Sequence[int], preferred: int, max_batch: int, *, exceeded: bool) -> int:
    """Triton's dynamic batcher (``GetDynamicBatch``), the one model of it here: how many of the queued requests
    (``sizes``: inputs of each, oldest first) an idle instance puts into one batch once it stops waiting. At
    least one; more while their inputs stay within the preferred batch (``max_batch`` when ``preferred`` is 0),
    or within ``max_batch`` once the queue delay is ``exceeded``. :func:`dynamic_batch` cuts here; the simulator
    uses :class:`TritonBatcher`, whose walk of the queue agrees with this for one free instance."""
    cap = max_batch if exceeded or preferred <= 0 else preferred
    take, rows = 0, 0
    while take < len(sizes) and (take == 0 or rows + sizes[take] <= cap):
        rows += sizes[take]
        take += 1
    return take


def dynamic_batch(staged: int, oldest_wait_us: float, max_batch: int, *, delay_us: float) -> int:
    """Triton's dynamic batcher (preferred batch = max batch, one input per request), the baselines' rule
    where they are emulated outside Triton (``e3 bench admission --cuda``): how many of ``staged`` queued
    inputs an idle instance takes now (0: it waits). A full batch goes at once; less goes once the oldest
    has waited ``delay_us`` (with no delay: at once, all up to the max batch)."""
    if max_batch < 1 or delay_us < 0:
        raise ValueError(f"max_batch must be >= 1 and delay_us >= 0, got {max_batch} and {delay_us}")
    if staged <= 0:
        return 0
    if staged >= max_batch or oldest_wait_us >= delay_us:
        return batch_cut([1] * min(staged, max_batch), max_batch, max_batch, exceeded=oldest_wait_us >= delay_us > 0)
    return 0


@dataclass(eq=False)
class Payload:
    """One batch Triton's batcher is forming or has formed: requests join it until an instance takes it."""
    handles: list = field(default_factory=list)
    rows: int = 0
    queued: bool = False    # handed to the instances (the rate limiter's payload queue)
    taken: bool = False     # an instance runs it: it grows no more
    started: float = 0.0    # when the batcher started it (``BatcherStartNs``)


class TritonBatcher:
    """Triton's dynamic batcher as the embedded server (2.51, core r24.10) runs it, payloads included (pure).

    ``batch_cut`` is the rule for one idle instance taking queued requests; the real batcher differs where
    instances are busy, which is where every closed-loop run lives. Its thread (``BatcherThread``) keeps a
    *payload*: requests move from the queue into it (``GetDynamicBatch``), it is handed to the instances as soon as
    it holds any, and it **keeps growing while no instance has taken it**, until it is saturated (it would pass
    the largest preferred batch, or reached a preferred batch with no delay, or the queue delay was exceeded with
    it at or past the largest preferred size); then a new payload starts. At most ``2 x instances`` payloads wait
    for an instance (``RateLimiter::PayloadSlotAvailable``, with prefetching: a model without a queue policy, as
    every model the bench serves). An instance taking a payload merges into it, where a queue delay is set, the
    waiting payloads started more than the delay ago, up to ``max_batch`` (``InstanceQueue::Dequeue``): where
    requests queue behind busy instances, that is what makes Triton's batches of the max batch. Within one call
    the batcher walks the queue:

    * a preferred batch reached (or the rows before the request that would pass the largest preferred size)
      and the delay not exceeded: that much moves (with no delay, the payload is then saturated);
    * else everything walked (up to ``max_batch`` with the payload) moves when the walk hit ``max_batch`` or
      the largest preferred size, when the oldest queued request has waited the delay out, or when there is no
      delay; and also when the payload already holds rows that are not a preferred size and is not saturated
      (so an instance picks up the largest batch available);
    * else it waits until the oldest request has waited the delay, woken earlier by an arrival only once the
      queued rows reach the next preferred size (``Enqueue``'s wake-up rule).

    Measured against this Triton's ``batch_stats`` (docs/data/cpu/bench_side_by_side.json, stock and naive
    early exit, preferred 8, max batch 64, 2 instances, 16 closed-loop clients): with a 2 ms delay and requests
    of 1 input Triton ran batches of 1 to 15 inputs (mean 4.0), which the one-idle-instance rule could not form
    (its batches: 1 and 7-8, mean 4.7). Requests and the clock are the caller's: ``enqueue`` a request,
    ``form`` when woken, ``take`` for a free instance."""

    def __init__(self, *, instances: int, preferred: Sequence[int], max_batch: int, delay_s: float):
        if instances < 1 or max_batch < 1 or delay_s < 0:
            raise ValueError(f"instances and max_batch must be >= 1 and delay_s >= 0, got {instances}, "
                             f"{max_batch}, {delay_s}")
        self.preferred = frozenset(p for p in preferred if 0 < p <= max_batch)
        self.max_preferred = max(self.preferred) if self.preferred else max_batch
        self.max_batch, self.delay_s, self.slots = max_batch, delay_s, 2 * instances
        self.queue: deque = deque()        # (arrival_s, rows, handle), oldest first
        self.queued_rows = 0
        self.payload = Payload()
        self.saturated = False
        self.next_preferred = 0
        self.ready: deque[Payload] = deque()   # payloads handed to the instances, not taken yet

    def enqueue(self, now: float, rows: int, handle) -> bool:
        """A request arrives; returns whether it wakes the batcher (else it sleeps out its wait)."""
        self.queue.append((now, rows, handle))
        self.queued_rows += rows
        return self.saturated or self.payload.taken or self.queued_rows >= self.next_preferred

    def take(self, now: float) -> Payload | None:
        """A free instance takes the oldest payload handed over (None: none waits). With a queue delay, the
        payloads behind it that the batcher started more than the delay ago are merged into it while the rows
        stay within ``max_batch`` (``InstanceQueue::Dequeue``)."""
        if not self.ready:
            return None
        payload = self.ready.popleft()
        payload.taken = True
        while (self.delay_s > 0 and self.max_batch > 1 and self.ready
               and now - self.ready[0].started > self.delay_s
               and payload.rows + self.ready[0].rows <= self.max_batch):
            merged = self.ready.popleft()
            merged.taken = True
            payload.handles += merged.handles
            payload.rows += merged.rows
        return payload

    def form(self, now: float) -> float | None:
        """One turn of the batcher thread: move requests into the payload as Triton would. Returns 0 (turn
        again), seconds to wait (or until a waking arrival), or None (wait for an arrival or a free slot)."""
        if self.saturated or self.payload.taken:
            self.payload, self.saturated, self.next_preferred = Payload(started=now), False, 0
        if not self.queue or len(self.ready) >= self.slots:
            return None
        wait, count = self._walk(now)
        if wait == 0 and count:
            for _ in range(count):
                _, rows, handle = self.queue.popleft()
                self.queued_rows -= rows
                self.payload.handles.append(handle)
                self.payload.rows += rows
            if not self.payload.queued:
                self.payload.queued = True
                self.ready.append(self.payload)
        return wait

    def _walk(self, now: float) -> tuple[float, int]:
        """``GetDynamicBatch``: (seconds to wait, 0 = move now; how many queued requests move)."""
        held = self.payload.rows
        pending = count = best = best_count = 0
        send_now = False
        for _, rows, _ in self.queue:
            if held + pending > 0:
                if held + pending + rows > self.max_preferred and best == 0:
                    best, best_count, self.saturated = pending, count, True
                if held + pending + rows > self.max_batch:
                    send_now = True
                    break
            pending += rows
            count += 1
            if pending + held in self.preferred:
                best, best_count = pending, count
        # a nanosecond's slack: a wait of the delay's remainder must end with the delay exceeded despite rounding
        exceeded = self.delay_s > 0 and now - self.queue[0][0] >= self.delay_s - 1e-9
        if best and not exceeded:
            if self.delay_s == 0:
                self.saturated = True
            return 0.0, best_count
        if count == 0:
            return 0.0, 0
        if send_now or held + pending >= self.max_preferred:
            self.saturated = True
            return 0.0, count
        if exceeded or self.delay_s == 0:
            return 0.0, count
        above = [p for p in self.preferred if p > pending + held]
        nxt = min(above) if above else (min(self.preferred) if self.preferred else 0)
        self.next_preferred = nxt - held if nxt else 0
        if not self.saturated and held and held not in self.preferred:
            return 0.0, count
        return self.delay_s - (now - self.queue[0][0]), 0
