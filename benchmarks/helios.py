"""``e3 bench helios``: HELIOS against each of its candidates served alone, on one server, under one memory budget.

Candidates: ``smollm2-ee`` (SmolLM2-135M-Instruct, exit heads after layers 10 and 20) and ``smollm2-ee-late``
(the same weights, heads after 15 and 25): they share the tokenizer and differ in where tokens can leave.

Systems (one embedded tritonserver; every split and kv-fill model 1 instance x 1 intra-op thread; one system
at a time; each gets the same ``memory_mb`` budget for loaded weights plus reserved KV cache):

* ``helios_only_<m>``: candidate m whole, CALM at ``tau``, admission under the budget (no controller);
* ``helios_generate``: HELIOS (evaluation of both candidates on the first prompts, partial loading, the
  breach counter), the same budget and ``tau``.

Workload: ``prompts`` requests in two halves whose difficulty differs (first: requests to write a movie-review
sentence, the exit heads' training distribution, where tokens leave early; then held-out "is this review
positive?" questions), sent by ``clients`` concurrent clients, ``new_tokens`` tokens each.

Figures: tokens/s, the batch reached (most sequences running at once), time to first token and time per output
token (medians, from the server's timings: the Table 5 analogue), the share of tokens per exit layer (the
Table 4 analogue), agreement with the full model's greedy tokens (in-process engine over the same splits), and
HELIOS's decisions. Results: ``artifacts/results/helios.json`` and a section of ``docs/RESULTS.md``.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import tritonclient.http as http
from tqdm import tqdm

from e3.benchmarks.generation import agreement, engine_tokens
from e3.benchmarks.report import commit, write_section
from e3.core.files import write_json_atomic
from e3.deploy.server import TritonServer
from e3.generation.engine import EngineSpec
from e3.generation.models import load_generation_model
from e3.generation.repository import export_helios_repository, onnx_files
from e3.generation.training import chat_prompt, eval_prompts
from e3.models.data.text import rotten_tomatoes
from e3.paths import artifacts_dir, project_root

__all__ = ["HeliosBenchSettings", "run_helios_bench", "format_tables", "write_results_section"]

log = logging.getLogger(__name__)
BEGIN, END = "<!-- helios-bench:begin -->", "<!-- helios-bench:end -->"


@dataclass(frozen=True)
class HeliosBenchSettings:
    models: tuple[str, ...] = ("smollm2-ee", "smollm2-ee-late")
    prompts: int = 48
    new_tokens: int = 32
    clients: int = 24
    taus: tuple[float, ...] = (0.2, 0.1)  # 0.2: about half the tokens leave by layer 20; 0.1: most by layer 10
    memory_mb: float = 560.0             # whole (516 MiB of weights) leaves KV room for ~10 sequences
    eval_prompts: int = 5
    ri: int = 150
    cbc_max: int = 50
    window: int = 100
    out: Path | None = None
    write_docs: bool = True

    @classmethod
    def quick(cls, **kw) -> "HeliosBenchSettings":
        return cls(**{"prompts": 24, "new_tokens": 16, "clients": 12, **kw})


def workload(n: int) -> list[str]:
    """``n`` chat prompts: the first half asks for a review sentence about a film (easy for the exit heads), the
    second half asks about held-out reviews (harder)."""
    easy = n // 2
    topics = [t.split(".")[0][:60] for t in rotten_tomatoes()["test"].texts[200:200 + easy]]
    return ([chat_prompt(f"Write one sentence of a movie review about {t}.") for t in topics]
            + eval_prompts(n - easy))


def _call(url: str, model: str, prompt: list[int], new_tokens: int) -> dict:
    with http.InferenceServerClient(url, network_timeout=600.0, connection_timeout=600.0) as c:
        ids = http.InferInput("input_ids", [len(prompt)], "INT64")
        ids.set_data_from_numpy(np.array(prompt, np.int64))
        n = http.InferInput("max_new_tokens", [1], "INT32")
        n.set_data_from_numpy(np.array([new_tokens], np.int32))
        r = c.infer(model, [ids, n], timeout=600_000_000)
    return {"tokens": r.as_numpy("tokens").tolist(), "exit_layers": r.as_numpy("exit_layers").tolist(),
            "ttft_ms": float(r.as_numpy("ttft_ms")[0]), "total_ms": float(r.as_numpy("total_ms")[0]),
            "served_by": r.as_numpy("served_by")[0].decode()}


def _status(url: str, model: str) -> dict:
    with http.InferenceServerClient(url) as c:
        s = http.InferInput("status", [1], "BYTES")
        s.set_data_from_numpy(np.array([b"?"], dtype=object))
        return json.loads(c.infer(model, [s]).as_numpy("text_out")[0])


def _run_system(url: str, model: str, prompts: list[list[int]], s: HeliosBenchSettings) -> tuple[list[dict], float]:
    """Send the prompts in order, ``clients`` at a time (closed loop); returns the answers in order, wall time."""
    start = time.perf_counter()
    with ThreadPoolExecutor(s.clients) as pool, tqdm(total=len(prompts), desc=model, unit="prompt") as bar:
        futures = [pool.submit(_call, url, model, p, s.new_tokens) for p in prompts]
        out = []
        for f in futures:
            out.append(f.result())
            bar.update()
    return out, time.perf_counter() - start


def _exit_share(answers: list[dict]) -> dict[str, float]:
    exits = Counter(e for a in answers for e in a["exit_layers"][1:])
    total = sum(exits.values()) or 1
    return {str(k): v / total for k, v in sorted(exits.items())}


def run_helios_bench(settings: HeliosBenchSettings = HeliosBenchSettings(), echo=print) -> dict:
    """Export, serve, run every system at every threshold; returns the results (also JSON and, unless disabled,
    docs/RESULTS.md)."""
    torch.set_num_threads(1)
    s = settings
    repo = artifacts_dir() / "generation" / "helios-repo"
    budget = (f"every split and kv-fill model 1 instance x 1 intra-op thread, one engine thread per front door, "
              f"memory budget {s.memory_mb:.0f} MiB (weights + reserved KV), one system at a time")
    results: dict = {"settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(s).items()},
                     "budget": budget, "runs": []}
    full_tokens = None
    for i, tau in enumerate(s.taus):
        echo(f"tau {tau}: exporting {', '.join(s.models)} and the front doors to {repo} "
             f"(exit heads train on first use) ...")
        doors = _export(s, repo, tau, reuse=i > 0)
        gm = load_generation_model(s.models[0], progress=False)
        prompts = [gm.tokenizer.encode(p).ids for p in workload(s.prompts)]
        if full_tokens is None:
            spec = EngineSpec.from_dict(json.loads((repo / f"{s.models[0].replace('-', '_')}_generation.json")
                                                   .read_text()))
            echo(f"the full model's greedy tokens for {len(prompts)} prompts (in-process, the same splits) ...")
            full, _ = engine_tokens(spec, onnx_files(repo, spec), prompts, new_tokens=s.new_tokens, mode="full", tau=2.0)
            full_tokens = [f.tokens for f in full]
        echo(f"serving on one tritonserver ({budget}); {len(prompts)} prompts, {s.clients} clients, tau {tau}")
        results["runs"].append({"tau": tau, "systems": _serve_all(s, repo, doors, prompts, full_tokens, echo)})
    out_path = write_json_atomic(s.out or artifacts_dir() / "results" / "helios.json", results, sort_keys=False)
    echo(f"wrote {out_path}")
    if s.write_docs:
        docs = project_root() / "docs" / "RESULTS.md"
        write_results_section(docs, results)
        echo(f"updated {docs}")
    return results


def _export(s: HeliosBenchSettings, repo: Path, tau: float, reuse: bool) -> list[str]:
    return export_helios_repository(list(s.models), repo, memory_mb=s.memory_mb, tau=tau, eval_prompts=s.eval_prompts,
                                    ri=s.ri, cbc_max=s.cbc_max, window=s.window, reuse_splits=reuse)


def _serve_all(s: HeliosBenchSettings, repo: Path, doors: list[str], prompts, full_tokens, echo) -> list[dict]:
    order = [d for d in doors if d != "helios_generate"] + ["helios_generate"]
    rows = []
    with TritonServer.on_free_ports(repo, order, log_file=artifacts_dir() / "logs" / "bench-helios.log",
                                    exit_timeout_s=5) as server:
        for door in order:
            # Warm-up, every system alike: 2 prompts x 2 tokens load the models. For HELIOS they are also the
            # first 2 of its Step-2 prompts on the first candidate (4 decoded tokens in its exit profile).
            _run_system(server.http_url, door, prompts[:2], HeliosBenchSettings(new_tokens=2, clients=2))
            answers, wall = _run_system(server.http_url, door, prompts, s)
            status = _status(server.http_url, door)
            tokens = sum(len(a["tokens"]) for a in answers)
            tpot = [(a["total_ms"] - a["ttft_ms"]) / (len(a["tokens"]) - 1) for a in answers if len(a["tokens"]) > 1]
            row = {"system": "HELIOS" if door == "helios_generate" else door.replace("helios_only_", "") + " alone",
                   "front_door": door, "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
                   "batch_reached": status.get("peak_active"),
                   "ttft_ms_p50": statistics.median(a["ttft_ms"] for a in answers),
                   "tpot_ms_p50": statistics.median(tpot) if tpot else float("nan"),
                   "exit_share": _exit_share(answers),
                   "agreement": statistics.mean(agreement(a["tokens"], t) for a, t in zip(answers, full_tokens)),
                   "served_by": dict(Counter(a["served_by"] for a in answers)),
                   "decisions": status.get("decisions", []), "pht": status.get("rows", [])}
            rows.append(row)
            echo(f"  {row['system']:24s} {row['tokens_per_s']:6.1f} tok/s  batch {row['batch_reached']}  "
                 f"TTFT {row['ttft_ms_p50']:7.0f} ms  TPOT {row['tpot_ms_p50']:6.1f} ms  agreement "
                 f"{row['agreement']:.3f}  exits {row['exit_share']}")
            for d in row["decisions"]:
                echo(f"      {d['kind']}: {d['before']} -> {d['after']} ({d['reason']})")
    return rows


def format_tables(results: dict) -> str:
    s = results["settings"]
    lines = [f"`e3 bench helios` (candidates {', '.join(s['models'])}; {s['prompts']} prompts x {s['new_tokens']} "
             f"new tokens, {s['clients']} clients, CBCmax {s['cbc_max']} of {s['window']} tokens, Step 2 on "
             f"{s['eval_prompts']} prompts per candidate; commit {commit()}, {time.strftime('%Y-%m-%d')}). "
             f"Budget: {results['budget']}."]
    for run in results["runs"]:
        lines += ["", *_run_tables(run)]
    return "\n".join(lines)


def _run_tables(run: dict) -> list[str]:
    rows, tau = run["systems"], run["tau"]
    layers = sorted({int(k) for r in rows for k in r["exit_share"]})
    lines = [f"### tau {tau}", "", "Table 5 analogue, with throughput, batch reached and quality:", "",
             "| system | tokens/s | batch reached | TTFT p50 ms | TPOT p50 ms | agreement with full greedy |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['system']} | {r['tokens_per_s']:.1f} | {r['batch_reached']} | {r['ttft_ms_p50']:.0f} "
                     f"| {r['tpot_ms_p50']:.1f} | {r['agreement']:.3f} |")
    lines += ["", "Table 4 analogue, share of decoded tokens per exit layer (the layer whose head chose the token):",
              "", "| system | " + " | ".join(f"layer {e}" for e in layers) + " |",
              "|---|" + "---:|" * len(layers)]
    for r in rows:
        lines.append(f"| {r['system']} | " + " | ".join(f"{r['exit_share'].get(str(e), 0.0):.2f}" for e in layers)
                     + " |")
    helios = next((r for r in rows if r["front_door"] == "helios_generate"), None)
    if helios:
        lines += ["", f"HELIOS served its prompts on: {', '.join(f'{k} ({v})' for k, v in helios['served_by'].items())}"
                      " (model:depth). Its decisions:", ""]
        lines += [f"- {d['kind']}: {d['before']} -> {d['after']} ({d['reason']})" for d in helios["decisions"]]
        alone = [r for r in rows if r is not helios]
        if alone:
            best = max(alone, key=lambda r: r["tokens_per_s"])
            lines += ["", f"HELIOS against the faster candidate alone ({best['system']}): "
                          f"{helios['tokens_per_s'] / best['tokens_per_s']:.2f}x tokens/s, batch reached "
                          f"{helios['batch_reached']} vs {best['batch_reached']}."]
    return lines


def write_results_section(path: Path, results: dict) -> None:
    """Replace (or append) this benchmark's section of ``path``, between its markers; the rest is kept."""
    write_section(path, BEGIN, END,
                  section=f"## HELIOS: candidates, partial loading, breach counter (issue 15)\n\n{format_tables(results)}")
