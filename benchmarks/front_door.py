"""The guards' overhead against Triton's own HTTP and gRPC ports, side by side, one server.

Starts tiny-ee's router and splits on the embedded tritonserver, the HTTP guard and the gRPC port in front
(as in ``e3 serve``: the HTTP guard in this process on its own event loop thread; for gRPC the C++ front,
``deploy/grpc_front``, a child process, with the Python gRPC guard behind it in this process, or with
``--grpc-port guard`` the Python guard alone), and drives both sides with Triton's
``perf_analyzer`` (the C++ load generator shipped in the client wheel: asynchronous, ``--concurrency-range
C``, one input per request, binary tensors, ``--input-data zero``), per protocol through the guard, then
straight to Triton's port, alternating for ``--rounds``. Triton's ports here are loopback TCP ports (not
``e3 serve``'s private Unix sockets: perf_analyzer's HTTP client cannot reach a Unix socket), so the guards'
upstream hop is TCP too. Each run is a fixed request count sized from a short calibration on
Triton's port so that it lasts about ``--seconds``; perf_analyzer fails the run on any failed request or
broken connection, and the guard's answers by status are read from its counters. Prints throughput and
p99 per run and the ratios guard / direct. The guard, Triton and perf_analyzer share the machine's cores
(printed, with the load average after each run): what the guard costs in CPU is taken from Triton. Both
sides are warmed before the first run (the calibration on Triton's port, 2,000 requests through the guard),
odd rounds run the direct side first, and the process tunes its garbage collector as ``e3 serve`` does
(:func:`e3.deploy.guard.tune_gc`). Each run also prints where the CPU went, per request: tritonserver with its
Python stubs (its process group), perf_analyzer, and the guards: this process (nothing else in it works
during a run) and the C++ gRPC front, from ``/proc`` and ``getrusage``.

Usage: ``.venv/bin/python benchmarks/front_door.py [--concurrency 64] [--seconds 30] [--rounds 1]
[--protocols http,grpc] [--grpc-port front|guard] [--stream-lanes 0]``.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import subprocess
import sys
from pathlib import Path

from e3.deploy.grpc_front_process import GrpcFront, front_binary
from e3.deploy.grpc_guard import GrpcGuard
from e3.deploy.guard import Guard, tune_gc
from e3.deploy.server import TritonServer, group_cpu_s
from e3.deploy.tools import perf_analyzer_binary, tool_env
from e3.export.repository import ExportSettings, export_repository
from e3.paths import artifacts_dir

MODELS = ["tiny_ee_split_1-2", "tiny_ee_split_3-4", "tiny_ee_router"]


def perf(url: str, concurrency: int, requests: int, headers: dict[str, str], protocol: str = "http",
         timeout_s: float = 600.0) -> dict:
    """One perf_analyzer run of ``requests`` requests; throughput (req/s), p99 (ms), and its exit status (a run
    past ``timeout_s`` fails: some call was never answered)."""
    cmd = [perf_analyzer_binary(), "-m", "tiny_ee_router", "-u", url, "-i", protocol, "--async",
           "--concurrency-range", str(concurrency), "--request-count", str(requests), "--input-data", "zero",
           "--percentile", "99", "-b", "1", "--shape", "input_ids:16", "--shape", "attention_mask:16"]
    for k, v in headers.items():
        cmd += ["-H", f"{k}:{v}"]
    try:
        p = subprocess.run(cmd, env=tool_env(), capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as err:
        return {"ok": False, "rc": "timeout", "out": f"no end after {timeout_s:.0f} s: {str(err.stdout)[-1500:]}"}
    out = p.stdout + p.stderr
    tput = re.search(r"Throughput: ([\d.]+) infer/sec", out)
    p99 = re.search(r"p99 latency: (\d+) usec", out)
    count = re.search(r"Request count: (\d+)", out)
    if p.returncode or not tput or not p99:
        return {"ok": False, "rc": p.returncode, "out": out[-2000:]}
    return {"ok": True, "rps": float(tput.group(1)), "p99_ms": int(p99.group(1)) / 1e3,
            "requests": int(count.group(1)) if count else requests}


def _cpu_now(pgid: int, front_pid: int | None) -> tuple[float, float, float, float]:
    """(tritonserver's group, perf_analyzer runs so far, this process (the Python guards), the C++ gRPC front) in
    CPU seconds."""
    kids, me = resource.getrusage(resource.RUSAGE_CHILDREN), resource.getrusage(resource.RUSAGE_SELF)
    front = sum(group_cpu_s(front_pid).values()) if front_pid else 0.0   # its own session: pgid = pid
    return sum(group_cpu_s(pgid).values()), kids.ru_utime + kids.ru_stime, me.ru_utime + me.ru_stime, front


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", default=None, help="tiny-ee repository (default: exported into artifacts/)")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--protocols", default="http,grpc", help="comma-separated: http, grpc")
    parser.add_argument("--seconds", type=float, default=30.0, help="approximate length of each run")
    parser.add_argument("--rounds", type=int, default=1, help="guard/direct pairs, alternating")
    parser.add_argument("--stream-lanes", type=int, default=0,
                        help="the Python gRPC guard's shared streams to Triton (grpc_mux; 0, the default: a unary "
                             "call each); only with --grpc-port guard")
    parser.add_argument("--grpc-port", choices=["front", "guard"], default="front" if front_binary() else "guard",
                        help="what serves gRPC: the C++ front with the Python guard behind it (as `e3 serve` runs "
                             "it; the default where deploy/grpc_front is built) or the Python guard alone")
    args = parser.parse_args()
    repo = Path(args.repo) if args.repo else Path(artifacts_dir()) / "bench" / "front-door-tiny-ee"
    if not (repo / "tiny_ee_router").is_dir():
        export_repository("tiny-ee", "2", repo, settings=ExportSettings(slo_ms=10_000.0), progress=False)
    protocols = args.protocols.split(",")
    with TritonServer.on_free_ports(repo, MODELS, exit_timeout_s=3) as server, \
            Guard(server.http_url, port=0) as guard, \
            (GrpcFront(server.grpc_url, port=0) if args.grpc_port == "front" else
             GrpcGuard(server.grpc_url, port=0, stream_lanes=args.stream_lanes)) as grpc_guard:
        front_pid = grpc_guard.process.pid if args.grpc_port == "front" else None
        tune_gc()   # as `e3 serve` does once its guard is up
        urls = {"http": (guard.url, server.http_url), "grpc": (grpc_guard.url, server.grpc_url)}
        calib = perf(server.http_url, args.concurrency, 2000, {})
        if not calib["ok"]:
            print(calib["out"], file=sys.stderr)
            return 1
        for protocol in protocols:   # the guards' upstream connections opened, as Triton's are
            warm = perf(urls[protocol][0], args.concurrency, 2000, {}, protocol, timeout_s=120)
            if not warm["ok"]:
                print(warm["out"], f"\nHTTP guard: {dict(guard.responses)}, gRPC: {dict(grpc_guard.codes)}",
                      file=sys.stderr)
                return 1
        n = max(1000, int(calib["rps"] * args.seconds))
        print(f"cores: {os.cpu_count()} shared by tritonserver (router + 2 splits, 1 thread each), the guards "
              f"(one event loop each) and perf_analyzer; {args.concurrency} concurrent clients, "
              f"{n} requests per run (~{args.seconds:g} s at the calibrated {calib['rps']:.0f} req/s)")
        rows = []
        for r in range(args.rounds):
            for protocol in protocols:
                sides = [("guard", urls[protocol][0]), ("direct", urls[protocol][1])]
                for side, url in sides if r % 2 == 0 else sides[::-1]:   # odd rounds: direct first
                    before = _cpu_now(server.process.pid, front_pid)
                    res = perf(url, args.concurrency, n, {}, protocol)
                    used = [(b - a) * 1e6 / n for a, b in zip(before, _cpu_now(server.process.pid, front_pid))]
                    res.update(side=side, round=r, protocol=protocol, cpu_us=used)
                    rows.append(res)
                    if not res["ok"]:
                        print(f"{protocol} {side}: perf_analyzer failed (exit {res['rc']}):\n{res['out']}")
                    else:
                        print(f"round {r} {protocol:<4} {side:<6} {res['rps']:8.1f} req/s  p99 {res['p99_ms']:7.1f} ms"
                              f"  ({res['requests']} requests, 0 failed; load average {os.getloadavg()[0]:.1f}); "
                              f"CPU per request: tritonserver {used[0]:.0f} us, perf_analyzer {used[1]:.0f} us, "
                              f"guards {used[2] + used[3]:.0f} us (the C++ gRPC front {used[3]:.0f} us)")
        ok = all(x["ok"] for x in rows)
        if ok:
            for r in range(args.rounds):
                for protocol in protocols:
                    g, d = (next(x for x in rows if x["round"] == r and x["side"] == s and x["protocol"] == protocol)
                            for s in ("guard", "direct"))
                    print(f"round {r} {protocol}: guard {g['rps']:.1f} req/s, Triton's own port {d['rps']:.1f} "
                          f"req/s: {g['rps'] / d['rps']:.2f}x (bound >= 0.9); p99 {g['p99_ms']:.1f} vs "
                          f"{d['p99_ms']:.1f} ms: {g['p99_ms'] / d['p99_ms']:.2f}x")
            mux = getattr(grpc_guard, "_mux", None)
            print(f"HTTP guard answers by status over the whole run: {dict(guard.responses)}; gRPC "
                  f"{args.grpc_port}: {dict(grpc_guard.codes)} (anything but 200/OK would be a failure the guard "
                  f"produced); gRPC calls carried on the guard's shared streams: {mux.sent if mux else 0}")
        return 0 if ok else 1

if __name__ == "__main__":
    sys.exit(main())
