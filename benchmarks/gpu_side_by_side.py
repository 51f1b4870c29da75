"""E3 against the stock model and the naive early-exit model on one GPU, through Triton's gRPC front door.

``python3 benchmarks/gpu_side_by_side.py OUT_DIR [--cpu] [--quick] [--wheels DIR] [--models a,b] [--batches 8,32]``

On a bare GPU host (PyTorch with CUDA, no package registry, nothing of the project installed) it unpacks the
server and client it is given (``--wheels``, default ``.gpu_wheels/`` of the checkout, filled by ``make
gpu-wheels``: the tritonserver of the ``nvidia-pytriton`` wheel, trimmed; the pure-Python ``tritonclient``;
``python-rapidjson``; ``numpy<2`` for the Python-backend stubs), imports the project from the checkout, and
for every model:

1. **In process** (the limit): on the GPU, with the very executors the served models use (FP16, one CUDA
   graph per batch bucket), the time of every block at batch B, what one split execution costs besides its
   blocks (the one sync, the rule, the survivors' gather), E3's cuts from those prices
   (:mod:`e3.controller.planner.device`), and the inputs/s of the stock model, the naive early-exit model and
   E3's pipeline with nothing around them.
2. **Through Triton**: one ``tritonserver`` with every system as a KIND_GPU model (:mod:`e3.export.
   device_repository`): E3's router holding its constant splits on the device (split batches B), the stock
   model (one graph per bucket) and the naive early-exit model (compacting on the device), each at Triton max
   batch B; every system with 1 and 2 instances (the better one is kept: its best configuration). Closed-loop
   gRPC clients send requests of 8 inputs; each system runs alone on the GPU, one after the other. At the
   highest concurrency the load saturates every system (the saturating rows, ``slo_ms`` null); lower
   concurrencies trace p99 against goodput, and the goodput at a p99 SLO is the best goodput among the
   points whose p99 meets it.

Models have random weights (``--untrained`` architectures), so exits are **forced** from a stated
distribution (:class:`~e3.core.exits.ForcedRule`): a mix "80-20" sends 80% easy inputs (those the rule
lets out before the head, in the rule's proportions) and 20% hard ones. Labelled so in every output. The
results go to ``OUT_DIR/side_by_side.json`` (written after every run, so a run cut short keeps what it
measured); ``e3 bench gpu --measured OUT_DIR`` renders them into docs/RESULTS.md.

``--cpu``: the same runner on this machine's CPU with tiny-ee, KIND_CPU instances and eager PyTorch, short
runs: what ``make test`` runs, so the runner cannot rot between GPU runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

if __package__:   # imported as e3.benchmarks.gpu_side_by_side
    from e3.benchmarks.gpu_host_setup import measure_each, namespace, prepare_host
    from e3.benchmarks.gpu_load import INPUTS_PER_REQUEST, LoadPool, slo_rows
else:             # run as a script, on a bare host before the project can be imported
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_host_setup import measure_each, namespace, prepare_host
    from gpu_load import INPUTS_PER_REQUEST, LoadPool, slo_rows

__all__ = ["Settings", "run", "main", "namespace", "REACH", "MIXES"]

# The forced exit distributions (share of inputs reaching each block; the rule of the served models):
# bert-ee's is its 80:20 workload's batch profile as recorded for the GPU reference measurement
# (../shared/gpu/README.md); the BERT-base-sized model's easy inputs leave after layer 2.
REACH = {"bert-base-ee": [1.0, 1.0] + [0.2] * 10,
         "bert-ee": [1.0, 0.35, 0.25, 0.22, 0.21, 0.21],
         "tiny-ee": [1.0, 0.5, 0.35, 0.3]}
PRICES = ("bls_ms", "host_ms", "handoff_ms")   # e3.serving.device.hops's rows (imported there with Triton's utils)
REPORTED_NAME = {"bert-base-ee": "bert-base", "bert-ee": "bert-ee", "tiny-ee": "tiny-ee"}
MIXES = {"80-20": 0.8, "50-50": 0.5}   # share of easy inputs
SLOS_MS = (5, 10, 20, 50)


@dataclass
class Settings:
    out: Path
    cpu: bool = False
    models: tuple[str, ...] = ("bert-base-ee", "bert-ee")
    batches: tuple[int, ...] = (8, 32, 128)
    mixes: tuple[str, ...] = ("80-20", "50-50")
    concurrency: tuple[int, ...] = (4, 24, 128)      # requests in flight (of 8 inputs); the last saturates
    instances: tuple[int, ...] = (1, 2)              # the baselines' instance counts tried
    duration_s: float = 1.2
    warmup_s: float = 0.3
    processes: int = 8                               # client processes (threads share the concurrency)
    wheels: Path | None = None
    limit_reps: int = 20
    seed: int = 0
    budget_s: float | None = None                    # stop starting new measurements past this (None: no limit)
    started: float = field(default_factory=time.monotonic)

    def left_s(self) -> float:
        return math.inf if self.budget_s is None else self.budget_s - (time.monotonic() - self.started)


# -- inputs ------------------------------------------------------------------------------------------------------
def mixed_pool(model, rule, easy_share: float, *, size: int, seed: int) -> dict:
    """``size`` inputs of which ``easy_share`` exit before the head under ``rule`` (forced exits), shuffled."""
    import numpy as np
    L = model.card.num_blocks
    easy, hard, s = [], [], seed
    while len(easy) < size or len(hard) < size:
        arrays = model.example_arrays(4 * size, seed=s)
        s += 1
        at = rule.init_state_for(arrays, 4 * size)["exit_at"]
        easy += [{k: v[i] for k, v in arrays.items()} for i in np.flatnonzero(at < L)]
        hard += [{k: v[i] for k, v in arrays.items()} for i in np.flatnonzero(at == L)]
    n_easy = int(round(easy_share * size))
    rows = easy[:n_easy] + hard[:size - n_easy]
    order = np.random.default_rng(seed).permutation(size)
    return {k: np.stack([rows[i][k] for i in order]) for k in rows[0]}


def reach_of(rule, pool: dict, L: int) -> list[float]:
    """Share of the pool's inputs reaching each block under ``rule``."""
    import numpy as np
    n = len(next(iter(pool.values())))
    at = rule.init_state_for(pool, n)["exit_at"]
    return [float(np.mean(at >= k)) for k in range(1, L + 1)]


# -- in process --------------------------------------------------------------------------------------------------
def _timed(fn, reps: int, sync) -> float:
    import numpy as np
    for _ in range(3):
        fn()
    sync()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts)) * 1e3


def in_process(model, rule, enabled: tuple[int, ...], *, device_settings, pools: dict[str, dict], B: int,
               reps: int, echo) -> dict:
    """Prices at batch B, E3's cuts per mix, and the in-process inputs/s of the three systems."""
    import dataclasses

    import numpy as np
    import torch

    from e3.controller.planner.device import choose_device_cuts
    from e3.serving.device.executor import make_executor
    from e3.serving.device.pipeline import DevicePipeline, NaiveRunner, StockRunner
    from e3.serving.policy import BatchRoute

    card, L = model.card, model.card.num_blocks
    sync = torch.cuda.synchronize if device_settings.cuda else (lambda: None)
    at_b = dataclasses.replace(device_settings, max_batch=B, buckets=(B,))
    any_pool = next(iter(pools.values()))
    first = {k: v[:B] for k, v in any_pool.items()}
    feed = tuple(torch.from_numpy(first[s.name]) for s in card.inputs)
    block_ms, state, at_ramp = [], feed, None
    first_ramp = min(enabled) if enabled else L
    for k in range(1, L + 1):
        ex = make_executor(model, k, k, ramps=card.split_ramps(k, k, enabled), settings=at_b)
        outs = ex.run([state], B)
        block_ms.append(_timed(lambda: ex.run([state], B), reps, sync))
        if k == first_ramp:
            at_ramp = tuple(o.clone() for o in outs)
        state = tuple(o.clone() for o in outs[:len(card.state)]) if k < L else state

    rule_state = rule.init_state_for(first, B)   # admission's work, not a split run's: outside the timing

    def one_run_overhead():
        """One split execution besides its blocks: the sync of the ramp's logits, the rule, the survivors' gather."""
        held = at_ramp[:len(card.state)] if first_ramp < L else ()
        logits = torch.stack([o.float() for o in at_ramp[len(held):]]).cpu().numpy()
        route = BatchRoute(B, card.num_classes, L, rule, {k: v.copy() for k, v in rule_state.items()})
        keep = route.observe({first_ramp: logits[0]})
        where = torch.from_numpy(np.flatnonzero(keep)).to(device_settings.device, non_blocking=True)
        return [t.index_select(0, where) for t in held]
    run_ms = _timed(one_run_overhead, reps, sync)
    stock = StockRunner(model, at_b)
    stock_ms = _timed(lambda: stock.run(first), reps, sync)
    out = {"max_batch": B, "block_ms": block_ms, "run_ms": run_ms, "stock_ms": stock_ms,
           "stock_ips": B / stock_ms * 1e3, "mixes": {}}
    full = dataclasses.replace(device_settings, max_batch=B, buckets=None)
    naive = NaiveRunner(model, enabled_ramps=enabled, rule=rule, settings=full)
    for mix, pool in pools.items():
        reach = reach_of(rule, pool, L)
        plan = choose_device_cuts(reach, block_ms, run_ms, enabled_ramps=enabled, stock_ms=stock_ms)
        batch = {k: v[:B] for k, v in pool.items()}
        naive_ms = _timed(lambda: naive.run(batch), reps, sync)
        n_req = max(4, 12 * B // INPUTS_PER_REQUEST)
        pipe = DevicePipeline(model, cuts=plan.cuts, batch_sizes=[B] * (len(plan.cuts) + 1), enabled_ramps=enabled,
                              rule=rule, settings=full, slo_ms=1e6, answer=lambda h, o: None, fail=lambda h, m: None)

        def e3_once():
            n = len(next(iter(pool.values())))
            for r in range(n_req):
                rows = [(r * INPUTS_PER_REQUEST + j) % n for j in range(INPUTS_PER_REQUEST)]
                pipe.admit(r, {k: v[rows] for k, v in pool.items()})
            pipe.run_until_idle()
        e3_ms = _timed(e3_once, max(3, reps // 4), sync)
        e3_ips = n_req * INPUTS_PER_REQUEST / e3_ms * 1e3
        ideal = L / sum(reach)
        out["mixes"][mix] = {"reach": reach, "cuts": list(plan.cuts), "predicted_ms_per_b": plan.time_ms,
                             "naive_ips": B / naive_ms * 1e3, "e3_ips": e3_ips, "ideal": ideal,
                             "e3_vs_stock": e3_ips / out["stock_ips"], "e3_vs_naive": e3_ips / (B / naive_ms * 1e3)}
        echo(f"  in process B={B} {mix}: stock {out['stock_ips']:,.0f}/s naive {B / naive_ms * 1e3:,.0f}/s "
             f"E3 {e3_ips:,.0f}/s (cuts {list(plan.cuts)}; {out['mixes'][mix]['e3_vs_stock']:.2f}x stock, "
             f"{out['mixes'][mix]['e3_vs_naive']:.2f}x naive; ideal {ideal:.2f}x)")
    if device_settings.cuda:
        torch.cuda.empty_cache()
    return out


# -- through Triton ------------------------------------------------------------------------------------------------
class Results:
    """side_by_side.json, rewritten after every measurement."""

    def __init__(self, path: Path, device: str, settings: Settings):
        self.path = path
        self.doc = {"device": device, "exits": "forced (random weights; ForcedRule from a stated distribution)",
                    "inputs_per_request": INPUTS_PER_REQUEST, "budget": "one GPU, one system at a time" if not settings.cpu
                    else "the CPU, one system at a time", "rows": [], "limit": [], "runs": [], "plans": []}

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.doc, indent=1, default=float))
        tmp.replace(self.path)


def measure_model(name: str, settings: Settings, results: Results, *, binary: Path | None, stub_first: list[str],
                  echo) -> None:
    import torch

    from e3.core.exits import ForcedRule
    from e3.deploy.server import TritonServer
    from e3.export.device_repository import DeviceModel, write_device_model, write_hop_models
    from e3.serving.device.executor import DeviceSettings, build_model, prepare_model

    reported = REPORTED_NAME.get(name, name)
    rule = ForcedRule(REACH[name])
    L = len(rule.reach)
    shares = [rule.reach[k - 1] - (rule.reach[k] if k < L else 0.0) for k in range(1, L + 1)]
    enabled = tuple(k for k in range(1, L) if shares[k - 1] > 0)   # the exit-wrapper: ramps nobody leaves at cost only
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
                                             "cuts": m["cuts"], "reach": m["reach"], "block_ms": lim["block_ms"],
                                             "run_ms": lim["run_ms"], "predicted_ms_per_b": m["predicted_ms_per_b"]})
            results.save()
    del model
    if not settings.cpu:
        torch.cuda.empty_cache()

    repo = settings.out / f"repo_{reported}"
    shutil.rmtree(repo, ignore_errors=True)
    card = build_model(name, seed=settings.seed, trained=False).card
    base = dict(model=name, exit_rule=rule.to_dict(), enabled_ramps=enabled, gpu=not settings.cpu, seed=settings.seed)
    names: dict[tuple, str] = {}
    for B in settings.batches:
        for k in settings.instances:
            names[("stock", None, B, k)] = write_device_model(repo, DeviceModel(system="stock", max_batch=B, instances=k, **base), card)
        for mix in settings.mixes:
            for k in settings.instances:
                # the naive model's rule is the model's; only the e3 router differs per mix (its cuts)
                names[("ee", mix, B, k)] = write_device_model(repo, DeviceModel(system="ee", max_batch=B, instances=k, **base), card)
            for k in settings.instances:
                e3 = DeviceModel(system="e3", max_batch=B, cuts=plans[(mix, B)], slo_ms=1000.0, instances=k,
                                 variant=mix.replace("-", "_"), **base)
                names[("e3", mix, B, k)] = write_device_model(repo, e3, card)
            results.doc["plans"].append({"model": reported, "mix": mix, "max_batch": B, "cuts": list(plans[(mix, B)]),
                                         "batch_sizes": [B] * (len(plans[(mix, B)]) + 1), "enabled_ramps": list(enabled)})
    # E3 once more at full precision (FP32, no reduced-precision kernels): its answers are checked exactly
    check_mix = settings.mixes[0]
    names[("check", check_mix, min(settings.batches), 1)] = write_device_model(repo, DeviceModel(
        system="e3", max_batch=min(settings.batches), cuts=plans[(check_mix, min(settings.batches))], slo_ms=1000.0,
        variant="fp32", precision="fp32", **base), card)
    hops = write_hop_models(repo, card, gpu=not settings.cpu, precision=dev_settings.precision)
    models = sorted({*names.values(), *hops})
    env_path = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = os.pathsep.join([*stub_first, env_path] if env_path else stub_first) or env_path
    echo(f"  starting tritonserver with {len(models)} models")
    t = time.monotonic()
    server = TritonServer.on_free_ports(repo, models, tritonserver=binary, log_file=settings.out / f"triton_{reported}.log",
                                        extra_args=["--model-load-thread-count=16"])
    server.start(timeout_s=600)
    os.environ["PYTHONPATH"] = env_path
    echo(f"  ready after {time.monotonic() - t:.0f} s")
    load = LoadPool(server.grpc_url, settings.processes)
    try:
        check_answers(name, reported, settings, results=results, url=server.grpc_url, names=names, pool=pools[check_mix],
                      rule=rule, enabled=enabled, echo=echo)
        price_hops(name, reported, settings, results=results, url=server.grpc_url, prices=hops[1], echo=echo)
        _sweep(reported, settings, results, load, names, pools, echo)
    finally:
        load.close()
        server.stop()


def check_answers(name: str, reported: str, settings: Settings, *, results: Results, url: str, names: dict, pool: dict,
                  rule, enabled: tuple[int, ...], echo) -> None:
    """Every system's answers through Triton against the PyTorch reference (FP32, one input at a time, on the
    CPU): labels and exit ramps. The FP32 E3 model must match exactly; the FP16 models are reported."""
    import numpy as np
    import tritonclient.grpc as grpcclient

    from e3.export.reference import reference_answers
    from e3.serving.device.executor import build_model

    model = build_model(name, seed=settings.seed, trained=False)
    card = model.card
    count = 32 if not settings.cpu else 48
    inputs = {k: v[:count] for k, v in pool.items()}
    ref = reference_answers(model, tuple(inputs[s.name] for s in card.inputs), rule, enabled_ramps=enabled)
    stock_ref = reference_answers(model, tuple(inputs[s.name] for s in card.inputs), rule, enabled_ramps=())
    client = grpcclient.InferenceServerClient(url)
    checks = {}
    for (system, mix, B, k), served in names.items():
        if (system != "check" and B != max(settings.batches)) or (mix not in (None, settings.mixes[0]) and system != "check"):
            continue
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


def _sweep(reported: str, settings: Settings, results: Results, load: LoadPool, names: dict, pools: dict, echo) -> None:
    sat = max(settings.concurrency)

    def one(system: str, mix: str | None, B: int, k: int, c: int, pool: dict) -> dict:
        model = names[(system, mix, B, k)]
        r = load.run(model, c, pool, warmup_s=settings.warmup_s, duration_s=settings.duration_s)
        r["duration_s"] = settings.duration_s
        row = {k2: v for k2, v in r.items() if k2 != "latencies_ms"}
        row.update(model=reported, system=system, mix=mix, max_batch=B, instances=k, served=model)
        results.doc["runs"].append(row)
        results.save()
        echo(f"    {system:5s} {mix or '':5s} B={B:<4d} x{k} c={c:<4d} {r['inputs_per_s']:>9,.0f} inputs/s "
             f"p99 {r['p99_ms'] or float('nan'):7.1f} ms errors {r['errors']}")
        return r

    def add_rows(system: str, mix: str, B: int, config: dict, curve: list[dict]) -> None:
        satr = max(curve, key=lambda r: r["concurrency"])
        results.doc["rows"].append({"model": reported, "mix": mix, "max_batch": B, "slo_ms": None, "system": system,
                                    "goodput": satr["inputs_per_s"] if not satr["errors"] else 0.0,
                                    "p99_ms": satr["p99_ms"], "config": {**config, "concurrency": satr["concurrency"],
                                                                         "errors": satr["errors"]}})
        for slo in SLOS_MS:
            best = slo_rows(curve, slo)
            results.doc["rows"].append({"model": reported, "mix": mix, "max_batch": B, "slo_ms": slo, "system": system,
                                        "goodput": best["goodput"] if best else 0.0,
                                        "p99_ms": best["p99_ms"] if best else None,
                                        "config": {**config, "concurrency": best["concurrency"] if best else None}})
        results.save()

    for B in settings.batches:
        if settings.left_s() < 30:
            echo("  time budget spent: stopping here")
            return
        for system, mixes in (("stock", [None]), ("ee", list(settings.mixes)), ("e3", list(settings.mixes))):
            for mix in mixes:
                pool = pools[mix or settings.mixes[0]]
                # every system at its better instance count on the GPU (E3 too: a second router process overlaps
                # its host work with the first one's device work, as a second baseline instance does)
                cal = {k: one(system, mix, B, k, sat, pool) for k in settings.instances}
                best_k = max(cal, key=lambda k: cal[k]["inputs_per_s"] if not cal[k]["errors"] else -1)
                curve = [cal[best_k]] + [one(system, mix, B, best_k, c, pool)
                                         for c in settings.concurrency if c != sat]
                config = {"instances": best_k, "tried": {str(k): cal[k]["inputs_per_s"] for k in cal}}
                if system == "e3":
                    plan = next(p for p in results.doc["plans"]
                                if p["model"] == reported and p["mix"] == mix and p["max_batch"] == B)
                    config.update(cuts=plan["cuts"], batch_sizes=plan["batch_sizes"])
                else:
                    config["queue_delay_us"] = 0
                for m in ([mix] if mix else list(settings.mixes)):
                    add_rows(system, m, B, config, curve)


def run(settings: Settings, echo=print) -> dict:
    binary, settings.out = prepare_host(settings.out, cpu=settings.cpu, wheels=settings.wheels)
    stub_first: list[str] = []   # prepare_host put them on the model processes' path
    import torch
    device = "cpu" if settings.cpu else torch.cuda.get_device_name()
    results = Results(settings.out / "side_by_side.json", device, settings)
    results.doc["settings"] = {"batches": list(settings.batches), "mixes": list(settings.mixes),
                               "concurrency": list(settings.concurrency), "duration_s": settings.duration_s,
                               "warmup_s": settings.warmup_s, "torch": torch.__version__,
                               "precision": "fp32" if settings.cpu else "fp16", "graphs": not settings.cpu}
    measure_each(settings.models, results, lambda name: measure_model(name, settings, results, binary=binary,
                                                                      stub_first=stub_first, echo=echo),
                 left_s=settings.left_s, echo=echo)
    results.save()
    return results.doc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--cpu", action="store_true", help="tiny-ee on this CPU, short runs (what make test runs)")
    p.add_argument("--quick", action="store_true", help="batches 8,32, concurrency 8,128, shorter runs")
    p.add_argument("--models", default=None)
    p.add_argument("--batches", default=None)
    p.add_argument("--mixes", default=None)
    p.add_argument("--instances", default=None, help="the baselines' instance counts to try (default 1,2)")
    p.add_argument("--wheels", type=Path, default=None,
                   help="folder with the server and client to unpack (default .gpu_wheels/; with --cpu only if given)")
    p.add_argument("--budget-s", type=float, default=None, help="start no new batch size past this many seconds")
    a = p.parse_args(argv)
    s = Settings(a.out, cpu=a.cpu, wheels=a.wheels, budget_s=a.budget_s)
    if a.cpu:
        s.models, s.batches, s.concurrency, s.instances = ("tiny-ee",), (8, 16), (1, 4), (1, 2)
        s.duration_s, s.warmup_s, s.processes, s.limit_reps = 0.6, 0.2, 2, 3
    if a.quick:
        s.batches, s.concurrency, s.duration_s = (8, 32), (8, 128), 1.0
    if a.models:
        s.models = tuple(a.models.split(","))
    if a.batches:
        s.batches = tuple(int(b) for b in a.batches.split(","))
    if a.mixes:
        s.mixes = tuple(a.mixes.split(","))
    if a.instances:
        s.instances = tuple(int(k) for k in a.instances.split(","))
    doc = run(s)
    return 1 if doc.get("failed") or not doc["rows"] else 0


if __name__ == "__main__":
    sys.exit(main())
