"""`e3 bench admission`, the pure parts: the burst's arrival schedule, latency per phase, throughput at
the QoS target, and the tables (E²bird Fig. 13 and Fig. 14 analogues).

* **Burst** (Fig. 13): Poisson arrivals whose rate steps low -> high -> low
  (:func:`burst_schedule`); each request belongs to the phase it arrived in,
  and every phase reports its p50 / p99 against the QoS target.
* **Throughput at the QoS target** (Fig. 14): open-loop runs at rising offered
  rates; a rate *meets* the target when the run's p99 is within it and nothing
  failed. A server that cannot keep up builds a queue whose wait grows through
  the run, so runs last at least 4x the target (the bench sees to it) and p99
  alone tells; ``keep_up`` (share of the offered rate answered per second of
  arrivals, default off) can add a check. The figure is the answered rate of
  the highest rate that met it (:func:`throughput_at_qos`); the sweep stops at
  the first rate that misses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

__all__ = ["Phase", "burst_schedule", "phase_latencies", "RatePoint", "throughput_at_qos", "format_burst", "burst_rows", "admission_markdown",
           "format_throughput"]


@dataclass(frozen=True)
class Phase:
    name: str            # "low", "high", ...
    rate_rps: float      # offered requests/s
    duration_s: float


def burst_schedule(phases: Sequence[Phase], seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Arrival times (s from 0, increasing) of Poisson arrivals at each phase's rate, phases back to back,
    and the phase index of every arrival."""
    rng = np.random.default_rng(seed)
    times, labels, start = [], [], 0.0
    for i, p in enumerate(phases):
        if p.rate_rps <= 0 or p.duration_s <= 0:
            raise ValueError(f"phase {p.name}: rate and duration must be > 0, got {p.rate_rps}, {p.duration_s}")
        t = start + np.cumsum(rng.exponential(1.0 / p.rate_rps, size=int(p.rate_rps * p.duration_s * 1.5) + 10))
        t = t[t < start + p.duration_s]
        times.append(t)
        labels.append(np.full(len(t), i))
        start += p.duration_s
    return np.concatenate(times), np.concatenate(labels)


def phase_latencies(latency_ms: np.ndarray, phase: np.ndarray, failed: np.ndarray, *, phases: Sequence[Phase],
                    qos_ms: float) -> list[dict]:
    """Per phase: requests, failed, p50 / p99 (ms) of the answered ones, and whether p99 <= ``qos_ms``
    with none failed."""
    out = []
    for i, p in enumerate(phases):
        mine = phase == i
        ok = mine & ~failed
        lat = latency_ms[ok]
        p99 = float(np.percentile(lat, 99)) if len(lat) else float("nan")
        out.append({"phase": p.name, "rate_rps": p.rate_rps, "requests": int(mine.sum()),
                    "failed": int((mine & failed).sum()),
                    "p50_ms": float(np.percentile(lat, 50)) if len(lat) else float("nan"), "p99_ms": p99,
                    "meets_qos": bool(len(lat) and p99 <= qos_ms and not (mine & failed).any())})
    return out


@dataclass(frozen=True)
class RatePoint:
    offered_rps: float     # offered requests/s
    answered_rps: float    # requests answered successfully per second of arrivals
    p99_ms: float
    failed: int


def meets(point: RatePoint, qos_ms: float, keep_up: float = 0.0) -> bool:
    """The run at this rate met the target: p99 within it, nothing failed (and, with ``keep_up``, at
    least that share of the offered rate answered)."""
    return point.failed == 0 and point.p99_ms <= qos_ms and point.answered_rps >= keep_up * point.offered_rps


def throughput_at_qos(points: Sequence[RatePoint], qos_ms: float, keep_up: float = 0.0) -> float:
    """The answered rate (requests/s) of the highest offered rate that met the target, every lower rate
    having met it too (0 if the lowest missed)."""
    best = 0.0
    for p in sorted(points, key=lambda x: x.offered_rps):
        if not meets(p, qos_ms, keep_up):
            break
        best = p.answered_rps
    return best


def format_burst(rows: Sequence[dict], qos_ms: float, budget: str) -> str:
    """The Fig. 13 analogue: one line per system and phase."""
    lines = [f"latency through a low -> high -> low burst; QoS target p99 <= {qos_ms:.0f} ms; {budget}",
             f"{'system':<28} {'phase':<6} {'offered/s':>9} {'requests':>8} {'p50 ms':>8} {'p99 ms':>8}  QoS"]
    for r in rows:
        lines.append(f"{r['system']:<28} {r['phase']:<6} {r['rate_rps']:>9.1f} {r['requests']:>8d} "
                     f"{r['p50_ms']:>8.1f} {r['p99_ms']:>8.1f}  {'met' if r['meets_qos'] else 'MISSED'}"
                     + (f" ({r['failed']} failed)" if r["failed"] else ""))
    return "\n".join(lines)


def format_throughput(rows: Sequence[dict], qos_ms: float, budget: str) -> str:
    """The Fig. 14 analogue: throughput at the QoS target per system, and its ratio to OPT_Wait."""
    opt = next((r["throughput_rps"] for r in rows if r["system"].startswith("OPT_Wait")), None)
    lines = [f"throughput at the QoS target (p99 <= {qos_ms:.0f} ms, nothing failed); {budget}",
             f"{'system':<28} {'inputs/s':>9} {'vs OPT_Wait':>11}  config"]
    for r in rows:
        ratio = f"{r['throughput_rps'] / opt:.2f}x" if opt else "-"
        lines.append(f"{r['system']:<28} {r['throughput_rps']:>9.1f} {ratio:>11}  {r['config']}")
    return "\n".join(lines)


SAME_AS_NO_WAIT = "OPT_Wait (0 us)"   # OPT_Wait's sweep chose no delay: the NO_Wait configuration again


def shown_system(system: str) -> str:
    """A system's name in a table: OPT_Wait whose best delay was 0 us is said to be NO_Wait again."""
    return f"{system[:-1]}, the same system as NO_Wait)" if system == SAME_AS_NO_WAIT else system


def sweep_label(system: str) -> str:
    """The sweep's label of a table row: ``OPT_Wait (500 us)`` ran as ``wait 500 us`` (0 us: NO_Wait)."""
    if system.startswith("OPT_Wait ("):
        delay = system[len("OPT_Wait ("):].split()[0]
        return "NO_Wait" if delay == "0" else f"wait {delay} us"
    return system


def met_up_to(m: dict, system: str) -> tuple[float, float | None] | None:
    """From the rate sweep of ``m``: the highest offered rate at which ``system`` met the target (every lower
    rate too) and the next offered rate, which it missed (None: it met every rate tried); None when ``m``
    holds no sweep for it."""
    sweep = m.get("sweep", {}).get(sweep_label(system))
    if sweep is None:
        return None
    points = sorted((RatePoint(**p) for p in (sweep["points"] if isinstance(sweep, dict) else sweep)),
                    key=lambda p: p.offered_rps)
    met = 0.0
    for p in points:
        if not meets(p, m["qos_ms"]):
            return met, p.offered_rps
        met = p.offered_rps
    return met, None


def verdict(m: dict) -> str:
    """The issue's two claims, read off the figures: E-Ebird within the target in every burst phase while
    NO_Wait misses it in the high phase, and E-Ebird's throughput at the target against OPT_Wait's."""
    def phases(system: str) -> list[dict]:
        return [r for r in m["burst"] if r["system"] == system]
    ee_ok = bool(phases("E-Ebird")) and all(r["meets_qos"] for r in phases("E-Ebird"))
    no_high = [r for r in phases("NO_Wait") if r["phase"] == "high"]
    no_misses = bool(no_high) and not all(r["meets_qos"] for r in no_high)
    tput = {r["system"]: r["throughput_rps"] for r in m["throughput"]}
    opt = next((v for k, v in tput.items() if k.startswith("OPT_Wait")), None)
    ee = tput.get("E-Ebird")
    ratio = f"{ee / opt:.2f}x" if ee is not None and opt else "-"
    opt_name = next((k for k in tput if k.startswith("OPT_Wait")), "")
    ee_met = met_up_to(m, "E-Ebird")
    if ee_met is not None and ee_met == met_up_to(m, opt_name):
        # the same step of the sweep: the ratio is the sweep's resolution, not a difference between systems
        third = (f"E-Ebird's throughput at the target {ratio} OPT_Wait's: **not separated** (both met the target "
                 "up to the same rate of the sweep, so its steps, not the systems, set the ratio)")
    else:
        third = (f"E-Ebird's throughput at the target {ratio} OPT_Wait's "
                 f"(**{'>=' if ee is not None and opt is not None and ee >= opt else '<'}**)")
    return (f"Claims: E-Ebird's p99 within the target in every burst phase: **{'yes' if ee_ok else 'no'}**; "
            f"NO_Wait's p99 over it in the high phase: **{'yes' if no_misses else 'no'}**; {third}.")


def burst_rows(rows: Sequence[dict], digits: int = 1) -> list[str]:
    """The Fig. 13 analogue as markdown table lines: system, phase, offered rate, requests, p50, p99 (ms, to
    ``digits`` decimals) and whether the phase met the target."""
    out = ["| system | phase | offered/s | requests | p50 ms | p99 ms | within the target |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        ok = "yes" if r["meets_qos"] else "**no**" + (f" ({r['failed']} failed)" if r["failed"] else "")
        out.append(f"| {shown_system(r['system'])} | {r['phase']} | {r['rate_rps']:.1f} | {r['requests']} | {r['p50_ms']:.{digits}f} | "
                   f"{r['p99_ms']:.{digits}f} | {ok} |")
    return out


def admission_markdown(doc: dict, command: str) -> str:
    """docs/RESULTS.md's section for `e3 bench admission`: per model, the Fig. 14 analogue (throughput at
    the QoS target) and the Fig. 13 analogue (p50 / p99 per burst phase)."""
    out = [f"## Elastic admission (E²bird) against Triton's dynamic batcher (`{command}`)", "",
           f"Commit {doc.get('commit', 'unknown')}; every input through system shared memory; open-loop Poisson "
           "arrivals of single-input requests. The offline phase, the systems and what a CPU cannot show: "
           "`docs/admission.md`. JSON: `artifacts/results/admission.json`."]
    for name, m in doc["models"].items():
        if "error" in m:
            out += ["", f"### {name}: not measured", "", f"The benchmark's server failed: {m['error']}"]
            continue
        qos = m["qos_ms"]
        out += ["", f"### {name} ({m['stock']}): QoS target p99 <= {qos:.0f} ms, MaxBS {m['offline']['max_bs']}", "",
                f"Budget: {m['budget']}. Offline: one worker's latency per batch (ms) {m['offline']['latency_ms']}; "
                f"E-Ebird's best worker set per TotalBS {m['offline']['confs']}. NO_Wait's closed-loop capacity "
                f"{m['capacity_ips']:.1f} inputs/s; the sweep's rates are fractions of it."
                + (f" Load average (1 min) of the machine at the start / end: {m['load_avg'][0]:.1f} / "
                   f"{m['load_avg'][1]:.1f}." if m.get("load_avg") else ""), "",
                "Throughput at the QoS target (Fig. 14 analogue; the systems take turns at every rate):", "",
                "| system | inputs/s at the target | vs OPT_Wait | configuration |", "| --- | --- | --- | --- |"]
        opt = next((r["throughput_rps"] for r in m["throughput"] if r["system"].startswith("OPT_Wait")), None)
        for r in m["throughput"]:
            ratio = f"{r['throughput_rps'] / opt:.2f}x" if opt else "-"
            out.append(f"| {shown_system(r['system'])} | {r['throughput_rps']:.1f} | {ratio} | {r['config']} |")
        rounds = m.get("burst_rounds", 1)
        if m.get("closed_loop"):
            out += ["", "Closed loop (2 x MaxBS clients; median of runs, the systems in turn): inputs/s, and the "
                    "server's CPU per input (tritonserver and every stub), which a neighbour's load disturbs "
                    "least; `cores x 1000 / CPU ms` bounds a system's inputs/s at the budget:", "",
                    "| system | inputs/s | server CPU ms per input |", "| --- | --- | --- |"]
            out += [f"| {k} | {v['inputs_per_s']:.1f} | {v['cpu_ms_per_input']:.2f} |" for k, v in m["closed_loop"].items()]
        out += ["", "Latency through a low -> high -> low burst (Fig. 13 analogue"
                + (f"; {rounds} rounds, the systems in turn, pooled per phase" if rounds > 1 else "") + "):", "",
                *burst_rows(m["burst"], digits=1), "", verdict(m)]
        if m.get("burst_figure"):
            out += ["", f"![{name}: latency through the burst]({m['burst_figure']})"]
    return "\n".join(out)
