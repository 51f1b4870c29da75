"""``e3 bench generate``: early-exit generation's speed and quality, side by side on one server.

Quality (in-process, the same ONNX splits the server runs, driven by the same engine, so the tokens are the
served ones): for each CALM threshold ``tau``, agreement with the full model's greedy tokens (share of
positions whose token equals the full model's at that position), perplexity of the generated tokens scored by
the full model (teacher-forced, PyTorch), where tokens left, and the compute spent per token in
layer-equivalents (multiply-adds over one layer's ~3.5M: a head's 49,152 x 576 matmul counts as 8.0). The KV fill of skipped layers is compared: CALM's copy against recomputation (PyTorch
reference, layers executed and agreement).

Speed (one embedded tritonserver, every system through the same split models: one instance each, one
intra-op thread, so every system has the same cores): all prompts sent at once, tokens/s over the run, and
per request the server's time to first token (TTFT) and time per output token (TPOT = (total - TTFT) /
(tokens - 1)), medians. Systems: the full model decoded plainly (continuous batching), E3 for generation
(CALM exits, survivors re-batched between splits, continuous batching), naive early exit (the same exits, one
sequence at a time: nothing to re-batch), the full model one sequence at a time (naive's fair comparator),
lossless self-speculative decoding, and E3 with the KV cache passed as tensors instead of kept inside the
split instances (the two placements side by side). All but the last keep the cache in the split instances.

Results: ``artifacts/results/generation.json`` and a section of ``docs/RESULTS.md``.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from e3.benchmarks.report import commit
from e3.paths import artifacts_dir, project_root

__all__ = ["GenerateBenchSettings", "run_generate_bench", "agreement", "format_tables", "write_results_section"]

log = logging.getLogger(__name__)
BEGIN, END = "<!-- generation-bench:begin -->", "<!-- generation-bench:end -->"


@dataclass(frozen=True)
class GenerateBenchSettings:
    model: str = "smollm2-ee"
    prompts: int = 16                      # held-out prompts (Rotten Tomatoes test snippets)
    new_tokens: int = 32
    taus: tuple[float, ...] = (0.1, 0.2, 0.3, 0.5, 0.7, 0.9)
    tau: float = 0.5                       # threshold of the speed table's early-exit systems
    fast_tau: float | None = 0.2           # an extra, aggressive threshold for E3 in the speed table
    draft_tokens: int = 4
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
def _nll(model, prompt: list[int], tokens: list[int]) -> list[float]:
    """Per-token NLL (nats) of ``tokens`` after ``prompt`` under the full model (teacher-forced)."""
    from e3.generation.decoder import attention_mask
    ids = torch.tensor([prompt + tokens])
    n = ids.shape[1]
    c = model.config
    h = model.embed(ids)
    cos, sin = model.rope(torch.arange(n)[None])
    mask = attention_mask(torch.ones(1, n, dtype=torch.bool), n)
    empty = torch.zeros(1, c.num_kv_heads, 0, c.head_dim)
    for layer in range(1, c.num_layers + 1):
        h, _, _ = model.layer_forward(layer, h, cos, sin, empty, empty, mask)
    logp = torch.log_softmax(model.head_logits(h[0, len(prompt) - 1:n - 1], c.num_layers), -1)
    return (-logp.gather(1, torch.tensor(tokens)[:, None])[:, 0]).tolist()


def layer_costs(config) -> tuple[float, float]:
    """(head, kv fill of one layer) in layer-equivalents: multiply-adds over those of one decoder layer."""
    c = config
    layer = 2 * c.hidden_size * c.num_heads * c.head_dim + 2 * c.hidden_size * c.num_kv_heads * c.head_dim \
        + 3 * c.hidden_size * c.intermediate_size
    return c.vocab_size * c.hidden_size / layer, 2 * c.hidden_size * c.num_kv_heads * c.head_dim / layer


def _cost(exit_layers: list[int], config, calm: bool) -> float:
    """Layer-equivalents per decoded token: layers run, heads read (every ramp passed in CALM mode, the final
    head at L) and the kv fill of skipped layers."""
    head, fill = layer_costs(config)
    L, exits = config.num_layers, config.exit_layers
    per = [e + ((sum(1 for x in exits if x <= e) if calm else 0) + (e == L)) * head + (L - e) * fill
           for e in exit_layers]
    return statistics.mean(per) if per else 0.0


def engine_tokens(spec, files, prompts, *, new_tokens, mode, tau, draft_tokens=4):
    from e3.generation.engine import GenerationEngine, GenRequest, OrtRunner
    engine = GenerationEngine(spec, OrtRunner(files))
    for i, p in enumerate(prompts):
        engine.submit(GenRequest(i, p, new_tokens, mode=mode, tau=tau, draft_tokens=draft_tokens))
    done = {}
    start = time.perf_counter()
    while not engine.idle:
        done.update({f.request_id: f for f in engine.step()})
    wall = time.perf_counter() - start
    stats = {"wall_s": wall, "kv_gather_s": engine.kv_gather_s, "call_s": engine.call_s,
             "tokens_per_s": sum(len(f.tokens) for f in done.values()) / wall}
    return [done[i] for i in range(len(prompts))], stats


def _serve(url: str, model: str, prompts, new_tokens, **kw):
    from e3.generation.client import generate
    start = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        out = list(pool.map(lambda p: generate(url, model, p, max_new_tokens=new_tokens, **kw), prompts))
    return out, time.perf_counter() - start


def run_generate_bench(settings: GenerateBenchSettings = GenerateBenchSettings(), echo=print) -> dict:
    """Run both tables; returns the results (also written to JSON and, unless disabled, docs/RESULTS.md)."""
    from e3.deploy.server import TritonServer
    from e3.generation.models import load_generation_model
    from e3.generation.reference import generate_early_exit, generate_full
    from e3.generation.repository import export_generation_repository, model_names, onnx_files, router_names
    from e3.generation.training import eval_prompts
    torch.set_num_threads(1)
    s = settings
    gm = load_generation_model(s.model)
    model, tok = gm.decoder, gm.tokenizer
    L, exits = model.config.num_layers, model.config.exit_layers
    repo = artifacts_dir() / "generation" / "repo"
    echo(f"exporting {s.model} to {repo} ...")
    spec = export_generation_repository(s.model, repo, max_active=s.max_active)
    files = onnx_files(repo, spec)
    prompts = [tok.encode(p).ids for p in eval_prompts(s.prompts)]
    results: dict = {"settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(s).items()},
                     "training": gm.training, "quality": [], "kv_fill": [], "speed": [],
                     "head_layer_equivalents": layer_costs(model.config)[0]}

    echo(f"quality: {len(prompts)} prompts x {s.new_tokens} tokens, in-process engine over the served splits")
    full, stats = engine_tokens(spec, files, prompts, new_tokens=s.new_tokens, mode="full", tau=2.0)
    full_tokens = [f.tokens for f in full]
    rows = [("full", None, full, stats)]
    for tau in s.taus:
        rows.append(("calm", tau, *engine_tokens(spec, files, prompts, new_tokens=s.new_tokens, mode="calm", tau=tau)))
    for kind, tau, got, stats in rows:
        exits_at = [e for f in got for e in f.exit_layers[1:]]
        row = {"system": kind, "tau": tau,
               "agreement": statistics.mean(agreement(f.tokens, t) for f, t in zip(got, full_tokens)),
               "perplexity": _perplexity(model, prompts, [f.tokens for f in got]),
               "exit_share": {str(e): exits_at.count(e) / max(1, len(exits_at)) for e in [*exits, L]},
               "layer_equivalents_per_token": _cost(exits_at, model.config, kind == "calm"),
               "in_process": stats}
        results["quality"].append(row)
        echo(f"  {kind:5s} tau={tau}  agreement {row['agreement']:.3f}  ppl {row['perplexity']:.2f}  "
             f"exits {row['exit_share']}  cost {row['layer_equivalents_per_token']:.1f} layer-eq/token  "
             f"in-process {stats['tokens_per_s']:.1f} tok/s, KV gather {stats['kv_gather_s'] / stats['wall_s']:.0%}")

    echo(f"kv fill of skipped layers at tau={s.tau}: copy (CALM) vs recompute, PyTorch reference")
    n_kv = min(len(prompts), 8)
    reference = {}
    for fill in ("copy", "recompute"):
        start = time.perf_counter()
        outs = [generate_early_exit(model, p, s.new_tokens, tau=s.tau, eos_id=gm.eos_id, kv_fill=fill)
                for p in prompts[:n_kv]]
        reference[fill] = outs
        wall = time.perf_counter() - start
        fulls = [generate_full(model, p, s.new_tokens, eos_id=gm.eos_id).tokens for p in prompts[:n_kv]]
        row = {"kv_fill": fill, "tau": s.tau, "prompts": n_kv,
               "agreement": statistics.mean(agreement(o.tokens, f) for o, f in zip(outs, fulls)),
               "decode_layers_run_per_token": statistics.mean(
                   (o.layers_run - len(p) * L) / max(1, len(o.tokens) - 1) for o, p in zip(outs, prompts)),
               "wall_s": wall}
        results["kv_fill"].append(row)
        echo(f"  {fill:9s} agreement {row['agreement']:.3f}  layers run per decoded token "
             f"{row['decode_layers_run_per_token']:.1f}  wall {wall:.1f} s")

    names = router_names(s.model)
    systems = [("full, continuous batching", names["continuous"], dict(mode="full")),
               (f"E3 CALM tau={s.tau}, re-batched", names["continuous"], dict(mode="calm", tau=s.tau)),
               *([(f"E3 CALM tau={s.fast_tau}, re-batched", names["continuous"], dict(mode="calm", tau=s.fast_tau))]
                 if s.fast_tau is not None else []),
               (f"E3 CALM tau={s.tau}, KV passed as tensors", names["tensors"], dict(mode="calm", tau=s.tau)),
               (f"naive CALM tau={s.tau}, one at a time", names["naive"], dict(mode="calm", tau=s.tau)),
               ("full, one at a time", names["naive"], dict(mode="full")),
               (f"self-speculative (draft {s.draft_tokens} from layer {exits[0]}), lossless", names["continuous"],
                dict(mode="speculative", draft_tokens=s.draft_tokens))]
    budget = "every split and kv-fill model: 1 instance x 1 intra-op thread; one engine thread per router; one system at a time"
    echo(f"speed on one tritonserver ({budget}); {len(prompts)} prompts sent at once")
    served_models = model_names(s.model, spec)
    with TritonServer.on_free_ports(repo, served_models, log_file=artifacts_dir() / "logs" / "bench-generate.log",
                                    exit_timeout_s=5) as server:
        for name, router, kw in systems:
            _serve(server.http_url, router, prompts[:2], 4, **kw)   # warm-up
            out, wall = _serve(server.http_url, router, prompts, s.new_tokens, **kw)
            n_tokens = sum(len(o.tokens) for o in out)
            tpot = [(o.total_ms - o.ttft_ms) / (len(o.tokens) - 1) for o in out if len(o.tokens) > 1]
            row = {"system": name, "router": router, **kw, "tokens": n_tokens, "wall_s": wall,
                   "tokens_per_s": n_tokens / wall, "ttft_ms_p50": statistics.median(o.ttft_ms for o in out),
                   "tpot_ms_p50": statistics.median(tpot) if tpot else float("nan"),
                   "agreement": statistics.mean(agreement(o.tokens, t) for o, t in zip(out, full_tokens)),
                   "perplexity": _perplexity(model, prompts, [o.tokens for o in out]),
                   "budget": budget}
            if kw == dict(mode="calm", tau=s.tau):   # served = the PyTorch reference (greedy, same tau)
                same = sum((o.tokens, o.exit_layers) == (r.tokens, r.exit_layers)
                           for o, r in zip(out, reference["copy"]))
                row["equal_to_pytorch_reference"] = f"{same}/{len(reference['copy'])}"
            results["speed"].append(row)
            echo(f"  {name:45s} {row['tokens_per_s']:7.1f} tok/s  TTFT {row['ttft_ms_p50']:8.1f} ms  "
                 f"TPOT {row['tpot_ms_p50']:6.1f} ms  agreement {row['agreement']:.3f}  ppl {row['perplexity']:.2f}")
    base = results["speed"][0]["tokens_per_s"]
    for row in results["speed"]:
        row["speedup_vs_full"] = row["tokens_per_s"] / base
    out_path = s.out or artifacts_dir() / "results" / "generation.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(results, indent=1))
    echo(f"wrote {out_path}")
    if s.write_docs:
        docs = s.docs or project_root() / "docs" / "RESULTS.md"
        write_results_section(docs, results)
        echo(f"updated {docs}")
    return results



def format_tables(results: dict) -> str:
    """The Markdown tables of a result (speed, quality vs tau, KV fill)."""
    s = results["settings"]
    lines = [f"`e3 bench generate` ({s['model']}, {s['prompts']} held-out prompts x {s['new_tokens']} new tokens, "
             f"commit {commit()}, {time.strftime('%Y-%m-%d')}). Budget: {results['speed'][0]['budget']}.", "",
             "| system | tokens/s | x full | TTFT p50 ms | TPOT p50 ms | agreement | perplexity |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in results["speed"]:
        lines.append(f"| {r['system']} | {r['tokens_per_s']:.1f} | {r['speedup_vs_full']:.2f} | {r['ttft_ms_p50']:.0f} "
                     f"| {r['tpot_ms_p50']:.1f} | {r['agreement']:.3f} | {r['perplexity']:.2f} |")
    lines += ["", *_reading(results)]
    lines += ["", "Quality against the threshold (same splits, in-process engine; cost in layer-equivalents, "
              f"a head counted as {results['head_layer_equivalents']:.1f} layers):", "",
              "| tau | agreement | perplexity | exits (layer: share) | layer-eq per token |", "|---|---:|---:|---|---:|"]
    for r in results["quality"]:
        share = ", ".join(f"{k}: {v:.2f}" for k, v in r["exit_share"].items())
        lines.append(f"| {'full' if r['tau'] is None else r['tau']} | {r['agreement']:.3f} | {r['perplexity']:.2f} "
                     f"| {share} | {r['layer_equivalents_per_token']:.1f} |")
    lines += ["", "The same workload in one process (engine over ONNX Runtime sessions, no Triton hop): tokens/s, and "
              "the share of time spent assembling and storing the cache slices passed to the splits:", "",
              "| tau | tokens/s in-process | KV gather share |", "|---|---:|---:|"]
    for r in results["quality"]:
        st = r["in_process"]
        lines.append(f"| {'full' if r['tau'] is None else r['tau']} | {st['tokens_per_s']:.1f} "
                     f"| {st['kv_gather_s'] / st['wall_s']:.0%} |")
    lines += ["", "KV of skipped layers (PyTorch reference):", "",
              "| fill | tau | agreement | layers run per decoded token | wall s |", "|---|---:|---:|---:|---:|"]
    for r in results["kv_fill"]:
        lines.append(f"| {r['kv_fill']} | {r['tau']} | {r['agreement']:.3f} | {r['decode_layers_run_per_token']:.1f} "
                     f"| {r['wall_s']:.1f} |")
    return "\n".join(lines)


def _reading(results: dict) -> list[str]:
    """Ratios read off the speed table (same run, same server, same cores)."""
    rows = {r["system"]: r for r in results["speed"]}
    tau = results["settings"]["tau"]
    out = []
    e3 = rows.get(f"E3 CALM tau={tau}, re-batched")
    naive = rows.get(f"naive CALM tau={tau}, one at a time")
    kv = rows.get(f"E3 CALM tau={tau}, KV passed as tensors")
    full = results["speed"][0]
    if e3 and naive:
        out.append(f"- E3 (re-batched, continuous) against naive early exit (one sequence at a time), tau={tau}: "
                   f"{e3['tokens_per_s'] / naive['tokens_per_s']:.2f}x tokens/s.")
    if e3:
        if "equal_to_pytorch_reference" in e3:
            out.append(f"- Served tokens and exit layers equal the PyTorch reference early-exit decoder's for "
                       f"{e3['equal_to_pytorch_reference']} prompts (tau={tau}).")
        out.append(f"- E3 against the full model decoded plainly (both continuous): "
                   f"{e3['tokens_per_s'] / full['tokens_per_s']:.2f}x tokens/s, agreement {e3['agreement']:.3f}.")
    if e3 and kv:
        out.append(f"- KV kept in the split instances (E3's default) against KV passed as tensors (same exits, "
                   f"same cores): {e3['tokens_per_s'] / kv['tokens_per_s']:.2f}x tokens/s, TPOT "
                   f"{e3['tpot_ms_p50']:.1f} vs {kv['tpot_ms_p50']:.1f} ms.")
    return out


def write_results_section(path: Path, results: dict) -> None:
    """Replace (or append) this benchmark's section of ``path``, between its markers; the rest is kept."""
    from e3.benchmarks.report import write_section
    write_section(path, BEGIN, END, section=f"## Early-exit generation (issue 14)\n\n{format_tables(results)}")
