"""Driving a served generation front door for ExeGPT's measurements: control requests to
``<m>_generate_exegpt`` and a closed-loop load whose output lengths are drawn from a distribution.

Client side only (tritonclient over HTTP); nothing in the server imports it.
"""

from __future__ import annotations

import json
import math
import random
import threading
import time
from dataclasses import dataclass

import numpy as np

from e3.generation.client import _inputs
from e3.generation.exegpt.workload import LengthDistribution

__all__ = ["control", "Run", "drive", "percentile", "concurrency_for"]


def control(url: str, door: str, doc: dict | None = None) -> dict:
    """Send a control document (``{}``: status) to ``door`` at ``url`` (host:port); its status JSON."""
    # deferred: each protocol loads its own client (http: gevent, 400 ms; grpc: 350 ms)
    from tritonclient import http
    from tritonclient.utils import InferenceServerException
    t = http.InferInput("control", [1], "BYTES")
    t.set_data_from_numpy(np.array([json.dumps(doc or {}).encode()], dtype=object))
    with http.InferenceServerClient(url) as client:
        try:
            r = client.infer(door, [t])
        except InferenceServerException as err:
            raise ValueError(err.message()) from None
    return json.loads(r.as_numpy("text_out")[0].decode())


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100, nearest rank: a value that was measured)."""
    if not values:
        return math.nan
    v = sorted(values)
    return v[min(len(v) - 1, max(0, math.ceil(q / 100 * len(v)) - 1))]


def concurrency_for(batch_size: int, decode_batch: float) -> int:
    """Requests to keep in flight so that an RRA schedule finds its queue full at every phase start: the live
    decode batch the simulator expects (``Prediction.detail["decode_batch"]``) plus a phase's ``batch_size``
    admissions, with a margin of 30% (lengths vary around the expectation)."""
    return int(math.ceil(1.3 * (decode_batch + batch_size))) + 2


@dataclass(frozen=True)
class Run:
    """One closed-loop run against a door (figures over the requests after the warm-up)."""

    sequences: int            # finished in the measured part
    seconds: float            # from the warm-up's end to the last finish
    seq_s: float              # sequences per second
    tok_s: float              # generated tokens per second
    p99_ms: float             # 99th percentile of the server's latency (admission to last token, ``total_ms``)
    p99_client_ms: float      # 99th percentile seen by the client (queueing before admission included)
    errors: int               # failed requests (all of them, warm-up included)
    first_error: str = ""     # the first failure's message

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def drive(grpc_url: str, door: str, lengths: LengthDistribution, *, prompt_tokens: int, requests: int, concurrency: int,
          vocab: int, warmup: int = 0, seed: int = 0, mode: str = "full", timeout_s: float = 600.0,
          measure_s: float | None = None) -> Run:
    """``requests`` generations kept ``concurrency`` in flight (a closed loop over gRPC, asynchronous: one client,
    no thread per request, so the client takes little of the cores the server runs on), prompts of
    ``prompt_tokens`` random ids in [3, vocab), ``max_new_tokens`` drawn from ``lengths``; the first ``warmup``
    to finish are not measured. With ``measure_s``, no request is sent once ``measure_s`` seconds have passed
    since the warm-up ended, and only what finished by then is measured (the rest drains unmeasured).
    RuntimeError if the run has not finished within ``timeout_s``."""
    from tritonclient import grpc   # deferred: each protocol loads its own client (see control)
    rng = random.Random(seed)
    jobs = [([rng.randrange(3, vocab) for _ in range(prompt_tokens)], rng.choices(lengths.lengths, lengths.probs)[0])
            for _ in range(requests)]
    lock = threading.Lock()
    done: list[tuple[float, float, float, int]] = []   # (finish time, server ms, client ms, tokens)
    errors: list = []
    state = {"next": 0, "open": 0, "stop_at": math.inf}
    finished = threading.Event()
    client = grpc.InferenceServerClient(grpc_url)

    def submit() -> None:
        with lock:
            if state["next"] >= len(jobs) or time.perf_counter() >= state["stop_at"]:
                if state["open"] == 0:
                    finished.set()
                return
            prompt, n = jobs[state["next"]]
            state["next"] += 1
            state["open"] += 1
        t0 = time.perf_counter()
        knobs = {"max_new_tokens": n, "mode": mode, "tau": 0.9, "draft_tokens": 4}
        client.async_infer(door, _inputs(grpc, prompt, knobs),
                           callback=lambda result, error: answered(t0, result, error), client_timeout=timeout_s)

    def answered(t0: float, result, error) -> None:
        t1 = time.perf_counter()
        with lock:
            state["open"] -= 1
            if error is not None:
                errors.append(str(error))
            else:
                done.append((t1, float(result.as_numpy("total_ms")[0]), 1e3 * (t1 - t0),
                             len(result.as_numpy("tokens"))))
                if measure_s is not None and len(done) == max(warmup, 1):
                    state["stop_at"] = t1 + measure_s
        submit()

    try:
        for _ in range(min(concurrency, len(jobs))):
            submit()
        if not finished.wait(timeout=timeout_s):
            raise RuntimeError(f"{door}: {state['open']} requests still open after {timeout_s:.0f} s")
    finally:
        client.close()
    done.sort()
    if measure_s is not None:
        done = [d for d in done if d[0] <= state["stop_at"]]
    measured = done[warmup:] if len(done) > warmup + 1 else done
    t_start = done[warmup - 1][0] if 0 < warmup < len(done) else (done[0][0] if done else 0.0)
    seconds = max(measured[-1][0] - t_start, 1e-9) if measured else 0.0
    n = len(measured) - (1 if warmup == 0 else 0)   # without a warm-up the first finish opens the window
    return Run(len(measured), seconds, n / seconds if seconds else 0.0,
               sum(m[3] for m in measured[(1 if warmup == 0 else 0):]) / seconds if seconds else 0.0,
               percentile([m[1] for m in measured], 99), percentile([m[2] for m in measured], 99), len(errors),
               errors[0] if errors else "")
