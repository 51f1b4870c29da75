"""Closed-loop load generator: ``concurrency`` clients, each sending requests of
``batch`` inputs back to back, until ``requests`` requests were sent.

Inputs are taken in order (wrapping around) from a pool of arrays, so every
answer can be matched with its input afterwards. Latency is measured per
request, on the client, from send to answer.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from e3.client.sdk import ClientError, E3Client

__all__ = ["LoadResult", "closed_loop"]


@dataclass
class LoadResult:
    model: str
    requests: int = 0                 # requests answered (successfully or with an error)
    inputs: int = 0                   # inputs answered successfully
    errors: int = 0                   # requests that came back with an error
    duration_s: float = 0.0           # wall time of the run
    latencies_ms: list[float] = field(default_factory=list)   # per successful request
    exit_counts: Counter = field(default_factory=Counter)     # exit ramp -> inputs
    error_messages: Counter = field(default_factory=Counter)  # message -> count

    @property
    def throughput_ips(self) -> float:
        """Inputs answered per second."""
        return self.inputs / self.duration_s if self.duration_s > 0 else 0.0

    def percentile_ms(self, q: float) -> float:
        return float(np.percentile(self.latencies_ms, q)) if self.latencies_ms else float("nan")


def closed_loop(url: str, model: str, pool: dict[str, np.ndarray], *, concurrency: int = 8, batch: int = 4,
                requests: int = 200, protocol: str = "http", warmup: int = 0) -> LoadResult:
    """Run a closed loop against ``model``; returns counts, latencies and the exit histogram."""
    size = next(iter(pool.values())).shape[0]
    result = LoadResult(model)
    lock = threading.Lock()
    next_request = iter(range(requests))

    def rows(i: int) -> np.ndarray:
        return (np.arange(batch) + i * batch) % size

    def worker() -> None:
        with E3Client(url, protocol) as client:
            for i in range(warmup):
                client.infer(model, {k: v[rows(i)] for k, v in pool.items()})
            barrier.wait()
            while True:
                with lock:
                    i = next(next_request, None)
                if i is None:
                    return
                start = time.perf_counter()
                try:
                    answers = client.infer(model, {k: v[rows(i)] for k, v in pool.items()})
                except ClientError as err:
                    with lock:
                        result.requests += 1
                        result.errors += 1
                        result.error_messages[str(err)[:200]] += 1
                    continue
                elapsed = (time.perf_counter() - start) * 1e3
                with lock:
                    result.requests += 1
                    result.inputs += len(answers.label)
                    result.latencies_ms.append(elapsed)
                    result.exit_counts.update(answers.exit_ramp.tolist())

    barrier = threading.Barrier(concurrency + 1)
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    result.duration_s = time.perf_counter() - start
    return result
