"""`e3 demo`: export a model, serve it on the embedded Triton, load the router and
both baselines side by side, print one table, stop the server.

Equal budgets: every system gets the same compute cores, counted as Triton
instances x ONNX Runtime threads (1 per instance): each baseline runs
``cores`` instances, and E3's splits share ``cores`` instances between them
(the router itself, one instance that schedules, is listed beside the
budget, not counted in it: it runs on the same machine, so its work is paid
out of the same cores). The table prints each system's budget.

E3's plan: for a zoo model with a dataset, the planner's plan for this
machine (measured latency profile, the 50:50 mix's batch profile; as `e3
bench side-by-side` does); for a model without one, one compact split over
every block (this CPU's form); with ``--cuts``, constant splits at those cuts
(E3's accelerator form) sharing the cores.

Glue only: each step is a call into its room (export, deploy, client).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path

from e3.benchmarks.side_by_side import machine_plan
from e3.client.loadgen import LoadResult, closed_loop
from e3.client.report import format_table
from e3.core.names import ee_name, parse_cuts, ranges_from_cuts, router_name, served_name, stock_name
from e3.core.plan import COMPACT, CONSTANT, Plan, default_plan
from e3.deploy.server import TritonServer, free_port, port_taken
from e3.export.repository import ExportSettings, export_repository
from e3.models.data import split_inputs
from e3.models.recipes import missing_checkpoints, train
from e3.models.zoo import ZOO, resolve_model
from e3.paths import artifacts_dir, project_root

__all__ = ["DemoSettings", "run_demo", "core_budgets", "split_instances", "explain", "kept_gpu_limits"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DemoSettings:
    model: str = "bert-ee"       # trained on first use
    cuts: str | None = None      # default: the planner's plan (or one compact split); cuts: constant splits
    requests: int = 300          # per served model
    concurrency: int = 8
    batch: int = 4               # inputs per request
    pool: int = 512              # distinct inputs cycled through
    protocol: str = "http"
    cores: int = 2               # compute cores each system gets (instances x 1 thread)


def run_demo(repo: Path, settings: DemoSettings = DemoSettings(), echo=print) -> list[LoadResult]:
    for name in missing_checkpoints(settings.model):
        echo(f"[0/3] {name} is not trained yet: training it now (once; cached under artifacts/checkpoints)")
        report = train(name)
        echo(f"      {name} trained in {report.seconds / 60:.1f} min")
    model = resolve_model(settings.model)
    export = ExportSettings(baseline_instances=settings.cores)
    plan = demo_plan(settings, model, export, echo=echo)
    echo(f"[1/3] exporting {settings.model} into {repo}: {_describe(plan)}")
    plan = export_repository(settings.model, None, repo, settings=export, plan=plan)
    m = served_name(settings.model)
    budgets = core_budgets(plan, export)
    pool, labels = _pool(settings, model)
    ports = [8000, 8001, 8002]
    if any(port_taken("127.0.0.1", p) for p in ports):
        ports = [free_port(), free_port(), free_port()]
        echo(f"      ports 8000-8002 are busy; using {ports[0]}/{ports[1]}/{ports[2]}")
    server = TritonServer(repo, http_port=ports[0], grpc_port=ports[1], metrics_port=ports[2],
                          log_file=artifacts_dir() / "logs" / "demo-tritonserver.log")
    echo(f"[2/3] starting tritonserver (logs: {server.log_file})")
    results = []
    with server:
        url = server.http_url if settings.protocol == "http" else server.grpc_url
        echo(f"[3/3] {settings.requests} requests x {settings.batch} inputs, {settings.concurrency} clients, "
             f"to {router_name(m)} (plan: {_describe(plan)}) and both baselines, "
             f"each system on {settings.cores} cores (instances x 1 thread)")
        for name in (router_name(m), ee_name(m), stock_name(m)):
            results.append(closed_loop(url, name, pool, concurrency=settings.concurrency, batch=settings.batch,
                                       requests=settings.requests, protocol=settings.protocol, warmup=2,
                                       true_label=labels))
    echo("")
    echo(format_table(results, reference=stock_name(m), budgets=budgets))
    failed = sum(r.errors for r in results)
    echo(f"\n{failed} failed requests" if failed else "\nevery request answered")
    echo("")
    for line in explain(plan, {r.model: r.throughput_ips for r in results}, kept_gpu_limits()):
        echo(line)
    return results


def explain(plan: Plan, inputs_per_s: dict[str, float], gpu: list[dict]) -> list[str]:
    """The lines under the demo's table: which form the planner chose here and why, what E3 gains where (the
    GPU runs kept in the repository, :func:`kept_gpu_limits`, or that none is), and where to read more.
    ``inputs_per_s``: served model -> its throughput in this run."""
    m = plan.model
    e3, ee, stock = (inputs_per_s.get(n, 0.0) for n in (router_name(m), ee_name(m), stock_name(m)))
    forms = {s.form for s in plan.splits}
    ratio = f"E3 {e3 / ee:.2f}x `{ee_name(m)}` and {e3 / stock:.2f}x stock in this run" if ee and stock else ""
    if forms == {COMPACT}:
        why = ("The planner chose the compact form for this CPU (rows leave the batch between blocks, inside the router): "
               "here a block costs in proportion to its batch, so a shrinking batch wastes nothing and E3 is early exit "
               f"done well, at the in-process early-exit model's speed ({ratio}).")
    else:
        kinds = ", ".join(sorted(forms))
        why = (f"This run served {kinds} splits ({ratio}); on this CPU the planner's own choice is the compact form, "
               "since a shrinking batch costs nothing here.")
    lines = [why]
    if gpu:
        # every kept figure of one model and mix (the first device's first): the range over the batches, no pick
        g0 = gpu[0]
        same = [g for g in gpu if (g["device"], g["model"], g["mix"]) == (g0["device"], g0["model"], g0["mix"])]
        def span(k: str) -> str:
            low, high = min(g[k] for g in same), max(g[k] for g in same)
            return f"{low:.2f}x" if f"{low:.2f}" == f"{high:.2f}" else f"{low:.2f}-{high:.2f}x"
        batches = ", ".join(str(g["max_batch"]) for g in same)
        measured = (f"on an {g0['device']} ({g0['model']}, mix {g0['mix']}, batch{'es' if len(same) > 1 else ''} "
                    f"{batches}, in process) E3 ran {span('e3_over_stock')} the stock model and {span('e3_over_ee')} "
                    "naive early exit")
        if max(g["e3_over_ee"] for g in same) < 1.0:   # say so where the kept GPU run has E3 behind naive EE
            lines.append("E3's constant batches are meant to pay where a shrinking batch wastes the device, but "
                         f"{measured}: not ahead of naive early exit there yet (docs/gpu.md says why we think so "
                         "and what the next GPU run measures).")
        else:
            lines.append(f"E3's constant batches pay where a shrinking batch wastes the device: {measured} "
                         "(docs/RESULTS.md, 'E3 on a GPU'; through Triton on a GPU: docs/gpu.md).")
    else:
        lines.append("E3's constant batches pay where a shrinking batch wastes the device (a GPU): no GPU run is kept "
                     "in this checkout yet (docs/gpu.md says how to make one).")
    lines.append("Read more: docs/README.md (where everything is), docs/RESULTS.md (every figure with its command).")
    return lines


def kept_gpu_limits(root: Path | None = None) -> list[dict]:
    """The in-process GPU figures kept in ``docs/data/<gpu>/side_by_side.json`` (the standing GPU run's
    ``limit`` rows): per device, model, mix and batch, E3's throughput over the stock model's and naive early
    exit's. Empty where none is kept (a checkout without docs/, or no GPU run yet)."""
    out = []
    for path in sorted(((root or project_root()) / "docs" / "data").glob("*/side_by_side.json")):
        try:
            rows = json.loads(path.read_text()).get("limit") or []
        except (OSError, ValueError):
            continue
        for r in rows:
            if r.get("stock") and r.get("ee") and r.get("e3"):
                out.append({"device": path.parent.name.upper(), "model": r["model"], "mix": r["mix"],
                            "max_batch": r["max_batch"], "e3_over_stock": r["e3"] / r["stock"],
                            "e3_over_ee": r["e3"] / r["ee"]})
    return out


def _describe(plan: Plan) -> str:
    return " | ".join(f"blocks {s.first_block}-{s.last_block} {s.form} x{s.instances} batch {s.batch_size}"
                      for s in plan.splits)


def demo_plan(settings: DemoSettings, model, export: ExportSettings, *, echo=print) -> Plan:
    """E3's plan for the demo (see the module docstring)."""
    card = model.card
    L, m = card.num_blocks, served_name(settings.model)
    entry = ZOO.get(settings.model)
    if settings.cuts is None and entry is not None and entry.dataset:
        return machine_plan(settings.model, settings.cores, echo=echo)
    ranges = ranges_from_cuts(parse_cuts(settings.cuts or "", L), L)
    plan = default_plan(m, L, ranges, exit_rule=card.exit_rule, ramp_blocks=card.ramp_blocks, batch_size=export.batch_size,
                        queue_delay_us=export.queue_delay_us, slo_ms=export.slo_ms)
    form = CONSTANT if settings.cuts else COMPACT
    return replace(plan, splits=tuple(replace(s, instances=n, form=form)
                                      for s, n in zip(plan.splits, split_instances(settings.cores, len(ranges)))))


def split_instances(cores: int, n_splits: int) -> list[int]:
    """Instances of each split so that E3's splits together get exactly ``cores`` (1 thread each):
    as even as possible, earlier splits (which see every input) first. Raises ValueError when there
    are fewer cores than splits: each split needs an instance, and E3 would get more cores than the
    baselines."""
    if cores < n_splits:
        raise ValueError(f"--cores {cores} is fewer than the {n_splits} splits: each split needs one instance; "
                         f"use --cores {n_splits} or fewer cuts")
    return [cores // n_splits + (1 if i < cores % n_splits else 0) for i in range(n_splits)]


def core_budgets(plan: Plan, export: ExportSettings) -> dict[str, str]:
    """Served model -> its core budget as printed: instances x threads (1 ONNX Runtime thread each)."""
    m = plan.model
    splits = ", ".join(f"{s.first_block}-{s.last_block} {s.form} x{s.instances}" for s in plan.splits)
    return {router_name(m): f"{sum(s.instances for s in plan.splits)} ({splits}; router x{export.router_instances or plan.router_instances})",
            ee_name(m): f"{export.baseline_instances} (x{export.baseline_instances} inst.)",
            stock_name(m): f"{export.baseline_instances} (x{export.baseline_instances} inst.)"}


def _pool(settings: DemoSettings, model):
    """The model's test inputs with their labels (zoo models with a dataset), else random inputs."""
    entry = ZOO.get(settings.model)
    if entry is not None and entry.dataset:
        inputs, labels = split_inputs(entry.dataset, "test", model.card.max_seq_len)
        names = [t.name for t in model.card.inputs]
        return {n: x[:settings.pool] for n, x in zip(names, inputs)}, labels[:settings.pool]
    return model.example_arrays(settings.pool, seed=7), None
