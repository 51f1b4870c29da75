"""E²bird's stage through Triton (``benchmarks/admission_triton.py``'s ``admission_triton.json``) as a section of
docs/RESULTS.md: ``e3 bench admission --measured FILE``. Pure: a document in, markdown out; the claims are read off
the figures (nothing is filled in where a run stopped early).

Per model: the rule and what the offline phase made of it, the answers against the reference, throughput at the
QoS target for every system (OPT_Wait shown apart only where its best delay is not 0; the best instance count),
each system's sweep up to its first miss, the burst's p50/p99 per phase, and the issue's claims: E-Ebird's
throughput at the target against the best baseline's (target 1.3x) and E-Ebird's p99 within the target in the
burst's high phase.
"""

from __future__ import annotations

from pathlib import Path

from e3.benchmarks.report import load_run, write_section

__all__ = ["load_admission_triton", "render_admission_triton", "write_admission_triton_section", "BEGIN", "END",
           "not_measured_section"]

BEGIN, END = "<!-- admission-triton:begin -->", "<!-- admission-triton:end -->"
TITLE = "## Elastic admission (E²bird) through Triton on a GPU (`benchmarks/admission_triton.py`)"
COMMAND = "python3 benchmarks/admission_triton.py OUT_DIR --budget-s 420"
TARGET_RATIO = 1.3


def load_admission_triton(path: str | Path) -> dict:
    """``admission_triton.json`` from a run folder or the file itself; a clear error if it is not one."""
    p, doc = load_run(path, "admission_triton.json", "benchmarks/admission_triton.py")
    if doc.get("kind") != "admission-triton" or not isinstance(doc.get("models"), dict):
        raise ValueError(f"{p} is not a run of benchmarks/admission_triton.py (no kind 'admission-triton')")
    return doc


def _baselines(m: dict) -> list[str]:
    """The baselines' labels as measured: NO_Wait, the delays, the instance counts."""
    return [lb for lb in m["systems"] if not lb.startswith(("N-Ebird", "E-Ebird"))]   # the stages, any form


def _tput(m: dict, label: str) -> tuple[float, bool]:
    t = m["throughput"][label]
    return t["rps"], t["lower_bound"]


def claims(m: dict) -> dict:
    """The issue's claims read off one model's figures."""
    best = max(_baselines(m), key=lambda lb: _tput(m, lb)[0])
    ee, ee_bound = _tput(m, "E-Ebird")
    base, base_bound = _tput(m, best)
    ratio = ee / base if base else float("inf")
    high = [r for r in m.get("burst", []) if r["system"] == "E-Ebird" and r["phase"] == "high"]
    return {"best_baseline": best, "ratio": ratio, "ratio_is_lower_bound": ee_bound and not base_bound,
            "ratio_meets": ratio >= TARGET_RATIO, "burst_high_met": bool(high) and all(r["meets_qos"] for r in high),
            "baseline_unbounded": base_bound}


def _model_section(name: str, m: dict, doc: dict) -> list[str]:
    off = m["offline"]
    out = ["", f"### {name} on {doc['device']}: QoS target p99 <= {m['qos_ms']:.2f} ms, MaxBS {off['max_bs']}, "
               f"{m['per_request']} inputs per request", "",
           f"Offline (on the device, {off['timed_by']}): one worker's latency per batch (ms) "
           + ", ".join(f"{b}: {v:.3f}" for b, v in off["latency_ms"].items())
           + f"; compute budget {off['budget_ms']:.3f} ms; E-Ebird's sets per TotalBS {off['confs']}, MaxInf "
             f"{off['max_inflight']}. QoS = NO_Wait's p99 at a light load ({m['floor_p99_ms']:.2f} ms) + the budget. "
             f"NO_Wait's capacity {m['capacity_rps']:,.0f} requests/s ({m['capacity_rps'] * m['per_request']:,.0f} "
             "inputs/s); the sweep's rates start at a fraction of it."]
    ans = m.get("answers", {})
    if ans:
        out += ["", "Answers against the PyTorch reference (labels equal): "
                + ", ".join(f"{lb} {v:.0%}" for lb, v in ans.items()) + "."]
    if "throughput" not in m:
        return out + ["", "**Stopped before the rate sweep ended**: no throughput at the target is reported."]
    opt = m["opt_wait"]
    rows = ["NO_Wait"] + ([] if opt["same_as_no_wait"] else [opt["label"]]) + \
        ([m["instances_best"]] if m.get("instances_best") else []) + ["N-Ebird", "E-Ebird"]
    no_wait = _tput(m, "NO_Wait")[0]
    c = claims(m)
    best = _tput(m, c["best_baseline"])[0]
    out += ["", "Throughput at the QoS target (the answered rate at the highest offered rate met, every lower rate "
            "met too; ≥: it met every rate offered):", "",
            "| system | requests/s | inputs/s | vs NO_Wait | vs best baseline | configuration |",
            "| --- | --- | --- | --- | --- | --- |"]
    for lb in rows:
        rps, bound = _tput(m, lb)
        shown = f"OPT_Wait ({opt['delay_us']} us)" if lb == opt["label"] and not opt["same_as_no_wait"] else lb
        ge = "≥ " if bound else ""
        out.append(f"| {shown} | {ge}{rps:,.0f} | {ge}{m['throughput'][lb]['ips']:,.0f} | "
                   f"{rps / no_wait:.2f}x | {rps / best:.2f}x | {m['systems'][lb]['config']} |" if no_wait and best else
                   f"| {shown} | {ge}{rps:,.0f} | {ge}{m['throughput'][lb]['ips']:,.0f} | - | - | "
                   f"{m['systems'][lb]['config']} |")
    delays = [lb for lb in _baselines(m) if lb.startswith("wait ")]
    if opt["same_as_no_wait"]:
        out += ["", f"OPT_Wait: the delay sweep ({', '.join(d[5:] for d in delays)}) gave no more throughput at the "
                "target than no delay, so OPT_Wait is NO_Wait here and is not shown apart."]
    others = [lb for lb in _baselines(m) if lb.startswith("instances") and lb != m.get("instances_best")]
    if others:
        out += ["", "Also measured: " + ", ".join(f"{lb} {_tput(m, lb)[0]:,.0f} requests/s" for lb in others
                                                  + [d for d in delays if d != opt["label"]]) + "."]
    chk = m.get("client_check")
    if chk:
        out += ["", f"Load generator: {chk['processes']} client processes offered {chk['factor']:g}x the best system's "
                f"throughput ({chk['best_system']}), {chk['offered_rps']:,.0f} requests/s, to a null model behind the "
                f"same front door: answered {chk['answered_rps']:,.0f}/s, p99 {chk['p99_ms']:.2f} ms, clients late by "
                f"{chk['late_p99_ms']:.2f} ms at p99: "
                + ("**the clients are not the limit of these figures**." if chk["ok"] else
                   "**the clients may be the limit of these figures** (they could not send that rate on time).")]
    else:
        out += ["", "Load generator: not checked against a null model in this run (an older run)."]
    if m.get("client_bound_rps"):
        out += ["", f"**The clients fell behind the schedule at {m['client_bound_rps']:,.0f} requests/s**: the sweep "
                f"stopped there; {', '.join(m.get('unmissed', [])) or 'no system'} had not missed yet (lower bounds)."]
    elif m.get("unmissed"):
        out += ["", f"The sweep's last rate was reached with {', '.join(m['unmissed'])} still within the target "
                "(lower bounds)."]
    out += ["", "The sweep (p99 ms per offered rate; the last entry of a system is its first miss, then the rate "
            "between its last met and first missed):", "", "| system | offered requests/s: p99 ms |", "| --- | --- |"]
    for lb in m["systems"]:
        pts = m["sweep"][lb]
        out.append(f"| {lb} | " + ", ".join(f"{p['offered_rps']:,.0f}: {p['p99_ms']:.2f}{'' if p['met'] else ' ✗'}"
                                             for p in pts) + " |")
    if m.get("burst"):
        out += ["", "Latency through a low -> high -> low burst (fractions of NO_Wait's capacity):", "",
                "| system | phase | offered requests/s | requests | p50 ms | p99 ms | within the target |",
                "| --- | --- | --- | --- | --- | --- | --- |"]
        for r in m["burst"]:
            ok = "yes" if r["meets_qos"] else "**no**" + (f" ({r['failed']} failed)" if r["failed"] else "")
            out.append(f"| {r['system']} | {r['phase']} | {r['rate_rps']:,.0f} | {r['requests']} | {r['p50_ms']:.2f} | "
                       f"{r['p99_ms']:.2f} | {ok} |")
    ratio = f"{'≥ ' if c['ratio_is_lower_bound'] else ''}{c['ratio']:.2f}x"
    out += ["", f"Claims: E-Ebird's throughput at the target {ratio} the best baseline's ({c['best_baseline']}; the "
            f"target is {TARGET_RATIO}x): **{'met' if c['ratio_meets'] else 'not met'}**"
            + (" (the baseline met every rate offered: its figure is a lower bound, so the ratio is an upper one)"
               if c["baseline_unbounded"] else "")
            + f"; E-Ebird's p99 within the target in the burst's high phase: "
              f"**{'yes' if c['burst_high_met'] else 'no' if m.get('burst') else 'not measured'}**."]
    return out


def render_admission_triton(doc: dict) -> str:
    out = [TITLE, "",
           f"Commit {doc.get('commit', 'unknown')} on {doc['device']} (torch {doc.get('torch', '?')}). {doc['budget']}. "
           "Open-loop Poisson arrivals over gRPC, the same arrivals for every system at a rate. The rule that set "
           f"MaxBS, MaxInf and the target before the run: {doc['rule']} (`serving/ebird/offline.py`). "
           "Random weights (latency does not depend on them). JSON: `docs/data/<gpu>/admission_triton.json`."]
    if doc["device"] == "cpu":
        out += ["", "**A CPU smoke run (`--cpu`)**: it shows the runner works end to end, not a figure about "
                "E²bird (tiny-ee's head path, eager, on a shared CPU)."]
    for name, m in doc["models"].items():
        out += _model_section(name, m, doc)
    for key, what in (("failed", "failed"), ("skipped", "were skipped (time budget)")):
        if doc.get(key):
            out += ["", f"Models that {what}: {', '.join(doc[key])}."]
    return "\n".join(out)


def not_measured_section() -> str:
    """What the section says before any GPU run."""
    return "\n".join([TITLE, "", "**Not measured yet**: no GPU host was available to the session that built the "
                      "stage on the GPU. One call on a GPU host measures it (a few minutes, `.gpu_wheels/` carried: "
                      f"`make gpu-wheels`): `{COMMAND}`; then keep `OUT_DIR/admission_triton.json` as "
                      "`docs/data/<gpu>/admission_triton.json` and run `e3 bench admission --measured "
                      "docs/data/<gpu>/admission_triton.json`, which writes this section from that file. The emulated "
                      "GPU figures below (outside Triton, inputs pre-staged) are what there is until then."])


def write_admission_triton_section(path: str | Path | None, results_md: str | Path) -> str:
    """Write the section into ``results_md`` from the run at ``path`` (None: the not-measured text); returns it."""
    text = render_admission_triton(load_admission_triton(path)) if path is not None else not_measured_section()
    write_section(results_md, BEGIN, END, section=text)
    return text
