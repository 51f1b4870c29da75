"""Planning time of E3's DP (`e3.controller.planner.best_plan`) vs layers x devices x configurations.

Synthetic GPU-like profiles (fixed cost per call + cost per input, per configuration; Tx grows with
the batch; labelled synthetic, not measured), a batch profile where inputs leave steadily, SLO 200 ms,
slack 0.2, R = 3000 inputs/s, no cost bound. Prints a table and writes
artifacts/results/planning_time.json.

    .venv/bin/python -m benchmarks.planning_time [--quick] [--repeats 3] [--reference]

``--reference`` times the planner's original exact search (``e3.controller.planner.reference.reference_best_plan``,
the tests' oracle) instead of the fast one, for before/after tables; both return the same plans.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import numpy as np

from e3.controller.planner import PlanOptions, best_plan
from e3.controller.planner.reference import reference_best_plan
from e3.core.files import write_json_atomic
from e3.core.profile import BatchProfile, DeviceConfig, LatencyProfile
from e3.paths import artifacts_dir

# name: (fixed ms per block call, ms per input, price per device): V100-, T4- and K80-like shapes
GPU_SHAPES = {"v100": (1.0, 0.05, 3.0), "t4": (1.5, 0.12, 1.0), "k80": (3.0, 0.3, 0.5)}
BATCHES = [1, 2, 4, 8, 16, 32, 64, 128]


def synthetic_profile(num_blocks: int, configs: list[str], seed: int = 0) -> LatencyProfile:
    rng = np.random.default_rng(seed)
    scale = rng.uniform(0.8, 1.2, num_blocks)
    block, ramp, tx = {}, {}, {}
    for name in configs:
        fixed, per_input, _ = GPU_SHAPES[name]
        block[name] = [[float(scale[k] * (fixed + per_input * b)) for b in BATCHES] for k in range(num_blocks)]
        ramp[name] = [[(0.1 * fixed + 0.01 * per_input * b) if k < num_blocks - 1 else 0.0 for b in BATCHES]
                      for k in range(num_blocks)]
        tx[name] = [0.3 + 0.02 * b for b in BATCHES]
    return LatencyProfile(model="synthetic", num_blocks=num_blocks, batch_sizes=list(BATCHES),
                          devices={n: DeviceConfig(n, GPU_SHAPES[n][2], modelled=True) for n in configs},
                          block_ms=block, ramp_ms=ramp, tx_ms=tx, source="synthetic GPU-like (benchmark)")


def synthetic_batch(num_blocks: int) -> BatchProfile:
    reach = np.maximum(0.2, 1.0 - 1.2 * np.arange(num_blocks) / num_blocks)
    return BatchProfile(model="synthetic", batch_size=64, reach=[1.0] + reach[1:].round(4).tolist())


def split_devices(total: int, configs: list[str]) -> dict[str, int]:
    base, extra = divmod(total, len(configs))
    return {c: base + (1 if i < extra else 0) for i, c in enumerate(configs)}


def _reference():
    """The tests' oracle (the original reference search)."""
    return reference_best_plan


def run_case(layers: int, devices: int, n_configs: int, *, repeats: int, reference: bool = False) -> dict:
    configs = list(GPU_SHAPES)[:n_configs]
    lat, batch = synthetic_profile(layers, configs), synthetic_batch(layers)
    res = split_devices(devices, configs)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        r = (_reference() if reference else best_plan)(lat, batch, res, PlanOptions(slo_ms=200.0, rate_rps=3000.0,
                                                                                    slack=0.2, alpha=None))
        times.append(time.perf_counter() - start)
    return {"layers": layers, "devices": devices, "configs": n_configs, "device_counts": res,
            "seconds_median": statistics.median(times), "seconds_all": times,
            "splits": len(r.splits), "cuts": r.cuts, "input_batch_size": r.input_batch_size,
            "throughput_rps": r.throughput_rps, "latency_ms": r.latency_ms, "cost": r.cost}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small grid only (smoke run)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per case (median reported)")
    ap.add_argument("--reference", action="store_true", help="time the original exact search instead")
    args = ap.parse_args(argv)
    grid = [(6, 8, 1), (12, 16, 1), (6, 8, 3)] if args.quick else \
        [(l, d, c) for c in (1, 3) for l in (6, 12, 24) for d in (8, 16, 64)]
    rows = []
    print(f"{'layers':>6} {'devices':>7} {'configs':>7} {'seconds':>8} {'splits':>6} {'B0':>5} "
          f"{'thr (in/s)':>11} {'lat ms':>7} {'cost':>7}")
    for layers, devices, n_configs in grid:
        row = run_case(layers, devices, n_configs, repeats=args.repeats, reference=args.reference)
        rows.append(row)
        print(f"{layers:>6} {devices:>7} {n_configs:>7} {row['seconds_median']:>8.3f} {row['splits']:>6} "
              f"{row['input_batch_size']:>5} {row['throughput_rps']:>11.0f} {row['latency_ms']:>7.1f} "
              f"{row['cost']:>7.1f}", flush=True)
    out = artifacts_dir() / "results" / ("planning_time_reference.json" if args.reference else "planning_time.json")
    write_json_atomic(out, {"benchmark": "planning_time", "search": "reference" if args.reference else "fast",
                            "profile": "synthetic GPU-like (not measured)",
                            "machine": platform.processor() or platform.machine(),
                            "python": platform.python_version(), "rows": rows}, sort_keys=False)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
