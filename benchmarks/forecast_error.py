"""Forecast error of the exit forecaster on a replayed stream (E3 §3.1, §5.8.2).

Replays per-input exit ramps in arrival order, cut into windows of
``--window-inputs`` inputs. Each window goes through the same code the
controller runs on live telemetry: cumulative router counters
(:class:`~e3.controller.telemetry.RouterSnapshot`) are diffed into the
window's batch profile by ``window_profile``, every forecaster forecasts
each window from the previous ones, and ``forecast_error`` scores them on
shares of B0, with the windows right after a mix switch reported apart.

Inputs:
  --synthetic            80:20 easy:hard for the first half, then 20:80
                         (E3 §5.8's mixes); binomial noise from sampling.
  --workload FILE.json   a list of per-input exit ramps, or of objects with
                         ``exit_ramp`` (and optionally ``mix``: a change of
                         ``mix`` marks a switch), or ``{"inputs": [...]}``.

Writes ``artifacts/results/forecast_error.json``. Target: MAE <= 10% of B0
outside switch windows.

    .venv/bin/python benchmarks/forecast_error.py --synthetic
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import numpy as np

from e3.controller.forecast import forecast_error, make_forecaster
from e3.controller.telemetry import RouterSnapshot, window_profile
from e3.paths import artifacts_dir

TARGET_MAE = 0.10   # share of B0

# Exit distributions over ramps 1..4 (4 = the head) for the synthetic stream.
EASY = [0.60, 0.25, 0.10, 0.05]
HARD = [0.05, 0.10, 0.15, 0.70]


def synthetic_stream(windows: int, window_inputs: int, seed: int) -> tuple[list[int], list[int], int]:
    """Exit ramps of ``windows * window_inputs`` inputs; the hard share goes 0.2 -> 0.8 half way.

    Returns (exit ramps, input indices where the mix switches, L).
    """
    rng = np.random.default_rng(seed)
    n = windows * window_inputs
    switch_at = (windows // 2) * window_inputs
    hard_share = np.where(np.arange(n) < switch_at, 0.2, 0.8)
    hard = rng.random(n) < hard_share
    ramps = np.where(hard, rng.choice(4, size=n, p=HARD), rng.choice(4, size=n, p=EASY)) + 1
    return ramps.astype(int).tolist(), [switch_at], len(EASY)


def load_workload(path: Path) -> tuple[list[int], list[int]]:
    """Exit ramps (and switch points) from a workload JSON file: an `e3 workload` file (top-level
    ``exit_ramp`` list and a ``phases`` table), a list of ramps, or ``{"inputs": [{"exit_ramp": k, "mix": ..}]}``."""
    data = json.loads(path.read_text())
    if isinstance(data, dict) and isinstance(data.get("exit_ramp"), list):
        switches = [int(p["start_index"]) for p in data.get("phases", [])[1:]]
        return [int(k) for k in data["exit_ramp"]], switches
    items = data["inputs"] if isinstance(data, dict) else data
    if not isinstance(items, list) or not items:
        raise SystemExit(f"{path}: expected a non-empty list of inputs (or {{\"inputs\": [...]}})")
    ramps, switches, mix = [], [], None
    for i, item in enumerate(items):
        if isinstance(item, dict):
            if "exit_ramp" not in item:
                raise SystemExit(f"{path}: input {i} has no 'exit_ramp' field")
            ramps.append(int(item["exit_ramp"]))
            if "mix" in item:
                if mix is not None and item["mix"] != mix:
                    switches.append(i)
                mix = item["mix"]
        else:
            ramps.append(int(item))
    if min(ramps) < 1:
        raise SystemExit(f"{path}: exit ramps must be block numbers >= 1 (got {min(ramps)})")
    return ramps, switches


def replay_windows(ramps: list[int], window_inputs: int, num_blocks: int, *, batch_size: int):
    """Per-window batch profiles, built by diffing cumulative router counters like live telemetry."""
    reached = np.zeros(num_blocks + 1)
    exited = np.zeros(num_blocks + 1)
    inputs = 0

    def snap(t: float) -> RouterSnapshot:
        return RouterSnapshot(model="replay", at_s=t, inputs=float(inputs), batches=inputs / batch_size,
                              reached={k: float(reached[k]) for k in range(1, num_blocks + 1)},
                              exited={k: float(exited[k]) for k in range(1, num_blocks + 1)})

    windows, start = [], snap(0.0)
    for w in range(len(ramps) // window_inputs):
        chunk = np.asarray(ramps[w * window_inputs:(w + 1) * window_inputs])
        for k in range(1, num_blocks + 1):
            reached[k] += np.count_nonzero(chunk >= k)
            exited[k] += np.count_nonzero(chunk == k)
        inputs += len(chunk)
        end = snap(float(w + 1))
        windows.append(window_profile(start, end, num_blocks=num_blocks, batch_size=batch_size).profile)
        start = end
    return windows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--synthetic", action="store_true", help="80:20 -> 20:80 easy:hard stream")
    src.add_argument("--workload", type=Path, help="JSON file of per-input exit ramps in arrival order")
    ap.add_argument("--window-inputs", type=int, default=512, help="inputs per window (default 512)")
    ap.add_argument("--windows", type=int, default=60, help="synthetic: number of windows (default 60)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-blocks", type=int, help="L (default: the largest exit ramp seen)")
    ap.add_argument("--batch-size", type=int, default=8, help="B0 the shares refer to (default 8)")
    ap.add_argument("--switch-at", default="", help="input indices where the mix switches, comma-separated")
    ap.add_argument("--settle-windows", type=int, default=2,
                    help="windows from a switch reported as switch windows (default 2)")
    ap.add_argument("--forecasters", default="arima,last", help="comma-separated (default arima,last)")
    ap.add_argument("--out", type=Path, default=artifacts_dir() / "results" / "forecast_error.json")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    if args.window_inputs < 1:
        ap.error("--window-inputs must be >= 1")
    if args.synthetic:
        ramps, switches, L = synthetic_stream(args.windows, args.window_inputs, args.seed)
        source = f"synthetic 80:20 -> 20:80 easy:hard, seed {args.seed}"
    else:
        ramps, switches = load_workload(args.workload)
        L = max(ramps)
        source = str(args.workload)
    L = args.num_blocks or L
    if max(ramps) > L:
        ap.error(f"--num-blocks {L} is below the largest exit ramp {max(ramps)}")
    switches += [int(s) for s in args.switch_at.split(",") if s.strip()]
    switch_windows = sorted({s // args.window_inputs for s in switches})
    names = [n.strip() for n in args.forecasters.split(",") if n.strip()]
    forecasters = {}
    for n in names:
        try:
            forecasters[n] = make_forecaster(n)
        except ValueError as err:
            ap.error(str(err))

    observed = replay_windows(ramps, args.window_inputs, L, batch_size=args.batch_size)
    if len(observed) < 2:
        ap.error(f"{len(ramps)} inputs make {len(observed)} windows of {args.window_inputs}; need at least 2")
    results = {}
    print(f"{len(observed)} windows of {args.window_inputs} inputs, L = {L}, switch windows {switch_windows} "
          f"(+{args.settle_windows - 1} after each)")
    for n, fc in forecasters.items():
        t0 = time.perf_counter()
        forecasts = []
        for prof in observed:
            forecasts.append(fc.forecast())
            if prof is not None:
                fc.observe(prof)
        elapsed = time.perf_counter() - t0
        rep = forecast_error(forecasts, observed, switch_windows, settle_windows=args.settle_windows)
        results[n] = {**rep.to_dict(), "seconds_per_window": elapsed / len(observed),
                      "forecasts": [f.reach if f else None for f in forecasts]}
        ramps_txt = "  ".join(f"r{k}={v:.3f}" for k, v in rep.per_ramp_mae.items())
        sw_txt = "  ".join(f"r{k}={v:.3f}" for k, v in rep.per_ramp_mae_switch.items())
        ok = "meets" if rep.mae <= TARGET_MAE else "MISSES"
        print(f"{n:>6}: steady MAE {rep.mae:.4f} of B0 over {rep.windows} windows ({ramps_txt})  [{ok} "
              f"the {TARGET_MAE:.0%} target]")
        if rep.switch_windows:
            print(f"{'':>6}  switch MAE {rep.mae_switch:.4f} over {rep.switch_windows} windows ({sw_txt})")
        print(f"{'':>6}  {elapsed / len(observed) * 1e3:.1f} ms per window")

    doc = {"source": source, "num_blocks": L, "window_inputs": args.window_inputs, "batch_size": args.batch_size,
           "switch_windows": switch_windows, "settle_windows": args.settle_windows, "target_mae": TARGET_MAE,
           "observed": [p.reach if p else None for p in observed], "forecasters": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    tmp.replace(args.out)
    print(f"wrote {args.out}")
    return 0 if all(r["mae"] is not None and r["mae"] <= TARGET_MAE for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
