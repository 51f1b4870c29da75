"""The GPU side-by-side (``benchmarks/gpu_side_by_side.py``'s ``side_by_side.json``) as a section of
docs/RESULTS.md: ``e3 bench gpu --measured OUT_DIR``. Pure: a document in, markdown out.

Tables: the in-process limit (the same executors with nothing around them), the client's bound against a null
model (and whether it was at least 3x the best system's rate), the saturating runs through Triton with E3's
ratio to the best baseline and its share of its in-process limit, goodput at each p99 SLO (each system at its
best configuration for that SLO, the median of the repetitions with their min-max), E3's inline fallback where
it was measured (labelled, never in the comparison), and every served system's answers against the reference.
A setting with no measurement says so (and the run's ``failed`` list says which models stopped early): nothing
is filled in. Runs written before the repetitions and the client bound existed render as before.
"""

from __future__ import annotations

import json
from pathlib import Path

from e3.benchmarks.report import load_run, markers, write_section
from e3.core.names import BASELINES, SIDE_BY_SIDE
from e3.paths import project_root

__all__ = ["load_side_by_side", "render_side_by_side", "is_side_by_side", "write_side_by_side_section", "SECTION"]

SECTION = "gpu-side-by-side"
SYSTEMS = SIDE_BY_SIDE


def load_side_by_side(path: str | Path) -> dict:
    """``side_by_side.json`` from a run folder or the file itself; a clear error if it is not one."""
    p, doc = load_run(path, "side_by_side.json", "benchmarks/gpu_side_by_side.py")
    for key in ("device", "rows", "limit"):
        if key not in doc:
            raise ValueError(f"{p} is not a GPU side-by-side run (no {key!r})")
    return doc


def is_side_by_side(path: str | Path) -> bool:
    """Whether ``path`` is a side-by-side run (its folder or its ``side_by_side.json``), not a latency profile."""
    p = Path(path)
    return (p / "side_by_side.json").is_file() if p.is_dir() else p.name.startswith("side_by_side")


def write_side_by_side_section(path: str | Path, results_md: Path | None = None) -> str:
    """Render the run at ``path`` into its section of docs/RESULTS.md (the rest of the file kept); returns the
    section's text."""
    doc = load_side_by_side(path)
    p = Path(path)
    try:
        source = str((p if p.is_file() else p / "side_by_side.json").resolve().relative_to(project_root()))
    except ValueError:
        source = str(p)
    text = "### GPU side by side: E3, the stock model and naive early exit through Triton\n\n" + \
        render_side_by_side(doc, source=source)
    write_section(results_md or project_root() / "docs" / "RESULTS.md", *markers("e3 bench gpu --measured"),
                  section=text)
    return text


def _f(x, digits=0) -> str:
    return "—" if x is None else f"{x:,.{digits}f}"


def _ratio(a, b) -> str:
    return "—" if not a or not b else f"{a / b:.2f}x"


def _spread(row: dict) -> str:
    c = row["config"]
    return f" [{_f(c['goodput_min'])}-{_f(c['goodput_max'])}]" if c.get("goodput_min") is not None else ""


def _config(row: dict, system: str, brief: bool = False) -> str:
    """The winning configuration: instances, the batcher's delay (baselines), the answering form (E3)."""
    c = row["config"]
    parts = [f"x{c['instances']}"] if c.get("instances") else []
    if system != "e3" and c.get("queue_delay_us"):
        parts.append(f"delay {c['queue_delay_us']} us")
    if system == "e3" and c.get("answering") and not brief:
        parts.append(c["answering"])
    if not parts:
        return ""
    return f" ({', '.join(parts)})" if brief else ", " + ", ".join(parts)


def render_side_by_side(doc: dict, *, source: str = "") -> str:
    """The section's markdown (without the section markers)."""
    lines = [f"Measured on **{doc['device']}**{f' ({source})' if source else ''}: "
             f"{doc.get('budget', 'one device, one system at a time')}; exits **{doc.get('exits', 'model rule')}**; "
             f"requests of {doc.get('inputs_per_request', 8)} inputs through Triton's gRPC front door. "
             f"Settings: `{json.dumps(doc.get('settings', {}))}`.", ""]
    failed = doc.get("failed", [])
    if failed:
        lines += [f"Stopped early: {', '.join(failed)} (the notes below the tables say why).", ""]
    depth = max((r.get("in_flight", 0) for r in doc["limit"]), default=0)
    overlap = (f"; every system with {depth} batches in flight, as E3's pipeline" if depth > 1 else
               "" if depth else "; the baselines one batch at a time")
    lines += [f"**In process** (the same executors and the same device, nothing around them{overlap}; inputs/s):", "",
              "| model | mix | B | stock | naive EE | E3 | E3 / stock | E3 / naive | ideal | E3's cuts |",
              "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in doc["limit"]:
        lines.append(f"| {r['model']} | {r['mix']} | {r['max_batch']} | {_f(r['stock'])} | {_f(r['ee'])} | "
                     f"{_f(r['e3'])} | {_ratio(r['e3'], r['stock'])} | {_ratio(r['e3'], r['ee'])} | "
                     f"{r['ideal']:.2f}x | {r['cuts']} |")
    main_rows = [r for r in doc["rows"] if not r["config"].get("extra")]
    sat = {(r["model"], r["mix"], r["max_batch"], r["system"]): r for r in main_rows if r["slo_ms"] is None}
    limit = {(r["model"], r["mix"], r["max_batch"]): r for r in doc["limit"]}
    keys = sorted({k[:3] for k in limit} | {k[:3] for k in sat}, key=lambda k: (k[0], k[1] != "80-20", k[2]))
    bounds = doc.get("client_bound", [])
    if bounds:
        lines += ["", "**The client's bound** (the same client processes and request shape against a null model that "
                  "answers zeros at once; inputs/s, median [min-max]):", ""]
        for b in bounds:
            verdict = "" if b.get("ratio") is None else (
                f" = {b['ratio']:.1f}x the best system's rate" + ("" if b.get("ok") else
                                                                 " — **below 3x: the client may be the limit**"))
            lines.append(f"- {b['model']}, B = {b['max_batch']}: {_f(b['inputs_per_s'])} [{_f(b['inputs_per_s_min'])}-"
                         f"{_f(b['inputs_per_s_max'])}] with {b['processes']} client processes at {b['concurrency']} "
                         f"requests in flight{verdict}")
    lines += ["", "**Through Triton, saturating load** (inputs/s; where repeated, the median of the runs [min-max]; p99 ms; "
              "each system at its best configuration: instances x, batcher delay):", "",
              "| model | mix | B | stock | naive EE | E3 | E3 / best baseline | E3's share of its in-process figure |",
              "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for k in keys:
        cell = {s: sat.get((*k, s)) for s in SYSTEMS}

        def show(s):
            r = cell[s]
            if r is None:
                return "not measured"
            return f"{_f(r['goodput'])}{_spread(r)} (p99 {_f(r['p99_ms'], 1)}{_config(r, s)})"
        best = max((cell[s]["goodput"] for s in BASELINES if cell[s]), default=None)
        e3 = cell["e3"]["goodput"] if cell["e3"] else None
        share = _ratio(e3, limit[k]["e3"]) if k in limit and e3 else "—"
        lines.append(f"| {k[0]} | {k[1]} | {k[2]} | {show('stock')} | {show('ee')} | {show('e3')} | "
                     f"{_ratio(e3, best)} | {share} |")
    slo_rows = [r for r in main_rows if r["slo_ms"] is not None]
    if slo_rows:
        slos = sorted({r["slo_ms"] for r in slo_rows})
        lines += ["", "**Goodput at a p99 SLO** (inputs/s within the SLO at the best measured load whose p99 "
                  "meets it, each system at its best configuration for that SLO; — none did):", "",
                  "| model | mix | B | system | " + " | ".join(f"p99 ≤ {s:g} ms" for s in slos) + " |",
                  "| --- | --- | ---: | --- | " + " | ".join("---:" for _ in slos) + " |"]
        by = {}
        for r in slo_rows:
            by.setdefault((r["model"], r["mix"], r["max_batch"], r["system"]), {})[r["slo_ms"]] = r
        for key in sorted(by, key=lambda k: (k[0], k[1] != "80-20", k[2], SYSTEMS.index(k[3]))):
            cells = [(f"{_f(by[key][s]['goodput'])}{_spread(by[key][s])}{_config(by[key][s], key[3], brief=True)}"
                      if by[key].get(s) and by[key][s]["goodput"] else "—") for s in slos]
            lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | " + " | ".join(cells) + " |")
    extra = [r for r in doc["rows"] if r["config"].get("extra")]
    if extra:
        lines += ["", "**Not in the comparison** (labelled extras):", ""]
        for r in extra:
            slo = "saturating" if r["slo_ms"] is None else f"p99 ≤ {r['slo_ms']:g} ms"
            lines.append(f"- {r['model']} {r['mix']} B = {r['max_batch']}, {slo}: {r['system']} "
                         f"({r['config']['extra']}) {_f(r['goodput'])}{_spread(r)}{_config(r, r['system'])}")
    hops = doc.get("hops", [])
    if hops:
        lines += ["", "**A split boundary's price** (ms, median; the model's cut state at B): a BLS call between two "
                  "Triton models with device tensors, a round trip through host memory, and E3's device-resident "
                  "hand-off (the survivors gathered on the device):", "",
                  "| model | B | BLS, device tensors | through host memory | device hand-off |",
                  "| --- | ---: | ---: | ---: | ---: |"]
        lines += [f"| {h['model']} | {h['max_batch']} | {h['bls_ms']:.3f} | {h['host_ms']:.3f} | {h['handoff_ms']:.3f} |"
                  for h in hops]
    answers = doc.get("answers", {})
    if answers:
        lines += ["", "**Answers through Triton against the PyTorch reference** (FP32, one input at a time; "
                  "labels / exit ramps equal):", ""]
        for model, checks in answers.items():
            parts = [f"`{name}` ({c['precision']}) {c['label_equal']:.0%} / {c['exit_ramp_equal']:.0%}"
                     for name, c in checks.items()]
            lines.append(f"- {model}: " + "; ".join(parts) + f" (of {next(iter(checks.values()))['inputs']} inputs each)")
    notes = doc.get("notes", [])
    if notes:
        lines += ["", "Notes:", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"
