"""A discrete-event simulator of the served system (SimPy), driven by the same inputs as the real one.

What it takes: the latency profile (``e3 profile``: P(k, c, B), ramps, Tx,
the router's per-batch and exit-check work), a plan, the inputs' exit ramps
(from a workload: the reference model's exit per input) and the arrival process
(a closed loop of clients or Poisson arrivals, ``batch`` inputs per request).
What it returns: what the load generator reports (inputs/s, p50 / p99,
goodput under an SLO, drops) plus the batch each split ran.

* **E3** runs through the *real* scheduler (:class:`e3.serving.scheduler.Scheduler`,
  the same queues, slots, delays, SLO forcing and drops as the router): the
  simulator only replaces time. A constant split's batch holds one of its
  instances for ``sum_k P(k, B) + Tx(B)`` (its blocks at the batch's size, the
  BLS hop) plus the router's work ``router(B)``; a compact split holds one of
  the router's workers for its blocks with the batch shrinking at every
  enabled ramp, plus ``check(B)`` per ramp and ``router(B)`` (also where the
  router composes it into one graph: see :meth:`_Router.service_ms`).
* **stock** and **naive EE** run through Triton's dynamic batcher as the embedded
  server runs it (:class:`e3.serving.batcher.TritonBatcher`): requests move into
  payloads cut at the ``preferred`` batch (a larger request alone), at once when
  the delay is 0, else at a preferred batch or when the oldest has waited the
  delay (then up to ``max_batch`` rows); a payload handed over keeps growing
  until an instance takes it, and one taken merges the waiting payloads older
  than the delay (until 2026-11-27 a free instance took queued requests
  directly: its batches of 1 and 7-8 inputs, where Triton ran 1 to 15: docs/RESULTS.md, "The simulator's misses"). One execute costs one Python-model call (``Tx(B)``, the
  same measured hop) plus ``Tx(1)`` for every further request in it (each is
  a request/response exchange of its own), plus the blocks (stock: its
  measured whole-graph curve when given, else every block at B without ramps;
  EE: shrinking at every ramp, with the exit check). A router instance
  answering inline pays the same ``Tx(1)`` per further request it takes.
* **Threads** (the thread model, :func:`e3.core.cost.thread_gain`): the profile measures the stock graph
  on 1 and 2 intra-op threads, quietly (each batch size measured again while other processes use the
  cores: a 2-thread graph is the first casualty of someone else's work, see
  :func:`e3.profiling.host_profile.quietest`). A 2-thread stock instance runs the measured 2-thread graph;
  every other graph (naive EE's blocks, E3's) runs each block ``stock_ms / stock_2t_ms`` faster *at the
  rows that block runs* (a block after a ramp runs fewer rows, where the second thread gains less); the
  exit checks (numpy) run on one thread. Where the profile has no 2-thread curve, ``t x
  parallel_efficiency`` (assumed).
* **Compact graphs as one graph** (``CallCosts.one_graph``): ``<m>_ee`` runs its blocks, exit tests and
  compaction as one composed ONNX Runtime call (``serving/compact.py``), and so does the router's compact split
  where its exit rule composes (:func:`e3.serving.fused_split.can_fuse`: entropy rules), the same code. Each
  block of either is priced at :meth:`~e3.core.profile.LatencyProfile.one_graph` of its own session call at
  the rows it runs (the stock graph over the sum of its blocks, measured in the same profile: 0.75-0.91 on
  bert-ee). Measured (`e3 bench --quick --baselines 1x2,2x1`, quiet machine): priced as separate blocks, an
  execution of 8 rows of ``<m>_ee`` took 57.1 ms simulated against 44.1 served; as one graph 44.7. Until
  2026-11-28 E3's compact split stayed priced as its blocks, and every E3 cell of two quick benches was
  under-predicted (-5% to -32%) while naive EE's were not: served side by side in turns (bert-ee 80:20, 8
  inputs per request, 16 clients, six rounds), the router and ``<m>_ee`` served 317-394 and 321-376 inputs/s
  and the server spent 6.47-7.77 and 6.69-7.92 CPU ms per input, the same within a round.
* **Instances side by side** (``CallCosts.beside``, off): the profile measures the stock graph with one
  copy per core running at once (``corun_ms``); its ratio to the graph alone was 0.96-1.20 over batch
  sizes and as noisy between profiles. Applied, it moved the served executions of 2 instances x 1 thread
  further off (stock at 16 rows: 230.9 ms simulated against 205.4 served; without it 194.2), so the
  simulator leaves it out and the curve stays in the profile for a quieter machine to settle.
* **Jitter** (``jitter_cv``): each batch's time is drawn lognormal around
  its profiled mean with the coefficient of variation the profile measured
  for a batch running beside one neighbour per core (a deterministic time
  would give every request of a closed loop the same latency, and tails
  thinner than any real server's).
* **Host CPU** (``request_ms``): each request costs the host CPU that no
  instance's time holds (the client and tritonserver's front door). On a CPU
  the instances share those cores: :func:`e3.simulator.load.with_host_share` runs a simulation
  with every compute time stretched by ``1 / (1 - share)``, where ``share`` is
  the request rate times that CPU over the cores, until the share it assumed
  and the one its result implies agree (a processor-sharing approximation: the
  OS time-slices the front door's threads with the instances).
* **Exits**: an input leaves at its reference exit ramp; where the plan
  disabled that ramp it leaves at the next enabled one (or the head). The
  exit rule's decision itself is not re-run.
* **Call costs** (:class:`CallCosts`; the default is the CPU's model above):
  for a GPU cluster (``e3 bench gpu``) a call carrying model inputs (a
  baseline's execute, E3's first constant split) pays ``tx_in`` (the inputs'
  bytes), not the cut's hop; a further request in one execute pays a fixed
  ``request_ms`` (a native GPU backend, not a Python model); and a constant
  split's hop runs on a copy engine of its own beside the instance's compute
  (a pipeline stage per instance, as the planner prices it, E3 §3.2.2).
  Two more GPU-only choices: ``router_cores`` > 0 puts a constant split's
  router work (``router(B)``) on a pool of that many host cores beside the
  devices instead of inside the instance's time (the real router's worker
  thread does it on the host CPU while the split's Triton instance, a
  separate model, already runs the next batch), at most one batch per
  instance at a time (a pipeline stage per instance); ``out_copy`` charges a
  constant split's output state (every row of its batch, the next split's
  input) a device-to-host copy on an engine of its own per instance (the
  BLS answer goes through the router's host memory); ``hop_fixed_latency``
  holds a copy engine for a hop's bytes only, its fixed part (the BLS
  exchange's handshake, host threads) being latency. A compact split runs
  its blocks from the router's own thread, so its router work stays inside
  its time on every device.
* **The device form** (a plan of device splits, :attr:`Plan.on_device`, docs/design.md §2b): one device runs the
  plan's splits one at a time inside the router. Every split has a queue of rows (survivors of any
  requests); each time the device is free the device router's own dispatch rule
  (``e3.serving.device.dispatch.choose``, the pure module the layering table lets the simulator import)
  names the split and its rows; a run of n rows holds
  the device for the cost model's stage time of the device form at the executor's bucket for n (the smallest
  profiled batch >= n): its blocks, one exit check and the router's work
  (:func:`e3.core.cost.batch_ms` + ``router``); rows whose exit block lies in the split are answered, the
  rest join the next split's queue. A request is dropped when even its split's run (the cost model's at the
  plan's batch) would end past its deadline, as ``DevicePipeline`` and the CPU router's scheduler do. Not modelled: the pipeline's second run in flight while the host decides the
  first (``DEPTH``), which the cost model does not count either.
* **Not modelled**: OS scheduling noise (time slices of a few ms between the
  instances and the front door's threads, which widen the real tails), the
  Python GIL inside the router. The validation table (``e3 bench``) says how
  far that leaves it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np
import simpy

from e3.core.cost import ASSUMED_THREAD_EFFICIENCY, batch_ms, thread_gain
from e3.core.exits import BUILTIN_RULES, check_rule_config, make_exit_rule
from e3.core.plan import COMPACT, CONSTANT, Plan
from e3.core.profile import LatencyProfile
from e3.serving.device.dispatch import choose
from e3.serving.batcher import TritonBatcher
from e3.serving.fused_split import can_fuse
from e3.serving.scheduler import Scheduler
from e3.simulator.device import Dispatch, DeviceRouter
from e3.simulator.load import Arrivals, Clock, SimResult
from e3.simulator.speed import TwoSpeeds, speed_path

__all__ = ["Arrivals", "Baseline", "CallCosts", "SimResult", "simulate_plan", "simulate_baseline", "next_enabled_exit",
           "Dispatch", "baseline_execution_ms"]


@dataclass(frozen=True)
class Baseline:
    """A single model behind Triton's dynamic batcher: ``stock`` (no ramps) or ``ee`` (naive early exit)."""
    kind: str                           # "stock" | "ee"
    instances: int = 2
    threads: int = 1
    delay_us: int = 0
    max_batch: int = 64
    preferred: int = 8                  # the batcher's preferred batch size (rows): ends a delayed wait early
    enabled_ramps: tuple[int, ...] | None = None   # ee: default every ramp of the profile


@dataclass(frozen=True)
class CallCosts:
    """What a Triton call costs beside the blocks. The default is the model validated on this CPU (every
    call is a Python-model request/response exchange costing the measured BLS hop ``tx``).

    Decision for GPUs (the paper is silent; ``e3 bench gpu``): ``input_curve="tx_in"``,
    ``request_ms`` a small constant and ``overlap_hop=True`` (see the module docstring)."""
    input_curve: str = "tx"             # hop of a call carrying model inputs: "tx" (a cut's) or "tx_in" (the inputs')
    request_ms: float | None = None     # per further request taken into one execute (ms); None: tx(1)
    overlap_hop: bool = False           # a constant split's hop holds a copy engine per instance, not the instance
    router_cores: int = 0               # > 0: a constant split's router work holds one of this many host cores
    #                                     (shared by all splits), not the split's instance; 0: inside its time
    out_copy: bool = False              # a constant split (not the last) copies its output state to the host on
    #                                     an engine of its own per instance: the bytes part of tx(rows)
    hop_fixed_latency: bool = False     # with overlap_hop: a hop's fixed part (the BLS exchange, host threads) is
    #                                     latency that holds nothing; the copy engine is held for the bytes only
    service_cv: float | None = None     # coefficient of variation of every batch's time (lognormal, mean kept):
    #                                     an instance's batch runs beside the other instances on shared cores;
    #                                     None: the profile's jitter_cv at the batch's rows (0 where absent)
    service_seed: int = 0
    slots_per_instance: int | None = None   # a constant split's batches in flight per instance (the router's
    #                                     slots); None: one per pipeline stage (copy in, compute, copy out, host)
    one_graph: bool = True              # a compact graph (naive EE's, E3's compact split where its rule composes)
    #                                     priced as one composed graph (LatencyProfile.one_graph)
    speed: TwoSpeeds | None = None      # the machine's two speeds (simulator/speed.py); None: one speed
    beside: bool = False                # a batch that starts while another instance computes takes the profile's
    #                                     co-run factor longer (LatencyProfile.beside); measured, not adopted:
    #                                     see the module docstring

    def __post_init__(self) -> None:
        if self.input_curve not in ("tx", "tx_in"):
            raise ValueError(f"input_curve must be 'tx' or 'tx_in', got {self.input_curve!r}")
        if self.request_ms is not None and not self.request_ms >= 0:
            raise ValueError(f"request_ms must be >= 0 (ms), got {self.request_ms}")
        if self.router_cores < 0:
            raise ValueError(f"router_cores must be >= 0, got {self.router_cores}")
        if self.service_cv is not None and not self.service_cv >= 0:
            raise ValueError(f"service_cv must be >= 0, got {self.service_cv}")
        if self.slots_per_instance is not None and self.slots_per_instance < 1:
            raise ValueError(f"slots_per_instance must be >= 1, got {self.slots_per_instance}")

    def stages_per_instance(self) -> int:
        """Batches of a constant split in flight per instance: one per pipeline stage that runs beside the
        instance's compute (its hop in, its output copy, the router's host work), plus the compute."""
        if self.slots_per_instance is not None:
            return self.slots_per_instance
        return (1 + int(self.overlap_hop) + int(self.overlap_hop and self.hop_fixed_latency) + int(self.out_copy)
                + int(self.router_cores > 0))

    def jitter(self, rng: np.random.Generator, latency: LatencyProfile, device: str, rows: int,
               speed: float = 1.0) -> float:
        """One batch's time factor: lognormal with mean 1 and CV ``service_cv`` (else the profile's
        ``jitter_cv`` at ``rows``), 1.0 for a CV of 0, times ``speed`` (the machine's level at its start)."""
        cv = latency.jitter(device, rows) if self.service_cv is None else self.service_cv
        if cv <= 0:
            return speed
        sigma2 = float(np.log1p(cv ** 2))
        return speed * float(rng.lognormal(-sigma2 / 2, np.sqrt(sigma2)))

    def input_hop(self, latency: LatencyProfile, device: str, rows: float) -> float:
        """ms of a call carrying ``rows`` inputs' model inputs."""
        return float(latency.tx_in(device, rows) if self.input_curve == "tx_in" else latency.tx(device, rows))

    def neighbours(self, latency: LatencyProfile, device: str, rows: int, others: int) -> float:
        """How many times longer a batch of ``rows`` rows takes with ``others`` instances computing beside it:
        the profile's co-run factor where any do (and :attr:`beside`), else 1."""
        if not self.beside or others < 1:
            return 1.0
        factor = latency.beside(device, rows)
        return 1.0 if factor is None else factor

    def per_request(self, latency: LatencyProfile, device: str) -> float:
        """ms each further request in one execute adds."""
        return float(latency.tx(device, 1)) if self.request_ms is None else self.request_ms


def next_enabled_exit(exit_ramp: np.ndarray, enabled: Sequence[int], num_blocks: int) -> np.ndarray:
    """Each input's exit block when only ``enabled`` ramps exist: its reference exit if enabled, else the
    next enabled ramp after it, else the head ``num_blocks``."""
    stops = np.array(sorted(set(enabled)) + [num_blocks])
    return stops[np.searchsorted(stops, np.asarray(exit_ramp))]


@dataclass
class _SimRoute:
    """What :meth:`Scheduler.finish` reads of a batch's outcome."""
    exit_ramp: np.ndarray               # [n] block that answered, 0 = still running
    label: np.ndarray
    probs: np.ndarray
    active: np.ndarray                  # indices of undecided rows
    rule_state: dict = field(default_factory=dict)


class _TritonQueue:
    """Triton's dynamic batcher in simulated time (:class:`e3.serving.batcher.TritonBatcher`, the rule and why):
    requests queue here, the batcher's thread moves them into payloads, a free instance takes the oldest."""

    def __init__(self, env: simpy.Environment, *, instances: int, preferred: Sequence[int], max_batch: int,
                 delay_s: float):
        self.env = env
        self.batcher = TritonBatcher(instances=instances, preferred=preferred, max_batch=max_batch, delay_s=delay_s)
        self._wake = env.event()      # the batcher thread's condition variable
        self._handed = env.event()    # a payload was handed to the instances
        env.process(self._thread())

    def send(self, pool_rows: np.ndarray) -> simpy.Event:
        """Queue a request; the event fires with True (answered) or False (dropped)."""
        done = self.env.event()
        if self.batcher.enqueue(self.env.now, len(pool_rows), (self.env.now, pool_rows, done)):
            self._kick()
        return done

    def _kick(self) -> None:
        if not self._wake.triggered:
            self._wake.succeed()

    def _thread(self) -> Iterator:
        while True:
            wait = self.batcher.form(self.env.now)
            if self.batcher.ready and not self._handed.triggered:
                self._handed.succeed()
            if wait == 0:
                continue
            if self._wake.triggered:
                self._wake = self.env.event()
            yield self._wake if wait is None else self._wake | self.env.timeout(wait)

    def take(self) -> Iterator:
        """For a free instance (``yield from``): the oldest payload's requests, (arrival, pool rows, answered)."""
        while True:
            payload = self.batcher.take(self.env.now)
            if payload is not None:
                self._kick()   # the payload's callback: the batcher starts the next one
                return payload.handles
            if self._handed.triggered:
                self._handed = self.env.event()
            yield self._handed


class _Router:
    """One router instance: its own scheduler and split workers, in simulated time."""

    def __init__(self, env: simpy.Environment, latency: LatencyProfile, plan: Plan, exit_ramp: np.ndarray,
                 device: str, num_classes: int, batches: dict[int, list[int]], costs: CallCosts = CallCosts(),
                 computing: list[int] | None = None):
        self.env, self.latency, self.plan, self.device, self.C = env, latency, plan, device, num_classes
        self.costs = costs
        self.computing = [0] if computing is None else computing   # batches computing now, every router's
        # the router composes a compact split into one graph where the plan's exit rule allows it (a rule of
        # the user's own, not importable here, is priced block by block, as the router would run it)
        self.composes = (costs.one_graph and check_rule_config(plan.exit_rule) in BUILTIN_RULES
                         and can_fuse(make_exit_rule(plan.exit_rule)))
        splits = plan.splits
        # the router's own construction; with stages beside the compute (a copy in or out, the router's host
        # work), a constant split has one batch in flight per stage per instance
        self.sched = Scheduler.for_plan(plan, stages_per_instance=costs.stages_per_instance())
        slots = self.sched.slots
        L = plan.num_blocks
        self.exits = [next_enabled_exit(exit_ramp, s.enabled_ramps, L) for s in splits]
        # inline with one worker per split: the execute thread runs every split's batches (direct)
        if self.sched.direct:
            one = simpy.Resource(env, capacity=1)
            self.workers = [one] * len(splits)
        else:
            self.workers = [simpy.Resource(env, capacity=s.instances if s.form != COMPACT else max(1, n))
                            for s, n in zip(splits, slots)]
        # a copy engine per instance of a constant split (CallCosts.overlap_hop), one more for its output
        # copy (CallCosts.out_copy), and the host cores of the router's work (CallCosts.router_cores)
        self.links = [simpy.Resource(env, capacity=s.instances) for s in splits]
        self.links_out = [simpy.Resource(env, capacity=s.instances) for s in splits]
        self.host = simpy.Resource(env, capacity=costs.router_cores) if costs.router_cores else None
        # ... of which one per instance: a split's router work is one pipeline stage per instance, as the
        # planner prices it (gpu.beside_profile), not as many at once as batches are in flight
        self.host_lanes = [simpy.Resource(env, capacity=s.instances) for s in splits]
        self.batches = batches
        self.rng = np.random.default_rng(costs.service_seed)
        self.speed = speed_path(costs.speed, costs.service_seed)
        self.waiting: dict[int, simpy.Event] = {}
        self.wake_at: float | None = None

    def split_device(self, i: int) -> str:
        """Split i's device configuration: the plan's where the profile has it (heterogeneous plans), else
        the simulation's one device."""
        dev = self.plan.splits[i].device
        return dev if dev in self.latency.devices else self.device

    def hop_ms(self, i: int, rows: int) -> float:
        """The hop into constant split i carrying ``rows`` inputs (the first split's carries model inputs)."""
        dev = self.split_device(i)
        return self.costs.input_hop(self.latency, dev, rows) if i == 0 else float(self.latency.tx(dev, rows))

    def router_beside(self, i: int) -> bool:
        """Whether split i's router work runs on the host cores beside its instances
        (:attr:`CallCosts.router_cores`; constant splits only)."""
        return self.host is not None and self.plan.splits[i].form != COMPACT

    def out_copy_ms(self, i: int, rows: int) -> float:
        """Split i's output copy to the host (:attr:`CallCosts.out_copy`): the bytes part of the hop curve at
        ``rows`` (tx(rows) - tx(1) + the per-row step, exact for a fixed + bytes hop); 0 for the last split."""
        if not self.costs.out_copy or i == len(self.plan.splits) - 1 or self.plan.splits[i].form == COMPACT:
            return 0.0
        dev = self.split_device(i)
        one, two = float(self.latency.tx(dev, 1)), float(self.latency.tx(dev, 2))
        return max(0.0, float(self.latency.tx(dev, rows)) - one + (two - one))

    def service_ms(self, i: int, pool_rows: np.ndarray) -> tuple[float, np.ndarray]:
        """Time of split i on these inputs and the exit block of each (0: goes on); a constant split's hop
        is included unless it overlaps (:attr:`CallCosts.overlap_hop`), its router work unless it runs
        beside it (:meth:`router_beside`)."""
        s, lat, dev = self.plan.splits[i], self.latency, self.split_device(i)
        n0 = len(pool_rows)
        out = self.exits[i][pool_rows]
        leaves = np.where(out <= s.last_block, out, 0)
        ms = 0.0 if self.router_beside(i) else lat.router(dev, n0)
        if s.form == COMPACT and i == 0 and self.costs.input_curve == "tx_in":
            ms += self.hop_ms(0, n0)   # the router's session copies the model inputs in, in its own call
        # Decision: a compact split whose exit rule composes runs as one graph (serving/fused_split.py) and is
        # priced as naive EE's is (CallCosts.one_graph, the module docstring): the same code serves both, and
        # served in turns they spent the same CPU per input (2026-11-28). Until then it was priced as its
        # blocks, from a measurement of the router's stubs alone (6.07 and 6.11 CPU ms per input at 1 and 8
        # inputs per request, against a profile taken at another time) that the paired one did not bear out.
        ms += batch_ms(lat, dev, s.first_block, last=s.last_block, exit_block=out, ramps=s.enabled_ramps, form=s.form,
                       one_graph=s.form == COMPACT and self.composes)
        if s.form != COMPACT:
            if not self.costs.overlap_hop:
                ms += lat.tx(dev, n0) if self.costs.input_curve == "tx" else self.hop_ms(i, n0)
        return ms, leaves

    def admit(self, pool_rows: np.ndarray) -> simpy.Event:
        """A request of these inputs: admitted now; the event fires with True (answered) or False (dropped)."""
        job = self.sched.job(None, len(pool_rows), self.env.now, self.C)
        done = self.env.event()
        self.waiting[id(job)] = done
        self.sched.admit(job, {"x": pool_rows.astype(np.float64)}, {}, self.env.now)
        return done

    def pump(self) -> None:
        dispatches, dropped, at = self.sched.poll(self.env.now)
        for job in dropped:
            job.answered = True
            self.waiting.pop(id(job)).succeed(False)
        for d in dispatches:
            self.env.process(self._run(d))
        if at is not None and (self.wake_at is None or at < self.wake_at or self.wake_at <= self.env.now):
            self.wake_at = at
            self.env.process(self._timer(at))

    def _timer(self, at: float) -> Iterator:
        yield self.env.timeout(max(0.0, at - self.env.now))
        if self.wake_at == at:
            self.wake_at = None
        self.pump()

    def hop_parts_ms(self, i: int, rows: int) -> tuple[float, float]:
        """The hop into split i as (fixed part, bytes part) in ms: the curve's value at 1 row less its per-row
        step, and the rest (exact for a fixed + bytes hop); (0, all of it) unless
        :attr:`CallCosts.hop_fixed_latency`."""
        total = self.hop_ms(i, rows)
        if not self.costs.hop_fixed_latency:
            return 0.0, total
        one, two = self.hop_ms(i, 1), self.hop_ms(i, 2)
        fixed = min(total, max(0.0, one - (two - one)))
        return fixed, total - fixed

    def _run(self, d) -> Iterator:
        if self.costs.overlap_hop and self.plan.splits[d.split].form != COMPACT:
            fixed_ms, bytes_ms = self.hop_parts_ms(d.split, len(d.rows))
            if fixed_ms > 0:
                yield self.env.timeout(fixed_ms / 1e3)
            with self.links[d.split].request() as link:
                yield link
                yield self.env.timeout(bytes_ms / 1e3)
        with self.workers[d.split].request() as slot:
            yield slot
            feed, _ = Scheduler.stack(d.rows)
            pool_rows = feed["x"].astype(int)
            ms, leaves = self.service_ms(d.split, pool_rows)
            self.batches[d.split].append(len(pool_rows))
            dev = self.split_device(d.split)
            ms *= self.costs.neighbours(self.latency, dev, len(pool_rows), self.computing[0])
            self.computing[0] += 1
            yield self.env.timeout(ms * self.costs.jitter(self.rng, self.latency, dev, len(pool_rows),
                                                          self.speed(self.env.now)) / 1e3)
            self.computing[0] -= 1
        n = len(pool_rows)
        copy_ms = self.out_copy_ms(d.split, n)
        if copy_ms > 0:
            with self.links_out[d.split].request() as link:
                yield link
                yield self.env.timeout(copy_ms / 1e3)
        if self.router_beside(d.split):
            with self.host_lanes[d.split].request() as lane, self.host.request() as core:
                yield lane
                yield core
                yield self.env.timeout(float(self.latency.router(self.split_device(d.split), n)) / 1e3)
        route = _SimRoute(exit_ramp=leaves.astype(np.int32), label=np.zeros(n, np.int64),
                          probs=np.zeros((n, self.C), np.float32), active=np.flatnonzero(leaves == 0))
        for job in self.sched.finish(d, route, {"x": pool_rows[route.active]}, ms, self.env.now):
            self.waiting.pop(id(job)).succeed(True)
        self.pump()


def simulate_plan(latency: LatencyProfile, plan: Plan, exit_ramp: np.ndarray, *, arrivals: Arrivals,
                  device: str = "cpu", num_classes: int = 2, slo_ms: float | None = None,
                  max_batch: int = 64, costs: CallCosts = CallCosts(),
                  dispatch: Dispatch | None = None) -> SimResult:
    """E3 serving ``plan`` (the router's scheduler, its splits and instances); ``exit_ramp``: [pool] the
    reference exit block of every input the load cycles through. ``slo_ms``: goodput's objective
    (default: the plan's SLO decides drops, goodput counts every answer).

    With one router instance, ``execute`` admits requests and returns at once: every request goes
    straight to the one scheduler. With several (compact plans, :attr:`Plan.router_instances`), each
    instance answers inline: Triton's batcher (delay :attr:`Plan.router_queue_delay_us`, at most
    ``max_batch`` rows) hands a free instance the queued requests, and the instance takes no more until
    all of them are answered, together, when the last is (its ``execute`` returns their responses). ``costs``: what calls cost beside the blocks (:class:`CallCosts`); a split
    runs on its plan's device where the profile has that device, else on ``device``.

    A plan of the device form (:attr:`Plan.on_device`) runs on one device under ``dispatch``, the device
    router's rule (default: :func:`e3.serving.device.dispatch.choose`, the router's own). ``max_batch`` and the
    call costs other than the jitter do not apply to it."""
    env = simpy.Environment()
    batches: dict[int, list[int]] = {i: [] for i in range(len(plan.splits))}
    if plan.on_device:
        engine = DeviceRouter(env, latency, plan, exit_ramp, device, batches, costs, dispatch or choose)
        clock = Clock(env, arrivals, len(exit_ramp), engine.admit)
        clock.start()
        env.run(until=clock.all_done)
        return clock.result(slo_ms, batches)
    computing = [0]     # batches computing now, over every router instance (CallCosts.beside)
    routers = [_Router(env, latency, plan, exit_ramp, device, num_classes, batches, costs, computing)
               for _ in range(plan.router_instances)]
    if len(routers) == 1:
        router = routers[0]

        def send(pool_rows: np.ndarray) -> simpy.Event:
            done = router.admit(pool_rows)
            router.pump()
            return done
    else:
        triton = _TritonQueue(env, instances=len(routers), preferred=(plan.splits[0].batch_size,),
                              max_batch=max_batch, delay_s=plan.router_queue_delay_us / 1e6)

        def instance(router: _Router) -> Iterator:
            while True:
                take = yield from triton.take()
                if not take:
                    continue
                # Triton hands the instance its requests; each costs one request/response exchange
                yield env.timeout((len(take) - 1) * costs.per_request(latency, routers[0].split_device(0)) / 1e3)
                mine = [(router.admit(r), done) for _, r, done in take]
                router.pump()
                # the execute returns its responses together (serving/router.py, inline): every request it
                # took is answered when the last one is
                oks = []
                for answered, _ in mine:
                    oks.append((yield answered))
                for ok, (_, done) in zip(oks, mine):
                    done.succeed(ok)

        for router in routers:
            env.process(instance(router))
        send = triton.send

    clock = Clock(env, arrivals, len(exit_ramp), send)
    clock.start()
    env.run(until=clock.all_done)
    return clock.result(slo_ms, batches)


def baseline_execution_ms(latency: LatencyProfile, base: Baseline, exit_ramp: np.ndarray, requests: int = 1, *,
                          device: str = "cpu", costs: CallCosts = CallCosts(),
                          parallel_efficiency: float = ASSUMED_THREAD_EFFICIENCY) -> float:
    """The time (ms) one execution of ``base`` holds its instance, before jitter and neighbours: the call (the
    hop carrying its inputs, ``Tx(1)`` for each further request of the ``requests`` it merged) and the graph on
    rows whose reference exit blocks are ``exit_ramp`` (naive EE: each row leaves at the next enabled ramp).
    The one price of a baseline's execution: :func:`simulate_baseline` runs it, and the validation reads the
    machine's speed from Triton's count of the same executions (``benchmarks/sim_validation.py``)."""
    L = latency.num_blocks
    n = len(exit_ramp)
    ms = costs.input_hop(latency, device, n) + (requests - 1) * costs.per_request(latency, device)
    if base.kind == "stock":
        whole = latency.stock(device, n, base.threads)     # the one graph, measured on 1 and 2 threads
        if whole is not None:
            return ms + whole
        if latency.stock(device, n) is not None:   # 1 thread measured only: the thread model's gain
            return ms + latency.stock(device, n) / thread_gain(latency, device, n, base.threads, parallel_efficiency)
        return ms + batch_ms(latency, device, 1, last=L, exit_block=np.full(n, L), ramps=(), form=CONSTANT,
                             threads=base.threads, efficiency=parallel_efficiency)
    ramps = set(latency.ramp_blocks() if base.enabled_ramps is None else base.enabled_ramps)
    return ms + batch_ms(latency, device, 1, last=L, exit_block=next_enabled_exit(exit_ramp, ramps, L), ramps=ramps,
                         form=COMPACT, threads=base.threads, efficiency=parallel_efficiency, one_graph=costs.one_graph)


def simulate_baseline(latency: LatencyProfile, base: Baseline, exit_ramp: np.ndarray, *, arrivals: Arrivals,
                      device: str = "cpu", slo_ms: float | None = None,
                      parallel_efficiency: float = ASSUMED_THREAD_EFFICIENCY,
                      costs: CallCosts = CallCosts()) -> SimResult:
    """``<m>_stock`` or ``<m>_ee`` behind Triton's dynamic batcher (see the module docstring).
    The stock model runs the profile's ``stock_ms`` curve (the one graph it is served as) where measured,
    else the sum of its blocks (which counts a session call
    per block the one graph does not make). An instance of 2 threads runs the profile's measured gain of
    the second thread (``stock_2t_ms``) at its batch; elsewhere ``threads x parallel_efficiency``.
    ``costs``: what a call and each further request in it cost (:class:`CallCosts`)."""
    if base.kind not in ("stock", "ee"):
        raise ValueError(f"unknown baseline {base.kind!r}: 'stock' or 'ee'")
    env = simpy.Environment()
    triton = _TritonQueue(env, instances=base.instances, preferred=(base.preferred,), max_batch=base.max_batch,
                          delay_s=base.delay_us / 1e6)
    batches: dict[int, list[int]] = {0: []}
    held: dict[int, list[float]] = {0: []}     # every execution's time (ms), beside ``batches``
    computing = [0]                            # instances computing now (CallCosts.beside)
    rng = np.random.default_rng(costs.service_seed)
    speed = speed_path(costs.speed, costs.service_seed)

    def service_ms(pool_rows: np.ndarray, requests: int) -> float:
        return baseline_execution_ms(latency, base, exit_ramp[pool_rows], requests, device=device, costs=costs,
                                     parallel_efficiency=parallel_efficiency)

    def instance(device_free: simpy.Resource) -> Iterator:
        while True:
            take = yield from triton.take()
            if not take:
                continue
            pool_rows = np.concatenate([r for _, r, _ in take])
            batches[0].append(len(pool_rows))
            ms = (service_ms(pool_rows, len(take)) * costs.jitter(rng, latency, device, len(pool_rows), speed(env.now))
                  * costs.neighbours(latency, device, len(pool_rows), computing[0]))
            held[0].append(ms)
            if not costs.overlap_hop:
                computing[0] += 1
                yield env.timeout(ms / 1e3)
                computing[0] -= 1
                for _, _, done in take:
                    done.succeed(True)
                continue
            # the input copy beside the previous batch's compute: copy, then wait for the device
            copy_ms = costs.input_hop(latency, device, len(pool_rows))
            yield env.timeout(copy_ms / 1e3)
            slot = device_free.request()
            yield slot
            env.process(compute(device_free, slot, (ms - copy_ms) / 1e3, take))

    def compute(device_free: simpy.Resource, slot, seconds: float, take) -> Iterator:
        yield env.timeout(seconds)
        device_free.release(slot)
        for _, _, done in take:
            done.succeed(True)

    for _ in range(base.instances):   # one device each
        env.process(instance(simpy.Resource(env, capacity=1)))
    clock = Clock(env, arrivals, len(exit_ramp), triton.send)
    clock.start()
    env.run(until=clock.all_done)
    result = clock.result(slo_ms, batches)
    result.batch_ms = held
    return result


