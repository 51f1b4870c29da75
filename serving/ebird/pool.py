"""E²bird's memory pool, the bookkeeping: which ring slots an arriving request is copied into, which rows a worker
takes, and when a slot may be written again. Pure (no torch, no CUDA): the device calls sit behind
:class:`~e3.serving.ebird.engine.DeviceOps`, so every rule here is tested on the CPU.

The paper (TPDS, §5.1, Fig. 5 and Table 2) keeps the inputs of every inference in a circular buffer in GPU memory:
each arriving input is copied into the next slot on one stream (``InStream``, one copy at a time under
``InMutex``, in arrival order) and its ``InEvent`` recorded; slots are contiguous, so a worker given the next
``b`` ready slots reads them as one batch, and waits only on the ``InEvent`` of the last of them (the copies are
ordered on one stream). Here:

* **Rows, not requests, hold slots.** A request of ``n`` inputs takes ``n`` consecutive slots; every row gets a
  serial number (``seq``, the paper's ``index``) in arrival order, and slot = ``seq % capacity``.
* **Copied once, in arrival order.** :meth:`SlotRing.reserve` hands out the next free slots in ``seq`` order;
  nothing moves a row afterwards (a worker reads it where it lies). A request that does not fit waits on the host
  (:class:`Backlog`, arrival order kept) until slots free: later arrivals never overtake it into the ring.
* **Never overwritten while read.** A slot is free again only after the worker that took it has finished with
  it (:meth:`SlotRing.release`, called when the host has seen the worker's completion event). Workers finish out
  of order, so the ring's write limit is the oldest row still held, staged or being read.
* **Which copy a worker waits on.** :class:`CopyLog` keeps, in order, the ``seq`` reached by each recorded
  copy event; a batch of rows ``[start, stop)`` waits on the first event at or past ``stop`` (the paper's "only
  the last slot's InEvent"), on the device (a stream wait), never on the host.
* **Wrap-around.** The ring's end does not align with batches: a request's rows, or a batch's, may run past the
  last slot and continue at slot 0; :meth:`SlotRing.segments` gives the (at most two) slot ranges. The paper's
  buffer is circular too and is silent on this; a worker gathers its segments into its own input (a CUDA graph
  reads fixed addresses: :mod:`e3.serving.ebird.torch_ops`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

__all__ = ["SlotRing", "Taken", "CopyLog", "Backlog", "Staged", "PoolFull"]


class PoolFull(ValueError):
    """More rows were asked for than the ring can give now."""


@dataclass(frozen=True)
class Taken:
    """Rows ``[start, stop)`` (serial numbers) handed to one worker, and where they lie in the ring."""
    start: int
    stop: int
    segments: tuple[tuple[int, int], ...]   # slot ranges [a, b), in row order (two when the batch wraps)

    @property
    def rows(self) -> int:
        return self.stop - self.start


class SlotRing:
    """The ring's three frontiers, by serial number: ``written`` (rows whose copy was issued), ``taken`` (rows
    handed to workers; the paper's ``DevPtr``), and the oldest row a worker still reads. Staged rows are
    ``[taken, written)``; free slots are those below the oldest row held."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"the pool needs at least one slot, got capacity {capacity}")
        self.capacity = capacity
        self.written = 0                        # next serial number to hand to an arriving row
        self.taken = 0                          # next serial number a worker takes
        self._reading: dict[int, int] = {}      # start -> stop of every batch a worker holds

    @property
    def staged(self) -> int:
        """Rows copied (or being copied) into the ring and not yet taken by a worker: the paper's ``N``."""
        return self.written - self.taken

    @property
    def held_from(self) -> int:
        """The oldest serial number whose slot may not be written: the oldest batch still read, else ``taken``."""
        return min(self._reading, default=self.taken)

    @property
    def room(self) -> int:
        """Slots free for arriving rows now."""
        return self.capacity - (self.written - self.held_from)

    @property
    def reading(self) -> int:
        """Rows held by workers (taken, not released): the paper's ``CurInf``."""
        return sum(stop - start for start, stop in self._reading.items())

    def segments(self, start: int, stop: int) -> tuple[tuple[int, int], ...]:
        """Slot ranges of rows ``[start, stop)``: one, or two where they run past the last slot."""
        if stop - start > self.capacity or stop < start:
            raise ValueError(f"rows [{start}, {stop}) do not fit a ring of {self.capacity} slots")
        if start == stop:
            return ()
        a, b = start % self.capacity, stop % self.capacity or self.capacity
        return ((a, b),) if a < b else ((a, self.capacity), (0, b))

    def reserve(self, n: int) -> Taken:
        """The next ``n`` slots for an arriving request (its rows get the next serial numbers). Raises
        :class:`PoolFull` when fewer are free: the caller keeps the request waiting on the host."""
        if n < 1:
            raise ValueError(f"a request holds at least one row, got {n}")
        if n > self.room:
            raise PoolFull(f"{n} rows asked, {self.room} slots free of {self.capacity}")
        start = self.written
        self.written += n
        return Taken(start, self.written, self.segments(start, self.written))

    def take(self, n: int) -> Taken:
        """The next ``n`` staged rows, oldest first, for one worker; they stay held until :meth:`release`."""
        if not 1 <= n <= self.staged:
            raise ValueError(f"a worker takes 1..{self.staged} staged rows, asked {n}")
        start = self.taken
        self.taken += n
        self._reading[start] = self.taken
        return Taken(start, self.taken, self.segments(start, self.taken))

    def release(self, taken: Taken) -> None:
        """The worker that took ``taken`` is done with its slots: they may be written again (once every older
        batch is released too)."""
        if self._reading.get(taken.start) != taken.stop:
            raise ValueError(f"rows [{taken.start}, {taken.stop}) are not held by a worker")
        del self._reading[taken.start]


class CopyLog:
    """Copy events in issue order, each with the serial number its copies reached. The copies run on one stream,
    so an event also covers every row before it."""

    def __init__(self) -> None:
        self._events: deque[tuple[int, Any]] = deque()   # (rows written when recorded, the event)

    def record(self, written: int, event: Any) -> None:
        if self._events and written <= self._events[-1][0]:
            raise ValueError(f"a copy event must cover new rows: {written} after {self._events[-1][0]}")
        self._events.append((written, event))

    def covering(self, stop: int) -> Any:
        """The event to wait on before reading rows up to ``stop`` (exclusive): the first recorded at or past it."""
        for written, event in self._events:
            if written >= stop:
                return event
        raise ValueError(f"no copy event covers row {stop - 1}: rows were taken before their copy was recorded")

    def forget_before(self, taken: int) -> None:
        """Drop events no future batch needs (every batch from now on ends after ``taken``)."""
        while self._events and self._events[0][0] <= taken:
            self._events.popleft()

    def __len__(self) -> int:
        return len(self._events)


@dataclass(eq=False)
class Staged:
    """One request in the pool (or waiting for it): its rows and, as workers finish, their outputs."""
    handle: Any                      # whatever answers the request (Triton's request)
    arrays: dict                     # input name -> host array [n, ...]
    n: int                           # rows
    first: int = -1                  # serial number of its first row, once in the ring (-1: waiting on the host)
    pending: int = 0                 # rows not computed yet
    outputs: Any = None              # host array [n, ...] once its first part is back
    failed: str | None = None


@dataclass
class Backlog:
    """Requests in arrival order: those waiting for slots (``waiting``), and those in the ring (``inside``,
    oldest first) until every row is computed."""
    waiting: deque = field(default_factory=deque)
    inside: deque = field(default_factory=deque)

    def parts(self, start: int, stop: int) -> list[tuple[Staged, int, int, int]]:
        """The requests holding rows ``[start, stop)``: (request, its first row, rows, offset in the batch)."""
        out = []
        for r in self.inside:
            if r.first >= stop:
                break
            lo, hi = max(start, r.first), min(stop, r.first + r.n)
            if lo < hi:
                out.append((r, lo - r.first, hi - lo, lo - start))
        return out

    def finished(self) -> list[Staged]:
        """Pop and return the requests whose every row is computed, wherever they stand (workers finish out of
        order; a request later in the ring may finish first)."""
        done = [r for r in self.inside if r.pending == 0]
        if done:
            self.inside = deque(r for r in self.inside if r.pending > 0)
        return done
