"""``e3 bench exegpt``: ExeGPT's schedules executed on Triton, measured (the paper's Table 6 and Fig. 6 analogues).

One embedded tritonserver serves the model's ``<m>_kv_split_*`` and kv-fill models (one instance each, one
intra-op thread), WAA's encode-worker splits ``<m>_enc_split_*`` (the same), ExeGPT's front door
``<m>_generate_exegpt`` and the continuous-batching router ``<m>_generate``. The machine's 2 cores are every
system's budget: RRA and the baselines call the split models one at a time (one worker, all they can use
without pipelining, which is not built); WAA runs an encode worker beside the decode worker (two).

1. **Calibration**: the door is pinned to static batches (``calibration_batches``), RRA and WAA schedules and
   driven; it times its own steps, which gives the served profiles
   (:class:`e3.generation.exegpt.scheduler.StepTimes`: RRA's steps, WAA's encode passes and decode iterations)
   the plans use.
2. **Per latency bound** (multiples of the p99-length latency of a static batch of one, predicted on the
   served profiles, and no bound): the bound is sent to the door, which plans (branch-and-bound over RRA and
   WAA under the bound net of slack) and reports its schedule (Table 6 analogue); that schedule is then
   measured, so is the best schedule of the other kind under the same bound (RRA against WAA), and the best
   static batch (admit B, decode until all finished: RRA with N_D = the longest output, as
   ``e3 plan-generate --validate`` defines it), each in a closed loop that keeps enough requests in flight for
   the schedule's queue to be full at each phase start. Each run's prediction beside its measurement is the
   simulator's validation on Triton.
3. **Continuous batching without a bound**: ``<m>_generate`` (admits whenever a slot is free, up to its
   ``max_active``) under the same load.

Latency is the server's, from a sequence's admission to its last token (the simulator's; queueing before
admission depends on the offered load and is reported beside it as the client's p99). Results:
``artifacts/results/exegpt_triton.json`` and a section of ``docs/RESULTS.md`` between
``<!-- exegpt-triton:begin -->`` and ``<!-- exegpt-triton:end -->``.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from e3.benchmarks.report import write_section
from e3.deploy.server import TritonServer
from e3.generation.engine import EngineSpec
from e3.generation.exegpt.door import door_models, export_exegpt_door
from e3.generation.exegpt.drive import Run, concurrency_for, control, drive
from e3.generation.exegpt.profiler import ProfileSettings, cached_profile
from e3.generation.exegpt.scheduler import (ReplanPolicy, RraSchedule, WaaSchedule, best_static, predict, predict_waa,
                                            schedule_from_json)
from e3.generation.exegpt.workload import LayerProfile, LengthDistribution
from e3.generation.repository import export_generation_repository, router_names
from e3.paths import artifacts_dir, project_root

__all__ = ["ExegptBenchSettings", "Calibration", "calibrate", "measure", "chosen_of", "run_exegpt_bench",
           "format_tables", "write_results_section", "BEGIN", "END"]

log = logging.getLogger(__name__)
BEGIN, END = "<!-- exegpt-triton:begin -->", "<!-- exegpt-triton:end -->"
BUDGET = ("every split and kv-fill model 1 instance x 1 intra-op thread; one engine thread per front door; "
          "RRA: one worker (the engine calls the <m>_kv_split_* models one after another); WAA: two workers, the "
          "encode worker's <m>_enc_split_* (1 instance x 1 thread each, its own thread in the door) and the decode "
          "worker's <m>_kv_split_* (the door's engine thread): 2 cores; one system at a time")


@dataclass(frozen=True)
class ExegptBenchSettings:
    model: str = "smollm2-ee"
    prompt_tokens: int = 32
    lengths: tuple[int, ...] = tuple(range(4, 17))     # output lengths, uniform
    batch_sizes: tuple[int, ...] = tuple(range(1, 17))
    factors: tuple[float, ...] = (2.0, 3.0, 5.0, 8.0)  # bounds: x the static batch of one's p99-length latency
    calibration_batches: tuple[int, ...] = (16, 8, 4)
    calibration_phases: int = 3
    calibration_waa_batches: tuple[int, ...] = (16, 4)  # WAA's B_E pinned while calibrating
    phases: int = 6                                    # measured requests ~ phases x concurrency ...
    measure_s: float = 60.0                            # ... or this many seconds after the warm-up, if sooner
    unbounded: bool = True                             # also the row without a bound
    slack: float = 0.2
    max_active: int = 16                               # <m>_generate's (continuous batching)
    out: Path | None = None
    docs: Path | None = None
    write_docs: bool = True
    quick: bool = False

    @classmethod
    def quick_form(cls, **kw) -> "ExegptBenchSettings":
        """A short run: two bounds, no unbounded row, runs of at most 20 s measured."""
        # 3 calibration phases: each static batch then gives 4 pure prefill steps, one more than a size needs
        # (with 2, a part-full phase under load left too few and the calibration failed)
        return cls(**{"factors": (3.0, 6.0), "phases": 3, "calibration_phases": 3, "measure_s": 20.0,
                      "unbounded": False, "quick": True, **kw})


def _lengths(s: ExegptBenchSettings) -> LengthDistribution:
    return LengthDistribution.from_samples(list(s.lengths))


@dataclass(frozen=True)
class Calibration:
    """The served profiles the door fitted during :func:`calibrate`: RRA's single-worker steps (medians and the
    latency quantile) and WAA's encode passes and decode iterations (None if WAA was not calibrated)."""

    rra: LayerProfile
    rra_tail: LayerProfile
    waa: LayerProfile | None = None
    waa_tail: LayerProfile | None = None

    def predict(self, schedule: RraSchedule | WaaSchedule, prompt_tokens: float, lengths: LengthDistribution):
        """The simulator's prediction for ``schedule`` on these profiles (WAA on RRA's before WAA has run)."""
        if schedule.kind == "waa":
            return predict_waa(self.waa or self.rra, prompt_tokens, lengths,
                               schedule=(schedule.batch_size, schedule.micro_batches), latency_profile=self.waa_tail or self.rra_tail)
        return predict(self.rra, prompt_tokens, lengths, schedule=(schedule.batch_size, schedule.decode_iters), latency_profile=self.rra_tail)


def calibrate(http_url: str, grpc_url: str, door: str, *, lengths: LengthDistribution, prompt_tokens: int, vocab: int,
              batches: tuple[int, ...] = (16, 8, 4), phases: int = 3,
              rra_iters: tuple[int, ...] = (2,), waa_batches: tuple[int, ...] = (16, 4)) -> Calibration:
    """Pin static batches of ``batches`` and drive ``phases`` phases of each, so that the door times pure prefill
    steps at several sizes and decode steps up to the largest batch; then RRA with the largest batch and each
    N_D of ``rra_iters``, whose live batch (B_E x E[ceil(S / N_D)] rows) reaches the decode sizes refilling
    schedules run (a line fitted to small batches alone under-predicted them by 30% on tiny-gen); then WAA with
    each B_E of ``waa_batches`` (encode passes at two sizes, decode iterations up to B_E x the mean length).
    Returns the served profiles the door fitted."""
    s_max = lengths.lengths[-1]
    runs = [(["rra", b, s_max], (phases + 1) * b, 2 * b) for b in batches]   # the first phase may start part-full
    big = max(batches)
    for nd in rra_iters:
        rows = big * sum(p * math.ceil(n / nd) for n, p in zip(lengths.lengths, lengths.probs))
        c = concurrency_for(big, rows)
        runs.append((["rra", big, nd], phases * c, c))
    for b in waa_batches:
        c = concurrency_for(b, b * lengths.mean())
        runs.append((["waa", b, 1], phases * c, c))
    for sched, requests, concurrency in runs:
        control(http_url, door, {"schedule": sched})
        run = drive(grpc_url, door, lengths, prompt_tokens=prompt_tokens, requests=requests, concurrency=concurrency, vocab=vocab,
                    seed=sched[1] * 100 + sched[2] + (50 if sched[0] == "waa" else 0))
        if run.errors:
            raise RuntimeError(f"calibration failed: {run.first_error}")
    status = control(http_url, door, {})
    if status["served_profile"] is None:
        raise RuntimeError(f"calibration left too few steps to fit a profile: {status['served_points']}")
    if waa_batches and status["waa_served_profile"] is None:
        raise RuntimeError(f"calibration left too few WAA steps to fit a profile: {status['waa_served_points']}")
    waa = status["waa_served_profile"]
    return Calibration(LayerProfile.from_dict(status["served_profile"]),
                       LayerProfile.from_dict(status["served_latency_profile"]),
                       None if waa is None else LayerProfile.from_dict(waa),
                       None if waa is None else LayerProfile.from_dict(status["waa_served_latency_profile"]))


def measure(http_url: str, grpc_url: str, door: str, *, schedule: RraSchedule | WaaSchedule,
            predicted_decode_batch: float, lengths: LengthDistribution, prompt_tokens: int, vocab: int, phases: int,
            seed: int = 0, measure_s: float | None = None) -> Run:
    """Pin ``schedule`` (RRA or WAA) on the door and drive it in a closed loop kept full (see
    :func:`concurrency_for`): about ``phases`` x the requests in flight (or ``measure_s`` seconds), after as many
    as a warm-up."""
    control(http_url, door, {"schedule": schedule.as_list()})
    c = concurrency_for(schedule.batch_size, predicted_decode_batch)
    return drive(grpc_url, door, lengths, prompt_tokens=prompt_tokens, requests=(phases + 1) * c, concurrency=c, vocab=vocab, warmup=c, seed=seed,
                 measure_s=measure_s)


def chosen_of(status: dict) -> RraSchedule | WaaSchedule:
    """The schedule in force, from the door's status."""
    d = status["schedule"]
    return (WaaSchedule(d["batch_size"], d["micro_batches"]) if status.get("kind") == "waa"
            else RraSchedule(d["batch_size"], d["decode_iters"]))


def _measured(schedule, predicted, run: Run) -> dict:
    return {"kind": schedule.kind, "schedule": schedule.as_list()[1:], "predicted_seq_s": predicted.throughput_seq_s,
            "predicted_latency_ms": predicted.latency_ms, **run.to_dict()}


def run_exegpt_bench(settings: ExegptBenchSettings = ExegptBenchSettings(), echo=print) -> dict:
    """Export (when missing), serve, calibrate, measure every bound; returns the results (also JSON and, unless
    disabled, ``docs/RESULTS.md``)."""
    s = settings
    m = s.model.replace("-", "_")
    repo = artifacts_dir() / "generation" / ("repo" if s.model.startswith("smollm2") else f"{m}-repo")
    if not (repo / f"{m}_generation.json").exists() or not (repo / f"{m}_generate").exists():
        echo(f"exporting {s.model} to {repo} ...")
        export_generation_repository(s.model, repo, max_active=s.max_active)
    spec = EngineSpec.from_dict(json.loads((repo / f"{m}_generation.json").read_text()))
    lengths = _lengths(s)
    offline = _offline_profile(repo, spec)
    door = export_exegpt_door(repo, s.model, offline, lengths=lengths, prompt_tokens=s.prompt_tokens, batch_sizes=s.batch_sizes,
                              policy=ReplanPolicy(slack=s.slack), stop_at_eos=False)
    continuous = router_names(s.model)["continuous"]
    vocab = spec.vocab_size or 1000
    echo(f"budget: {BUDGET}")
    log_file = artifacts_dir() / "logs" / "bench-exegpt-tritonserver.log"
    results: dict = {"model": s.model, "budget": BUDGET, "settings": _jsonable(asdict(s)), "rows": []}
    with TritonServer.on_free_ports(repo, door_models(repo, s.model) + [continuous], log_file=log_file,
                                    exit_timeout_s=10) as server:
        http, grpc = server.http_url, server.grpc_url
        echo("calibrating: the door times its own steps under pinned static batches, RRA and WAA ...")
        cal = calibrate(http, grpc, door, lengths=lengths, prompt_tokens=s.prompt_tokens, vocab=vocab, batches=s.calibration_batches,
                        phases=s.calibration_phases, waa_batches=s.calibration_waa_batches)
        served, tail = cal.rra, cal.rra_tail
        results["served_profile"], results["served_latency_profile"] = served.to_dict(), tail.to_dict()
        if cal.waa is not None:
            results["waa_served_profile"] = cal.waa.to_dict()
        floor = predict(served, s.prompt_tokens, lengths, schedule=(1, lengths.lengths[-1]), latency_profile=tail).latency_ms
        bounds = [round(f * floor) for f in s.factors] + ([math.inf] if s.unbounded else [])
        for bound in bounds:
            status = control(http, door, {"bound_ms": None if math.isinf(bound) else bound})
            chosen = chosen_of(status)
            # the door's own predictions (the profiles it planned with); the other kind's best beside it
            plan = status["history"][-1]
            p_chosen = replace(cal.predict(chosen, s.prompt_tokens, lengths),
                               throughput_seq_s=plan["predicted_seq_s"], latency_ms=plan["predicted_latency_ms"])
            echo(f"bound {_b(bound)} ms: the door chose {_sched(chosen)} (profiles: RRA {status['profile']}, WAA "
                 f"{status['waa_profile']}); measuring ...")
            run_c = measure(http, grpc, door, schedule=chosen, predicted_decode_batch=p_chosen.detail["decode_batch"], lengths=lengths, prompt_tokens=s.prompt_tokens,
                            vocab=vocab, phases=s.phases, measure_s=s.measure_s)
            row = {"bound_ms": None if math.isinf(bound) else bound, "feasible": status["feasible"],
                   "chosen": _measured(chosen, p_chosen, run_c)}
            other = "waa" if chosen.kind == "rra" else "rra"
            cands = plan.get("candidates") or {}
            if other in cands:
                cand = cands[other]
                if cand is not None:
                    alt = schedule_from_json([other, *cand["schedule"]])
                    p_alt = replace(cal.predict(alt, s.prompt_tokens, lengths),
                                    throughput_seq_s=cand["predicted_seq_s"], latency_ms=cand["predicted_latency_ms"])
                    echo(f"  the best {other.upper()} under the bound, {_sched(alt)}; measuring ...")
                else:   # none predicted to meet the bound: measure its lowest-latency schedule, to check that
                    alt = (WaaSchedule(min(s.batch_sizes)) if other == "waa"
                           else RraSchedule(min(s.batch_sizes), lengths.lengths[-1]))
                    p_alt = cal.predict(alt, s.prompt_tokens, lengths)
                    echo(f"  no {other.upper()} schedule is predicted to meet the bound; its lowest-latency one, "
                         f"{_sched(alt)}; measuring ...")
                run_a = measure(http, grpc, door, schedule=alt, predicted_decode_batch=p_alt.detail["decode_batch"], lengths=lengths, prompt_tokens=s.prompt_tokens,
                                vocab=vocab, phases=s.phases, measure_s=s.measure_s)
                row["other"] = {**_measured(alt, p_alt, run_a), "predicted_feasible": cand is not None}
            net = bound * (1 - s.slack)
            p_static = best_static(served, s.prompt_tokens, lengths, bound_ms=net, batch_sizes=s.batch_sizes, latency_profile=tail)
            if p_static is not None:
                st = RraSchedule(*p_static.config)
                echo(f"  static batch B={st.batch_size}; measuring ...")
                run_s = measure(http, grpc, door, schedule=st, predicted_decode_batch=p_static.detail["decode_batch"], lengths=lengths, prompt_tokens=s.prompt_tokens,
                                vocab=vocab, phases=s.phases, measure_s=s.measure_s)
                row["static"] = _measured(st, p_static, run_s)
            results["rows"].append(row)
            _save(s, results)   # a run cut short keeps the rows measured so far
        echo(f"continuous batching ({continuous}, max_active {s.max_active}, no bound); measuring ...")
        c = concurrency_for(s.max_active, s.max_active)
        run = drive(grpc, continuous, lengths, prompt_tokens=s.prompt_tokens, requests=(s.phases + 1) * c, concurrency=c, vocab=vocab, warmup=c,
                    measure_s=s.measure_s)
        results["continuous"] = {"max_active": s.max_active, **run.to_dict()}
        results["door_status"] = control(http, door, {})
    _save(s, results)
    echo(format_tables(results))
    if s.write_docs:
        write_results_section(s.docs or project_root() / "docs" / "RESULTS.md", results)
    return results


def _save(s: ExegptBenchSettings, results: dict) -> None:
    results["date"] = time.strftime("%Y-%m-%d")
    out = s.out or artifacts_dir() / "results" / "exegpt_triton.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=1))
    tmp.replace(out)


def _offline_profile(repo: Path, spec) -> LayerProfile:
    """The offline profiler's whole-model step estimate (layers x L + head), the door's start before calibration."""
    first, last = spec.ranges[-1]
    onnx = repo / f"{spec.model}_split_{first}-{last}" / "1" / "model.onnx"
    per_layer = cached_profile(onnx, last - first + 1, last,
                               cache=artifacts_dir() / "generation" / "exegpt" / f"{spec.model}_profile.json",
                               settings=ProfileSettings(), progress=False, final_head=True).fitted()
    L = per_layer.num_layers
    return LayerProfile(1, per_layer.prefill_tokens, tuple(L * v for v in per_layer.prefill_ms),
                        per_layer.decode_batch, tuple(L * v + per_layer.head_call_ms(b)
                                                      for v, b in zip(per_layer.decode_ms, per_layer.decode_batch)))


def _jsonable(d: dict) -> dict:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in d.items()}


def _b(bound) -> str:
    return "none" if bound is None or (isinstance(bound, float) and math.isinf(bound)) else f"{bound:,.0f}"


def _sched(schedule) -> str:
    """``RRA B_E=16, N_D=3`` / ``WAA B_E=8, B_m=1``."""
    if schedule.kind == "waa":
        return f"WAA B_E={schedule.batch_size}, B_m={schedule.micro_batches}"
    return f"RRA B_E={schedule.batch_size}, N_D={schedule.decode_iters}"


def _cell_sched(c: dict) -> str:
    kind = c.get("kind", "rra")
    return _sched(schedule_from_json([kind, *c["schedule"]]))


def _err(pred: float, meas: float) -> str:
    return "-" if not meas else f"{pred / meas - 1:+.0%}"


def _table_head(intro: str, header: str, align: str) -> list[str]:
    """A table's lines before its rows: a blank line, the sentence that introduces it, its header."""
    return ["", intro, "", header, align]


def format_tables(r: dict) -> str:
    """Markdown: the Table 6 analogue (schedule chosen per bound, measured), RRA against WAA per bound, the
    simulator against the measured runs, and the Fig. 6 analogue."""
    out = [f"Budget: {r['budget']}.", "",
           "Schedule chosen per latency bound, measured on Triton (Table 6 analogue; latency = the server's p99, "
           "admission to last token):", "",
           "| bound (ms) | schedule | predicted seq/s | measured seq/s | tokens/s | predicted p99-length ms | "
           "measured p99 ms | meets | client p99 ms |",
           "|---:|---|---:|---:|---:|---:|---:|:-:|---:|"]
    for row in r["rows"]:
        c, b = row["chosen"], row["bound_ms"]
        meets = "-" if b is None else ("yes" if c["p99_ms"] <= b else "NO")
        out.append(f"| {_b(b)} | {_cell_sched(c)} | {c['predicted_seq_s']:.1f} | "
                   f"{c['seq_s']:.1f} | {c['tok_s']:.0f} | {c['predicted_latency_ms']:,.0f} | {c['p99_ms']:,.0f} | "
                   f"{meets} | {c['p99_client_ms']:,.0f} |")
    if any("other" in row for row in r["rows"]):
        out += ["", "RRA (one worker) against WAA (an encode and a decode worker) per bound, each the best of its kind "
                "under the bound as the door planned it, both measured (seq/s, server p99 ms in brackets):", "",
                "| bound (ms) | RRA | WAA | WAA / RRA | chosen |", "|---:|---|---|---:|---|"]
        infeasible = False
        for row in r["rows"]:
            if "other" not in row:
                continue
            by = {row["chosen"].get("kind", "rra"): row["chosen"], row["other"]["kind"]: row["other"]}
            ra, wa = by["rra"], by["waa"]
            star = "" if row["other"].get("predicted_feasible", True) else "*"
            infeasible = infeasible or bool(star)
            cells = {k: f"{_cell_sched(c)}{star if c is row['other'] else ''}: {c['seq_s']:.1f} ({c['p99_ms']:,.0f})"
                     for k, c in by.items()}
            out.append(f"| {_b(row['bound_ms'])} | {cells['rra']} | {cells['waa']} | "
                       f"{wa['seq_s'] / ra['seq_s']:.2f} | {row['chosen'].get('kind', 'rra').upper()} |")
        if infeasible:
            out += ["", "\\* none of its kind was predicted to meet the bound; its lowest-latency schedule, measured."]
    out += _table_head("The simulator against the measured runs (every schedule measured above; error = predicted / "
                       "measured - 1; the p99-length latency against the measured p99):",
                       "| bound (ms) | run | schedule | predicted seq/s | measured seq/s | error | predicted p99 ms | "
                       "measured p99 ms | error | sequences |", "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for row in r["rows"]:
        for key in ("chosen", "other", "static"):
            c = row.get(key)
            if c is None:
                continue
            out.append(f"| {_b(row['bound_ms'])} | {key} | {_cell_sched(c)} | {c['predicted_seq_s']:.1f} | "
                       f"{c['seq_s']:.1f} | {_err(c['predicted_seq_s'], c['seq_s'])} | "
                       f"{c['predicted_latency_ms']:,.0f} | {c['p99_ms']:,.0f} | "
                       f"{_err(c['predicted_latency_ms'], c['p99_ms'])} | {c['sequences']} |")
    cont = r["continuous"]
    out += _table_head("Against the best static batch under the same bound and continuous batching without a bound "
                       "(Fig. 6 analogue; seq/s measured, server p99 ms in brackets):",
                       "| bound (ms) | ExeGPT (chosen) | static batch | chosen / static | continuous batching (no bound) "
                       "| chosen / continuous | continuous meets the bound |", "|---:|---|---|---:|---|---:|:-:|")
    for row in r["rows"]:
        c, st, b = row["chosen"], row.get("static"), row["bound_ms"]
        st_txt = "none meets it" if st is None else (f"B={st['schedule'][0]}: {st['seq_s']:.1f} "
                                                     f"({st['p99_ms']:,.0f})")
        ratio = "-" if st is None or not st["seq_s"] else f"{c['seq_s'] / st['seq_s']:.2f}"
        if st is not None and st["schedule"] == c["schedule"] and c.get("kind", "rra") == "rra":
            ratio += " (same schedule, measured twice)"
        meets = "-" if b is None else ("yes" if cont["p99_ms"] <= b else "no")
        out.append(f"| {_b(b)} | {_cell_sched(c)}: {c['seq_s']:.1f} "
                   f"({c['p99_ms']:,.0f}) | {st_txt} | {ratio} | {cont['seq_s']:.1f} ({cont['p99_ms']:,.0f}) | "
                   f"{c['seq_s'] / cont['seq_s']:.2f} | {meets} |")
    p = r["served_profile"]
    out += ["", f"Served profile (the door's own steps, fitted lines): RRA decode {p['decode']['ms'][0]:.1f} ms at "
            f"{p['decode']['batch'][0]:g} rows .. {p['decode']['ms'][-1]:.1f} at {p['decode']['batch'][-1]:g}; "
            f"prefill {p['prefill']['ms'][0]:.1f} ms at {p['prefill']['tokens'][0]:g} tokens .. "
            f"{p['prefill']['ms'][-1]:.1f} at {p['prefill']['tokens'][-1]:g}."]
    w = r.get("waa_served_profile")
    if w:
        out[-1] += (f" WAA decode iteration {w['decode']['ms'][0]:.1f} ms at {w['decode']['batch'][0]:g} rows .. "
                    f"{w['decode']['ms'][-1]:.1f} at {w['decode']['batch'][-1]:g}; encode pass "
                    f"{w['prefill']['ms'][0]:.1f} ms at {w['prefill']['tokens'][0]:g} tokens .. "
                    f"{w['prefill']['ms'][-1]:.1f} at {w['prefill']['tokens'][-1]:g}.")
    out[-1] += f" Errors: {_errors(r)}."
    return "\n".join(out)


def _errors(r: dict) -> int:
    rows = sum(row["chosen"]["errors"] + (row.get("static") or {}).get("errors", 0)
               + (row.get("other") or {}).get("errors", 0) for row in r["rows"])
    return rows + r["continuous"]["errors"]


def write_results_section(path: Path, results: dict) -> None:
    """Replace (or append) this benchmark's section of ``path`` between its markers; the rest is kept."""
    s = results["settings"]
    head = (f"## ExeGPT on Triton (issue 17: `e3 bench exegpt{' --quick' if s.get('quick') else ''}`, "
            f"{results['model']}, {results['date']})\n\nPrompts of {s['prompt_tokens']} tokens, output lengths "
            f"uniform {s['lengths'][0]}..{s['lengths'][-1]}, B_E 1..{s['batch_sizes'][-1]}, slack "
            f"{s['slack']:.0%}; bounds: {', '.join(str(f) for f in s['factors'])} x the predicted p99-length "
            f"latency of a static batch of one{', and none' if s.get('unbounded', True) else ''}; each run "
            f"measured over at most {s['measure_s']:.0f} s after a warm-up as large as its concurrency.\n")
    write_section(path, BEGIN, END, section=f"{head}\n{format_tables(results)}")
