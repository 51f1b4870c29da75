"""When a device-resident split runs (E3 §4), as a pure function of what the queues hold. No torch.

One thread drives every split of the plan on one device (one CUDA stream: the device runs one split at a
time; running two at once would only split its SMs). Each time the device is free it asks :func:`choose`:

1. a **full batch**, latest split first (finish what is started: a later split's rows are older, and running
   them frees their requests soonest): the split runs at its plan batch;
2. else a **forced partial batch**, latest split first, where
   - the queue is split 1's (its delay is 0: a free device takes what is there, as Triton's dynamic batcher
     does with no delay, so that a light load is not held back), or
   - nothing upstream can add rows (every earlier queue is empty; the pipeline launches a partial batch only with nothing in flight), or
   - waiting longer would break the SLO minus slack: ``now`` plus the expected time of this and every later
     split reaches the oldest row's target;
3. else nothing: no row waits (the lowest non-empty queue always has an empty upstream, or is split 1's, so
   a row never waits for a forcing time that no event would bring).

Decision (the paper runs each split on its own devices and is silent on sharing one): on one device a
later split's partial batch goes before split 1's, because its rows have already been paid for once.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["QueueView", "Choice", "choose"]


@dataclass(frozen=True)
class QueueView:
    """What :func:`choose` needs of one split's queue."""
    rows: int                        # rows waiting
    batch: int                       # the plan's batch for this split (rows per run)
    oldest_target_s: float | None    # earliest target (arrival + SLO x (1 - slack)) among the waiting rows
    expected_s: float                # expected time of one run of this split (0 before it has run)


@dataclass(frozen=True)
class Choice:
    split: int | None     # the split to run now (None: nothing)
    rows: int             # how many rows it takes (its batch, or fewer when forced)


def choose(queues: list[QueueView], now: float) -> Choice:
    """The next run (module docstring)."""
    for s in reversed(range(len(queues))):
        q = queues[s]
        if q.rows >= q.batch:
            return Choice(s, q.batch)
    for s in reversed(range(len(queues))):
        q = queues[s]
        if q.rows == 0:
            continue
        if s == 0 or all(u.rows == 0 for u in queues[:s]):
            return Choice(s, q.rows)
        if q.oldest_target_s is not None:
            at = q.oldest_target_s - sum(u.expected_s for u in queues[s:])
            if now >= at:
                return Choice(s, q.rows)
    return Choice(None, 0)
