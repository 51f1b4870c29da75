"""The device form in simulated time (a plan of device splits, :attr:`e3.core.plan.Plan.on_device`): one device
runs the plan's splits one at a time inside the router, under the device router's own dispatch rule, each run
priced by the one cost model. :func:`e3.simulator.des.simulate_plan` runs it; its module docstring says what is
and is not modelled."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator

import numpy as np
import simpy

from e3.core.cost import batch_ms, device_table
from e3.core.plan import DEVICE, Plan
from e3.core.profile import LatencyProfile
from e3.serving.device.dispatch import QueueView

if TYPE_CHECKING:
    from e3.simulator.des import CallCosts

__all__ = ["Dispatch", "DeviceRouter"]


Dispatch = Callable[[list, float], Any]   # (queue views, now in s) -> a choice with .split (None: nothing), .rows


@dataclass(eq=False)
class _DeviceJob:
    pending: int                     # rows not yet decided
    deadline: float                  # arrival + SLO (s): past it, the request is dropped
    done: simpy.Event
    live: bool = True


class DeviceRouter:
    """The device router in simulated time (module docstring, the device form): one device, the plan's device
    splits, a queue each, the device dispatch rule."""

    def __init__(self, env: simpy.Environment, latency: LatencyProfile, plan: Plan, exit_ramp: np.ndarray,
                 device: str, batches: dict[int, list[int]], costs: CallCosts, dispatch: Dispatch):
        self.env, self.latency, self.plan, self.costs, self.dispatch = env, latency, plan, costs, dispatch
        self.splits = plan.splits
        self.device = [s.device if s.device in latency.devices else device for s in self.splits]
        self.ramps = plan.enabled_ramps
        from e3.simulator.des import next_enabled_exit   # des imports this module: a late import
        self.exits = next_enabled_exit(exit_ramp, self.ramps, plan.num_blocks)
        self.queues: list[deque] = [deque() for _ in self.splits]   # chunks: (job, pool rows, target s)
        self.rows = [0] * len(self.splits)
        self.expected_s = []
        for s, dev in zip(self.splits, self.device):   # the cost model's run at the plan's batch
            T, _ = device_table(latency, dev, np.zeros(plan.num_blocks), batch=float(s.batch_size), ramps=self.ramps)
            self.expected_s.append(float(T[s.first_block - 1, s.last_block - 1]) / 1e3)
        self.target_s = plan.slo_ms * (1 - plan.slack) / 1e3
        self.slo_s = plan.slo_ms / 1e3
        self.batches = batches
        self.rng = np.random.default_rng(costs.service_seed)
        self.wake: simpy.Event | None = None
        env.process(self._engine())

    def admit(self, pool_rows: np.ndarray) -> simpy.Event:
        """A request of these inputs joins split 1's queue; the event fires with True (answered) or False
        (dropped)."""
        now = self.env.now
        job = _DeviceJob(len(pool_rows), now + self.slo_s, self.env.event())
        self._push(0, job, np.asarray(pool_rows), now + self.target_s)
        if self.wake is not None and not self.wake.triggered:
            self.wake.succeed()
        return job.done

    def _push(self, i: int, job: _DeviceJob, rows: np.ndarray, target: float) -> None:
        if len(rows):
            self.queues[i].append((job, rows, target))
            self.rows[i] += len(rows)

    def _take(self, i: int, n: int) -> list[tuple[_DeviceJob, np.ndarray, float]]:
        out, want, q = [], n, self.queues[i]
        while want and q:
            job, rows, target = q.popleft()
            if len(rows) > want:
                q.appendleft((job, rows[want:], target))
                rows = rows[:want]
            out.append((job, rows, target))
            want -= len(rows)
        self.rows[i] -= n - want
        return out

    def run_ms(self, i: int, rows: np.ndarray) -> float:
        """One run of split i on these rows: the device form's stage at the executor's bucket for them."""
        s, dev = self.splits[i], self.device[i]
        n = len(rows)
        bucket = next((b for b in self.latency.batch_sizes if b >= n), n)
        return (float(self.latency.router(dev, bucket))
                + batch_ms(self.latency, dev, s.first_block, last=s.last_block, exit_block=np.zeros(bucket, int),
                           ramps=self.ramps, form=DEVICE))

    def _drop_late(self) -> None:
        now, dead = self.env.now, False
        for i, q in enumerate(self.queues):
            for job, _, _ in q:   # the router's rule: this split's run would end past the deadline
                if job.live and now + self.expected_s[i] > job.deadline:
                    job.live, dead = False, True
                    job.done.succeed(False)
        if dead:
            for i, q in enumerate(self.queues):
                self.queues[i] = deque(c for c in q if c[0].live)
                self.rows[i] = sum(len(c[1]) for c in self.queues[i])

    def _engine(self) -> Iterator:
        while True:
            self._drop_late()
            views = [QueueView(self.rows[i], s.batch_size,
                               min((c[2] for c in self.queues[i]), default=None), self.expected_s[i])
                     for i, s in enumerate(self.splits)]
            choice = self.dispatch(views, self.env.now)
            if choice.split is None:
                self.wake = self.env.event()
                yield self.wake
                continue
            i = choice.split
            chunks = self._take(i, choice.rows)
            rows = np.concatenate([c[1] for c in chunks])
            self.batches[i].append(len(rows))
            ms = self.run_ms(i, rows) * self.costs.jitter(self.rng, self.latency, self.device[i], len(rows))
            yield self.env.timeout(ms / 1e3)
            last = self.splits[i].last_block
            for job, r, target in chunks:
                if not job.live:
                    continue
                leaves = self.exits[r] <= last
                job.pending -= int(leaves.sum())
                if job.pending == 0:
                    job.live = False
                    job.done.succeed(True)
                elif i + 1 < len(self.splits):
                    self._push(i + 1, job, r[~leaves], target)
