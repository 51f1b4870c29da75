"""The simulator's load and what it measures: the arrivals (a closed or open loop), every request's record
and the result (rates, percentiles, drops), and the host's share of the cores found as a fixed point
(:func:`with_host_share`). The served system itself is :mod:`e3.simulator.des`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np
import simpy

from e3.core.profile import LatencyProfile

__all__ = ["Arrivals", "SimResult", "Clock", "HostShare", "with_host_share"]


@dataclass(frozen=True)
class Arrivals:
    """The load: a closed loop of ``clients`` or Poisson arrivals at ``rate_rps`` requests/s."""
    batch: int = 1                      # inputs per request
    requests: int = 400                 # measured requests
    clients: int | None = 16            # closed loop; None: open loop at rate_rps
    rate_rps: float | None = None
    warmup: int = 32                    # requests sent (and not measured) first
    seed: int = 0
    client_ms: float = 1.0              # mean of the client's and transport's time per request (exponential):
    #                                     it also keeps closed-loop clients from resending in lockstep
    client_cpu_ms: float = 0.0          # the load generator's CPU per request, run one request at a time (its
    #                                     clients are threads of one Python process, one GIL): half before the
    #                                     send, half after the answer, both inside the request's latency
    steady: bool = False                # rates over [first measured send, last send] only (the load's steady
    #                                     part; the default spans until the last answer, as a real run's does)

    def __post_init__(self) -> None:
        if (self.clients is None) == (self.rate_rps is None):
            raise ValueError("give exactly one of clients (closed loop) or rate_rps (open loop)")
        if self.batch < 1 or self.requests < 1:
            raise ValueError(f"batch and requests must be >= 1, got {self.batch}, {self.requests}")


@dataclass
class SimResult:
    inputs_per_s: float                 # inputs answered successfully per simulated second
    p50_ms: float
    p99_ms: float
    goodput_ips: float                  # inputs answered within the SLO per second (all answered without one)
    dropped_inputs: int = 0
    answered_inputs: int = 0
    batches: dict[int, list[int]] = field(default_factory=dict)   # split index -> rows of every batch run
    duration_s: float = 0.0
    drop_waited_ms: list[float] = field(default_factory=list)   # each dropped request: send to its drop error
    batch_ms: dict[int, list[float]] = field(default_factory=dict)   # split index -> time of every batch in
    #                                     ``batches`` (ms, as an execution of it holds its instance); baselines


class Clock:
    """The load (closed or open loop) and the record of every request's latency."""

    def __init__(self, env: simpy.Environment, arrivals: Arrivals, pool_size: int, send):
        self.env, self.arrivals, self.pool_size, self.send = env, arrivals, pool_size, send
        self.total = arrivals.warmup + arrivals.requests
        self.next = 0
        self.records: list[tuple[float, float, int, bool]] = []   # (sent, done, inputs, ok) of measured ones
        self.every: list[tuple[float, float, int, bool]] = []     # the same of every request (steady rates)
        self.all_done = env.event()
        self.finished = 0
        self.rng = np.random.default_rng(arrivals.seed + 1)
        self.gil = simpy.Resource(env, capacity=1)      # the load generator's one GIL (client_cpu_ms)

    def rows(self, i: int) -> np.ndarray:
        b = self.arrivals.batch
        return (np.arange(i * b, (i + 1) * b)) % self.pool_size

    def start(self) -> None:
        if self.arrivals.clients is not None:
            for _ in range(self.arrivals.clients):
                self.env.process(self._client())
        else:
            self.env.process(self._poisson())

    def _one(self, i: int) -> Iterator:
        sent = self.env.now
        if self.arrivals.client_ms > 0:
            yield self.env.timeout(self.rng.exponential(self.arrivals.client_ms) / 1e3)
        yield from self._client_cpu()
        ok = yield self.send(self.rows(i))
        yield from self._client_cpu()
        if i >= self.arrivals.warmup:
            self.records.append((sent, self.env.now, self.arrivals.batch, bool(ok)))
        if self.arrivals.steady:
            self.every.append((sent, self.env.now, self.arrivals.batch, bool(ok)))
        self.finished += 1
        if self.finished == self.total:
            self.all_done.succeed()

    def _client_cpu(self) -> Iterator:
        """Half the load generator's CPU of one request, holding its one GIL."""
        if self.arrivals.client_cpu_ms > 0:
            with self.gil.request() as held:
                yield held
                yield self.env.timeout(self.arrivals.client_cpu_ms / 2 / 1e3)

    def _client(self) -> Iterator:
        while self.next < self.total:
            i, self.next = self.next, self.next + 1
            yield self.env.process(self._one(i))

    def _poisson(self) -> Iterator:
        rng = np.random.default_rng(self.arrivals.seed)
        for i in range(self.total):
            yield self.env.timeout(rng.exponential(1.0 / self.arrivals.rate_rps))
            self.env.process(self._one(i))

    def result(self, slo_ms: float | None, batches: dict) -> SimResult:
        rec = np.array(self.records, dtype=float).reshape(-1, 4)
        ok = rec[:, 3] > 0
        lat = (rec[ok, 1] - rec[ok, 0]) * 1e3
        span = rec[:, 1].max() - rec[:, 0].min() if len(rec) else 0.0
        answered = int(rec[ok, 2].sum())
        good = int(rec[ok, 2][lat <= slo_ms].sum()) if slo_ms is not None else answered
        pct = (lambda q: float(np.percentile(lat, q)) if len(lat) else float("nan"))
        dropped_waited = ((rec[~ok, 1] - rec[~ok, 0]) * 1e3).tolist()
        if self.arrivals.steady and len(rec):
            # a closed loop drains after its last send: count every answer (warm-up requests' too) between
            # the first measured send and the last send
            every = np.array(self.every, dtype=float).reshape(-1, 4)
            start, end = rec[:, 0].min(), every[:, 0].max()
            span = end - start
            inside = (every[:, 3] > 0) & (every[:, 1] > start) & (every[:, 1] <= end)
            answered_rate = int(every[inside, 2].sum())
            good_rate = int(every[inside, 2][(every[inside, 1] - every[inside, 0]) * 1e3 <= slo_ms].sum()) \
                if slo_ms is not None else answered_rate
            return SimResult(inputs_per_s=answered_rate / span if span > 0 else 0.0, p50_ms=pct(50), p99_ms=pct(99),
                             goodput_ips=good_rate / span if span > 0 else 0.0, dropped_inputs=int(rec[~ok, 2].sum()),
                             answered_inputs=answered, batches=batches, duration_s=span,
                             drop_waited_ms=dropped_waited)
        return SimResult(inputs_per_s=answered / span if span > 0 else 0.0, p50_ms=pct(50), p99_ms=pct(99),
                         goodput_ips=good / span if span > 0 else 0.0, dropped_inputs=int(rec[~ok, 2].sum()),
                         answered_inputs=answered, batches=batches, duration_s=span, drop_waited_ms=dropped_waited)


@dataclass(frozen=True)
class HostShare:
    """What :func:`with_host_share` settled on."""
    share: float            # of the cores' time the host's per-request work took (0..max_share)
    iterations: int         # simulations run
    converged: bool         # the assumed and implied shares agreed within the tolerance


def with_host_share(simulate: Callable[[LatencyProfile], SimResult], latency: LatencyProfile, *, batch: int,
                    cores: int, device: str = "cpu", max_share: float = 0.9, tolerance: float = 0.005,
                    max_iterations: int = 8) -> tuple[SimResult, HostShare]:
    """Run ``simulate`` on ``latency`` slowed by the host's per-request CPU (``request_ms`` at ``batch``
    inputs per request) shared with ``cores`` cores: the compute curves x ``1 / (1 - share)``, where
    ``share = requests/s x request_ms / cores`` of the result. A fixed point, found by iterating (the
    share falls as compute slows, so plain iteration from 0 oscillates towards it; each step moves half
    way). Without a ``request_ms`` curve: one plain simulation, share 0.

    Decision (the simulator's papers model no host CPU; here the load generator and tritonserver's front
    door run on the very cores the instances use): processor sharing, the instances getting what the
    front door leaves, instead of a core token per request, which would let a request's bookkeeping wait
    for a whole batch to finish."""
    per_request = float(latency.request(device, batch))
    if per_request <= 0 or cores < 1:
        return simulate(latency), HostShare(0.0, 1, True)
    share, result = 0.0, None
    for i in range(1, max_iterations + 1):
        result = simulate(latency.slowed(1.0 / (1.0 - share)) if share > 0 else latency)
        implied = min(max_share, result.inputs_per_s / batch * per_request / 1e3 / cores)
        if abs(implied - share) <= tolerance:
            return result, HostShare(share, i, True)
        share = implied if i == 1 else (share + implied) / 2
    return result, HostShare(share, max_iterations, False)

