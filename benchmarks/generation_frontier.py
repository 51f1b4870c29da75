"""``e3 bench generate --frontier-only`` (and after the tables of ``e3 bench generate``): early-exit generation's
speed/quality frontier (issue 40). Served tokens/s against per-token agreement, decoded agreement and ROUGE-L for
each operating point, on general prompts and review prompts, beside the full model; the plot and the section of
``docs/RESULTS.md``. The speed and quality tables themselves are :mod:`e3.benchmarks.generation`'s."""

from __future__ import annotations

import logging
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from e3.benchmarks.generation import _serve, agreement, per_token_agreement, rouge_l
from e3.benchmarks.report import commit, write_section
from e3.core.files import write_json_atomic
from e3.deploy.server import TritonServer
from e3.generation.client import Generated, generate_stream
from e3.generation.engine import MEASURES
from e3.generation.models import load_generation_model
from e3.generation.policy import MIN_GAIN, Costs, calm_s_per_token, plain_step_s, predict_raw, speedup
from e3.generation.repository import export_generation_repository, model_names, router_names
from e3.generation.training import eval_prompts, general_prompts
from e3.paths import artifacts_dir, project_root

__all__ = ["FrontierSettings", "run_frontier", "predicted_ratio", "format_frontier", "write_frontier_docs",
           "plot_frontier"]

log = logging.getLogger(__name__)

F_BEGIN, F_END = "<!-- generation-frontier:begin -->", "<!-- generation-frontier:end -->"


@dataclass(frozen=True)
class FrontierSettings:
    """``e3 bench generate --frontier-only`` (and after the tables of :func:`run_generate_bench`)."""
    model: str = "smollm2-ee"
    concurrent: int = 8                    # prompts sent at once per run (per prompt set)
    new_tokens: int = 32
    rounds: int = 5                        # interleaved rounds of the plain-call check (full, generate, stream)
    point_rounds: int = 5                  # rounds of the operating points, each right after a full run
    exit_shares: tuple[float, ...] = (0.05, 0.2)   # per measure: the raw tau whose replayed exit share is nearest
    measures: tuple[str, ...] = ("classifier", "saturation", "softmax")
    draft_tokens: int = 4
    max_active: int = 16
    out: Path | None = None
    docs: Path | None = None
    write_docs: bool = True


def _tau_for_share(table: dict, share: float) -> float:
    """The raw tau of a calibration replay table whose total exit share is nearest ``share``."""
    got = [(abs(sum(r) - share), t) for t, r in zip(table["taus"], table["exit_rate"]) if t <= 1.0]
    return min(got)[1]


def _serve_stream(url: str, model: str, prompts, new_tokens, **kw):

    def one(p):
        stream = generate_stream(url, model, p, new_tokens, **kw)
        tokens, exits = [], []
        for t, e in stream:
            tokens += t
            exits += e
        return Generated(tokens, exits, "", parameters=stream.parameters)
    start = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        out = list(pool.map(one, prompts))
    return out, time.perf_counter() - start


def _rate(out, wall: float) -> float:
    return sum(len(o.tokens) for o in out) / wall


def predicted_ratio(costs, lengths: list[int], full_lengths: list[int], exit_share, *, measure: str) -> float:
    """The cost model's tokens/s of a CALM run over the full model's, given each run's tokens per sequence (all
    started together: step t decodes the sequences longer than t, so the batch shrinks as they finish) and the
    exit shares: decode steps only (the prefill is the same call in both)."""
    rates = [*exit_share, max(0.0, 1.0 - sum(exit_share))]

    def steps(lens):
        return [sum(n > t for n in lens) for t in range(1, max(lens, default=1))]
    calm = sum(r * calm_s_per_token(costs, rates, measure=measure, batch=r) for r in steps(lengths))
    plain = sum(plain_step_s(costs, r) for r in steps(full_lengths))
    decoded, full_decoded = sum(steps(lengths)), sum(steps(full_lengths))
    return (decoded / calm) / (full_decoded / plain) if calm and plain and full_decoded else 1.0


def run_frontier(settings: FrontierSettings = FrontierSettings(), echo=print) -> dict:
    """Served tokens/s against per-token agreement, decoded agreement and ROUGE-L for each operating point
    (raw thresholds per measure at the exit shares the calibration's replay gives, served with their exits
    taken, ``on_slower=serve``), on general prompts and review prompts, beside the full model, lossless
    speculation and the default; per exiting point the cost model's prediction (the costs as served, the
    observed exit shares) against the served ratio, and whether the default (``on_slower=fallback``) would take
    it. First, the plain-call check: ``generate()`` and ``generate_stream()`` with no knobs against the full
    model, ``rounds`` interleaved rounds."""
    torch.set_num_threads(1)
    s = settings
    gm = load_generation_model(s.model)
    model, tok = gm.decoder, gm.tokenizer
    exits = list(model.config.exit_layers)
    repo = artifacts_dir() / "generation" / "repo"
    echo(f"exporting {s.model} to {repo} (calibration cached beside the heads) ...")
    spec = export_generation_repository(s.model, repo, max_active=s.max_active)
    if not spec.calibration or not spec.calibration.get("raw"):
        raise ValueError(f"{s.model}'s calibration has no raw-threshold table: re-export it")
    sets = {"general": [tok.encode(p).ids for p in general_prompts(s.concurrent, heldout=True)],
            "review": [tok.encode(p).ids for p in eval_prompts(s.concurrent)]}
    names = router_names(s.model)
    door, stream_door = names["continuous"], names["stream"]
    budget = ("every split and kv-fill model: 1 instance x 1 intra-op thread; one engine thread per router; one "
              f"run at a time; {s.concurrent} prompts x {s.new_tokens} tokens sent at once")
    results: dict = {"settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(s).items()},
                     "budget": budget, "training": gm.training, "plain": {}, "points": []}
    points = [("full", dict(mode="full")), ("default (no knobs)", {}),
              ("speculative, lossless (policy)", dict(mode="speculative", draft_tokens=s.draft_tokens))]
    for m in s.measures:
        taus = sorted({_tau_for_share(spec.calibration["raw"][m], share) for share in s.exit_shares})
        points += [(f"{m} tau={t:.4g}", dict(mode="calm", tau=t, measure=m, on_slower="serve")) for t in taus]
    log_file = artifacts_dir() / "logs" / "bench-generate-frontier.log"
    served = [n for n in model_names(s.model, spec) if "_kv_split" in n or "_kvfill_" in n] + [door, stream_door]
    with TritonServer.on_free_ports(repo, served, log_file=log_file, exit_timeout_s=5) as server:
        url = server.http_url
        _serve(url, door, sets["review"][:2], 4, mode="full")   # warm-up
        echo(f"plain calls ({budget}; {s.rounds} interleaved rounds)")
        # each plain call right after the full model through the same router (streamed: the streaming one)
        runs: dict[str, list] = {"full": [], "generate()": [], "full, streamed": [], "generate_stream()": []}
        for rnd in range(s.rounds):
            for name in runs:
                if "stream" in name:
                    out, wall = _serve_stream(server.grpc_url, stream_door, sets["general"], s.new_tokens,
                                              **(dict(mode="full") if name.startswith("full") else {}))
                else:
                    out, wall = _serve(url, door, sets["general"], s.new_tokens,
                                       **(dict(mode="full") if name == "full" else {}))
                runs[name].append((out, wall))
            echo(f"  round {rnd + 1}: " + ", ".join(f"{n} {_rate(*runs[n][-1]):.1f} tok/s" for n in runs))
        full_general = [o.tokens for o in runs["full"][0][0]]
        for name, base in (("generate()", "full"), ("generate_stream()", "full, streamed")):
            ratios = [_rate(*o) / _rate(*f) for o, f in zip(runs[name], runs[base])]
            out = runs[name][0][0]
            results["plain"][name] = {
                "against": f"{base} (mode=full through the same router)",
                "vs_unstreamed_full": statistics.median(_rate(*o) / _rate(*f)
                                                        for o, f in zip(runs[name], runs["full"])),
                "ratios": ratios, "median": statistics.median(ratios),
                "modes": sorted({o.parameters.get("e3_mode", "?") for o in out}),
                "reason": out[0].parameters.get("e3_reason", ""),
                "identical_to_full": sum(o.tokens == f for o, f in zip(out, full_general))}
            echo(f"  {name}: median x{statistics.median(ratios):.3f} full (rounds {', '.join(f'{r:.2f}' for r in ratios)}), "
                 f"served as {results['plain'][name]['modes']}")
        for set_name, prompts in sets.items():
            echo(f"operating points on {set_name} prompts ({s.point_rounds} rounds, each point right after a "
                 "full run)")
            measured: dict[str, list] = {n: [] for n, _ in points}
            for rnd in range(s.point_rounds):
                for n, kw in points[1:]:   # the machine is shared: each point against the full run just before
                    c0 = server.cpu_s()
                    before = _serve(url, door, prompts, s.new_tokens, mode="full")
                    c1 = server.cpu_s()
                    out, wall = _serve(url, door, prompts, s.new_tokens, **kw)
                    c2 = server.cpu_s()
                    # tokens per server CPU-second, over the full run's: the ratio with the machine's noise removed
                    cpu_ratio = (sum(len(o.tokens) for o in out) / max(1e-9, c2 - c1)) / (
                        sum(len(o.tokens) for o in before[0]) / max(1e-9, c1 - c0))
                    measured["full"].append((*before, 1.0, 1.0, before[0]))
                    measured[n].append((out, wall, _rate(out, wall) / _rate(*before), cpu_ratio, before[0]))
                echo(f"  round {rnd + 1}: " + ", ".join(f"{n} x{measured[n][-1][2]:.2f} (cpu x{measured[n][-1][3]:.2f})"
                                                        for n, _ in points[1:]))
            reference = [o.tokens for o in measured["full"][0][0]]
            for n, kw in points:
                rows = measured[n]
                out = rows[0][0]
                # the table the router decided with at the end of the last round (the most calls timed)
                costs = next((Costs.from_dict(o.costs) for o in rows[-1][0] if o.costs), None)
                decoded = [e for o in out for e in o.exit_layers[1:]]
                shares = [decoded.count(e) / max(1, len(decoded)) for e in exits]
                row = {"set": set_name, "point": n, **kw,
                       "tokens_per_s": statistics.median(_rate(o, w) for o, w, *_ in rows),
                       "x_full": statistics.median(r[2] for r in rows), "x_full_rounds": [r[2] for r in rows],
                       "x_full_cpu": statistics.median(r[3] for r in rows),
                       "per_token_agreement": statistics.mean(per_token_agreement(model, p, o.tokens)
                                                              for p, o in zip(prompts, out)),
                       "decoded_agreement": statistics.mean(agreement(o.tokens, r) for o, r in zip(out, reference)),
                       "rouge_l": statistics.mean(rouge_l(o.tokens, r) for o, r in zip(out, reference)),
                       "exit_share": shares, "modes": sorted({o.parameters.get("e3_mode", "?") for o in out})}
                if kw.get("measure") in MEASURES and costs is not None and any(shares):
                    row["predicted_x_full"] = statistics.median(
                        predicted_ratio(costs, [len(o.tokens) for o in o_], [len(o.tokens) for o in f_],
                                        shares, measure=kw["measure"])
                        for o_, _, _, _, f_ in rows)
                    row["predicted_x_full_constant_batch"] = speedup(costs, shares, measure=kw["measure"],
                                                                     batch=s.concurrent)
                    row["served_costs"] = costs.to_dict()
                    pred = predict_raw(spec.calibration, costs, measure=kw["measure"], tau=kw["tau"], batch=s.concurrent)
                    row["default_takes_it"] = bool(pred and pred["speedup"] >= MIN_GAIN)
                results["points"].append(row)
                echo(f"  {n:34s} {row['tokens_per_s']:6.1f} tok/s x{row['x_full']:.2f} (cpu x{row['x_full_cpu']:.2f})"
                     + (f" (predicted x{row['predicted_x_full']:.2f}, default: "
                        f"{'exits' if row['default_takes_it'] else 'fallback'})" if "predicted_x_full" in row else "")
                     + f"  per-token {row['per_token_agreement']:.3f}  decoded {row['decoded_agreement']:.3f}  "
                       f"ROUGE-L {row['rouge_l']:.3f}  exits {', '.join(f'{x:.2f}' for x in shares)}")
    out_path = write_json_atomic(s.out or artifacts_dir() / "results" / "generation_frontier.json", results, sort_keys=False)
    echo(f"wrote {out_path}")
    if s.write_docs:
        echo(f"updated {' and '.join(str(p) for p in write_frontier_docs(results, s.docs))}")
    return results


def write_frontier_docs(results: dict, docs: Path | None = None) -> tuple[Path, Path]:
    """The frontier's plot (docs/figures/generation_frontier.png) and its section of ``docs`` (default
    docs/RESULTS.md), from a result (also a saved one: artifacts/results/generation_frontier.json)."""
    figure = project_root() / "docs" / "figures" / "generation_frontier.png"
    plot_frontier(results, figure)
    docs = docs or project_root() / "docs" / "RESULTS.md"
    write_section(docs, F_BEGIN, F_END, section="## Early-exit generation: the speed/quality frontier (issue 40)"
                  f"\n\n{format_frontier(results)}")
    return docs, figure


def plot_frontier(results: dict, path: Path) -> None:
    """Served x full against the three quality measures, one panel each, general and review prompts."""
    # deferred: matplotlib loads only when a figure is drawn, its Agg backend chosen before pyplot
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt   # after the backend is chosen
    fig, axes = plt.subplots(1, 3, figsize=(13, 4), sharey=True)
    for ax, (key, label) in zip(axes, [("per_token_agreement", "per-token agreement (same prefix)"),
                                       ("decoded_agreement", "decoded agreement (same positions)"),
                                       ("rouge_l", "ROUGE-L vs full")]):
        for set_name, marker in (("general", "o"), ("review", "s")):
            rows = [r for r in results["points"] if r["set"] == set_name]
            ax.scatter([r[key] for r in rows], [r["x_full"] for r in rows], marker=marker, label=f"{set_name} prompts")
            for r in rows:
                ax.annotate(r["point"].split(",")[0].replace("speculative", "spec."), (r[key], r["x_full"]),
                            fontsize=6, xytext=(3, 2), textcoords="offset points")
        ax.axhline(0.95, color="grey", lw=0.6, ls="--")
        ax.set_xlabel(label)
    axes[0].set_ylabel("served tokens/s, x full model")
    axes[0].legend(fontsize=7)
    fig.suptitle("Early-exit generation, SmolLM2 served on Triton: speed against quality per operating point")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def format_frontier(results: dict) -> str:
    """The frontier's Markdown: the plain-call check, the heads on general text, the operating points."""
    s = results["settings"]
    lines = [f"`e3 bench generate --frontier-only` ({s['model']}, commit {commit()}, {time.strftime('%Y-%m-%d')}). "
             f"Budget: {results['budget']}. x full: each run's tokens/s over that of the full model's run just "
             "before it, median over rounds (the machine is shared: absolute rates drift several-fold).", "",
             "Plain SDK calls (no knobs: the server's default), general prompts:", "",
             "| call | against | x full (median) | rounds | x the unstreamed full | served as | identical to full |",
             "|---|---|---:|---|---:|---|---:|"]
    for name, r in results["plain"].items():
        lines.append(f"| `{name}` | {r.get('against', 'full')} | {r['median']:.3f} "
                     f"| {', '.join(f'{x:.2f}' for x in r['ratios'])} | {r.get('vs_unstreamed_full', r['median']):.3f} "
                     f"| {', '.join(r['modes'])} | {r['identical_to_full']}/{s['concurrent']} |")
    reason = next((r["reason"] for r in results["plain"].values() if r["reason"]), "")
    if reason:
        lines += ["", f"The default's reason, as the server gives it: \"{reason}\"."]
    tr = results.get("training") or {}
    if tr.get("exits"):
        lines += ["", "Exit heads, top-1 agreement with the full model over the whole vocabulary: held-out review "
                  f"text ({tr['heldout_positions']} positions) and the full model's own answers to general prompts "
                  f"on held-out topics ({tr.get('general_positions', 0)} positions; never trained on), trained and "
                  "untrained (logit lens):", "",
                  "| exit after layer | review, trained | review, untrained | general, trained | general, untrained |",
                  "|---:|---:|---:|---:|---:|"]
        for e, r in tr["exits"].items():
            g, gu = r.get("general_top1"), r.get("general_top1_untrained")
            lines.append(f"| {e} | {r['top1_agreement_full_vocab']:.3f} | {r['top1_agreement_full_vocab_untrained']:.3f} "
                         f"| {'-' if g is None else f'{g:.3f}'} | {'-' if gu is None else f'{gu:.3f}'} |")
    lines += ["", "Operating points (raw thresholds served with their exits taken, `on_slower=serve`; predicted: the "
              "cost model with the costs as served and the exit shares observed; default: what a request with "
              "`on_slower` left out gets at this batch, exits or the fallback):", "",
              "![frontier](figures/generation_frontier.png)", "",
              "| prompts | point | tokens/s | x full | rounds | x full by server CPU | predicted x full | default "
              "| per-token agreement | decoded agreement | ROUGE-L | exit share (per exit) |",
              "|---|---|---:|---:|---|---:|---:|---|---:|---:|---:|---|"]
    for r in results["points"]:
        pred = f"{r['predicted_x_full']:.2f}" if "predicted_x_full" in r else "-"
        default = ("exits" if r.get("default_takes_it") else "fallback (plain)") if "default_takes_it" in r else \
            ", ".join(r["modes"])
        rounds = "reference" if r["point"] == "full" else ", ".join(f"{x:.2f}" for x in r["x_full_rounds"])
        lines.append(f"| {r['set']} | {r['point']} | {r['tokens_per_s']:.1f} | {r['x_full']:.2f} "
                     f"| {rounds} | {r.get('x_full_cpu', float('nan')):.2f} "
                     f"| {pred} | {default} "
                     f"| {r['per_token_agreement']:.3f} | {r['decoded_agreement']:.3f} | {r['rouge_l']:.3f} "
                     f"| {', '.join(f'{x:.2f}' for x in r['exit_share'])} |")
    lines += ["", *_frontier_reading(results)]
    return "\n".join(lines)


def _frontier_reading(results: dict) -> list[str]:
    """What the frontier's numbers say: the cost model's error per exiting point, the served modes that fall
    below 0.95x and whether the default takes them, the best point at per-token agreement >= 0.9."""
    out = []
    exiting = [r for r in results["points"] if "predicted_x_full" in r]
    for key, what in (("x_full", "served tokens/s"), ("x_full_cpu", "served tokens per server CPU-second")):
        if not exiting or key not in exiting[0]:
            continue
        errs = [r["predicted_x_full"] / r[key] - 1 for r in exiting]
        worst = max(exiting, key=lambda r: abs(r["predicted_x_full"] / r[key] - 1))
        out.append(f"- Cost model against {what}, {len(exiting)} exiting points: predicted/served - 1 from "
                   f"{min(errs):+.1%} to {max(errs):+.1%} (worst: {worst['set']}, {worst['point']}, predicted "
                   f"{worst['predicted_x_full']:.2f}x, served {worst[key]:.2f}x); "
                   f"{sum(abs(e) <= 0.10 for e in errs)}/{len(errs)} within 10%.")
    if exiting:
        slow = [r for r in exiting if r["x_full"] < 0.95]
        out.append(f"- Served below 0.95x with exits taken: {len(slow)} of {len(exiting)}; of those the default "
                   f"(fallback on) takes {sum(r['default_takes_it'] for r in slow)} and decodes the rest plainly.")
    for set_name in ("general", "review"):
        good = [r for r in exiting if r["set"] == set_name and r["per_token_agreement"] >= 0.9]
        if good:
            b = max(good, key=lambda r: r["x_full"])
            out.append(f"- Best exiting point at per-token agreement >= 0.9 on {set_name} prompts: {b['point']}, "
                       f"{b['x_full']:.2f}x full served ({b.get('x_full_cpu', float('nan')):.2f}x by server CPU), "
                       f"per-token {b['per_token_agreement']:.3f}, decoded {b['decoded_agreement']:.3f}, ROUGE-L "
                       f"{b['rouge_l']:.3f}, {sum(b['exit_share']):.1%} of tokens leaving.")
    costs = next((r["served_costs"] for r in reversed(exiting) if r.get("served_costs")), None)
    if costs:   # why the aim of 1.1x is out of reach here, from the table the router decided with
        sv, B = costs["served"], results["settings"]["concurrent"]
        at = lambda k, rows: 1e3 * (sv[k][0] + sv[k][1] * rows) if k in sv else float("nan")   # ms
        out.append("- Why no exit pays here, the costs as served (the router's table at the end): a split call "
                   f"{1e3 * sv.get('split1', [0, 0])[0]:.1f} ms + {1e3 * sv.get('split1', [0, 0])[1]:.2f} ms per row "
                   f"(the saving per leaving row and skipped split); reading the head adds "
                   f"{at('split0+head', B) - at('split0', B):.1f} ms to a call of {B} rows (softmax: at every ramp, "
                   f"every step); a kv-fill call of one row after layer 10 / 20 costs {at('fill0', 1):.1f} / "
                   f"{at('fill1', 1):.1f} ms without the head, {at('fill0+head', 1):.1f} / {at('fill1+head', 1):.1f} "
                   "ms with it (cheap measures), once per step with any row leaving there. At the few percent of "
                   f"tokens that may leave at per-token agreement >= 0.9, {B} rows save less per step than the calls "
                   "cost.")
    return out
