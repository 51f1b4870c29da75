"""gRPC load for the GPU runs: closed loops for the side-by-side (persistent client processes, each running its
share of the concurrency in threads), the goodput of a point under a p99 SLO, and repeated points
(:func:`measure_point`); open-loop Poisson arrivals for the admission runner (:class:`OpenLoop`). Needs only
numpy and tritonclient.

How a closed-loop run is counted (:func:`window_stats`): **throughput** counts every answer that arrives inside
the measurement window, whatever its send time (a rule that kept only requests both sent after the warm-up and
answered before the window's end under-read a system of latency W by about W / window: 13-20% on the H200 at
W = 160-240 ms in a 1.2 s window). **Latency percentiles** come from the requests *sent* inside the window,
answered whenever (every client waits for its last answer, so none is cut off). **Goodput at an SLO** counts
the answers inside the window whose latency met it. A point (:func:`measure_point`) is at least three runs, each
at least ten times the point's p50 long (lengthened from a hint or from its first run); its figures are the
medians of the runs, with their min and max beside them.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
import time

# Deferred imports: numpy and tritonclient load in the functions that send: a bare GPU host imports this module
# before prepare_host has unpacked the client's wheels.
INPUTS_PER_REQUEST = 8
REQUEST_TIMEOUT_S = 10.0   # a request not answered by then counts as an error (a stuck server ends the run, not the bench)
WINDOW_LATENCIES = 10.0    # a run's window is at least this many times the point's p50
MIN_REPS = 3               # runs per point: the median is the figure, min and max its spread
MAX_PROBES = 6             # runs per point set aside because their window proved too short (measure_point)
PROBE_MARGIN = 1.2         # a lengthened window's margin over the probe's need (a p50 a little longer next time)


def _client_worker(url: str, commands, results) -> None:
    """One client process: for each command, ``threads`` closed-loop gRPC clients for warmup + duration.

    Reports every request's send and answer times in seconds from the window's start (answer NaN: failed), its
    errors (warm-up included: a point with any is not a figure), and the exit ramps of the answers that arrived
    inside the window. Requests are built once per command, before the clock starts
    (building one costs more than sending it)."""
    import numpy as np
    import tritonclient.grpc as grpcclient
    while True:
        cmd = commands.get()
        if cmd is None:
            return
        model, threads, warmup_s, duration_s, pool, offset = cmd
        requests = _requests(grpcclient, pool, INPUTS_PER_REQUEST, offset)
        outputs = [grpcclient.InferRequestedOutput("exit_ramp")]
        start = time.monotonic()
        t0, t1 = start + warmup_s, start + warmup_s + duration_s
        sent_all, done_all, errors, exits, lock = [], [], [], {}, threading.Lock()

        def run(tid: int) -> None:
            client = grpcclient.InferenceServerClient(url)
            k = tid * 17
            sent, done, errs, seen = [], [], [], {}
            while True:
                s = time.monotonic()
                if s >= t1:
                    break
                try:
                    res = client.infer(model, requests[k % len(requests)], outputs=outputs,
                                       client_timeout=REQUEST_TIMEOUT_S)
                    d = time.monotonic()
                    if t0 <= d <= t1:
                        for r in res.as_numpy("exit_ramp").reshape(-1):
                            seen[int(r)] = seen.get(int(r), 0) + 1
                except Exception as err:  # noqa: BLE001 - counted (warm-up included) and reported, the run goes on
                    d = float("nan")
                    errs.append(str(err)[:200])
                sent.append(s - t0)
                done.append(d - t0)
                k += 1
            client.close()
            with lock:
                sent_all.extend(sent)
                done_all.extend(done)
                errors.extend(errs)
                for key, v in seen.items():
                    exits[key] = exits.get(key, 0) + v

        ts = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        results.put((np.asarray(sent_all, float), np.asarray(done_all, float), errors, exits))


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

    @property
    def processes(self) -> int:
        return len(self.commands)

    def run(self, model: str, concurrency: int, pool: dict, *, warmup_s: float, duration_s: float) -> dict:
        """One closed-loop run of ``concurrency`` requests in flight (of ``INPUTS_PER_REQUEST`` rows of ``pool``):
        :func:`window_stats` of its window, with ``concurrency``, the errors and the exit ramps answered."""
        import numpy as np
        share = [concurrency // self.processes + (1 if i < concurrency % self.processes else 0)
                 for i in range(self.processes)]
        used = 0
        for i, (q, k) in enumerate(zip(self.commands, share)):
            if k:
                q.put((model, k, warmup_s, duration_s, pool, i * 104729))
                used += 1
        sent, done, errors, exits = [], [], [], {}
        for _ in range(used):
            part_sent, part_done, part_err, part_exits = self.results.get(
                timeout=warmup_s + duration_s + REQUEST_TIMEOUT_S + 60)
            sent.append(part_sent)
            done.append(part_done)
            errors += part_err
            for k, v in part_exits.items():
                exits[k] = exits.get(k, 0) + v
        stats = window_stats(np.concatenate(sent), np.concatenate(done), duration_s)
        return {"concurrency": concurrency, **stats, "errors": len(errors), "error_sample": errors[:3],
                "exits": {str(k): v for k, v in sorted(exits.items())}}


def window_stats(sent, done, duration_s: float) -> dict:
    """A closed-loop run's figures from its requests' send and answer times (s from the window's start; answer
    NaN: failed), window ``[0, duration_s]`` (module docstring): ``requests`` and ``inputs_per_s`` count the
    answers inside the window whatever their send time; ``p50_ms`` / ``p99_ms`` and ``latencies_ms`` are of the
    requests sent inside it; ``answer_latencies_ms`` are the latencies of the answers inside it (what goodput
    at an SLO counts, :func:`goodput_at`)."""
    import numpy as np
    sent, done = np.asarray(sent, float), np.asarray(done, float)
    answered = ~np.isnan(done)
    inside = answered & (done >= 0.0) & (done <= duration_s)
    from_window = answered & (sent >= 0.0) & (sent < duration_s)
    lat = (done[from_window] - sent[from_window]) * 1e3
    n = int(inside.sum())
    return {"requests": n, "inputs_per_s": n * INPUTS_PER_REQUEST / duration_s, "duration_s": duration_s,
            "p50_ms": float(np.percentile(lat, 50)) if len(lat) else None,
            "p99_ms": float(np.percentile(lat, 99)) if len(lat) else None,
            "latencies_ms": lat, "answer_latencies_ms": (done[inside] - sent[inside]) * 1e3}


def goodput_at(run: dict, slo_ms: float) -> float:
    """Inputs/s answered inside one run's window within ``slo_ms``."""
    import numpy as np
    ms = run.get("answer_latencies_ms", run["latencies_ms"])
    return float(np.count_nonzero(ms <= slo_ms)) * INPUTS_PER_REQUEST / run["duration_s"] if len(ms) else 0.0


def _slo_key(slo_ms) -> str:
    return "null" if slo_ms is None else f"{float(slo_ms):g}"


def aggregate(runs: list[dict], slos_ms=()) -> dict:
    """One point from its repeated runs (same system, configuration and concurrency): the median of each figure
    (inputs/s, p50, p99, goodput at each SLO) with its min and max over the runs; errors summed, exits added.
    ``p99_ms`` is None where a run answered nothing (the point then meets no SLO)."""
    import numpy as np

    def spread(values) -> tuple:
        if any(v is None for v in values) or not values:
            return None, None, None
        return float(np.median(values)), float(min(values)), float(max(values))

    ips, ips_min, ips_max = spread([r["inputs_per_s"] for r in runs])
    p99, p99_min, p99_max = spread([r["p99_ms"] for r in runs])
    p50, _, _ = spread([r["p50_ms"] for r in runs])
    exits: dict[str, int] = {}
    for r in runs:
        for k, v in r.get("exits", {}).items():
            exits[k] = exits.get(k, 0) + v
    goodput, goodput_spread = {}, {}
    for slo in slos_ms:
        g, lo, hi = spread([goodput_at(r, slo) for r in runs])
        goodput[_slo_key(slo)], goodput_spread[_slo_key(slo)] = g, [lo, hi]
    errors = sum(r["errors"] for r in runs)
    return {"concurrency": runs[0]["concurrency"], "reps": len(runs), "inputs_per_s": ips,
            "inputs_per_s_min": ips_min, "inputs_per_s_max": ips_max, "p50_ms": p50, "p99_ms": p99,
            "p99_ms_min": p99_min, "p99_ms_max": p99_max, "goodput": goodput, "goodput_spread": goodput_spread,
            "requests": sum(r["requests"] for r in runs), "errors": errors,
            "error_sample": [e for r in runs for e in r.get("error_sample", [])][:3], "exits": exits,
            "window_s": max(r["duration_s"] for r in runs)}


def window_for(p50_ms: float | None, *, min_s: float, max_s: float) -> float:
    """A run's window: ``WINDOW_LATENCIES`` times ``p50_ms`` (s), within [``min_s``, ``max_s``]."""
    want = WINDOW_LATENCIES * p50_ms / 1e3 if p50_ms else 0.0
    return min(max_s, max(min_s, want))


def measure_point(load: LoadPool, model: str, concurrency: int, pool: dict, *, warmup_s: float, min_window_s: float,
                  max_window_s: float, reps: int = MIN_REPS, p50_hint_ms: float | None = None, slos_ms=()) -> dict:
    """One point, repeated: ``reps`` runs (at least ``MIN_REPS``) of ``concurrency`` requests in flight, each
    window ``WINDOW_LATENCIES`` times the point's p50 or longer (:func:`window_for` of ``p50_hint_ms``, e.g. the
    previous point's p50 scaled to this concurrency). A run whose window proves shorter than that (its own p50
    was longer than the window allows) is a probe: it is set aside and the next runs use the lengthened window,
    as often as that happens (the window only grows, up to ``max_window_s``, so this ends; at most
    ``MAX_PROBES`` probes, after which runs count as they come). Once, only the first such run was set aside,
    and a later run slowed by a neighbour on a shared machine counted with a window under 10 x its p50. A run
    that answered nothing and failed ends the point at once (each of its requests waited for its timeout; the
    point is no figure). Returns :func:`aggregate` of the runs that count, with ``window_over_p50`` (the shortest
    window of them over its run's p50: 10 or more unless ``max_window_s`` capped it or the probes ran out) and
    ``probe_discarded`` (how many runs were set aside)."""
    reps = max(MIN_REPS, reps)
    window = window_for(p50_hint_ms, min_s=min_window_s, max_s=max_window_s)
    runs, discarded = [], 0
    while len(runs) < reps:
        r = load.run(model, concurrency, pool, warmup_s=warmup_s, duration_s=window)
        if r["errors"] and not r["requests"]:   # nothing answered: a stuck or failing model, not a figure to repeat
            runs.append(r)
            break
        need = window_for(r["p50_ms"], min_s=min_window_s, max_s=max_window_s)
        if discarded < MAX_PROBES and need > window:
            window, discarded = min(max_window_s, need * PROBE_MARGIN), discarded + 1
            continue
        runs.append(r)
    point = aggregate(runs, slos_ms)
    ratios = [r["duration_s"] * 1e3 / r["p50_ms"] for r in runs if r["p50_ms"]]
    point.update(window_over_p50=min(ratios) if ratios else None, probe_discarded=discarded)
    return point


def slo_rows(points: list[dict], slo_ms: float | None) -> dict | None:
    """The best operating point of a p99-against-goodput curve (points of :func:`aggregate`, one configuration):
    under a p99 SLO, among the error-free points whose (median) p99 meets it, the one with the most inputs/s
    answered within it; with ``slo_ms`` None, the error-free point with the most inputs/s (saturating
    throughput). None: no point qualifies. Returns goodput (median over the point's runs) and its [min, max],
    the point's p99 and concurrency."""
    ok = [p for p in points if not p["errors"] and p["p99_ms"] is not None and p["inputs_per_s"] is not None
          and (slo_ms is None or p["p99_ms"] <= slo_ms)]
    if not ok:
        return None
    if slo_ms is None:
        best = max(ok, key=lambda p: p["inputs_per_s"])
        value, spread = best["inputs_per_s"], [best["inputs_per_s_min"], best["inputs_per_s_max"]]
    else:
        key = _slo_key(slo_ms)
        best = max(ok, key=lambda p: p["goodput"][key])
        value, spread = best["goodput"][key], best["goodput_spread"][key]
    return {"goodput": value, "goodput_min": spread[0], "goodput_max": spread[1], "p99_ms": best["p99_ms"],
            "p99_ms_min": best["p99_ms_min"], "p99_ms_max": best["p99_ms_max"], "concurrency": best["concurrency"],
            "reps": best["reps"], "window_s": best["window_s"]}


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

