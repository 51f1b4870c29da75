"""Closed-loop gRPC load for the GPU side-by-side: persistent client processes, each running its share of the
concurrency in threads; and the goodput of a run under a p99 SLO. Needs only numpy and tritonclient."""

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


class LoadPool:
    """Persistent client processes (imports paid once), each running its share of the concurrency in threads."""

    def __init__(self, url: str, processes: int):
        ctx = mp.get_context("spawn")
        self.commands = [ctx.Queue() for _ in range(processes)]
        self.results = ctx.Queue()
        self.procs = [ctx.Process(target=_client_worker, args=(url, q, self.results), daemon=True)
                      for q in self.commands]
        for p in self.procs:
            p.start()

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

    def close(self) -> None:
        for q in self.commands:
            q.put(None)
        for p in self.procs:
            p.join(timeout=10)


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
