"""What E²bird's serving loop costs on the host, without a device: ``python benchmarks/admission_engine_cost.py``.

Times :meth:`e3.serving.ebird.engine.AdmissionEngine.drive` (the inline form the served stage uses)
over a device that answers at once, for 1, 4 and 8 requests of 8 inputs per call under N-Ebird and E-Ebird with
resnet-stock's H200 configuration (MaxBS 64), and how long ``time.sleep(50 us)`` (the threaded form's polling
pause) really sleeps here. ``docs/admission.md`` quotes it beside the H200 run to say how much of the stage's
added latency is Python bookkeeping. Absolute figures depend on the host's CPU; both are medians of repeats.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

if not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.path.append(str(Path(__file__).resolve().parents[1] / "deploy"))   # gpu_host_setup, standard library only
    from gpu_host_setup import namespace
    sys.path.insert(0, str(namespace()))

import numpy as np

from e3.serving.ebird.policy import make_policy
from e3.serving.ebird.engine import AdmissionEngine, DeviceOps

POLICIES = {"N-Ebird": dict(kind="n-ebird", engine=(32, 16, 8, 4, 2, 1, 1), max_inflight=64),
            "E-Ebird": dict(kind="e-ebird", confs={4: (4,), 8: (8,), 16: (16,), 32: (32,), 64: (64,)},
                            max_inflight=64)}


class InstantDevice(DeviceOps):
    """Every copy and worker done as soon as it is issued: what is left is the engine's own work."""

    def copy_in(self, segments, arrays):
        pass

    def mark_copied(self):
        return None

    def launch(self, worker, taken, after):
        return None

    def ready(self, event):
        return True

    def result(self, worker, rows):
        return {"logits": np.zeros((rows, 10), np.float32)}


def engine_us_per_call(policy: dict, requests: int, *, calls: int = 2000, repeats: int = 5) -> float:
    """Median over ``repeats`` of the mean microseconds one ``drive`` of ``requests`` requests takes."""
    spec = dict(policy)
    got: dict = {}
    engine = AdmissionEngine(make_policy(spec.pop("kind"), **spec), InstantDevice(), capacity=512,
                             answer=lambda r: got.__setitem__(r.handle, r), poll_s=0.0)
    x = {"pixels": np.zeros((8, 1, 28, 28), np.float32)}
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            got.clear()
            for i in range(requests):
                engine.admit(i, x)
            engine.drive(lambda: len(got) >= requests)
        runs.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(runs)


def sleep_us(asked_s: float = 0.00005, n: int = 2000, repeats: int = 5) -> float:
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(n):
            time.sleep(asked_s)
        runs.append((time.perf_counter() - start) / n * 1e6)
    return statistics.median(runs)


def main() -> int:
    for label, policy in POLICIES.items():
        for requests in (1, 4, 8):
            print(f"{label}: {requests} request(s) of 8 inputs per call: {engine_us_per_call(policy, requests):.0f} us "
                  "per call (the engine's bookkeeping; no device, no pause)")
    print(f"time.sleep(50 us) sleeps {sleep_us():.0f} us here")
    return 0


if __name__ == "__main__":
    sys.exit(main())
