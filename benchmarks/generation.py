"""``e3 bench generate``: early-exit generation's speed and quality, side by side on one server.

**Speed** (one embedded tritonserver; every system through the same split models: one instance each, one
intra-op thread, one engine thread per router, so every system has the same cores): all prompts sent at once,
tokens/s over the run, the server's TTFT and TPOT medians. Systems: the full model decoded plainly
(continuous batching), CALM at ``--min-agreement`` 0.9 and 0.95 (measure and per-exit thresholds from the
calibration recorded in the router; survivors re-batched between splits), and lossless self-speculative
decoding (draft depth and length chosen per step by the never-slower policy). The systems run in
``rounds`` interleaved rounds because the machine is shared (its load changes several-fold within a minute):
in each round every system runs right after a run of the full model, and its ratio is to **that** run; each
row reports its median rate and the median of its ratios. With ``extra_systems``, also E3 with the KV cache passed as tensors and naive early
exit (one sequence at a time) and the full model one at a time.

**Quality** (in process, the same ONNX splits driven by the same engine, so the tokens are the served
ones): per system agreement with the full model's greedy tokens (share of positions holding the full
model's token), perplexity of the generated tokens under the full model (teacher-forced, PyTorch), where
tokens left, and what each decision cost: engine time deciding, rows whose head was read to decide (softmax
measure) or only because they left (cheap measures). Raw softmax thresholds (``taus``) are listed beside the
calibrated targets. **Lossless check**: speculative decoding with drafting forced (no policy) against the
full model on ``lossless_prompts`` held-out prompts, token for token, with the acceptance rate.

Prompts: :func:`e3.generation.training.eval_prompts` (test-split snippets 0..), never used for training
(train split) nor for calibration (test-split snippets 300..).

Results: ``artifacts/results/generation.json`` and a section of ``docs/RESULTS.md``.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from e3.benchmarks.report import commit, write_section
from e3.core.files import write_json_atomic
from e3.deploy.server import TritonServer
from e3.generation.client import generate
from e3.generation.decoder import attention_mask
from e3.generation.engine import GenerationEngine, GenRequest, OrtRunner
from e3.generation.models import load_generation_model
from e3.generation.policy import resolve_target
from e3.generation.reference import generate_early_exit, generate_full
from e3.paths import artifacts_dir, project_root

__all__ = ["GenerateBenchSettings", "run_generate_bench", "agreement", "format_tables", "write_results_section",
           "engine_tokens", "per_token_agreement", "rouge_l"]

log = logging.getLogger(__name__)
BEGIN, END = "<!-- generation-bench:begin -->", "<!-- generation-bench:end -->"


@dataclass(frozen=True)
class GenerateBenchSettings:
    model: str = "smollm2-ee"
    prompts: int = 16                      # held-out prompts (Rotten Tomatoes test snippets)
    new_tokens: int = 32
    targets: tuple[float, ...] = (0.9, 0.95)            # min_agreement of the speed table's CALM systems
    quality_targets: tuple[float, ...] = (0.8, 0.9, 0.95, 0.99)
    taus: tuple[float, ...] = (0.5, 0.9)   # raw softmax thresholds in the quality table, for comparison
    draft_tokens: int = 4                  # most tokens a speculative round drafts
    lossless_prompts: int = 50             # held-out prompts of the lossless check
    rounds: int = 3                        # interleaved rounds of the speed table (odd: a true median)
    extra_systems: bool = False            # also KV as tensors, naive early exit, full one at a time
    max_active: int = 16
    out: Path | None = None
    docs: Path | None = None               # RESULTS.md to update (default docs/RESULTS.md); skipped with --no-docs
    write_docs: bool = True


def agreement(tokens: list[int], full: list[int]) -> float:
    """Share of the full model's positions where ``tokens`` holds the same token (positions past the shorter
    sequence count as disagreements)."""
    if not full:
        return 1.0
    return sum(a == b for a, b in zip(tokens, full)) / len(full)


def _perplexity(model, prompts: list[list[int]], outputs: list[list[int]]) -> float:
    """exp(mean NLL) of all generated tokens, pooled over sequences, under the full model (teacher-forced)."""
    nll = [n for p, t in zip(prompts, outputs) for n in _nll(model, p, t)]
    return math.exp(statistics.mean(nll)) if nll else float("nan")


@torch.no_grad()
def _full_logits(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The full model's logits [len(tokens), V] at the positions that chose ``tokens`` after ``prompt``
    (teacher-forced on them: each position sees the generated prefix)."""
    ids = torch.tensor([prompt + tokens])
    n = ids.shape[1]
    c = model.config
    h = model.embed(ids)
    cos, sin = model.rope(torch.arange(n)[None])
    mask = attention_mask(torch.ones(1, n, dtype=torch.bool), n)
    empty = torch.zeros(1, c.num_kv_heads, 0, c.head_dim)
    for layer in range(1, c.num_layers + 1):
        h, _, _ = model.layer_forward(layer, h, cos, sin, empty, empty, mask)
    return model.head_logits(h[0, len(prompt) - 1:n - 1], c.num_layers)


def _nll(model, prompt: list[int], tokens: list[int]) -> list[float]:
    """Per-token NLL (nats) of ``tokens`` after ``prompt`` under the full model (teacher-forced)."""
    logp = torch.log_softmax(_full_logits(model, prompt, tokens), -1)
    return (-logp.gather(1, torch.tensor(tokens)[:, None])[:, 0]).tolist()


def per_token_agreement(model, prompt: list[int], tokens: list[int]) -> float:
    """Share of ``tokens`` that are the full model's greedy choice **given the same prefix** (the generated
    one): the quality of each decision, whatever happened before it."""
    if not tokens:
        return 1.0
    return float((_full_logits(model, prompt, tokens).argmax(-1) == torch.tensor(tokens)).float().mean())


def rouge_l(tokens: list[int], reference: list[int]) -> float:
    """ROUGE-L F1 over token ids: the longest common subsequence against the reference's and the output's
    lengths."""
    if not tokens or not reference:
        return float(tokens == reference)
    prev = [0] * (len(reference) + 1)
    for a in tokens:
        cur = [0]
        for j, b in enumerate(reference):
            cur.append(prev[j] + 1 if a == b else max(prev[j + 1], cur[j]))
        prev = cur
    lcs = prev[-1]
    if not lcs:
        return 0.0
    p, r = lcs / len(tokens), lcs / len(reference)
    return 2 * p * r / (p + r)


def layer_costs(config) -> tuple[float, float]:
    """(head, kv fill of one layer) in layer-equivalents: multiply-adds over those of one decoder layer."""
    c = config
    layer = 2 * c.hidden_size * c.num_heads * c.head_dim + 2 * c.hidden_size * c.num_kv_heads * c.head_dim \
        + 3 * c.hidden_size * c.intermediate_size
    return c.vocab_size * c.hidden_size / layer, 2 * c.hidden_size * c.num_kv_heads * c.head_dim / layer


def engine_tokens(spec, files, prompts, *, new_tokens, mode, tau, draft_tokens=4, runner=None, **request):
    """Decode ``prompts`` with the engine in this process (``request``: further GenRequest fields, e.g.
    ``min_agreement``); (finished per prompt, stats: wall, tokens/s, KV gather, call and decision time, head
    rows, drafted/accepted)."""
    engine = GenerationEngine(spec, runner or OrtRunner(files))
    for i, p in enumerate(prompts):
        engine.submit(GenRequest(i, p, new_tokens, mode=mode, tau=tau, draft_tokens=draft_tokens, **request))
    done = {}
    start = time.perf_counter()
    while not engine.idle:
        done.update({f.request_id: f for f in engine.step()})
    wall = time.perf_counter() - start
    stats = {"wall_s": wall, "kv_gather_s": engine.kv_gather_s, "call_s": engine.call_s,
             "tokens_per_s": sum(len(f.tokens) for f in done.values()) / wall, "decide_s": engine.decide_s,
             "ramp_head_rows": engine.ramp_head_rows, "exit_head_rows": engine.exit_head_rows,
             "drafted": engine.drafted, "accepted": engine.accepted,
             "fallback_steps": engine.policy.fallbacks if engine.policy else 0,
             "rounds": engine.policy.rounds if engine.policy else None}
    return [done[i] for i in range(len(prompts))], stats


def _serve(url: str, model: str, prompts, new_tokens, **kw):
    start = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        out = list(pool.map(lambda p: generate(url, model, p, max_new_tokens=new_tokens, **kw), prompts))
    return out, time.perf_counter() - start


def run_generate_bench(settings: GenerateBenchSettings = GenerateBenchSettings(), echo=print) -> dict:
    """Run the tables; returns the results (also written to JSON and, unless disabled, docs/RESULTS.md)."""
    # deferred: benchmarks/generation_gpu.py imports this module on a bare GPU host (torch and numpy), where
    # these two rooms (tqdm) may not import
    from e3.generation.repository import export_generation_repository, model_names, onnx_files, router_names
    from e3.generation.training import eval_prompts
    torch.set_num_threads(1)
    s = settings
    gm = load_generation_model(s.model)
    model, tok = gm.decoder, gm.tokenizer
    L, exits = model.config.num_layers, model.config.exit_layers
    repo = artifacts_dir() / "generation" / "repo"
    echo(f"exporting {s.model} to {repo} (calibration cached beside the heads) ...")
    spec = export_generation_repository(s.model, repo, max_active=s.max_active)
    if not spec.calibration:
        raise ValueError(f"{s.model} has no calibration (it needs a tokenizer and held-out prompts)")
    files = onnx_files(repo, spec)
    prompts = [tok.encode(p).ids for p in eval_prompts(max(s.prompts, s.lossless_prompts))]
    lossless_prompts, prompts = prompts[:s.lossless_prompts], prompts[:s.prompts]
    head_eq = layer_costs(model.config)[0]
    costs = spec.costs
    results: dict = {"settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(s).items()},
                     "training": gm.training, "calibration": spec.calibration, "costs": costs,
                     "quality": [], "speed": [], "head_layer_equivalents": head_eq, "num_layers": L}
    _echo_training(gm.training, echo)

    echo(f"quality: {len(prompts)} held-out prompts x {s.new_tokens} tokens, in-process engine over the served splits")
    full, stats = engine_tokens(spec, files, prompts, new_tokens=s.new_tokens, mode="full", tau=2.0)
    full_tokens = [f.tokens for f in full]
    runs = [("full", None, dict(mode="full", tau=2.0))]
    runs += [(f"CALM min-agreement {t}", t, dict(mode="calm", tau=2.0, min_agreement=t)) for t in s.quality_targets]
    runs += [(f"CALM softmax tau={t}", None, dict(mode="calm", tau=t, on_slower="serve")) for t in s.taus]
    runs += [("speculative (policy)", None, dict(mode="speculative", tau=2.0, draft_tokens=s.draft_tokens))]
    for name, target, kw in runs:
        got, st = (full, stats) if name == "full" else engine_tokens(spec, files, prompts, new_tokens=s.new_tokens, **kw)
        exits_at = [e for f in got for e in f.exit_layers[1:]]
        entry = _target_entry(spec.calibration, target)
        row = {"system": name, "min_agreement": target,
               "measure": entry["measure"] if entry and not entry["fallback"] else
               ("none (fallback: plain)" if entry else ("softmax" if kw.get("tau", 2) <= 1 else "-")),
               "thresholds": entry["thresholds"] if entry else None,
               "agreement": statistics.mean(agreement(f.tokens, t) for f, t in zip(got, full_tokens)),
               "perplexity": _perplexity(model, prompts, [f.tokens for f in got]),
               "exit_share": {str(e): exits_at.count(e) / max(1, len(exits_at)) for e in [*exits, L]},
               "tokens": len(exits_at) + len(got), "in_process": st}
        results["quality"].append(row)
        echo(f"  {name:28s} agreement {row['agreement']:.3f}  ppl {row['perplexity']:.2f}  measure {row['measure']}  "
             f"exits {_share(row['exit_share'])}  {st['tokens_per_s']:.1f} tok/s in-process  "
             f"decide {1e6 * st['decide_s'] / max(1, len(exits_at)):.0f} us/token  head rows: "
             f"to decide {st['ramp_head_rows']}, on exit {st['exit_head_rows']}")

    echo(f"lossless check: speculative decoding, drafting forced (no policy), {len(lossless_prompts)} held-out "
         f"prompts x {s.new_tokens} tokens")
    forced = replace(spec, costs=None)
    ref, _ = engine_tokens(spec, files, lossless_prompts, new_tokens=s.new_tokens, mode="full", tau=2.0)
    for depth_name, depth_spec in [(f"from layer {exits[0]}, {s.draft_tokens} tokens a round", forced)]:
        got, st = engine_tokens(depth_spec, files, lossless_prompts, new_tokens=s.new_tokens, mode="speculative",
                                tau=2.0, draft_tokens=s.draft_tokens)
        same = sum(g.tokens == r.tokens for g, r in zip(got, ref))
        results.setdefault("lossless", []).append({"draft": depth_name, "identical": same, "prompts": len(ref),
                                                   "acceptance": st["accepted"] / max(1, st["drafted"]),
                                                   "drafted": st["drafted"], "tokens_per_s": st["tokens_per_s"]})
        echo(f"  draft {depth_name}: {same}/{len(ref)} identical to the full model; acceptance "
             f"{st['accepted']}/{st['drafted']} = {st['accepted'] / max(1, st['drafted']):.3f}")

    results["kv_fill"] = kv_fill_rows(model, prompts[:8], spec.calibration, new_tokens=s.new_tokens,
                                      eos_id=gm.eos_id, echo=echo)

    names = router_names(s.model)
    systems = [("full", names["continuous"], dict(mode="full"))]
    systems += [(f"CALM min-agreement {t}", names["continuous"], dict(mode="calm", min_agreement=t)) for t in s.targets]
    systems += [("speculative, lossless (policy)", names["continuous"], dict(mode="speculative",
                                                                           draft_tokens=s.draft_tokens))]
    if s.extra_systems:
        t = s.targets[0]
        systems += [(f"CALM min-agreement {t}, KV passed as tensors", names["tensors"], dict(mode="calm", min_agreement=t)),
                    (f"naive CALM min-agreement {t}, one at a time", names["naive"], dict(mode="calm", min_agreement=t)),
                    ("full, one at a time", names["naive"], dict(mode="full"))]
    budget = ("every split and kv-fill model: 1 instance x 1 intra-op thread; one engine thread per router; one "
              "system at a time")
    echo(f"speed on one tritonserver ({budget}); {len(prompts)} prompts sent at once, {s.rounds} interleaved rounds")
    measured: dict[str, list] = {name: [] for name, _, _ in systems}
    paired: dict[str, list] = {name: [] for name, _, _ in systems}   # the full model's run before each
    with TritonServer.on_free_ports(repo, model_names(s.model, spec), log_file=artifacts_dir() / "logs" / "bench-generate.log",
                                    exit_timeout_s=5) as server:
        for name, router, kw in systems:
            _serve(server.http_url, router, prompts[:2], 4, **kw)   # warm-up
        for rnd in range(s.rounds):             # each system right after a run of the full model: a pair
            for pair in systems[1:]:
                for name, router, kw in (systems[0], pair):
                    out, wall = _serve(server.http_url, router, prompts, s.new_tokens, **kw)
                    measured[name].append((out, wall))
                    echo(f"  round {rnd + 1} {name:40s} {sum(len(o.tokens) for o in out) / wall:7.1f} tok/s")
                paired[pair[0]].append(measured["full"][-1])
    for name, router, kw in systems:
        rates = [sum(len(o.tokens) for o in out) / wall for out, wall in measured[name]]
        ratios = ([1.0] * len(rates) if name == "full" else
                  [r / (sum(len(o.tokens) for o in f) / w) for r, (f, w) in zip(rates, paired[name])])
        order = sorted(range(len(rates)), key=rates.__getitem__)
        out, wall = measured[name][order[len(order) // 2]]           # the median round's outputs
        tpot = [(o.total_ms - o.ttft_ms) / (len(o.tokens) - 1) for o in out if len(o.tokens) > 1]
        target = kw.get("min_agreement")
        entry = _target_entry(spec.calibration, target)
        row = {"system": name, "router": router, **kw, "tokens": sum(len(o.tokens) for o in out),
               "tokens_per_s": statistics.median(rates), "tokens_per_s_rounds": rates,
               "speedup_vs_full": statistics.median(ratios), "speedup_rounds": ratios,
               "ttft_ms_p50": statistics.median(o.ttft_ms for o in out),
               "tpot_ms_p50": statistics.median(tpot) if tpot else float("nan"),
               "agreement": statistics.mean(agreement(o.tokens, t) for o, t in zip(out, full_tokens)),
               "perplexity": _perplexity(model, prompts, [o.tokens for o in out]),
               "measure": (entry["measure"] if not entry["fallback"] else "none (fallback: plain)") if entry
               else ("draft policy" if kw["mode"] == "speculative" else "-"),
               "exited": sum(e < L for o in out for e in o.exit_layers), "budget": budget}
        results["speed"].append(row)
        echo(f"  {name:40s} {row['tokens_per_s']:7.1f} tok/s  x{row['speedup_vs_full']:.2f} full  TTFT "
             f"{row['ttft_ms_p50']:8.1f} ms  TPOT {row['tpot_ms_p50']:6.1f} ms  agreement {row['agreement']:.3f}  "
             f"ppl {row['perplexity']:.2f}  measure {row['measure']}")
    out_path = write_json_atomic(s.out or artifacts_dir() / "results" / "generation.json", results, sort_keys=False)
    echo(f"wrote {out_path}")
    if s.write_docs:
        docs = s.docs or project_root() / "docs" / "RESULTS.md"
        write_results_section(docs, results)
        echo(f"updated {docs}")
    return results


def kv_fill_rows(model, prompts: list[list[int]], calibration: dict, *, new_tokens: int, eos_id, echo=print) -> list:
    """The KV of skipped layers, copied (served) or recomputed (PyTorch reference), at the lowest target's
    replayed thresholds (the choice with the most exits): agreement with the full model and tokens that left."""
    t = min(calibration["targets"], key=lambda t: t["min_agreement"])
    r = t.get("replayed", t)
    exits = model.config.exit_layers
    if all(x > 1.0 for x in r["thresholds"]):
        return []
    thresholds = dict(zip(exits, r["thresholds"]))
    full = [generate_full(model, p, new_tokens, eos_id=eos_id).tokens for p in prompts]
    rows = []
    for fill in ("copy", "recompute"):
        start = time.perf_counter()
        outs = [generate_early_exit(model, p, new_tokens, tau=2.0, eos_id=eos_id, kv_fill=fill, measure=r["measure"],
                                    thresholds=thresholds) for p in prompts]
        rows.append({"kv_fill": fill, "measure": r["measure"], "thresholds": r["thresholds"], "prompts": len(prompts),
                     "agreement": statistics.mean(agreement(o.tokens, f) for o, f in zip(outs, full)),
                     "exited": sum(e < model.config.num_layers for o in outs for e in o.exit_layers),
                     "tokens": sum(len(o.tokens) for o in outs), "wall_s": time.perf_counter() - start})
        echo(f"  kv fill {fill:9s} ({r['measure']} at {r['thresholds']}): agreement {rows[-1]['agreement']:.3f}, "
             f"{rows[-1]['exited']}/{rows[-1]['tokens']} tokens left")
    return rows


def _target_entry(calibration: dict | None, target: float | None) -> dict | None:
    if target is None or not calibration:
        return None
    measure, thresholds = resolve_target(calibration, target)
    return next(t for t in calibration["targets"] if t["thresholds"] == thresholds and t["measure"] == measure
                and t["min_agreement"] >= target - 1e-9)


def _share(share: dict) -> str:
    return ", ".join(f"{k}: {v:.2f}" for k, v in share.items())


def _echo_training(training: dict | None, echo) -> None:
    if not training or "exits" not in training:
        return
    echo(f"exit heads ({training.get('counted', '')}; {training.get('heldout_positions')} held-out positions):")
    for e, r in training["exits"].items():
        echo(f"  after layer {e}: trained {r['top1_agreement_full_vocab']:.3f}, untrained "
             f"{r['top1_agreement_full_vocab_untrained']:.3f}, classifier AUC {r['classifier_auc']:.3f}")


def format_tables(results: dict) -> str:
    """The Markdown tables of a result (heads, speed, quality, lossless check, costs)."""
    s = results["settings"]
    tr, cal, costs = results.get("training") or {}, results["calibration"], results["costs"]
    lines = [f"`e3 bench generate` ({s['model']}, {s['prompts']} held-out prompts x {s['new_tokens']} new tokens, "
             f"commit {commit()}, {time.strftime('%Y-%m-%d')}). Budget: {results['speed'][0]['budget']}; "
             f"{s['rounds']} rounds, in each every system right after a run of the full model; tokens/s the median "
             "run, x full the median of the ratios to the run just before.", "",
             "| system | confidence measure | tokens/s | x full | TTFT p50 ms | TPOT p50 ms | agreement | perplexity "
             "| tokens exited |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results["speed"]:
        lines.append(f"| {r['system']} | {r['measure']} | {r['tokens_per_s']:.1f} | {r['speedup_vs_full']:.2f} "
                     f"| {r['ttft_ms_p50']:.0f} | {r['tpot_ms_p50']:.1f} | {r['agreement']:.3f} | {r['perplexity']:.2f} "
                     f"| {r['exited']}/{r['tokens']} |")
    lines += ["", *_reading(results)]
    if tr.get("exits"):
        lines += ["", f"Exit heads, held-out top-1 agreement with the full model **over the whole vocabulary** "
                  f"({tr['heldout_positions']} held-out positions of test-split text; trained on "
                  f"{tr['train_positions']} positions in {tr.get('train_s', 0):.0f} s):", "",
                  "| exit after layer | trained | untrained (logit lens) | ridge init only | classifier AUC |",
                  "|---:|---:|---:|---:|---:|"]
        for e, r in tr["exits"].items():
            lines.append(f"| {e} | {r['top1_agreement_full_vocab']:.3f} | {r['top1_agreement_full_vocab_untrained']:.3f} "
                         f"| {r['top1_agreement_full_vocab_ridge_only']:.3f} | {r['classifier_auc']:.3f} |")
    lines += ["", f"Calibration ({cal['prompts']} calibration prompts, {cal['positions']} decoded positions, "
              f"{cal.get('calibrate_s', 0):.0f} s; `generation/calibration.py`): per target the measure and "
              "per-exit thresholds with the least predicted time whose agreement, decoded on the calibration prompts, "
              "holds at 95% confidence, or plain decoding; beside it what the teacher-forced replay alone proposed "
              "and the agreement it predicted.", "",
              "| min-agreement | measure | thresholds | decoded agreement (calibration) | exit rate per exit | predicted "
              "speed-up | replay's choice: measure, predicted agreement |", "|---:|---|---|---:|---|---:|---|"]
    for t in cal["targets"]:
        b = t.get("replayed", t)
        lines.append(f"| {t['min_agreement']} | {'none (fallback)' if t['fallback'] else t['measure']} "
                     f"| {', '.join(f'{x:.3f}' for x in t['thresholds'])} | {t['predicted_agreement']:.3f} "
                     f"| {', '.join(f'{x:.3f}' for x in t['predicted_exit_rate'])} | {t['predicted_speedup']:.3f} "
                     f"| {b['measure']}, {b['predicted_agreement']:.3f} |")
    lines += ["", "Quality on the held-out prompts (in-process engine over the same splits; decision cost: engine "
              "time reading scores and re-batching per decoded token, and head rows computed to decide vs only "
              "for tokens that left; tokens/s in process is one run each on the shared machine, not a speed "
              "comparison; a speculative row's exits are drafted tokens the full model verified):", "",
              "| system | measure | agreement | perplexity | exits (layer: share) | tokens/s in-process | decide us/token "
              "| head rows to decide | head rows on exit |", "|---|---|---:|---:|---|---:|---:|---:|---:|"]
    for r in results["quality"]:
        st = r["in_process"]
        lines.append(f"| {r['system']} | {r['measure']} | {r['agreement']:.3f} | {r['perplexity']:.2f} "
                     f"| {_share(r['exit_share'])} | {st['tokens_per_s']:.1f} "
                     f"| {1e6 * st['decide_s'] / max(1, r['tokens']):.0f} | {st['ramp_head_rows']} | {st['exit_head_rows']} |")
    if results.get("kv_fill"):
        lines += ["", "KV of skipped layers at the replay's choice for the lowest target (PyTorch reference, the same "
                  "thresholds): copied from the exit state (CALM, served) or recomputed later:", "",
                  "| kv fill | measure | thresholds | prompts | agreement | tokens left | wall s |",
                  "|---|---|---|---:|---:|---:|---:|"]
        for r in results["kv_fill"]:
            lines.append(f"| {r['kv_fill']} | {r['measure']} | {', '.join(f'{x:.3f}' for x in r['thresholds'])} "
                         f"| {r['prompts']} | {r['agreement']:.3f} | {r['exited']}/{r['tokens']} | {r['wall_s']:.0f} |")
    for c in results.get("lossless", []):
        lines += ["", f"Lossless check (speculative decoding, drafting forced, draft {c['draft']}): "
                  f"{c['identical']}/{c['prompts']} held-out prompts identical to the full model token for token; "
                  f"acceptance {c['acceptance']:.3f} of {c['drafted']} drafted tokens; "
                  f"{c['tokens_per_s']:.1f} tokens/s in process."]
    sp = costs["splits"]
    lines += ["", f"Measured costs ({costs['device']}, in process, 16 rows, the never-slower rule's table): split calls "
              + ", ".join(f"{1e3 * f:.2f} ms + {1e3 * p:.2f} ms/position" for f, p in sp)
              + f"; the 49,152-token head {1e3 * costs.get('head_fixed_s', 0.0):.2f} ms per call + "
              f"{1e3 * costs['head_s']:.2f} ms per position "
              f"(= {costs['head_s'] * results['num_layers'] / (sum(p for _, p in sp) or 1):.1f} layers' per-position "
              f"cost, counted {results['head_layer_equivalents']:.1f} by multiply-adds); kv fill per exit "
              + ", ".join(f"{1e3 * f:.2f} ms + {1e3 * p:.3f} ms/row" for f, p in
                          (costs.get("fills") or [[costs["fill_fixed_s"], costs["fill_per_row_s"]]])) + "."]
    return "\n".join(lines)


def _reading(results: dict) -> list[str]:
    """Ratios read off the speed table (same run, same server, same cores), and why the best mode gives what
    it gives, from measured numbers."""
    out = []
    for r in results["speed"][1:]:
        out.append(f"- {r['system']}: {r['speedup_vs_full']:.2f}x the full model's tokens/s (rounds: "
                   f"{', '.join(f'{x:.2f}' for x in r['speedup_rounds'])}), agreement {r['agreement']:.3f} on prompts "
                   "not used for calibration.")
    costs, L = results["costs"], results["num_layers"]
    layer_s = sum(p for _, p in costs["splits"]) / L
    best = max(results["speed"][1:], key=lambda r: r["speedup_vs_full"], default=None)
    quality = {r["system"]: r for r in results["quality"]}
    calm = [r for r in results["quality"] if r.get("min_agreement") == 0.9]
    if best is not None and calm:
        q = calm[0]
        exited = 1 - q["exit_share"][str(L)]
        st = q["in_process"]
        lossless = (results.get("lossless") or [{}])[0]
        cands = results["calibration"].get("decoded_candidates", [])
        plain = results["calibration"]["plain_s_per_token"]
        if cands:
            c = max(cands, key=lambda c: plain / c["s_per_token"])
            out.append(f"- The calibration's fastest candidate, decoded on the calibration prompts: {c['measure']} at "
                       f"{', '.join(f'{x:.3f}' for x in c['thresholds'])}, {sum(c['exit_rate']):.1%} of tokens leaving, "
                       f"agreement {c['agreement']:.3f} ({c['agreement_lower']:.3f} at 95% confidence), predicted "
                       f"{plain / c['s_per_token']:.3f}x; no candidate with exits held 0.9.")
        plain_note = (" It runs the full model's calls (no exits, no drafts but probes), so its ratio is the "
                      "machine's noise, not a gain." if best["exited"] <= 0.05 * best["tokens"] else "")
        out.append(f"- Best mode: {best['system']}, {best['speedup_vs_full']:.2f}x.{plain_note} Why, measured: at min-agreement "
                   f"0.9 the calibration lets {exited:.1%} of decoded tokens leave on the held-out prompts "
                   f"({_share(q['exit_share'])}); a decision costs {1e6 * st['decide_s'] / max(1, q['tokens']):.0f} us "
                   f"of engine time per token plus 577 multiply-adds in the split, and the head is read only for "
                   f"the {st['exit_head_rows']} rows that left; the head costs {1e3 * costs['head_s']:.2f} ms per "
                   f"position (= {costs['head_s'] / layer_s:.1f} layers measured), a decoder layer "
                   f"{1e3 * layer_s:.3f} ms per position. A token leaving after layer 20 saves 10 layers and the "
                   f"final head but pays the kv fill and its own head: at most "
                   f"{(10 * layer_s + costs['head_s'] - costs['fill_per_row_s'] - costs['head_s']) / (L * layer_s + costs['head_s']):.0%} "
                   f"of its cost, so a few percent of tokens leaving cannot reach 1.2x. Speculation: acceptance "
                   f"{lossless.get('acceptance', float('nan')):.2f} per drafted token, and verifying k positions "
                   f"costs ~k decode steps here, so the policy decodes plainly "
                   f"({quality.get('speculative (policy)', {}).get('in_process', {}).get('fallback_steps', 0)} "
                   "fallback steps in process).")
    return out


def write_results_section(path: Path, results: dict) -> None:
    """Replace (or append) this benchmark's section of ``path``, between its markers; the rest is kept."""
    write_section(path, BEGIN, END, section=f"## Early-exit generation (issues 14, 28)\n\n{format_tables(results)}")
