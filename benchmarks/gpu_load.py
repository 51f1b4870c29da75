"""gRPC load for the GPU runs: closed loops for the side-by-side (persistent client processes, each running its
share of the concurrency in threads) and the goodput of a run under a p99 SLO; open-loop Poisson arrivals for the
admission runner (:class:`OpenLoop`). Needs only numpy and tritonclient."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time

INPUTS_PER_REQUEST = 8
REQUEST_TIMEOUT_S = 10.0   # a request not answered by then counts as an error (a stuck server ends the run, not the bench)


def _client_worker(url: str, commands, results) -> None:
    """One client process: for each command, ``threads`` closed-loop gRPC clients for warmup + duration."""
    import tritonclient.grpc as grpcclient
    while True:
        cmd = commands.get()
        if cmd is None:
            return
        model, threads, warmup_s, duration_s, pool, offset = cmd
        start = time.monotonic()
        t0, t1 = start + warmup_s, start + warmup_s + duration_s
        lat, errors, exits, lock = [], [], {}, threading.Lock()

        def run(tid: int) -> None:
            client = grpcclient.InferenceServerClient(url)
            n = len(next(iter(pool.values())))
            i = (offset + tid * 7919) % n
            mine, errs, seen = [], [], {}
            while True:
                now = time.monotonic()
                if now >= t1:
                    break
                rows = [(i + j) % n for j in range(INPUTS_PER_REQUEST)]
                i = (i + INPUTS_PER_REQUEST) % n
                inputs = []
                for name, arr in pool.items():
                    x = grpcclient.InferInput(name, [INPUTS_PER_REQUEST, *arr.shape[1:]], "INT64")
                    x.set_data_from_numpy(arr[rows])
                    inputs.append(x)
                sent = time.monotonic()
                try:
                    res = client.infer(model, inputs, outputs=[grpcclient.InferRequestedOutput("exit_ramp")],
                                       client_timeout=REQUEST_TIMEOUT_S)
                    done = time.monotonic()
                    if sent >= t0 and done <= t1:
                        mine.append(done - sent)
                        for r in res.as_numpy("exit_ramp").reshape(-1):
                            seen[int(r)] = seen.get(int(r), 0) + 1
                except Exception as err:  # noqa: BLE001 - counted and reported, the run goes on
                    if time.monotonic() <= t1:
                        errs.append(str(err)[:200])
            client.close()
            with lock:
                lat.extend(mine)
                errors.extend(errs)
                for k, v in seen.items():
                    exits[k] = exits.get(k, 0) + v

        ts = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        results.put((lat, errors, exits))


class _ClientProcesses:
    """Persistent client processes (imports paid once) running ``worker(url, commands, results)``: one command
    queue each, one results queue; ``close`` stops them."""

    def __init__(self, url: str, processes: int, worker):
        ctx = mp.get_context("spawn")
        self.commands = [ctx.Queue() for _ in range(processes)]
        self.results = ctx.Queue()
        self.procs = [ctx.Process(target=worker, args=(url, q, self.results), daemon=True) for q in self.commands]
        for p in self.procs:
            p.start()

    def close(self) -> None:
        for q in self.commands:
            q.put(None)
        for p in self.procs:
            p.join(timeout=10)


class LoadPool(_ClientProcesses):
    """Closed loops: each client process runs its share of the concurrency in threads."""

    def __init__(self, url: str, processes: int):
        super().__init__(url, processes, _client_worker)

    def run(self, model: str, concurrency: int, pool: dict, *, warmup_s: float, duration_s: float) -> dict:
        import numpy as np
        share = [concurrency // len(self.commands) + (1 if i < concurrency % len(self.commands) else 0)
                 for i in range(len(self.commands))]
        used = 0
        for i, (q, k) in enumerate(zip(self.commands, share)):
            if k:
                q.put((model, k, warmup_s, duration_s, pool, i * 104729))
                used += 1
        lat, errors, exits = [], [], {}
        for _ in range(used):
            part_lat, part_err, part_exits = self.results.get(timeout=warmup_s + duration_s + REQUEST_TIMEOUT_S + 60)
            lat += part_lat
            errors += part_err
            for k, v in part_exits.items():
                exits[k] = exits.get(k, 0) + v
        ms = np.asarray(lat) * 1e3
        return {"concurrency": concurrency, "requests": len(lat), "inputs_per_s": len(lat) * INPUTS_PER_REQUEST / duration_s,
                "p50_ms": float(np.percentile(ms, 50)) if len(ms) else None,
                "p99_ms": float(np.percentile(ms, 99)) if len(ms) else None,
                "latencies_ms": ms, "errors": len(errors), "error_sample": errors[:3],
                "exits": {str(k): v for k, v in sorted(exits.items())}}



def goodput_at(run: dict, slo_ms: float) -> float:
    """Inputs/s answered within ``slo_ms`` in one run."""
    import numpy as np
    ms = run["latencies_ms"]
    return float(np.count_nonzero(ms <= slo_ms)) * INPUTS_PER_REQUEST / run["duration_s"] if len(ms) else 0.0


def slo_rows(runs: list[dict], slo_ms: float) -> dict | None:
    """The best operating point of a p99-against-goodput curve under a p99 SLO: among the runs whose p99 meets
    it, the one with the most inputs/s answered within it (None: no run meets it)."""
    ok = [r for r in runs if r["p99_ms"] is not None and r["p99_ms"] <= slo_ms and not r["errors"]]
    if not ok:
        return None
    best = max(ok, key=lambda r: goodput_at(r, slo_ms))
    return {"goodput": goodput_at(best, slo_ms), "p99_ms": best["p99_ms"], "concurrency": best["concurrency"]}


# -- open loop -------------------------------------------------------------------------------------------------------
def _open_worker(url: str, commands, results) -> None:
    """One client process of an open loop: sends each of its requests at its scheduled time (``async_infer``, never
    waiting for answers), records when each was sent and answered (wall-clock seconds from the common start).

    Every run has its own record (:class:`_RunRecord`): an answer arriving after its run was reported lands in
    that run's record, never in the next run's (callbacks bound to loop variables did that: a late answer of one
    system was counted, with its error, against the next). A run is reported once every request is answered or
    timed out, so the next run starts on a server that is no longer working off this one's backlog; a request
    answered after ``drain_s`` past the last arrival still counts as failed."""
    import tritonclient.grpc as grpcclient
    client = grpcclient.InferenceServerClient(url)
    while True:
        cmd = commands.get()
        if cmd is None:
            client.close()
            return
        model, start_at, offsets, pool, per_request, first, timeout_s, drain_s = cmd
        requests = _requests(grpcclient, pool, per_request, first)
        outputs = [grpcclient.InferRequestedOutput("label")]
        rec = _RunRecord(len(offsets), start_at)
        for i, off in enumerate(offsets):
            while True:
                wait = start_at + off - time.time()
                if wait <= 0:
                    break
                time.sleep(min(wait, 0.0005))
            rec.sent[i] = time.time() - start_at
            try:
                client.async_infer(model, requests[i % len(requests)],
                                   callback=lambda result, error, i=i, rec=rec: rec.answered(i, error),
                                   outputs=outputs, client_timeout=timeout_s)
            except Exception as err:  # noqa: BLE001 - counted as failed, the loop goes on
                rec.answered(i, err)
        if len(offsets):
            rec.all_done.wait(timeout=max(0.0, start_at + float(offsets[-1]) + timeout_s + 1.0 - time.time()))
        results.put(rec.report(offsets, drain_s))


def _requests(grpcclient, pool: dict, per_request: int, first: int) -> list:
    """A few dozen distinct requests of ``per_request`` rows of ``pool``, reused in turn (building one costs more
    than sending it)."""
    import numpy as np
    from tritonclient.utils import np_to_triton_dtype
    n_rows = len(next(iter(pool.values())))
    out = []
    for j in range(64):
        rows = [(first + j * per_request + i) % n_rows for i in range(per_request)]
        xs = []
        for name, arr in pool.items():
            x = grpcclient.InferInput(name, [per_request, *arr.shape[1:]], np_to_triton_dtype(arr.dtype))
            x.set_data_from_numpy(np.ascontiguousarray(arr[rows]))
            xs.append(x)
        out.append(xs)
    return out


class _RunRecord:
    """One open-loop run's sends and answers in one client process (the callbacks' only target)."""

    def __init__(self, n: int, start_at: float):
        import numpy as np
        self.start_at = start_at
        self.sent, self.done = np.full(n, np.nan), np.full(n, np.nan)
        self.errors: list[str] = []
        self.lock = threading.Lock()
        self.left = n
        self.all_done = threading.Event()
        if n == 0:
            self.all_done.set()

    def report(self, offsets, drain_s: float) -> tuple:
        """(offsets, sent, done, first errors) as the run reports them: an answer later than ``drain_s`` after
        the last arrival counts as not answered (NaN). Copies: answers arriving later change only this record."""
        with self.lock:
            done = self.done.copy()
            if len(offsets):
                done[done > float(offsets[-1]) + drain_s] = float("nan")
            return offsets, self.sent.copy(), done, list(self.errors)

    def answered(self, i: int, error) -> None:
        t = time.time() - self.start_at
        with self.lock:
            if error is None:
                self.done[i] = t
            elif len(self.errors) < 3:
                self.errors.append(str(error)[:200])
            self.left -= 1
            if self.left == 0:
                self.all_done.set()


class OpenLoop(_ClientProcesses):
    """Open-loop Poisson load from persistent client processes: every request is sent at its scheduled time,
    whatever the server does; a request's latency runs from its scheduled arrival (so a late client counts
    against the system, and the lateness is reported)."""

    def __init__(self, url: str, processes: int):
        super().__init__(url, processes, _open_worker)

    def run(self, model: str, arrivals, pool: dict, *, per_request: int, timeout_s: float = REQUEST_TIMEOUT_S,
            drain_s: float = 2.0) -> dict:
        """Send one request of ``per_request`` inputs (rows of ``pool``) at each of ``arrivals`` (s from now,
        increasing). Returns per request ``latency_ms`` (NaN where it failed or was not answered within ``drain_s``
        after the last arrival), ``failed``, ``late_ms`` (sent after its time by), the first errors. Returns once
        every request is answered or timed out (``timeout_s``), so runs do not overlap."""
        import numpy as np
        arrivals = np.asarray(arrivals, float)
        k = len(self.commands)
        start_at = time.time() + 0.3   # every process starts its schedule at the same wall-clock instant
        for i, q in enumerate(self.commands):
            q.put((model, start_at, arrivals[i::k], pool, per_request, i * 7919, timeout_s, drain_s))
        latency = np.full(len(arrivals), np.nan)
        late = np.full(len(arrivals), np.nan)
        errors: list[str] = []
        span = float(arrivals[-1]) if len(arrivals) else 0.0
        for _ in range(k):
            offsets, sent, done, errs = self.results.get(timeout=span + timeout_s + 60)
            idx = np.searchsorted(arrivals, offsets)   # a process's arrivals are a sub-sequence of the schedule
            latency[idx] = (done - offsets) * 1e3
            late[idx] = (sent - offsets) * 1e3
            errors += errs
        failed = np.isnan(latency)
        return {"latency_ms": latency, "failed": failed, "late_ms": late, "errors": errors[:3]}

