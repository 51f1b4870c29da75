"""Soak (reliability, item 9): requests at saturation against tiny-ee's router while the resident memory of
tritonserver and of every Python-backend stub is sampled from /proc; then reloads of a split with a config
override; then a deliberately leaking positive control that the same memory check must catch. Runs on the
session's shared server (tests/conftest.py): in `make test` that saves a server start and stop; `make
reliability` runs this file in a pytest run of its own, so there the server serves nothing else.

* **Soak.** ``E3_SOAK_REQUESTS`` requests (``make reliability``: 1,000,000; ``make test``: 1,000), closed
  loop, ``CLIENTS`` client threads, one input per request in the binary tensor protocol, to
  ``tiny_ee_router`` (splits 1-2 and 3-4 behind it). Every request must be answered 200 with the same
  answer. The figure is the **heap growth**: the summed RSS (tritonserver + stubs) sampled every
  ``SAMPLE_S``, max minus mean over the run's second half (:func:`heap_growth_bytes`); pass <= 100 MB.
  Decision: the first half is left out because allocators and Python's caches fill up there (a leak
  shows as a rising second half: for a steady leak, max - mean is half of what leaked in that half);
  summed RSS counts pages a stub shares with tritonserver (its shared-memory region) once per process,
  which only makes the check stricter.
* **Reloads.** ``E3_SOAK_RELOADS`` loads (``make reliability``: 100; ``make test``: 2) of
  ``tiny_ee_split_3-4`` through the repository API with a config override, instance count n+1, n, n+1, ...,
  ending at its count n before; summed RSS before the first and after the last (each taken when the
  process group has its number of processes before); figure: growth per load; pass <=
  ``RELOAD_BOUND_MB_PER_LOAD``.
* **Positive control.** ``tiny_ee_split_1-2`` is reloaded from a test-only ``model.py`` that keeps a
  reference to every batch it executes (its inputs, tiled to ``LEAK_BYTES_PER_ROW`` per row so that a short
  run shows it: a real leak of a few hundred bytes per request takes the 1M-request run to see), and a
  short soak through the router (``CONTROL_REQUESTS``) must FAIL the same check (growth > 100 MB); then
  the generated ``model.py`` is put back and reloaded. Without it, a check that could not see a leak would
  pass for the wrong reason.
"""

from __future__ import annotations

import http.client
import itertools
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from helpers import binary_request

from e3.controller.triton_api import TritonControl
from polling import wait_until

pytestmark = pytest.mark.e2e
RELIABILITY = bool(os.environ.get("E3_RELIABILITY"))
SOAK_REQUESTS = int(os.environ.get("E3_SOAK_REQUESTS", "1000000" if RELIABILITY else "1000"))
RELOADS = int(os.environ.get("E3_SOAK_RELOADS", "100" if RELIABILITY else "2"))
CONTROL_REQUESTS = 500
CLIENTS = 16
SAMPLE_S = 0.1 if SOAK_REQUESTS <= 100_000 else 0.5
MB = 1e6
HEAP_GROWTH_BOUND_MB = 100.0
# A Python stub is a new process per instance, so a reload that leaks shows in tritonserver's own RSS
# (model configs, schedulers, backend state). Measured over 100 loads: 0.00 MB per load; over 2 (make test)
# +0.2 to +0.85 (allocator noise, not a trend), so the short run keeps a coarse bound that a leaked stub
# (tens of MB) would still break.
RELOAD_BOUND_MB_PER_LOAD = 1.0 if RELOADS >= 50 else 5.0
LEAK_BYTES_PER_ROW = 3 * 2**20
ROUTER, FIRST, LAST = "tiny_ee_router", "tiny_ee_split_1-2", "tiny_ee_split_3-4"
MODELS = [FIRST, LAST, ROUTER]

# Test-only split 1-2 that keeps a reference to every batch it executes (the positive control).
LEAKING_MODEL = '''"""Test-only: {split} that keeps every batch it executes (tests/test_reliability_soak.py)."""
import numpy as np
import triton_python_backend_utils as pb_utils

from e3.serving.split import TritonPythonModel as Split


class TritonPythonModel(Split):
    def initialize(self, args):
        super().initialize(args)
        self.kept = []   # never emptied: the leak

    def execute(self, requests):
        for request in requests:
            ids = pb_utils.get_input_tensor_by_name(request, "input_ids").as_numpy()
            self.kept.append(np.tile(ids, ({repeat}, 1)))   # {leak} bytes per row, pages touched
        return super().execute(requests)
'''


def heap_growth_bytes(samples: list[tuple[float, int]]) -> float:
    """Heap growth of a run from ``samples`` of (time in s, summed RSS in bytes): the maximum minus the mean
    of the RSS over the run's second half in time (the samples at or after the midpoint between the first
    and last sample's times). 0 for fewer than two samples in that half."""
    if not samples:
        return 0.0
    t0, t1 = samples[0][0], samples[-1][0]
    half = [rss for t, rss in samples if t >= t0 + (t1 - t0) / 2]
    return float(max(half) - np.mean(half)) if len(half) >= 2 else 0.0


def test_heap_growth_is_max_minus_mean_over_the_second_half():
    flat = [(t, 500_000_000 + (t % 2) * 1000) for t in range(100)]
    assert heap_growth_bytes(flat) == pytest.approx(500, abs=1)
    # a steady leak of 10 MB/s over 100 s: the second half rises 500 MB, max - mean = 250 MB
    leak = [(t, 300_000_000 + 10_000_000 * t) for t in range(101)]
    assert heap_growth_bytes(leak) == pytest.approx(250 * MB, rel=0.01)
    # a rise in the first half only (allocators warming up) is not growth
    warm = [(t, 300_000_000 + 200_000_000 * min(t, 30) / 30) for t in range(100)]
    assert heap_growth_bytes(warm) == 0
    assert heap_growth_bytes([]) == 0 and heap_growth_bytes([(0.0, 5)]) == 0


def rss_by_pid(pids: list[int]) -> dict[int, int]:
    """Resident bytes of each of ``pids`` that still runs (/proc/<pid>/statm)."""
    page = os.sysconf("SC_PAGE_SIZE")
    found = {}
    for pid in pids:
        try:
            found[pid] = int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * page
        except (OSError, ValueError, IndexError):
            pass
    return found


@dataclass
class SoakRun:
    requests: int = 0
    failed: list[str] = field(default_factory=list)
    seconds: float = 0.0
    samples: list[tuple[float, int]] = field(default_factory=list)   # (s since start, summed RSS bytes)
    processes: int = 0                                               # tritonserver + stubs sampled

    @property
    def growth_mb(self) -> float:
        return heap_growth_bytes(self.samples) / MB

    @property
    def rss_mb(self) -> tuple[float, float]:
        return self.samples[0][1] / MB, self.samples[-1][1] / MB


def soak(server, model: str, n_requests: int, body: bytes, headers: dict, expected: bytes) -> SoakRun:
    """Send ``n_requests`` to ``model`` from ``CLIENTS`` threads in a closed loop while sampling the
    summed RSS of the server's process group every ``SAMPLE_S``; a request fails unless it is answered 200
    with ``expected`` (the answer's bytes)."""
    run, tickets, done = SoakRun(), itertools.count(), threading.Event()
    lock = threading.Lock()

    def client():
        conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=120)
        sent, failed = 0, []
        while next(tickets) < n_requests:
            conn.request("POST", f"/v2/models/{model}/infer", body=body, headers=headers)
            r = conn.getresponse()
            answer = r.read()
            sent += 1
            if r.status != 200 or answer != expected:
                failed.append(f"{r.status}: {answer[:200]!r}" if len(failed) < 20 else "")   # count all, keep 20
        conn.close()
        with lock:
            run.requests += sent
            run.failed += failed

    def sampler():
        while True:
            pids = server.group_pids()
            run.samples.append((time.monotonic() - began, sum(rss_by_pid(pids).values())))
            run.processes = max(run.processes, len(pids))
            if done.wait(SAMPLE_S):
                return

    began = time.monotonic()
    watcher = threading.Thread(target=sampler, daemon=True)
    watcher.start()
    threads = [threading.Thread(target=client, daemon=True) for _ in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    run.seconds = time.monotonic() - began
    done.set()
    watcher.join()
    return run


def _expected_processes(control) -> int:
    """tritonserver + one Python stub per instance of every READY Python-backend model."""
    stubs = 0
    for model, state in control.loaded().items():
        config = control.model_config(model) if state == "READY" else {}
        if config.get("backend") == "python":
            stubs += sum(group.get("count", 1) for group in config.get("instance_group", []))
    return 1 + stubs


def _settled_rss(server, processes: int) -> int:
    """Summed RSS once the process group has ``processes`` processes (a replaced or removed instance's stub
    gone)."""
    wait_until(lambda: len(server.group_pids()) == processes, 30,
               lambda: f"{processes} processes in tritonserver's group ({len(server.group_pids())})")
    time.sleep(0.2)
    return sum(rss_by_pid(server.group_pids()).values())


def test_soak_reloads_and_a_leaking_control(server, tiny_model):
    ids, mask = (np.ascontiguousarray(x.numpy()) for x in tiny_model.example_inputs(1, seed=5))
    body, headers = binary_request(ids, mask)
    with TritonControl(server.http_url) as control:
        for model in MODELS:                                    # the session's server: as earlier tests left it
            if not control.is_ready(model):
                control.load(model)

        expected = _answer(server, ROUTER, body, headers)
        processes = _expected_processes(control)
        _settled_rss(server, processes)                         # an earlier test's replaced stub has exited
        run = soak(server, ROUTER, SOAK_REQUESTS, body, headers, expected)

        count = control.model_config(LAST)["instance_group"][0]["count"]
        before = _settled_rss(server, processes)
        began = time.monotonic()
        for i in range(RELOADS):
            control.set_instances(LAST, count + 1 if i % 2 == 0 else count)
        reload_s = time.monotonic() - began
        assert control.model_config(LAST)["instance_group"][0]["count"] == count
        after = _settled_rss(server, processes)
        per_load_mb = (after - before) / MB / RELOADS

        # The positive control: split 1-2 reloaded from a test-only model.py whose execute keeps every batch,
        # soaked through the router as above; then the generated model.py is put back and reloaded.
        code = server.repo / FIRST / "1" / "model.py"
        generated = code.read_text()
        try:
            code.write_text(LEAKING_MODEL.format(
                split=FIRST, repeat=LEAK_BYTES_PER_ROW // ids[0].nbytes, leak=LEAK_BYTES_PER_ROW))
            control.load(FIRST)                                 # read from disk: the leaking version
            leaking = soak(server, ROUTER, CONTROL_REQUESTS, body, headers, expected)
        finally:
            code.write_text(generated)
            control.load(FIRST)

    start_mb, end_mb = run.rss_mb
    print(f"soak: {run.requests:,} requests in {run.seconds:.0f} s ({run.requests / run.seconds:.0f} req/s, "
          f"{CLIENTS} clients, 1 input each, binary protocol), {len(run.failed)} failed; summed RSS of "
          f"tritonserver + {run.processes - 1} stubs {start_mb:.0f} -> {end_mb:.0f} MB; heap growth "
          f"(max - mean, second half) {run.growth_mb:.2f} MB (bound {HEAP_GROWTH_BOUND_MB:.0f}); leaking "
          f"control ({CONTROL_REQUESTS:,} requests, {LEAK_BYTES_PER_ROW // 2**20} MiB kept per input): "
          f"{leaking.growth_mb:.0f} MB, {'caught' if leaking.growth_mb > HEAP_GROWTH_BOUND_MB else 'MISSED'}")
    print(f"reloads: {RELOADS} loads of {LAST} with a config override (instances {count + 1} <-> {count}) in "
          f"{reload_s:.0f} s: summed RSS {before / MB:.0f} -> {after / MB:.0f} MB, {per_load_mb:+.2f} MB per load "
          f"(bound {RELOAD_BOUND_MB_PER_LOAD:g})")
    assert run.requests == SOAK_REQUESTS and not run.failed, run.failed[:3]
    assert run.growth_mb <= HEAP_GROWTH_BOUND_MB
    assert per_load_mb <= RELOAD_BOUND_MB_PER_LOAD
    assert leaking.requests == CONTROL_REQUESTS and not leaking.failed, leaking.failed[:3]
    assert leaking.growth_mb > HEAP_GROWTH_BOUND_MB      # the same check sees a leak


def _answer(server, model: str, body: bytes, headers: dict) -> bytes:
    """``model``'s answer to one request (the bytes every answer of a soak must equal)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
    try:
        conn.request("POST", f"/v2/models/{model}/infer", body=body, headers=headers)
        r = conn.getresponse()
        answer = r.read()
        assert r.status == 200, answer
        return answer
    finally:
        conn.close()
