"""``e3 plan-generate`` (also ``python -m e3.generation.exegpt``): profile the served decoder, then print
branch-and-bound against the exhaustive grid and the schedule chosen per latency bound."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from e3.generation.exegpt.profiler import ProfileSettings, cached_profile
from e3.generation.exegpt.report import default_bounds_ms, format_schedule_table, format_search_table, plan_rows
from e3.generation.exegpt.search import grid_search, rra_space
from e3.generation.exegpt.simulator import Workload, simulate_rra
from e3.generation.exegpt.validate import measure_rra, validate_rra
from e3.generation.exegpt.workload import LayerProfile, LengthDistribution
from e3.paths import artifacts_dir, default_repository

__all__ = ["add_arguments", "run", "main"]


def _range(text: str, what: str) -> tuple[int, ...]:
    try:
        lo, hi = (int(x) for x in text.split(":"))
    except ValueError:
        raise SystemExit(f"plan-generate: error: {what} must look like LOW:HIGH (e.g. 8:64), got {text!r}")
    if not 1 <= lo <= hi:
        raise SystemExit(f"plan-generate: error: {what} needs 1 <= LOW <= HIGH, got {text!r}")
    return tuple(range(lo, hi + 1))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default="smollm2-ee", help="exported generation model (default smollm2-ee)")
    p.add_argument("--repo", default=None, help="repository `e3 export-generate` wrote (default: "
                                                "artifacts/generation/repo, else model_repository/)")
    p.add_argument("--profile", default=None, help="a profile JSON to use instead of measuring (the format the "
                                                   "profiler caches; see docs/exegpt.md)")
    p.add_argument("--raw-profile", action="store_true", help="use the measured points as they are (default: "
                                                                 "each curve's least-squares line; docs/exegpt.md)")
    p.add_argument("--workers", type=int, default=2, help="identical workers (pinned cores) to schedule over "
                                                          "(default 2; WAA needs 2)")
    p.add_argument("--prompt-tokens", type=int, default=32, help="prompt length in tokens (default 32)")
    p.add_argument("--output-lengths", default="8:64", help="output lengths, uniform over LOW:HIGH or over a "
                   "comma-separated list of tokens (default 8:64), or a JSON file holding a list of observed lengths")
    p.add_argument("--batch-sizes", default="1:32", help="B_E candidates LOW:HIGH (default 1:32)")
    p.add_argument("--decode-iters", default="1:64", help="RRA's N_D candidates LOW:HIGH (default 1:64)")
    p.add_argument("--bounds-ms", default=None, help="comma-separated latency bounds in ms, 'inf' for none "
                                                     "(default: 1.2x, 2x, 4x, 8x the lowest reachable, and inf)")
    p.add_argument("--throughput-tol", type=float, default=0.05, help="B&B's relative throughput tolerance "
                                                                      "(default 0.05, the paper's 5%%)")
    p.add_argument("--latency-tol", type=float, default=0.05, help="B&B's relative latency tolerance (default 0.05)")
    p.add_argument("--json", default=None, help="also write the rows as JSON here")
    p.add_argument("--validate", action="store_true", help="also run RRA with the generation engine in this process "
                   "(one core: workers=1) at a few settings and print predicted against measured (~2 min)")
    p.add_argument("--validate-lengths", default="4,8,12,16", help="output lengths for --validate, as "
                                                                   "--output-lengths (default 4,8,12,16)")
    p.add_argument("--validate-phases", type=int, default=12, help="RRA phases per setting for --validate, the "
                                                                   "first 4 not measured (default 12)")


def _output_lengths(text: str):
    path = Path(text)
    if path.suffix == ".json" or path.exists():
        try:
            return LengthDistribution.from_samples([int(x) for x in json.loads(path.read_text())])
        except (OSError, ValueError, TypeError) as e:
            raise SystemExit(f"plan-generate: error: --output-lengths {text}: {e}")
    if "," in text:
        try:
            lengths = tuple(sorted({int(x) for x in text.split(",")}))
        except ValueError:
            raise SystemExit(f"plan-generate: error: lengths must be integers, got {text!r}")
        if lengths[0] < 1:
            raise SystemExit(f"plan-generate: error: lengths must be >= 1, got {text!r}")
    else:
        lengths = _range(text, "--output-lengths")
    return LengthDistribution(lengths, tuple(1.0 / len(lengths) for _ in lengths))


def _profile(args):
    if args.profile:
        try:
            doc = json.loads(Path(args.profile).read_text())
            return LayerProfile.from_dict(doc.get("profile", doc))
        except (OSError, ValueError) as e:
            raise SystemExit(f"plan-generate: error: --profile {args.profile}: {e}")
    m = args.model.replace("-", "_")
    repos = [Path(args.repo)] if args.repo else [artifacts_dir() / "generation" / "repo", default_repository()]
    repo = next((r for r in repos if (r / f"{m}_generation.json").exists()), repos[0])
    spec_file = repo / f"{m}_generation.json"
    if not spec_file.exists():
        raise SystemExit(f"plan-generate: error: {spec_file} not found; run `e3 export-generate {args.model}` "
                         f"(with --repo {repo}) first, or pass --profile")
    ranges = [tuple(r) for r in json.loads(spec_file.read_text())["ranges"]]
    first, last = ranges[-1]
    if first == 1:
        raise SystemExit(f"plan-generate: error: {args.model} has a single split; the profiler needs a last split "
                         f"that does not hold layer 1")
    onnx = repo / f"{m}_split_{first}-{last}" / "1" / "model.onnx"
    settings = ProfileSettings(prompt_tokens=args.prompt_tokens)
    return cached_profile(onnx, last - first + 1, last,
                          cache=artifacts_dir() / "generation" / "exegpt" / f"{m}_profile.json", settings=settings,
                          final_head=True)


VALIDATE_CONFIGS = ((2, 4), (4, 8), (8, 4), (4, 16), (8, 16))   # (B_E, N_D)


def _validate(args, workload) -> list[dict]:
    if args.validate_phases < 6:
        raise SystemExit("plan-generate: error: --validate-phases must be >= 6 (4 are warm-up)")
    m = args.model.replace("-", "_")
    repos = [Path(args.repo)] if args.repo else [artifacts_dir() / "generation" / "repo", default_repository()]
    repo = next((r for r in repos if (r / f"{m}_generation.json").exists()), None)
    if repo is None:
        raise SystemExit(f"plan-generate: error: --validate needs the exported model; run `e3 export-generate "
                         f"{args.model}` first")
    one = Workload(workload.profile, workload.input_lengths, _output_lengths(args.validate_lengths), workers=1)
    rows = validate_rra(repo, args.model, one, configs=list(VALIDATE_CONFIGS), phases=args.validate_phases)
    print("\nSimulator against measured RRA runs (engine in process, one core; output lengths "
          f"{args.validate_lengths}, p99 {one.output_lengths.quantile(0.99)}):\n")
    print("| B_E | N_D | predicted seq/s | measured seq/s | error | predicted p99-length latency (ms) | "
          "measured (ms) | error | sequences |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    out = []
    for pred, meas in rows:
        e_thr = pred.throughput_seq_s / meas.throughput_seq_s - 1
        e_lat = pred.latency_ms / meas.latency_ms - 1
        print(f"| {pred.config[0]} | {pred.config[1]} | {pred.throughput_seq_s:.2f} | {meas.throughput_seq_s:.2f} | "
              f"{e_thr:+.0%} | {pred.latency_ms:,.0f} | {meas.latency_ms:,.0f} | {e_lat:+.0%} | {meas.sequences} |")
        out.append({"config": list(pred.config), "predicted_seq_s": pred.throughput_seq_s,
                    "measured_seq_s": meas.throughput_seq_s, "predicted_latency_ms": pred.latency_ms,
                    "measured_latency_ms": meas.latency_ms, "sequences": meas.sequences})
    out.append(_against_static(repo, args, one))
    return out


def _against_static(repo: Path, args, one) -> dict:
    """Under one latency bound, RRA's chosen schedule against the best static batch (no admission until the
    batch has finished; it is RRA with N_D = the longest output), both run by the engine."""
    s_max = one.output_lengths.lengths[-1]
    batches = tuple(range(1, 17))
    static_space = rra_space(batches, (s_max,))
    # loose enough that admitting between decode steps can pay: tighter, the best RRA is the static batch itself
    bound = 6.0 * simulate_rra(one, 1, s_max).latency_ms
    chosen = grid_search(one, rra_space(batches, tuple(range(1, s_max + 1))), bound).best
    static = grid_search(one, static_space, bound).best
    if chosen is None or static is None:
        raise SystemExit("plan-generate: error: no schedule meets the validation bound")
    m_chosen, m_static = (measure_rra(repo, args.model, one, batch_size=c.config[0], decode_iters=c.config[1],
                                      phases=args.validate_phases) for c in (chosen, static))
    print(f"\nUnder a bound of {bound:,.0f} ms (6x the static batch of 1's p99-length latency), measured:\n")
    print("| schedule | B_E | N_D | predicted seq/s | measured seq/s | measured p99-length latency (ms) | meets |")
    print("|---|---:|---:|---:|---:|---:|:-:|")
    for name, p, m in (("RRA chosen", chosen, m_chosen), ("static batch", static, m_static)):
        print(f"| {name} | {p.config[0]} | {p.config[1]} | {p.throughput_seq_s:.2f} | {m.throughput_seq_s:.2f} | "
              f"{m.latency_ms:,.0f} | {'yes' if m.latency_ms <= bound else 'NO'} |")
    return {"bound_ms": bound, "chosen": list(chosen.config), "static": list(static.config),
            "chosen_measured_seq_s": m_chosen.throughput_seq_s, "static_measured_seq_s": m_static.throughput_seq_s,
            "chosen_measured_latency_ms": m_chosen.latency_ms, "static_measured_latency_ms": m_static.latency_ms}


def run(args) -> int:
    if args.workers < 1 or args.prompt_tokens < 1:
        raise SystemExit("plan-generate: error: --workers and --prompt-tokens must be >= 1")
    batch_sizes = _range(args.batch_sizes, "--batch-sizes")
    decode_iters = _range(args.decode_iters, "--decode-iters")
    profile = _profile(args)
    workload = Workload(profile if args.raw_profile else profile.fitted(), LengthDistribution.fixed(args.prompt_tokens),
                        _output_lengths(args.output_lengths), workers=args.workers)
    if args.bounds_ms:
        try:
            bounds = tuple(float(b) for b in args.bounds_ms.split(","))
        except ValueError:
            raise SystemExit(f"plan-generate: error: --bounds-ms must be numbers or inf, got {args.bounds_ms!r}")
    else:
        bounds = default_bounds_ms(workload, batch_sizes, decode_iters)
    rows = plan_rows(workload, bounds, batch_sizes, decode_iters=decode_iters, throughput_tol=args.throughput_tol, latency_tol=args.latency_tol)
    p = workload.profile
    print(f"profile ({'as measured' if args.raw_profile else 'least-squares lines'}): {p.num_layers} layers; "
          f"per layer: decode {p.decode_ms[0]:.2f} ms at batch {p.decode_batch[0]:g} .. {p.decode_ms[-1]:.2f} ms "
          f"at {p.decode_batch[-1]:g}; prefill "
          f"{p.prefill_ms[0]:.2f} ms at {p.prefill_tokens[0]:g} tokens .. {p.prefill_ms[-1]:.2f} ms at "
          f"{p.prefill_tokens[-1]:g}")
    out = workload.output_lengths
    print(f"workload: {args.workers} workers, prompts of {args.prompt_tokens} tokens, output mean "
          f"{out.mean():.1f} tokens, p99 {out.quantile(0.99)}; space: B_E {batch_sizes[0]}..{batch_sizes[-1]}, "
          f"N_D {decode_iters[0]}..{decode_iters[-1]}, B_m 1..{max(1, args.workers - 1)}\n")
    print("Branch-and-bound against the exhaustive grid (both schedules; evaluations = points simulated):\n")
    print(format_search_table(rows))
    print("\nSchedule chosen per latency bound (Table 6 analogue; predicted by the simulator):\n")
    print(format_schedule_table(rows))
    validation = []
    if args.validate:
        validation = _validate(args, workload)
    if args.json:
        doc = [{"bound_ms": None if math.isinf(r.bound_ms) else r.bound_ms,
                "bnb": {"evaluations": r.bnb.evaluations, "seconds": r.bnb.seconds,
                        "best": None if r.bnb.best is None else {
                            "schedule": r.bnb.best.schedule, "config": list(r.bnb.best.config),
                            "throughput_seq_s": r.bnb.best.throughput_seq_s,
                            "latency_ms": r.bnb.best.latency_ms}},
                "grid": {"evaluations": r.grid.evaluations, "seconds": r.grid.seconds,
                         "throughput_seq_s": None if r.grid.best is None else r.grid.best.throughput_seq_s},
                "same_optimum": r.same_optimum()} for r in rows]
        Path(args.json).write_text(json.dumps({"profile": p.to_dict(), "rows": doc, "validation": validation},
                                              indent=1))
    return 0 if all(r.same_optimum() for r in rows) else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m e3.generation.exegpt", description=__doc__)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
