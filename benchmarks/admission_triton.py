"""E²bird's admission stage through Triton on one GPU, against Triton's own batching of the same model on the same GPU.

``python3 benchmarks/admission_triton.py OUT_DIR [--cpu] [--models resnet-stock,bert-stock] [--budget-s 420]``

Runs on a bare GPU host the way ``benchmarks/gpu_side_by_side.py`` does (the server and client unpacked from
``.gpu_wheels/``, ``make gpu-wheels``; the project imported from the checkout), and writes
``OUT_DIR/admission_triton.json`` after every measurement; ``e3 bench admission --measured FILE`` renders it into
``docs/RESULTS.md`` (keep it as ``docs/data/<gpu>/admission_triton.json``). Per model (random weights: latency
does not depend on them):

1. **Offline phase** in this process on the device, with the stage's own executors, and the rule fixed in
   ``serving/ebird/offline.py`` (compute budget, MaxBS, E-Ebird's sets and MaxInf, N-Ebird's engine).
2. **One server, every system a KIND_GPU Python model of the same stock model in the same engine** (FP16, a CUDA
   graph per batch): the stages ``N-Ebird`` and ``E-Ebird`` (:mod:`e3.serving.ebird.model`: the memory
   pool, workers on streams, answering continuously), and Triton's dynamic batcher in front of the stock model
   (max batch MaxBS, as the stage's workers) at its best: 1, 2 and 4 instances, each with the delay sweep:
   ``NO_Wait`` (1 instance, no delay), ``wait <d> us`` (1 instance; **OPT_Wait** is the delay, 0 included, with
   the most throughput at the target, reported apart only where it is not 0), ``instances (k)`` and
   ``instances (k) wait <d> us`` (the best of them is reported). The claim compares E-Ebird with the best of
   every baseline.
3. **Answers**: every system answers a few requests as the PyTorch reference does (FP32 on the CPU; on the GPU
   the FP16 agreement is reported).
4. **The QoS target**: NO_Wait's p99 at a light load + the compute budget (the rule). NO_Wait's capacity: offered
   1.5x what the profile says it sustains, the requests answered per second from the first arrival to the last
   answer (:func:`capacity`).
5. **Rate sweep, extended until every system misses**: open-loop Poisson arrivals of requests of
   ``per_request`` inputs, the same arrivals for every system at a rate, rates rising by ``rate_step`` from
   ``start_fraction`` of NO_Wait's capacity; a system leaves the sweep at its first miss (a miss is run once more
   and the better run kept), the sweep ends when every system has missed (or the client cannot keep up: said so,
   and a system still meeting then gets a lower bound); then one rate between each system's last met and first
   missed rate sharpens its maximum. Throughput at the target = the answered rate of its highest rate met.
6. **Burst**: low (0.3) -> high (1.0) -> low, fractions of NO_Wait's capacity, p50/p99 per phase.
7. **The load generator's bound, in the same run**: the same clients offer ``client_factor`` (3) x the best
   system's throughput at the target to a null model (``gpu_sweep.write_null_model``: zeros at once, no compute,
   the standing run's null model) behind the same
   front door; the check passes when the clients keep to the schedule (p99 lateness under half the target) and
   the null model answers within the target. Reported beside every figure: where it fails, the figures may be
   the clients' limit, and the run says so.

``--cpu``: the same on this machine's CPU with tiny-ee's head path (KIND_CPU, eager, one thread), short runs: a
smoke run that the GPU call will not fail on a bug (its figures measure nothing).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

if __package__:   # imported as e3.benchmarks.admission_triton
    from e3.deploy.gpu_host_setup import measure_each, prepare_host
    from e3.benchmarks.gpu_load import OpenLoop
else:             # run as a script, on a bare host before the project can be imported
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.path.append(str(Path(__file__).resolve().parents[1] / "deploy"))   # gpu_host_setup, standard library only
    from gpu_host_setup import measure_each, prepare_host
    from gpu_load import OpenLoop

# Deferred imports: this runs on a bare GPU host, where the project (`e3`) imports only once prepare_host has made
# its namespace and tritonclient only once it has unpacked the wheels; numpy and torch load with the step using them.
__all__ = ["Settings", "run", "main"]

CAPACITY_REQUESTS = 4000   # the capacity probe's most requests (a few seconds of backlog at most)


@dataclass
class Settings:
    out: Path
    cpu: bool = False
    models: tuple[str, ...] = ("resnet-stock", "bert-stock")
    per_request: int = 8                        # inputs per request (the front door's cost is per request)
    delays_us: tuple[int, ...] = (200, 1000)    # the dynamic batcher's delays swept (besides 0), under each count
    instances: tuple[int, ...] = (2, 4)         # the instance counts tried besides 1, each with every delay
    client_factor: float = 3.0                  # the null model is offered this x the best system's throughput
    start_fraction: float = 0.4                 # the sweep's first rate, of NO_Wait's capacity
    rate_step: float = 1.25                     # each next rate
    max_steps: int = 14
    run_s: float = 0.6                          # one rate for one system
    burst: tuple[float, float] = (0.3, 1.0)     # low and high phases, of NO_Wait's capacity
    phase_s: float = 1.0
    light_rps: float = 200.0                    # the light load that prices the front door
    max_rps: float = 30_000.0                   # the most the clients are asked to send
    processes: int = 8                          # client processes
    pool_rows: int = 4096                       # rows of the inputs the clients send (cycled)
    offline_repeats: int = 20                   # timings per batch and per worker set (median)
    qos_factor: float = 2.5                     # the rule's compute budget, in latencies of a batch of 32
    inline_form: bool = False                   # also E-Ebird answered inline (the fallback form), beside the continuous one
    wheels: Path | None = None
    budget_s: float | None = None               # start no new model past this (None: no limit)
    seed: int = 0
    started: float = field(default_factory=time.monotonic)

    def left_s(self) -> float:
        return math.inf if self.budget_s is None else self.budget_s - (time.monotonic() - self.started)


class Results:
    """admission_triton.json, rewritten after every measurement."""

    def __init__(self, path: Path, doc: dict):
        self.path, self.doc = path, doc

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.doc, indent=1, default=float))
        tmp.replace(self.path)


def _point(res: dict, arrivals, *, per_request: int, qos_ms: float) -> dict:
    """One run's figures: offered and answered rate (requests/s over the arrivals' span), p50/p99 of the answered,
    failed requests, the clients' lateness, whether the target was met."""
    import numpy as np
    lat, failed = res["latency_ms"], res["failed"]
    span = max(float(arrivals[-1]), 1e-9) if len(arrivals) else 1.0
    ok = lat[~failed]
    p99 = float(np.percentile(ok, 99)) if len(ok) else float("nan")
    late = res["late_ms"][~np.isnan(res["late_ms"])]
    return {"offered_rps": len(arrivals) / span, "answered_rps": float(len(ok)) / span,
            "answered_ips": float(len(ok)) * per_request / span,
            "p50_ms": float(np.percentile(ok, 50)) if len(ok) else float("nan"), "p99_ms": p99,
            "failed": int(failed.sum()), "late_p99_ms": float(np.percentile(late, 99)) if len(late) else 0.0,
            "met": bool(len(ok) and not failed.any() and p99 <= qos_ms), "errors": res["errors"]}


def capacity(res: dict, arrivals) -> float:
    """Requests/s served while more was offered: the requests answered over the time from the first arrival to the
    last answer. Offered more than it serves, the system is backlogged from early on to its last answer, so this
    is its service rate (the short ramp at the start aside), whatever the clients' own pace."""
    import numpy as np
    ok = ~res["failed"]
    if not ok.any():
        return 0.0
    done = np.asarray(arrivals)[ok] + res["latency_ms"][ok] / 1e3
    return float(ok.sum()) / float(done.max() - np.asarray(arrivals)[0])


def measure_model(name: str, s: Settings, results: Results, *, binary, echo) -> None:
    import torch

    from e3.serving.ebird.offline import OfflineRule, offline_phase, policies, torch_timer
    from e3.benchmarks.admission_report import Phase, burst_schedule
    from e3.core.exits import EntropyRule
    from e3.deploy.server import TritonServer
    from e3.benchmarks.gpu_sweep import write_null_model
    from e3.export.device_repository import DeviceModel, write_device_model
    from e3.serving.ebird.repository import write_device_stage
    from e3.models.reference import reference_answers
    from e3.serving.device.executor import DeviceSettings, build_model, prepare_model

    m = results.doc["models"][name] = {"per_request": s.per_request}
    device = "cpu" if s.cpu else "cuda"
    settings = DeviceSettings(device=device, precision="fp32" if s.cpu else "fp16", max_batch=64)
    if s.cpu:
        torch.set_num_threads(1)
    model = prepare_model(build_model(name, seed=s.seed, trained=False), settings)
    rule = OfflineRule(repeats=s.offline_repeats, qos_factor=s.qos_factor)
    m["offline"] = offline = {**offline_phase(torch_timer(model, settings), rule, echo=echo),
                              "timed_by": "CUDA events, sets on their own streams" if settings.cuda
                              else "wall clock, sets one after another"}
    results.save()
    del model
    if not s.cpu:
        torch.cuda.empty_cache()
    max_bs, pol = offline["max_bs"], policies(offline)

    repo = s.out / f"repo_{name.replace('-', '_')}"
    card = build_model(name, seed=s.seed, trained=False).card
    base = dict(model=name, exit_rule={"kind": "entropy", "tau_nats": 0.0}, enabled_ramps=(), gpu=not s.cpu,
                seed=s.seed, max_batch=max_bs)
    systems: dict[str, tuple[DeviceModel, str]] = {
        "NO_Wait": (DeviceModel(system="stock", **base), f"1 instance, delay 0, max batch {max_bs}")}
    for d in s.delays_us:
        systems[f"wait {d} us"] = (DeviceModel(system="stock", queue_delay_us=d, variant=f"d{d}", **base),
                                   f"1 instance, delay {d} us, max batch {max_bs}")
    for k in s.instances:
        systems[f"instances ({k})"] = (DeviceModel(system="stock", instances=k, **base),
                                       f"{k} instances, delay 0, max batch {max_bs}")
        for d in s.delays_us:
            systems[f"instances ({k}) wait {d} us"] = (
                DeviceModel(system="stock", instances=k, queue_delay_us=d, variant=f"d{d}", **base),
                f"{k} instances, delay {d} us, max batch {max_bs}")
    for label, p in pol.items():
        systems[label] = (DeviceModel(system="admission", policy=p, variant=label.lower().replace("-", "_"), **base),
                          f"workers {list(p.get('engine') or offline['engine'])}, <= {p['max_inflight']} in flight"
                          + (f", sets {p['confs']}" if "confs" in p else ""))
    if s.inline_form:   # the fallback form beside the continuous one (each execute runs its own requests out)
        p = pol["E-Ebird"]
        systems["E-Ebird (inline)"] = (DeviceModel(system="admission", policy=p, variant="e_ebird_inline",
                                                   answering="inline", **base), systems["E-Ebird"][1] + ", answered inline (the fallback)")
    served = {label: (write_device_stage if desc.system == "admission" else write_device_model)(repo, desc, card)
              for label, (desc, _) in systems.items()}
    m["systems"] = {label: {"served": served[label], "config": cfg} for label, (_, cfg) in systems.items()}
    null = write_null_model(repo, card, instances=1 if s.cpu else 2)   # the load generator's bound (step 7)
    echo(f"  starting tritonserver with {len(served) + 1} models")
    t = time.monotonic()
    server = TritonServer.on_free_ports(repo, sorted([*served.values(), null]), tritonserver=binary,
                                        log_file=s.out / f"triton_{name}.log", extra_args=["--model-load-thread-count=16"])
    server.start(timeout_s=600)
    echo(f"  ready after {time.monotonic() - t:.0f} s")
    ref_model = build_model(name, seed=s.seed, trained=False)
    pool = ref_model.example_arrays(s.pool_rows, seed=s.seed + 1)
    load = OpenLoop(server.grpc_url, s.processes)
    try:
        m["answers"] = check_answers(ref_model, served, pool, url=server.grpc_url, per_request=s.per_request,
                                     rule=EntropyRule(0.0), reference=reference_answers, echo=echo)
        results.save()

        def go(label: str, arrivals, qos_ms: float) -> dict:
            return _point(load.run(served[label], arrivals, pool, per_request=s.per_request), arrivals,
                          per_request=s.per_request, qos_ms=qos_ms)

        def poisson(rate: float, seconds: float, seed: int):
            return burst_schedule([Phase("run", rate, seconds)], seed)[0]

        for label in served:   # warm-up (connections, first calls, allocations): not measured, failures said
            w = go(label, poisson(min(s.light_rps, s.max_rps), min(s.run_s, 0.3), s.seed + 5), math.inf)
            if w["failed"]:
                echo(f"  warm-up of {label}: {w['failed']} requests failed ({'; '.join(w['errors'])})")
        light = go("NO_Wait", poisson(min(s.light_rps, s.max_rps), s.run_s, s.seed), math.inf)
        m["floor_p99_ms"] = light["p99_ms"]
        m["qos_ms"] = qos = light["p99_ms"] + offline["budget_ms"]
        estimate = max_bs / offline["latency_ms"][str(max_bs)] * 1e3 / s.per_request
        # at most CAPACITY_REQUESTS: offered far more than the front door carries (the in-process estimate is
        # many times Triton's), a longer probe only leaves seconds of backlog that time out
        rate_over = min(1.5 * estimate, s.max_rps)
        over = poisson(rate_over, min(2 * s.run_s, CAPACITY_REQUESTS / rate_over), s.seed + 1)
        m["capacity_rps"] = cap = capacity(load.run(served["NO_Wait"], over, pool, per_request=s.per_request), over)
        echo(f"  QoS target {qos:.2f} ms (NO_Wait's light-load p99 {light['p99_ms']:.2f} + budget "
             f"{offline['budget_ms']:.2f}); NO_Wait's capacity {cap:,.0f} requests/s "
             f"({cap * s.per_request:,.0f} inputs/s)")
        results.save()
        sweep(m, s, go=go, poisson=poisson, results=results, echo=echo)
        burst_run(m, s, load=load, served=served, pool=pool, results=results, echo=echo)
        client_check(m, s, run=lambda arrivals, qos_ms: _point(
            load.run(null, arrivals, pool, per_request=s.per_request), arrivals, per_request=s.per_request,
            qos_ms=qos_ms), poisson=poisson, results=results, echo=echo)
    finally:
        load.close()
        server.stop()


def check_answers(model, served: dict, pool: dict, *, url: str, per_request: int, rule, reference, echo) -> dict:
    """Each system's labels for 4 requests against the PyTorch reference (FP32, one input at a time, CPU)."""
    import numpy as np
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype
    count = 4 * per_request
    inputs = {k: v[:count] for k, v in pool.items()}
    ref = reference(model, tuple(inputs[sp.name] for sp in model.card.inputs), rule, enabled_ramps=())
    client = grpcclient.InferenceServerClient(url)
    out = {}
    for label, name in served.items():
        got = []
        for at in range(0, count, per_request):
            xs = []
            for k, v in inputs.items():
                x = grpcclient.InferInput(k, [per_request, *v.shape[1:]], np_to_triton_dtype(v.dtype))
                x.set_data_from_numpy(np.ascontiguousarray(v[at:at + per_request]))
                xs.append(x)
            got.append(client.infer(name, xs, client_timeout=60).as_numpy("label").reshape(-1))
        out[label] = float(np.mean(np.concatenate(got) == ref.label))
        echo(f"  answers of {label} ({name}): labels {out[label]:.0%} equal to the reference")
    client.close()
    return out


def sweep(m: dict, s: Settings, *, go, poisson, results: Results, echo) -> None:
    """Step 5 of the module docstring."""
    qos, cap = m["qos_ms"], m["capacity_rps"]
    labels = list(m["systems"])
    points: dict[str, list[dict]] = {label: [] for label in labels}
    m["sweep"] = points
    alive, client_bound = set(labels), None
    rate = s.start_fraction * cap
    for step in range(s.max_steps):
        if not alive or rate > s.max_rps:
            break
        if s.left_s() < 40:
            echo("  the time budget is nearly spent: the sweep stops here (systems still meeting get lower bounds)")
            break
        arrivals = poisson(rate, s.run_s, s.seed + 10 + step)
        ran: list[str] = []
        for label in labels:
            if label not in alive:
                continue
            p = go(label, arrivals, qos)
            if not p["met"]:
                again = go(label, arrivals, qos)
                p = again if again["met"] or again["p99_ms"] < p["p99_ms"] else p
            points[label].append(p)
            ran.append(label)
            if not p["met"]:
                alive.discard(label)
        lateness = max(points[lb][-1]["late_p99_ms"] for lb in ran)
        echo(f"  rate {rate:,.0f}/s: " + "; ".join(
            f"{lb} p99 {points[lb][-1]['p99_ms']:.2f}{'' if points[lb][-1]['met'] else ' MISSED'}" for lb in ran)
            + f" (clients late by up to {lateness:.2f} ms at p99)")
        results.save()
        if lateness > qos / 2:
            client_bound = rate
            echo(f"  the clients fell behind the schedule at {rate:,.0f}/s: the sweep stops here")
            break
        rate *= s.rate_step
    m["client_bound_rps"] = client_bound
    m["unmissed"] = sorted(alive)
    for label in labels:   # one rate between the last met and the first missed sharpens the maximum
        met = [p for p in points[label] if p["met"]]
        miss = [p for p in points[label] if not p["met"]]
        if met and miss and label not in alive:
            mid = math.sqrt(met[-1]["offered_rps"] * miss[0]["offered_rps"])
            p = go(label, poisson(mid, s.run_s, s.seed + 99), qos)
            points[label].append(p)
    m["throughput"] = {label: throughput_at_target(points[label]) for label in labels}
    delays = {0: "NO_Wait", **{d: f"wait {d} us" for d in s.delays_us}}
    best_delay = max(delays, key=lambda d: (m["throughput"][delays[d]]["rps"], -d))
    m["opt_wait"] = {"delay_us": best_delay, "label": delays[best_delay], "same_as_no_wait": best_delay == 0}
    inst = [lb for lb in labels if lb.startswith("instances (")]
    m["instances_best"] = max(inst, key=lambda lb: m["throughput"][lb]["rps"]) if inst else None
    results.save()


def throughput_at_target(points: list[dict]) -> dict:
    """The answered rate at the highest offered rate met, every lower rate tried met too; ``bound``: it met every
    rate it was offered (a lower bound)."""
    best, bound = 0.0, True
    best_ips = 0.0
    for p in sorted(points, key=lambda q: q["offered_rps"]):
        if not p["met"]:
            bound = False
            break
        best, best_ips = p["answered_rps"], p["answered_ips"]
    return {"rps": best, "ips": best_ips, "lower_bound": bound and bool(points)}


def client_check(m: dict, s: Settings, *, run, poisson, results: Results, echo) -> None:
    """Step 7 of the module docstring: the clients offer ``client_factor`` x the best system's throughput at the
    target to the null model."""
    if "throughput" not in m:
        return
    best = max(m["throughput"], key=lambda lb: m["throughput"][lb]["rps"])
    rate = s.client_factor * m["throughput"][best]["rps"]
    p = run(poisson(rate, s.run_s, s.seed + 200), m["qos_ms"])
    ok = p["met"] and p["late_p99_ms"] < m["qos_ms"] / 2
    m["client_check"] = {"best_system": best, "factor": s.client_factor, "offered_rps": rate,
                         "answered_rps": p["answered_rps"], "p99_ms": p["p99_ms"], "late_p99_ms": p["late_p99_ms"],
                         "failed": p["failed"], "ok": bool(ok), "processes": s.processes}
    echo(f"  load generator: {s.client_factor:g}x the best system ({best}) = {rate:,.0f} requests/s offered to the "
         f"null model from {s.processes} processes: answered {p['answered_rps']:,.0f}/s, p99 {p['p99_ms']:.2f} ms, clients "
         f"late by {p['late_p99_ms']:.2f} ms at p99: {'not the limit' if ok else 'MAY BE THE LIMIT of these figures'}")
    results.save()


def burst_run(m: dict, s: Settings, *, load, served, pool, results, echo) -> None:
    """Step 6: the systems shown (NO_Wait, OPT_Wait where it is not NO_Wait, the best instances, the stages)."""
    from e3.benchmarks.admission_report import Phase, burst_schedule, phase_latencies
    cap, qos = m["capacity_rps"], m["qos_ms"]
    low, high = (f * cap for f in s.burst)
    phases = [Phase("low", low, s.phase_s), Phase("high", high, s.phase_s), Phase("low", low, s.phase_s)]
    arrivals, phase = burst_schedule(phases, s.seed + 100)
    shown = ["NO_Wait"] + ([] if m["opt_wait"]["same_as_no_wait"] else [m["opt_wait"]["label"]]) + \
        ([m["instances_best"]] if m["instances_best"] else []) + ["N-Ebird", "E-Ebird"]
    rows = []
    for label in shown:
        res = load.run(served[label], arrivals, pool, per_request=s.per_request)
        rows += [{"system": label, **r} for r in phase_latencies(res["latency_ms"], phase, res["failed"],
                                                                  phases=phases, qos_ms=qos)]
    m["burst"] = rows
    echo("  burst: " + "; ".join(f"{r['system']} {r['phase']} p99 {r['p99_ms']:.2f}" for r in rows))
    results.save()


def run(s: Settings, echo=print) -> dict:
    binary, s.out = prepare_host(s.out, cpu=s.cpu, wheels=s.wheels)
    import torch

    from e3.serving.ebird.offline import RULE_TEXT
    from e3.benchmarks.report import commit
    device = "cpu" if s.cpu else torch.cuda.get_device_name()
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(s).items() if k not in ("started",)}
    results = Results(s.out / "admission_triton.json", {
        "kind": "admission-triton", "device": device, "commit": commit(), "torch": torch.__version__,
        "rule": RULE_TEXT, "settings": settings, "models": {},
        "budget": f"one {device}; every system a Python-backend model on it in the same engine (PyTorch, "
                  f"{'FP32 eager' if s.cpu else 'FP16 CUDA graphs'}), behind the same gRPC front door; one system "
                  "at a time"})
    measure_each(s.models, results, lambda name: measure_model(name, s, results, binary=binary, echo=echo),
                 left_s=s.left_s, echo=echo)
    results.save()
    return results.doc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path, help="folder for admission_triton.json, the repositories and the server logs")
    p.add_argument("--cpu", action="store_true", help="tiny-ee's head path on this CPU, short runs (a smoke run)")
    p.add_argument("--models", default=None, help="stock models (default resnet-stock,bert-stock)")
    p.add_argument("--per-request", type=int, default=None, help="inputs per request (default 8)")
    p.add_argument("--wheels", type=Path, default=None,
                   help="folder with the server and client to unpack (default .gpu_wheels/; with --cpu only if given)")
    p.add_argument("--budget-s", type=float, default=None, help="start no new model past this many seconds (the last sweep stops 40 s before it)")
    a = p.parse_args(argv)
    s = Settings(a.out, cpu=a.cpu, wheels=a.wheels, budget_s=a.budget_s)
    if a.cpu:
        s.models, s.delays_us, s.instances, s.processes = ("tiny-ee",), (2000,), (2,), 2
        s.run_s, s.phase_s, s.light_rps, s.max_rps, s.max_steps, s.pool_rows = 0.3, 0.3, 100.0, 4000.0, 5, 256
        # a smoke run on a shared CPU: a looser budget and lower first rate, so that the sweep meets some rates
        # before it misses and every step of the runner runs
        s.start_fraction, s.rate_step, s.offline_repeats, s.qos_factor = 0.15, 1.8, 3, 10.0
        s.inline_form = True   # the CPU smoke run (make reliability, item 21) serves the inline form through Triton too
    if a.models:
        s.models = tuple(a.models.split(","))
    if a.per_request:
        s.per_request = a.per_request
    doc = run(s)
    ok = not doc.get("failed") and all("burst" in m for m in doc["models"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
