"""`e3 bench gpu`: GPU clusters by simulation, with MODELLED GPU profiles (glue only).

It reads (or makes) the modelled profile (``e3 profile --modelled``), the bert-ee 80:20 workload
(``e3 workload``: its batch profile and every input's reference exit), runs the simulations of
:mod:`e3.benchmarks.gpu_clusters`, and writes ``artifacts/results/gpu_sim.json``, the plot
``docs/figures/gpu_goodput_vs_batch.png`` and its own section of ``docs/RESULTS.md`` (between
``<!-- gpu-sim:begin -->`` and ``<!-- gpu-sim:end -->``; the rest of the file is left alone).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from pathlib import Path
from typing import Callable

import numpy as np

from e3.benchmarks.gpu_clusters import (GpuSimSettings, batch_table, best_baseline, cost_at_goodput, cost_table,
                                        describe_plan, goodput_ratios, goodput_vs_batch, heterogeneity,
                                        heterogeneity_table, plan_for, plot_goodput, results_document, saturated,
                                        simulate_e3, with_link)
from e3.benchmarks.report import commit, replace_between
from e3.benchmarks.side_by_side import load_workloads
from e3.core.files import write_atomic, write_json_atomic
from e3.core.profile import LatencyProfile
from e3.models.zoo import resolve_model
from e3.paths import artifacts_dir, project_root
from e3.profiling.modelled_profile import TX_FIXED_MS, TX_GBIT_S, model_modelled_profile
from e3.profiling.profiler import default_profile_path

__all__ = ["run_gpu_bench", "run_measured_gpu_bench", "beside_table", "BEGIN", "END", "FIGURE", "replace_gpu_section"]

log = logging.getLogger(__name__)

BEGIN, END = "<!-- gpu-sim:begin -->", "<!-- gpu-sim:end -->"
FIGURE = "figures/gpu_goodput_vs_batch.png"          # relative to docs/
MODELLED_GPUS = ("v100", "t4", "a100")
# said above every GPU cluster figure until the simulator is validated on a GPU (issue 42, item 3)
UNVALIDATED_ON_GPU = ("**The simulator's rules are validated on this project's 2-core CPU only**, and not to its "
                      "bar there (docs/RESULTS.md, issue 42); no GPU run has validated them yet (a GPU side-by-side "
                      "exists, `docs/data/h100`, but no GPU profile of its model to price it): every cluster figure "
                      "below extrapolates with rules not validated on a GPU.")


def replace_gpu_section(document: str, section: str) -> str:
    """``document`` with its gpu-sim section replaced (appended when absent): the one section writer,
    :func:`e3.benchmarks.report.replace_between`, with this section's markers."""
    return replace_between(document, BEGIN, END, section=section, name="gpu-sim")


def _workload(model: str, mix: tuple[int, int], echo):
    """The mix's batch profile, every input's reference exit (``e3 workload``, made when missing) and the
    planner's keywords from the model's card (exit rule, ramps; none where the card cannot be built)."""
    wl = load_workloads(model, [mix], echo)[mix]
    exit_ramp = np.load(artifacts_dir() / "workloads" / model / f"mix-{mix[0]}-{mix[1]}.npz")["exit_ramp"]
    plan_kw: dict = {}
    try:
        card = resolve_model(model).card
        plan_kw = {"exit_rule": dict(card.exit_rule), "ramp_blocks": list(card.ramp_blocks)}
    except Exception as err:   # the plan's rule is not simulated (exits come from the workload): a label only
        log.info("no model card for %s (%s): plans carry a placeholder exit rule", model, err)
    return wl["batch_profile"], exit_ramp, plan_kw


def _profile(model: str, gpus, echo):
    path = default_profile_path(model, list(gpus), modelled=True)
    if path.exists():
        return LatencyProfile.load(path)
    echo(f"[setup] modelling the GPU profile of {model} on {', '.join(gpus)} (e3 profile --modelled) -> {path}")
    profile = model_modelled_profile(model, list(gpus))
    profile.save(path)
    return profile


SENSITIVITY = (  # (label, hop link Gbit/s or None: the settings', settings changed, split forms)
    ("as modelled: hop over PCIe, router work beside the GPUs", None, {}, None),
    ("constant splits forced (E3's own form)", None, {}, ("constant",)),
    ("router work inside every split's time (the earlier model)", None, {"router_cores_per_gpu": 0.0}, None),
    ("router work on 1 host core (one router process: one GIL)", None, {"router_cores": 1}, None),
    ("router slots as today's router (instances + 1 per split)", None, {"router_slots": 1}, None),
    ("router work x 0.1 (compiled router code, assumed)", None, {"router_scale": 0.1}, None),
    ("a hop's fixed 0.2 ms holds the copy engine", None, {"hop_fixed_latency": False}, None),
    ("hops across machines at 25 Gbit/s", 25.0, {}, None),
    ("hops at the paper's 10 Gbit/s Ethernet", 10.0, {}, None),
    ("the earlier model: 25 Gbit/s, router work inside, no output copy", 25.0,
     {"router_cores_per_gpu": 0.0, "out_copy": False, "hop_fixed_latency": False}, None))


def _sensitivity(modelled, batch_profile, exit_ramp, settings, plan_kw, echo) -> list[dict]:
    """Why E3's ratio is what it is: the same cell (``settings.hetero_batch`` inputs per request, the
    homogeneous cluster) with one assumption changed at a time (:data:`SENSITIVITY`). ``modelled``: the
    profile as ``e3 profile --modelled`` wrote it (hops at its 25 Gbit/s)."""
    rows, baselines = [], {}
    for label, gbit, changes, forms in SENSITIVITY:
        gbit = settings.link_gbit_s if gbit is None else gbit
        changes = dict(changes)
        scale = changes.pop("router_scale", 1.0)
        st = dataclasses.replace(settings, **changes)
        lat = _linked(modelled, gbit, settings.link_fixed_ms)
        if scale != 1.0:
            lat = copy.deepcopy(lat)
            lat.router_ms = {d: [x * scale for x in ys] for d, ys in lat.router_ms.items()}
        plan = plan_for(lat, batch_profile, {st.device: st.gpus}, settings=st, forms=forms, **plan_kw)
        e3 = simulate_e3(lat, plan, exit_ramp, batch=st.hetero_batch, settings=st)
        if gbit not in baselines:   # the baselines see only the link (their inputs' copy)
            baselines[gbit] = [best_baseline(lat, k, st.device, gpus=st.gpus, exit_ramp=exit_ramp, batch=st.hetero_batch, settings=st)
                               for k in ("stock", "ee")]
        stock, ee = baselines[gbit]
        rows.append({"variant": label, "plan": describe_plan(plan), "predicted_ips": e3.predicted_ips,
                     "e3": e3.goodput_ips, "e3_saturated": bool(saturated(e3.sweep, st.rise)),
                     "stock": stock.goodput_ips, "ee": ee.goodput_ips})
        echo(f"[sensitivity] {label}: E3 {e3.goodput_ips:,.0f}, stock {stock.goodput_ips:,.0f}, "
             f"EE {ee.goodput_ips:,.0f}")
    return rows


def _linked(modelled, gbit_s: float, fixed_ms: float):
    """``modelled`` (hops at ``e3 profile --modelled``'s link) with its hops re-priced at ``gbit_s`` and
    ``fixed_ms`` per hop (:func:`e3.benchmarks.gpu_clusters.with_link`)."""
    if (gbit_s, fixed_ms) == (TX_GBIT_S, TX_FIXED_MS):
        return modelled
    return with_link(modelled, gbit_s, modelled_gbit_s=TX_GBIT_S, fixed_ms=TX_FIXED_MS, new_fixed_ms=fixed_ms)


def _diagnosis(latency, settings, plan) -> str:
    """The profile's numbers that decide the plan, at the largest batch: a block, the router's work per
    batch, a cut's hop."""
    b, d = latency.batch_sizes[-1], settings.device
    block = latency.block(2, d, b, with_ramp=False)
    forms = sorted({s.form for s in plan.splits})
    return (f"At batch {b} on a modelled {d}, one block of the model costs {block:.3f} ms, the router's work per "
            f"batch (Python, measured on this host) {latency.router(d, b):.3f} ms, and a cut's hop "
            f"{latency.tx(d, b):.3f} ms (inputs' hop {latency.tx_in(d, b):.3f} ms). The planner chose "
            f"{', '.join(forms)} splits. Each constant split's instance is a pipeline of copy in, compute, copy "
            "out and the router's host work, so its rate is set by the slowest of them: at these sizes the "
            "router's work per batch is longer than one or two blocks of this small model (6 layers, hidden "
            "384, 48 tokens), so E3's splits are bound by the router, not by the GPU; the rows below change one "
            "assumption at a time. Naive early exit beats stock because the modelled layer grows with the "
            "batch past batch ~10 (`benchmarks/gpu_clusters.py` says why that is consistent with the public figures), "
            "so its shrinking batches save time.")


def _sensitivity_table(rows) -> str:
    out = ["| variant (MODELLED) | E3 plan | planner's prediction | E3 | stock | naive EE | E3 / EE | E3 / stock |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        star = "" if r.get("e3_saturated", True) else "*"
        out.append(f"| {r['variant']} | {r['plan']} | {r['predicted_ips']:,.0f} | {r['e3']:,.0f}{star} | {r['stock']:,.0f} | "
                   f"{r['ee']:,.0f} | {r['e3'] / r['ee']:.2f}x | {r['e3'] / r['stock']:.2f}x |")
    return "\n".join(out)


def run_gpu_bench(quick: bool = False, model: str = "bert-ee", mix: tuple[int, int] = (80, 20),
                  *, out: Path | None = None, results_md: Path | None = None, figure: Path | None = None,
                  docs: bool = True, echo: Callable[[str], None] = print) -> dict:
    """Run every GPU simulation (module docstring); returns the results document."""
    started = time.monotonic()
    settings = GpuSimSettings.quick() if quick else GpuSimSettings()
    modelled = _profile(model, MODELLED_GPUS, echo)
    latency = _linked(modelled, settings.link_gbit_s, settings.link_fixed_ms)
    batch_profile, exit_ramp, plan_kw = _workload(model, mix, echo)
    say = (lambda m: echo(f"[goodput vs batch] {m}"))
    cluster = f"{settings.gpus} x {settings.device}"
    echo(f"[gpu] MODELLED profiles ({', '.join(MODELLED_GPUS)}), {model} {mix[0]}:{mix[1]}, {cluster}"
         + (" (quick)" if quick else ""))
    cells, plan = goodput_vs_batch(latency, batch_profile, exit_ramp, settings=settings, progress=say, plan_kw=plan_kw)
    hetero = heterogeneity(latency, batch_profile, exit_ramp, settings=settings, progress=lambda m: echo(f"[fixed cost] {m}"),
                           plan_kw=plan_kw)
    e3_at = next(c for c in cells if c.system == "e3" and c.batch == settings.hetero_batch) \
        if settings.hetero_batch in settings.batches else cells[0]
    target = round(settings.goodput_share * e3_at.goodput_ips, -3)
    cost = cost_at_goodput(latency, batch_profile, exit_ramp, target_ips=target, settings=settings,
                           progress=lambda m: echo(f"[fixed goodput] {m}"), plan_kw=plan_kw)
    sensitivity = _sensitivity(modelled, batch_profile, exit_ramp, settings, plan_kw, echo)
    doc = results_document(settings, latency, cells, plan=plan, hetero=hetero, cost=cost, commit=commit(), quick=quick,
                           mix=f"{mix[0]}:{mix[1]}", sensitivity=sensitivity,
                           seconds=round(time.monotonic() - started, 1))
    out = out or artifacts_dir() / "results" / "gpu_sim.json"
    write_json_atomic(out, doc, indent=1, sort_keys=False)
    echo(f"wrote {out}")
    if not docs:
        return doc
    docs_dir = project_root() / "docs"
    figure = figure or docs_dir / FIGURE
    figure.parent.mkdir(parents=True, exist_ok=True)
    plot_goodput([c.to_dict() for c in cells], f"{model} {mix[0]}:{mix[1]}, {cluster}, simulated", figure)
    echo(f"wrote {figure}")
    ratios = doc["ratios"]
    big = {b: r for b, r in ratios.items() if int(b) >= 8}
    command = "e3 bench gpu --quick" if quick else "e3 bench gpu"
    section = "\n".join([
        f"## GPU clusters by simulation: MODELLED GPU profiles (`{command}`)",
        "",
        "**Every figure in this section is MODELLED, not measured**: per-layer GPU latencies come from public "
        "whole-model BERT-base figures (`e3 profile --modelled`, `docs/data/public/gpu_latency_public.csv`: curve / 12 "
        "layers, scaled to each block by FLOPs), and the goodputs from the discrete-event simulator "
        f"(`simulator/`, SimPy, the real scheduler). {model}, mix {mix[0]}:{mix[1]} (its batch profile and every "
        f"input's reference exit, `e3 workload`); SLO {settings.slo_ms:g} ms; commit {doc['commit']}; JSON "
        "`artifacts/results/gpu_sim.json`.",
        "",
        UNVALIDATED_ON_GPU,
        "",
        "Assumptions (the paper is silent or describes another stack; `benchmarks/gpu_clusters.py` and `simulator/des.py` "
        "say why): one Triton instance per GPU for every system; each baseline in its best (max batch, queue delay) "
        "of a small grid, each saturated on its own; E3 runs the planner's plan for the same GPUs. *Hops*: our "
        "router moves a cut's state through its host memory, so a hop between GPUs of one machine is a copy out "
        "of one GPU and into another over PCIe: modelled as "
        f"{settings.link_fixed_ms:g} ms + the FP32 state's bytes at {settings.link_gbit_s:g} Gbit/s (PCIe 3.0 x16, "
        "the V100 hosts of the price model), the cluster taken as machines of 8 GPUs with a router each (the "
        "paper: GPUs of a server share PCIe); the copy in and the copy out"
        + (" (every row of a constant split's batch)" if settings.out_copy else "") +
        " each run on a copy engine beside the compute (E3 §3.2.2's pipelining)"
        + (", the engine busy for the bytes only (a hop's fixed part is the BLS handshake between host threads: "
           "latency)" if settings.hop_fixed_latency else "") + "; an execute carrying model "
        "inputs pays `tx_in` the same way (all systems). Hops across machines (25 Gbit/s; the paper's 10 Gbit/s "
        "Ethernet) are rows of the table below. *Router*: its per-batch work (`router_ms`, Python, measured on "
        "this host's CPU) runs on the host beside the GPUs, as the real router's worker threads do it while the "
        "split's Triton instance runs the next batch: a pipeline stage of its own for a constant split, on "
        f"{settings.router_cores_per_gpu:g} host cores per GPU (AWS p3 hosts: 8 vCPUs per V100), one batch in "
        "flight per stage per instance; inside a compact split's time (it runs the blocks from the router's "
        "thread). The planner counts the router's work inside every stage (right on a CPU), so the bench also "
        "asks it for constant plans priced with these stages beside the compute and keeps the faster. *Latency "
        "curve*: kept as modelled (flat to batch ~10, then growing: at batch 64 a layer is ~11 GFLOP at ~47 "
        "TFLOPS, the FP16 rate the public BERT-base figures reach from 1,024 tokens). A further request merged "
        f"into one execute costs {settings.request_ms:g} ms. *Batcher model*: a free instance takes whole queued "
        "requests up to its max batch, at once without a delay, else when the max batch waits or the oldest has "
        "waited the delay. *Saturation*: a closed loop, inputs in flight doubling from "
        f"{settings.inflight_start} until goodput rises by less than {settings.rise:.0%} (the sweeps below show "
        "it), rates counted between the first measured send and the last send (not the drain).",
        "",
        f"### Goodput against inputs per request, {cluster} (![plot]({FIGURE}))",
        "",
        f"E3's plan: {describe_plan(plan)} "
        f"(planner's prediction {plan.predicted.get('throughput_rps', float('nan')):,.0f} inputs/s).",
        "",
        batch_table([c.to_dict() for c in cells], cluster),
        "",
        "Must-show (batch >= 8: E3 >= 1.5x naive EE and >= 1.4x stock; the paper 1.44x / 1.30x): "
        + "; ".join(f"batch {b}: {r['e3_over_ee']:.2f}x EE, {r['e3_over_stock']:.2f}x stock" for b, r in big.items())
        + (" (met)" if big and all(r["e3_over_ee"] >= 1.5 and r["e3_over_stock"] >= 1.4 for r in big.values())
           else " (**not met**, see below)"),
        "",
        f"### Why: the same cell ({settings.hetero_batch} inputs per request, {cluster}) with one assumption "
        "changed at a time",
        "",
        _diagnosis(latency, settings, plan),
        "",
        _sensitivity_table(sensitivity),
        "",
        "\\* still rising at the last load tried (a lower bound).",
        "",
        f"### Heterogeneity at fixed cost (Fig. 13 analogue): ${hetero['budget_per_hour']:.2f}/hour (the price of "
        f"{settings.budget_gpus} x {settings.device}), {settings.hetero_batch} inputs per request",
        "",
        heterogeneity_table(hetero),
        "",
        f"### Cost at fixed goodput (Figs. 14-15 analogue): the cheapest cluster reaching {target:,.0f} inputs/s "
        f"({settings.goodput_share:.0%} of E3's on {cluster}), {settings.hetero_batch} inputs per request",
        "",
        cost_table(cost),
    ])
    path = results_md or docs_dir / "RESULTS.md"
    text = path.read_text() if path.exists() else "# Measured results\n"
    write_atomic(path, replace_gpu_section(text, section))
    echo(f"wrote the gpu-sim section of {path} ({time.monotonic() - started:.0f} s)")
    return doc


MEASURED_BEGIN, MEASURED_END = "<!-- gpu-measured:begin -->", "<!-- gpu-measured:end -->"


def beside_table(measured: list, modelled, block: int = 2, *, batches=(1, 8, 32, 64)) -> str:
    """Block ``block``'s latency and the stock graph's (ms) at ``batches`` on every measured profile's device
    and on every modelled GPU, one row each: the measured curves beside the modelled ones. Pure."""
    def at(profile, dev, curve, b):
        bs = profile.batch_sizes
        return f"{curve[bs.index(b)]:.3f}" if b in bs else "-"
    head = [f"block {block}, B={b}" for b in batches] + [f"stock graph, B={b}" for b in batches]
    out = ["| device | how | " + " | ".join(head) + " |", "| --- | --- | " + " | ".join("---" for _ in head) + " |"]
    for profile in [*measured, modelled]:
        for dev, cfg in profile.devices.items():
            how = "MODELLED from public figures" if cfg.modelled else "measured (PyTorch, " + (
                "eager FP32" if "eager" in dev else "FP16 CUDA graphs") + ")"
            stock = profile.stock_ms.get(dev)
            cells = [at(profile, dev, profile.block_ms[dev][block - 1], b) for b in batches]
            if stock:
                cells += [at(profile, dev, stock, b) for b in batches]
            else:   # modelled profiles have no stock graph: the sum of the blocks
                total = [sum(row[i] for row in profile.block_ms[dev]) for i in range(len(profile.batch_sizes))]
                cells += [at(profile, dev, total, b) + " (sum)" if b in profile.batch_sizes else "-" for b in batches]
            out.append(f"| {dev} | {how} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def run_measured_gpu_bench(profile_path: Path, quick: bool = False, model: str = "bert-ee",
                           *, mix: tuple[int, int] = (80, 20), beside: tuple[Path, ...] = (), docs: bool = True,
                           echo: Callable[[str], None] = print) -> dict:
    """`e3 bench gpu --measured PROFILE`: goodput against inputs per request for E3, stock and naive EE on 16
    GPUs of the profile's MEASURED device (``e3 profile --cuda``), simulated as the modelled run is (same
    settings, hops as measured: the state's copies and the assumed BLS exchange), with the measured curves
    beside the modelled ones (``beside``: more measured profiles, e.g. the eager FP32 one). Writes
    ``artifacts/results/gpu_sim_measured.json`` and its own section of ``docs/RESULTS.md``."""
    started = time.monotonic()
    measured = LatencyProfile.load(profile_path)
    devices = [d for d, c in measured.devices.items() if not c.modelled]
    if len(devices) != 1:
        raise ValueError(f"{profile_path} should hold one measured GPU (e3 profile --cuda), it holds {devices}")
    (device,) = devices
    settings = dataclasses.replace(GpuSimSettings.quick() if quick else GpuSimSettings(), device=device)
    batch_profile, exit_ramp, plan_kw = _workload(model, mix, echo)
    cluster = f"{settings.gpus} x {device}"
    echo(f"[gpu measured] {device} from {profile_path}, {model} {mix[0]}:{mix[1]}, {cluster}")
    cells, plan = goodput_vs_batch(measured, batch_profile, exit_ramp, settings=settings, plan_kw=plan_kw,
                                   progress=lambda m: echo(f"[goodput vs batch, {device}] {m}"))
    ratios = goodput_ratios(cells, settings.batches)
    doc = {"commit": commit(), "quick": quick, "device": device, "profile": str(profile_path),
           "source": measured.source, "mix": f"{mix[0]}:{mix[1]}", "cluster": cluster,
           "plan": plan.to_dict(), "cells": [c.to_dict() for c in cells], "ratios": ratios,
           "seconds": round(time.monotonic() - started, 1)}
    out = artifacts_dir() / "results" / "gpu_sim_measured.json"
    write_json_atomic(out, doc, indent=1, sort_keys=False)
    echo(f"wrote {out}")
    if not docs:
        return doc
    modelled = _profile(model, MODELLED_GPUS, echo)
    others = [LatencyProfile.load(p) for p in beside]
    big = {b: r for b, r in ratios.items() if int(b) >= 8}
    command = f"e3 bench gpu --measured {profile_path.name}" + (" --quick" if quick else "")
    table = batch_table(doc["cells"], cluster, profile=f"MEASURED {device} profile")
    section = "\n".join([
        f"## GPU clusters by simulation: a MEASURED GPU profile (`{command}`)", "",
        f"The latency profile of {model} measured on a real GPU (`e3 profile {model} --cuda --untrained`, run by "
        "`benchmarks/gpu_host.py` on a lent host): " + measured.source + ". The simulation is the modelled "
        f"section's with this profile in place of the modelled one ({cluster}, same settings, SLO "
        f"{settings.slo_ms:g} ms); commit {doc['commit']}; JSON `artifacts/results/gpu_sim_measured.json`.", "",
        UNVALIDATED_ON_GPU, "",
        "Measured beside modelled (ms):", "",
        beside_table([measured, *others], modelled), "",
        f"E3's plan: {describe_plan(plan)} (planner's prediction "
        f"{plan.predicted.get('throughput_rps', float('nan')):,.0f} inputs/s).", "",
        table, "",
        "At batch >= 8: " + "; ".join(f"batch {b}: {r['e3_over_ee']:.2f}x EE, {r['e3_over_stock']:.2f}x stock"
                                      for b, r in big.items()) + ".",
    ])
    path = project_root() / "docs" / "RESULTS.md"
    text = path.read_text() if path.exists() else "# Measured results\n"
    write_atomic(path, replace_between(text, MEASURED_BEGIN, MEASURED_END, section=section, name="gpu measured"))
    echo(f"wrote the measured-GPU section of {path} ({time.monotonic() - started:.0f} s)")
    return doc
