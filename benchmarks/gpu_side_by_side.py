"""E3 against the stock model and the naive early-exit model on one GPU, through Triton's gRPC front door.

``python3 benchmarks/gpu_side_by_side.py OUT_DIR [--cpu] [--quick] [--budget-s S] [--models a,b] [--batches 32]
[--mixes 80-20] [--instances 1,2,4] [--delays 0,500,2000] [--concurrency 4,8,16,32,96] [--processes 12] [--reps 3]``

On a bare GPU host (PyTorch with CUDA, no package registry, nothing of the project installed) it unpacks the
server and client it is given (``--wheels``, default ``.gpu_wheels/`` of the checkout, filled by ``make
gpu-wheels``: the tritonserver of the ``nvidia-pytriton`` wheel, trimmed; the pure-Python ``tritonclient``;
``python-rapidjson``; ``numpy<2`` for the Python-backend stubs), imports the project from the checkout, and
for every model (default: the headline, ``bert-base-ee`` at max batch 32 on the 80-20 mix; more behind flags):

1. **In process** (:mod:`gpu_in_process`, the limit): on the GPU, with the very executors the served models use
   (FP16, one CUDA graph per batch bucket), the time of every block at batch B, what one split execution costs
   besides its blocks (the one sync, the rule, the survivors' gather), E3's cuts from those prices
   (:mod:`e3.controller.planner.device`), and the inputs/s of the stock model, the naive early-exit model and
   E3's pipeline with nothing around them, every system with two batches in flight on a GPU as E3's pipeline.
2. **Through Triton** (:mod:`gpu_sweep`): one ``tritonserver`` with every system as a KIND_GPU model
   (:mod:`e3.export.device_repository`): E3's router holding its constant splits on the device (split batches
   B, answering ``continuous``), the stock model (one graph per bucket) and the naive early-exit model
   (compacting on the device), each at Triton max batch B. First every served system's answers are checked
   against the reference, then the client's bound is measured against a null model, then every system at 1, 2
   and 4 instances, the baselines' batcher delay, and E3 answering inline (a labelled extra), as the time
   budget allows. Closed-loop gRPC clients (``--processes`` processes) send requests of 8 inputs; each system
   runs alone on the GPU. Every point is repeated (the median is the figure, min and max beside it), each run
   ten times the point's p50 long or more, throughput counting every answer inside the window
   (:mod:`gpu_load`). Goodput at a p99 SLO (20 and 10 ms) is the most inputs/s within it among the points
   whose p99 meets it, of the system's best configuration for that SLO; ``slo_ms`` null is the saturating
   throughput.

Models have random weights (``--untrained`` architectures), so exits are **forced** from a stated
distribution (:class:`~e3.core.exits.ForcedRule`): a mix "80-20" sends 80% easy inputs (those the rule
lets out before the head, in the rule's proportions) and 20% hard ones. Labelled so in every output. The
results go to ``OUT_DIR/side_by_side.json`` (written after every point, so a run cut short keeps what it
measured); ``e3 bench gpu --measured OUT_DIR`` renders them into docs/RESULTS.md.

``--cpu``: the same runner on this machine's CPU with tiny-ee, KIND_CPU instances and eager PyTorch, short
runs: what ``make reliability`` runs (item 21), so the runner cannot rot between GPU runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

if __package__:   # imported as e3.benchmarks.gpu_side_by_side
    from e3.deploy.gpu_host_setup import measure_each, namespace, prepare_host
    from e3.benchmarks.gpu_in_process import in_process, mixed_pool
    from e3.benchmarks.gpu_load import INPUTS_PER_REQUEST, LoadPool
    from e3.benchmarks.gpu_sweep import Config, Sweep, device_model, has_answering, write_null_model
else:             # run as a script, on a bare host before the project can be imported
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.path.append(str(Path(__file__).resolve().parents[1] / "deploy"))   # gpu_host_setup, standard library only
    from gpu_host_setup import measure_each, namespace, prepare_host
    from gpu_in_process import in_process, mixed_pool
    from gpu_load import INPUTS_PER_REQUEST, LoadPool
    from gpu_sweep import Config, Sweep, device_model, has_answering, write_null_model

# Deferred imports: this runs on a bare GPU host, where the project (`e3`) imports only once prepare_host has made
# its namespace and tritonclient only once it has unpacked the wheels; numpy and torch load with the step using them.
__all__ = ["Settings", "run", "main", "namespace", "REACH", "MIXES"]

# The forced exit distributions (share of inputs reaching each block; the rule of the served models):
# bert-ee's is its 80:20 workload's batch profile as recorded for the GPU reference measurement
# (the H200 run made when the design was written, docs/design.md §5); the BERT-base-sized model's easy inputs leave after layer 2.
REACH = {"bert-base-ee": [1.0, 1.0] + [0.2] * 10,
         "bert-ee": [1.0, 0.35, 0.25, 0.22, 0.21, 0.21],
         "tiny-ee": [1.0, 0.5, 0.35, 0.3]}
PRICES = ("bls_ms", "host_ms", "handoff_ms")   # e3.serving.device.hops's rows (imported there with Triton's utils)
REPORTED_NAME = {"bert-base-ee": "bert-base", "bert-ee": "bert-ee", "tiny-ee": "tiny-ee"}
MIXES = {"80-20": 0.8, "50-50": 0.5}   # share of easy inputs


@dataclass
class Settings:
    """What one run measures (defaults: the headline on a GPU host; :meth:`for_cpu`: what ``make reliability``
    runs)."""
    out: Path
    cpu: bool = False
    models: tuple[str, ...] = ("bert-base-ee",)
    batches: tuple[int, ...] = (32,)                 # B: every system's max batch
    mixes: tuple[str, ...] = ("80-20",)
    concurrency: tuple[int, ...] = (4, 8, 16, 32, 96)   # requests in flight (of 8 inputs); the last saturates
    instances: tuple[int, ...] = (1, 2, 4)           # every system's instance counts tried (E3's router too)
    delays_us: tuple[int, ...] = (0, 500, 2000)      # the baselines' batcher delays tried (beyond 0: budget allowing)
    slos_ms: tuple[float, ...] = (20, 10)            # p99 SLOs of the goodput rows
    inline_extra: bool = True                        # E3 answering inline as a labelled extra row (budget allowing)
    reps: int = 3                                    # runs per point (at least 3)
    warmup_s: float = 0.15
    min_window_s: float = 0.5                        # a run's window: 10 x the point's p50, within these
    max_window_s: float = 4.0
    processes: int = 12                              # client processes (threads share the concurrency)
    wheels: Path | None = None
    limit_reps: int = 20
    seed: int = 0
    budget_s: float | None = None                    # start no measurement that would end past this (None: no limit)
    started: float = field(default_factory=time.monotonic)

    def left_s(self) -> float:
        return math.inf if self.budget_s is None else self.budget_s - (time.monotonic() - self.started)

    def for_cpu(self) -> "Settings":
        """tiny-ee on this CPU, short runs, two client processes (about a minute: ``make reliability``, item 21)."""
        self.models, self.batches, self.concurrency, self.instances = ("tiny-ee",), (8,), (1, 4), (1, 2)
        self.delays_us, self.slos_ms = (0, 500), (20, 50)
        self.warmup_s, self.min_window_s, self.max_window_s, self.processes, self.limit_reps = 0.1, 0.25, 1.0, 2, 3
        return self


# -- through Triton ------------------------------------------------------------------------------------------------
class Results:
    """side_by_side.json, rewritten after every measurement."""

    def __init__(self, path: Path, device: str, settings: Settings):
        self.path = path
        self.doc = {"device": device, "exits": "forced (random weights; ForcedRule from a stated distribution)",
                    "inputs_per_request": INPUTS_PER_REQUEST, "rows": [], "limit": [], "runs": [], "plans": []}

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.doc, indent=1, default=float))
        tmp.replace(self.path)


def _rule_and_ramps(name: str):
    from e3.core.exits import ForcedRule
    rule = ForcedRule(REACH[name])
    L = len(rule.reach)
    shares = [rule.reach[k - 1] - (rule.reach[k] if k < L else 0.0) for k in range(1, L + 1)]
    return rule, tuple(k for k in range(1, L) if shares[k - 1] > 0)   # the exit-wrapper: ramps nobody leaves cost only


def measure_model(name: str, settings: Settings, results: Results, *, binary: Path | None, echo) -> None:

    import torch

    from e3.core.names import SIDE_BY_SIDE
    from e3.deploy.server import TritonServer
    from e3.export.device_repository import write_device_model, write_hop_models
    from e3.serving.device.executor import DeviceSettings, build_model, prepare_model

    reported = REPORTED_NAME.get(name, name)
    rule, enabled = _rule_and_ramps(name)
    device = "cpu" if settings.cpu else "cuda"
    dev_settings = DeviceSettings(device=device, precision="fp32" if settings.cpu else "fp16",
                                  max_batch=max(settings.batches))
    model = prepare_model(build_model(name, seed=settings.seed, trained=False), dev_settings)
    if settings.cpu:
        torch.set_num_threads(1)
    pools = {mix: mixed_pool(model, rule, MIXES[mix], size=1024 if not settings.cpu else 128, seed=settings.seed + 7)
             for mix in settings.mixes}
    plans: dict[tuple[str, int], tuple[int, ...]] = {}
    with torch.inference_mode():
        for B in settings.batches:
            lim = in_process(model, rule, enabled, device_settings=dev_settings, pools=pools, B=B, reps=settings.limit_reps,
                             echo=echo)
            for mix, m in lim["mixes"].items():
                plans[(mix, B)] = tuple(m["cuts"])
                results.doc["limit"].append({"model": reported, "mix": mix, "max_batch": B, "stock": lim["stock_ips"],
                                             "ee": m["naive_ips"], "e3": m["e3_ips"], "ideal": m["ideal"],
                                             "stock_sync": lim["stock_sync_ips"], "ee_sync": m["naive_sync_ips"],
                                             "in_flight": lim["depth"], "cuts": m["cuts"], "reach": m["reach"],
                                             "block_ms": lim["block_ms"], "run_ms": lim["run_ms"],
                                             "predicted_ms_per_b": m["predicted_ms_per_b"]})
                results.doc["plans"].append({"model": reported, "mix": mix, "max_batch": B, "cuts": list(m["cuts"]),
                                             "batch_sizes": [B] * (len(m["cuts"]) + 1), "enabled_ramps": list(enabled)})
            results.save()
    del model
    if not settings.cpu:
        torch.cuda.empty_cache()

    repo = settings.out / f"repo_{reported}"
    shutil.rmtree(repo, ignore_errors=True)
    card = build_model(name, seed=settings.seed, trained=False).card
    base = dict(model=name, exit_rule=rule.to_dict(), enabled_ramps=enabled, gpu=not settings.cpu, seed=settings.seed)
    e3_form = "continuous" if has_answering() else ""
    sweeps = {B: Sweep(reported=reported, settings=settings, results=results, load=None, url="", repo=repo, card=card,
                       base=base, plans=plans, names={}, pools=pools, echo=echo) for B in settings.batches}
    for B, sweep in sweeps.items():   # every instance count at delay 0 from the start; the rest loaded when tried
        sweep.ensure([(Config(system, k, 0, e3_form if system == "e3" else ""), mix, B)
                      for k in settings.instances for system in SIDE_BY_SIDE
                      for mix in (settings.mixes if system != "stock" else (None,))], load=False)
    # E3 once more at full precision (FP32, no reduced-precision kernels): its answers are checked exactly
    check_mix, B0 = settings.mixes[0], min(settings.batches)
    check = device_model(Config("e3", 1, 0, e3_form), B=B0, mix=check_mix, base=base, cuts=plans[(check_mix, B0)])
    check = write_device_model(repo, dataclasses.replace(check, variant="fp32", precision="fp32"), card)
    hops = write_hop_models(repo, card, gpu=not settings.cpu, precision=dev_settings.precision)
    null = write_null_model(repo, card, instances=1 if settings.cpu else 2)
    models = sorted({*(n for s in sweeps.values() for n in s.names.values()), check, *hops, null})
    echo(f"  starting tritonserver with {len(models)} models")
    t = time.monotonic()
    server = TritonServer.on_free_ports(repo, models, tritonserver=binary, log_file=settings.out / f"triton_{reported}.log",
                                        extra_args=["--model-load-thread-count=16"])
    server.start(timeout_s=600)
    echo(f"  ready after {time.monotonic() - t:.0f} s")
    load = LoadPool(server.grpc_url, settings.processes)
    try:
        checked = {check: "check"}
        for B, sweep in sweeps.items():
            sweep.load, sweep.url = load, server.grpc_url
            for (cfg, mix, b), served in sweep.names.items():   # one instance count per system: the same code
                if b == max(settings.batches) and cfg.instances == settings.instances[0] and mix in (None, check_mix):
                    checked[served] = cfg.system
        check_answers(name, reported, settings, results=results, url=server.grpc_url, served=checked,
                      pool=pools[check_mix], rule=rule, enabled=enabled, echo=echo)
        price_hops(name, reported, settings, results=results, url=server.grpc_url, prices=hops[1], echo=echo)
        for B, sweep in sweeps.items():
            if settings.left_s() < 30:
                echo("  time budget spent: stopping here")
                break
            sweep.run(B)
    finally:
        load.close()
        server.stop()


def check_answers(name: str, reported: str, settings: Settings, *, results: Results, url: str, served: dict, pool: dict,
                  rule, enabled: tuple[int, ...], echo) -> None:
    """Every system's answers through Triton against the PyTorch reference (FP32, one input at a time, on the
    CPU): labels and exit ramps, for each of ``served`` (served name -> system, "check" for the FP32 E3). The
    FP32 E3 model must match exactly; the FP16 models are reported."""
    import numpy as np
    import tritonclient.grpc as grpcclient

    from e3.models.reference import reference_answers
    from e3.serving.device.executor import build_model

    model = build_model(name, seed=settings.seed, trained=False)
    card = model.card
    count = 32 if not settings.cpu else 48
    inputs = {k: v[:count] for k, v in pool.items()}
    ref = reference_answers(model, tuple(inputs[s.name] for s in card.inputs), rule, enabled_ramps=enabled)
    stock_ref = reference_answers(model, tuple(inputs[s.name] for s in card.inputs), rule, enabled_ramps=())
    client = grpcclient.InferenceServerClient(url)
    checks = {}
    for served, system in served.items():
        label, exit_ramp = [], []
        for at in range(0, count, INPUTS_PER_REQUEST):
            xs = []
            for spec in card.inputs:
                x = grpcclient.InferInput(spec.name, [INPUTS_PER_REQUEST, *spec.shape], "INT64")
                x.set_data_from_numpy(np.ascontiguousarray(inputs[spec.name][at:at + INPUTS_PER_REQUEST]))
                xs.append(x)
            res = client.infer(served, xs)
            label.append(res.as_numpy("label").reshape(-1))
            exit_ramp.append(res.as_numpy("exit_ramp").reshape(-1))
        want = stock_ref if system == "stock" else ref
        label, exit_ramp = np.concatenate(label), np.concatenate(exit_ramp)
        checks[served] = {"system": system, "inputs": count, "label_equal": float(np.mean(label == want.label)),
                          "exit_ramp_equal": float(np.mean(exit_ramp == want.exit_ramp)),
                          "precision": "fp32" if system == "check" or settings.cpu else "fp16"}
        echo(f"  answers of {served}: labels {checks[served]['label_equal']:.0%} and exit ramps "
             f"{checks[served]['exit_ramp_equal']:.0%} equal to the reference ({checks[served]['precision']})")
    client.close()
    results.doc.setdefault("answers", {})[reported] = checks
    results.save()


def price_hops(name: str, reported: str, settings: Settings, *, results: Results, url: str, prices: str, echo) -> None:
    """What a split boundary costs at every B on this device (:mod:`e3.serving.device.hops`): a BLS call between
    two Triton models with device tensors, a round trip through host memory, and the device-resident hand-off."""
    import numpy as np
    import tritonclient.grpc as grpcclient
    client = grpcclient.InferenceServerClient(url)
    for B in settings.batches:
        inputs = []
        for name, value in (("batch", B), ("repeats", 20 if not settings.cpu else 5)):
            x = grpcclient.InferInput(name, [1], "INT32")
            x.set_data_from_numpy(np.asarray([value], np.int32))
            inputs.append(x)
        times = client.infer(prices, inputs).as_numpy("times_ms")
        row = {"model": reported, "zoo": name, "max_batch": B, **{k: float(np.median(t)) for k, t in zip(PRICES, times)}}
        results.doc.setdefault("hops", []).append(row)
        echo(f"  hop at B={B}: BLS with device tensors {row['bls_ms']:.3f} ms, through host memory "
             f"{row['host_ms']:.3f} ms, device hand-off {row['handoff_ms']:.3f} ms")
    client.close()
    results.save()


def run(settings: Settings, echo=print) -> dict:
    binary, settings.out = prepare_host(settings.out, cpu=settings.cpu, wheels=settings.wheels)
    import torch
    device = "cpu" if settings.cpu else torch.cuda.get_device_name()
    precision = "fp32" if settings.cpu else "fp16"
    results = Results(settings.out / "side_by_side.json", device, settings)
    results.doc["budget"] = (f"one {device}, one system at a time, every system at the same max batch; torch "
                             f"{torch.__version__}, {precision.upper()}"
                             f"{' with CUDA graphs' if not settings.cpu else ', eager'}")
    results.doc["budget_info"] = {"device": device, "torch": torch.__version__, "cuda": torch.version.cuda,
                                  "precision": precision, "graphs": not settings.cpu, "cpus": os.cpu_count(),
                                  "client_processes": settings.processes}
    results.doc["settings"] = {"batches": list(settings.batches), "mixes": list(settings.mixes),
                               "concurrency": list(settings.concurrency), "instances": list(settings.instances),
                               "delays_us": list(settings.delays_us), "slos_ms": list(settings.slos_ms),
                               "reps": settings.reps, "warmup_s": settings.warmup_s,
                               "min_window_s": settings.min_window_s, "max_window_s": settings.max_window_s,
                               "processes": settings.processes, "budget_s": settings.budget_s,
                               "torch": torch.__version__, "precision": precision, "graphs": not settings.cpu}
    try:
        from e3.benchmarks.report import commit
        results.doc["commit"] = commit()
    except Exception:  # noqa: BLE001 - a record of where it ran, never a reason to stop
        results.doc["commit"] = os.environ.get("E3_COMMIT", "unknown")
    echo(f"budget: {results.doc['budget']}")
    measure_each(settings.models, results, lambda name: measure_model(name, settings, results, binary=binary, echo=echo),
                 left_s=settings.left_s, echo=echo)
    summary(results.doc, echo)
    results.save()
    return results.doc


def summary(doc: dict, echo=print) -> None:
    """The figures with the client bound, E3's through-Triton share of its in-process figure and the budget
    beside them."""
    echo(f"== figures ({doc.get('budget', '')}; every figure the median of its repetitions, [min-max])")
    bound = {(b["model"], b["max_batch"]): b for b in doc.get("client_bound", [])}
    share = {(r["model"], r["mix"], r["max_batch"]): r for r in doc.get("e3_triton_over_in_process", [])}
    for r in doc["rows"]:
        c, b = r["config"], bound.get((r["model"], r["max_batch"]))
        slo = "saturating" if r["slo_ms"] is None else f"p99 <= {r['slo_ms']:g} ms"
        spread = f" [{c['goodput_min']:,.0f}-{c['goodput_max']:,.0f}]" if c.get("goodput_min") is not None else ""
        extra = f"; E3 through Triton / in process {share[(r['model'], r['mix'], r['max_batch'])]['ratio']:.2f}" \
            if r["system"] == "e3" and r["slo_ms"] is None and not c.get("extra") and \
            share.get((r["model"], r["mix"], r["max_batch"]), {}).get("ratio") else ""
        echo(f"  {r['model']} {r['mix']} B={r['max_batch']} {slo:>14s} {r['system']:5s}"
             f"{' (' + c['extra'] + ')' if c.get('extra') else ''}: {r['goodput']:,.0f} inputs/s{spread} "
             f"(x{c.get('instances')}, delay {c.get('queue_delay_us')} us"
             f"{', ' + c['answering'] if c.get('answering') else ''}); client bound "
             f"{b['inputs_per_s'] if b else float('nan'):,.0f}/s{extra}")
    if doc.get("client_bound_ok") is False:
        echo("!!! client_bound_ok is false: the client's bound is below 3x the best system's rate (see above)")


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--cpu", action="store_true",
                   help="tiny-ee on this CPU, short runs (what make reliability runs, item 21)")
    p.add_argument("--quick", action="store_true", help="instances 1,2, concurrency 8,96, no delay sweep, no inline row")
    p.add_argument("--models", default=None, help="zoo models (default bert-base-ee)")
    p.add_argument("--batches", default=None, help="max batches B (default 32)")
    p.add_argument("--mixes", default=None, help="workload mixes (default 80-20; also 50-50)")
    p.add_argument("--instances", default=None, help="instance counts every system tries (default 1,2,4)")
    p.add_argument("--delays", default=None, help="the baselines' batcher delays in us (default 0,500,2000)")
    p.add_argument("--concurrency", default=None, help="requests in flight per point (default 4,8,16,32,96)")
    p.add_argument("--processes", type=int, default=None, help="client processes (default 12; --cpu 2)")
    p.add_argument("--reps", type=int, default=None, help="runs per point (default and least 3)")
    p.add_argument("--no-inline", action="store_true", help="skip E3's inline fallback row")
    p.add_argument("--wheels", type=Path, default=None,
                   help="folder with the server and client to unpack (default .gpu_wheels/; with --cpu only if given)")
    p.add_argument("--budget-s", type=float, default=None, help="start no measurement that would end past this")
    a = p.parse_args(argv)
    s = Settings(a.out, cpu=a.cpu, wheels=a.wheels, budget_s=a.budget_s)
    if a.cpu:
        s.for_cpu()
    if a.quick:
        s.instances, s.concurrency, s.delays_us, s.inline_extra = (1, 2), (8, 96), (0,), False
    for flag, attr, parse in (("models", "models", lambda t: tuple(t.split(","))), ("batches", "batches", _ints),
                              ("mixes", "mixes", lambda t: tuple(t.split(","))), ("instances", "instances", _ints),
                              ("delays", "delays_us", _ints), ("concurrency", "concurrency", _ints)):
        if getattr(a, flag):
            setattr(s, attr, parse(getattr(a, flag)))
    if a.processes:
        s.processes = a.processes
    if a.reps:
        s.reps = max(3, a.reps)
    if a.no_inline:
        s.inline_extra = False
    doc = run(s)
    return 1 if doc.get("failed") or not doc["rows"] else 0


if __name__ == "__main__":
    sys.exit(main())
