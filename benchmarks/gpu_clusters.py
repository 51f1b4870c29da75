"""GPU clusters by simulation (`e3 bench gpu`): E3 against the stock and naive early-exit models on
GPUs this project's machines lack, with latency profiles MODELLED from public figures.

Nothing here is measured on a GPU: the profiles come from ``e3 profile --modelled`` (whole-model
BERT-base curves per GPU, scaled to the model's blocks; :mod:`e3.profiling.modelled_profile`), every
table says MODELLED, and the figures are the discrete-event simulator's (:mod:`e3.simulator.des`).
Pure: a function of the profile, the batch profile and the inputs' exits; no files, no Triton.

Decisions (the paper is silent on them):

* **Saturation** is a closed loop whose clients keep ``inflight`` inputs outstanding
  (``inflight / batch`` clients); it starts at ``inflight_start`` and doubles until goodput
  rises by less than ``rise`` (or ``max_doublings``), and every level is kept (``sweep``), so a
  table shows that goodput had stopped rising. An open loop above capacity is not used: the
  baselines have no admission control, so their queue (and latency) would grow without bound
  and their goodput under the SLO would fall towards 0, which says nothing about their capacity.
  The best level is reported (a closed loop with too many clients only adds queueing).
* **Goodput** counts inputs answered within ``slo_ms``; E3's scheduler drops rows that cannot
  meet the same SLO (minus slack), the baselines answer everything.
* **Call costs on a GPU** (:func:`gpu_call_costs`): an execute carrying model inputs pays the
  inputs' hop (``tx_in``, token ids: small); a cut's hop (``tx``: hidden states at the modelled
  link) runs on a copy engine beside the instance's compute, a pipeline stage of its own, as
  the planner prices it (E3 §3.2.2: "overlapping computation and communication across
  batches"); a further request merged into one execute costs ``request_ms``
  (default 0: a native GPU backend gathers requests on the host while the GPU runs, the same
  for every system).
* **The hop's link** (``link_gbit_s``, ``link_fixed_ms``): our router moves a cut's state
  through its host memory (BLS: the split's output comes back to the router, the survivors go
  to the next split), so a hop between GPUs of one machine is a device-to-host and a
  host-to-device copy over PCIe, not a network transfer. Default: PCIe 3.0 x16 (the V100
  hosts of the price model, AWS p3: ~12 GB/s effective, 96 Gbit/s) with the modelled profile's
  fixed 0.2 ms per hop (the BLS exchange); the cluster is taken as machines of 8 GPUs, each
  with a router of its own, so no hop crosses the network (the paper: "GPUs on same server are
  connected via a shared PCIe interconnect"). Hops across machines (25 Gbit/s, the profile's
  old assumption; the paper's 10 Gbit/s Ethernet) are rows of the sensitivity table. The copy
  out of a constant split (every row of its batch, ``out_copy``) runs on an engine of its own
  per instance (a V100 copies both ways at once). A copy engine is busy while bytes move; a
  hop's fixed 0.2 ms is the BLS exchange's handshake between host threads (the router's stub
  and Triton), latency that holds no engine (``hop_fixed_latency``; holding one is a row of
  the sensitivity table).
* **The router's work** (``router_ms``, measured on this host's CPU: stacking rows, the exit
  rule, answers) runs on the host, beside the GPUs: the real router's worker thread does it
  after the split's BLS call returned, while the split's Triton instance (another model) runs
  the next batch. So for a constant split it is a pipeline stage of its own on a pool of host
  cores, ``router_cores_per_gpu`` per GPU of the plan (default 4: the hosts of the price model,
  AWS p3, have 8 vCPUs per V100; the paper's servers a 12-core CPU for 1-2 GPUs), not time
  the GPU waits; a compact split runs its blocks from the router's thread, so its router work
  stays in its time. One router process's Python holds one GIL, so the row "router work on 1
  host core" shows what a single router process doing all of it would reach; the router keeps
  one batch per pipeline stage per instance in flight (``router_slots``; today's
  ``serving/router.py`` gives a constant split instances + 1, another row).
  The planner counts the router's work inside every split's stage (right on a CPU, where it
  takes the same cores, and for compact splits): :func:`plan_for` also asks it for constant
  plans priced with the stages beside the compute (:func:`beside_profile`) and keeps the plan
  it predicts faster.
* **Latency curves** (why naive EE beats stock here): the modelled V100 layer of this model
  (hidden 384, 48 tokens) is flat only up to batch ~10 (the equivalent BERT-base batch r*B <=
  1) and grows after it: at batch 64 (3,072 tokens) it is 0.237 ms, ~11 GFLOP at ~47 TFLOPS,
  the FP16 rate the public BERT-base figures show from batch 8 at 128 tokens (1,024 tokens:
  ~51 TFLOPS); the public 6-layer distilled BERT on V100 (S4) grows likewise (2.0 -> 7.5 ms
  from batch 1 to 8). So a shrinking batch saves time here too, and the curve is kept.
* **Equal budgets**: every system gets the same GPUs, one Triton instance per GPU (the
  simulator does not model two instances sharing one GPU, so more would create capacity that
  does not exist). Each baseline keeps its best (max batch, queue delay) from a small grid
  (:func:`baseline_grid`), chosen at a calibration load per request size; E3 runs the
  planner's plan for the same GPUs (``best_plan``, no cost bound).
* **Heterogeneity at fixed cost** (Fig. 13): clusters whose hourly price fits one budget
  (prices of :data:`e3.profiling.modelled_profile.PRICES_PER_HOUR`); E3 plans every cluster, mixes
  included (a split's replicas share one GPU type); the baselines run on the homogeneous ones
  (one model on one GPU type).
* **Cost at fixed goodput** (Figs. 14-15): E3's cheapest cluster is the planner's
  :func:`cheapest_plan` over the GPU types (at most ``max_per_type`` of each), simulated to check
  it reaches the target; a baseline's is, per GPU type, the fewest GPUs whose simulated
  goodput reaches it (starting from its goodput on ``probe_gpus`` GPUs, scaled).
"""

from __future__ import annotations

import copy
import logging
import math
from dataclasses import asdict, dataclass, field
from typing import Callable, Mapping, Sequence

import numpy as np

from e3.controller.planner import PlanOptions, PlannerError, best_plan, cheapest_plan
from e3.core.plan import CONSTANT, FORMS, Plan
from e3.core.profile import BatchProfile, LatencyProfile
from e3.simulator.des import Arrivals, Baseline, CallCosts, SimResult, simulate_baseline, simulate_plan

__all__ = ["GpuSimSettings", "Cell", "gpu_call_costs", "beside_profile", "baseline_grid", "saturate", "plan_for", "simulate_e3",
           "best_baseline", "goodput_vs_batch", "clusters_at_budget", "heterogeneity", "cost_at_goodput",
           "describe_plan", "goodput_ratios", "saturated", "start_inflight", "with_link", "batch_table", "heterogeneity_table", "cost_table", "results_document", "plot_goodput", "MODELLED"]

log = logging.getLogger(__name__)

MODELLED = "MODELLED"
E3_ASK_MORE = (1.0, 1.05, 1.1, 1.2, 1.35, 1.5)   # cost at goodput: E3's planner asked for these x the target


@dataclass(frozen=True)
class GpuSimSettings:
    """What `e3 bench gpu` simulates (defaults: the full run; :meth:`quick` a shorter one)."""
    device: str = "v100"                        # the homogeneous cluster's GPU type
    gpus: int = 16                              # GPUs of the goodput-against-batch cluster
    batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32)   # inputs per request
    slo_ms: float = 100.0                       # planner's objective and goodput's SLO (ms)
    slack: float = 0.2
    rate_rps: float = 1e6                       # planner's offered rate (inputs/s): above every capacity here
    request_ms: float = 0.0                     # per further request merged into one execute (ms), all systems
    inflight_start: int = 1024                  # inputs outstanding at the first saturation level
    max_doublings: int = 4
    rise: float = 0.03                          # goodput rising less than this share: saturated
    min_requests: int = 1500                    # measured requests per simulation (at least 3 x clients)
    max_batch_grid: tuple[int, ...] = (16, 32, 64)   # baselines' max batch choices
    delay_grid_us: tuple[int, ...] = (0, 1000)       # baselines' queue delay choices
    hetero_batch: int = 8                       # inputs per request of Figs. 13-15
    budget_gpus: int = 8                        # Fig. 13's budget: the price of this many `device` GPUs
    hetero_types: tuple[str, ...] = ("v100", "t4", "a100")
    goodput_share: float = 0.5                  # Figs. 14-15's target: this share of E3's goodput on `gpus`
    max_per_type: int = 64                      # GPUs of each type the cheapest-cluster search may use
    seed: int = 0
    link_gbit_s: float = 96.0                   # a cut's hop: PCIe 3.0 x16 (~12 GB/s) through the router's host
    link_fixed_ms: float = 0.2                  # a hop's fixed part (the modelled profile's)
    out_copy: bool = True                       # a constant split's output copy on an engine of its own
    hop_fixed_latency: bool = True              # a hop's fixed part is host latency; the engine moves bytes only
    router_cores_per_gpu: float = 4.0           # host cores for the router's work per GPU of the plan; 0: the
    #                                             router's work inside every split's time (the planner's model)
    router_cores: int | None = None             # the router's host cores, whatever the GPUs (overrides the above)
    router_slots: int | None = None             # a constant split's batches in flight per instance; None: one
    #                                             per pipeline stage (today's router: 1, plus one per split)

    def host_cores(self, gpus: int) -> int:
        """Host cores the router's work may use on a cluster of ``gpus`` GPUs (0: inside the splits' time)."""
        if self.router_cores is not None:
            return self.router_cores
        return int(round(self.router_cores_per_gpu * gpus))

    @classmethod
    def quick(cls, **kw) -> "GpuSimSettings":
        """A smaller baseline grid, shorter simulations, request sizes 1, 8 and 32."""
        base = dict(max_doublings=4, min_requests=800, max_batch_grid=(32, 64), delay_grid_us=(0,), batches=(1, 8, 32))
        return cls(**{**base, **kw})


@dataclass
class Cell:
    """One simulated system at one setting, at its saturating load."""
    system: str                      # "e3" | "stock" | "ee"
    batch: int                       # inputs per request
    goodput_ips: float               # inputs/s answered within the SLO, best over the sweep
    p99_ms: float
    config: str                      # E3: the plan's splits; a baseline: its instances, max batch, delay
    sweep: list[tuple[int, float]] = field(default_factory=list)   # (inputs in flight, goodput inputs/s)
    cluster: str = ""                # e.g. "16 x v100"
    cost_per_hour: float = float("nan")
    predicted_ips: float = float("nan")   # E3: the planner's throughput

    def to_dict(self) -> dict:
        return asdict(self)


def gpu_call_costs(request_ms: float = 0.0, *, router_cores: int = 0, out_copy: bool = False,
                   slots_per_instance: int | None = None, hop_fixed_latency: bool = False) -> CallCosts:
    """The simulator's call costs on a GPU (module docstring); ``router_cores``: host cores of the router's
    work beside the GPUs (0: inside each split's time)."""
    return CallCosts(input_curve="tx_in", request_ms=request_ms, overlap_hop=True, router_cores=router_cores,
                     out_copy=out_copy, slots_per_instance=slots_per_instance, hop_fixed_latency=hop_fixed_latency)


def _bytes_part(curve: Sequence[float], batch_sizes: Sequence[int]) -> list[float]:
    """A fixed + bytes hop curve less its fixed part (the value at batch 1 less the per-row step, from its
    first two points)."""
    if len(curve) < 2:
        return list(curve)
    step = (curve[1] - curve[0]) / (batch_sizes[1] - batch_sizes[0])
    fixed = max(0.0, curve[0] - step * batch_sizes[0])
    return [max(0.0, x - fixed) for x in curve]


def beside_profile(latency: LatencyProfile, hop_fixed_latency: bool = False) -> LatencyProfile:
    """The profile the planner prices constant plans with when the router's work and the copies run beside
    the GPU (module docstring). The planner's cycle takes, per split, the larger of its stage and its hop,
    ``max(T, Tx)``; here the stage is the blocks alone and the hop's term carries the largest stage beside
    them at the same per-instance batch: ``max(Tx, R)`` into a cut, and for the first split ``max(Tx_in, R,
    out)`` with ``out`` its output copy (the bytes part of ``Tx``; a later split's copy out is no longer
    than the hop into it). ``hop_fixed_latency``: a hop's term is its bytes part only (its fixed part is
    latency that holds no engine). Worst-case latency then counts ``max`` where the stages add up, under
    by at most the smaller of them per split, and the hops' fixed parts (under 1 ms per split here, against
    a 100 ms SLO). Pure."""
    out = copy.deepcopy(latency)
    b = latency.batch_sizes
    for d in latency.devices:
        r = list(latency.router_ms.get(d) or [0.0] * len(b))
        tx = list(latency.tx_ms[d])
        out_copy = _bytes_part(tx, b)
        first = list(latency.tx_in_ms.get(d) or tx)
        if hop_fixed_latency:
            tx, first = out_copy, _bytes_part(first, b)
        out.tx_ms[d] = [max(t, x) for t, x in zip(tx, r)]
        out.tx_in_ms[d] = [max(t, x, c) for t, x, c in zip(first, r, out_copy)]
    out.router_ms = {}
    out.source = f"{latency.source}; planned with the router's work and copies beside the GPU"
    return out


def baseline_grid(settings: GpuSimSettings) -> list[tuple[int, int]]:
    """(max batch, queue delay us) a baseline may choose; its preferred batch is its max batch."""
    return [(b, d) for b in settings.max_batch_grid for d in settings.delay_grid_us]


def _arrivals(batch: int, inflight: int, settings: GpuSimSettings) -> Arrivals:
    clients = max(1, inflight // batch)
    return Arrivals(batch=batch, requests=max(settings.min_requests, 3 * clients), clients=clients,
                    warmup=clients, seed=settings.seed, steady=True)


def saturated(sweep: Sequence[tuple[int, float]], rise: float) -> bool:
    """Whether a sweep's last doubling raised goodput by less than ``rise`` (it had stopped rising)."""
    return len(sweep) >= 2 and sweep[-1][1] < sweep[-2][1] * (1 + rise)


def start_inflight(settings: GpuSimSettings, gpus: int) -> int:
    """The first level of a sweep on ``gpus`` GPUs: ``inflight_start`` scaled by ``gpus / settings.gpus``
    (a larger cluster needs more inputs in flight to fill), at least 64."""
    return max(64, settings.inflight_start * gpus // settings.gpus)


def saturate(run: Callable[[Arrivals], SimResult], batch: int, settings: GpuSimSettings, *, start: int | None = None
             ) -> tuple[SimResult, list[tuple[int, float]]]:
    """Run a closed loop at doubling loads from ``start`` inputs in flight (default ``inflight_start``)
    until goodput stops rising (module docstring); the best result and every level's (inputs in flight,
    goodput)."""
    best, sweep, inflight = None, [], start or settings.inflight_start
    for _ in range(settings.max_doublings + 1):
        result = run(_arrivals(batch, inflight, settings))
        sweep.append((inflight, result.goodput_ips))
        previous = best.goodput_ips if best is not None else 0.0
        if best is None or result.goodput_ips > best.goodput_ips:
            best = result
        if previous > 0 and result.goodput_ips < previous * (1 + settings.rise):
            break
        inflight *= 2
    return best, sweep


def plan_for(latency: LatencyProfile, batch_profile: BatchProfile, devices: Mapping[str, int],
             *, settings: GpuSimSettings, exit_rule: Mapping | None = None,
             ramp_blocks: Sequence[int] | None = None, forms: Sequence[str] | None = None) -> Plan:
    """The planner's best plan for ``devices`` (no cost bound), served with the bench's SLO; ``forms``:
    the split forms it may choose (None: both). With the router's work beside the GPUs
    (``settings.router_cores_per_gpu`` or ``router_cores``), also the best constant plan priced by
    :func:`beside_profile`; the one the planner predicts faster is kept (ties: the first)."""
    allowed = tuple(forms or FORMS)
    kw = dict(slo_ms=settings.slo_ms, rate_rps=settings.rate_rps, slack=settings.slack, alpha=None)
    result = best_plan(latency, batch_profile, dict(devices), PlanOptions(forms=allowed, **kw))
    if settings.host_cores(sum(devices.values())) > 0 and CONSTANT in allowed:
        try:
            beside = best_plan(beside_profile(latency, settings.hop_fixed_latency), batch_profile, dict(devices),
                               PlanOptions(forms=(CONSTANT,), **kw))
        except PlannerError as err:
            log.info("no constant plan with the router beside the GPUs: %s", err)
        else:
            if beside.throughput_rps > result.throughput_rps * (1 + 1e-9):
                result = beside
    ramps = list(ramp_blocks) if ramp_blocks is not None else list(latency.ramp_blocks())
    return result.to_plan(model=latency.model, num_blocks=latency.num_blocks,
                          exit_rule=dict(exit_rule or {"kind": "entropy", "tau_nats": 0.0}), ramp_blocks=ramps,
                          slo_ms=settings.slo_ms, slack=settings.slack)


def with_link(latency: LatencyProfile, gbit_s: float, *, modelled_gbit_s: float = 25.0,
              fixed_ms: float = 0.2, new_fixed_ms: float | None = None) -> LatencyProfile:
    """``latency`` with its hops (``tx_ms``, ``tx_in_ms``) re-priced for a link of ``gbit_s`` instead of the
    modelled ``modelled_gbit_s`` (:mod:`e3.profiling.modelled_profile` step 5: ``fixed_ms`` + bytes / bandwidth,
    so the bytes term scales by ``modelled_gbit_s / gbit_s``) and, when given, a fixed part of
    ``new_fixed_ms``. Pure; for the hop sensitivity."""
    scale = modelled_gbit_s / gbit_s
    fixed_out = fixed_ms if new_fixed_ms is None else new_fixed_ms

    def rescale(curves: Mapping[str, list[float]]) -> dict[str, list[float]]:
        return {d: [fixed_out + (x - fixed_ms) * scale for x in ys] for d, ys in curves.items()}

    out = copy.deepcopy(latency)
    out.tx_ms = rescale(latency.tx_ms)
    out.tx_in_ms = rescale(latency.tx_in_ms)
    out.source = f"{latency.source}; hops re-priced at {fixed_out:g} ms + bytes at {gbit_s:g} Gbit/s"
    return out


def describe_plan(plan: Plan) -> str:
    return " \\| ".join(f"{s.first_block}-{s.last_block} {s.form} {s.instances}x{s.device} b{s.batch_size}"
                        for s in plan.splits)


def _cluster(devices: Mapping[str, int]) -> str:
    return " + ".join(f"{n} x {d}" for d, n in devices.items() if n)


def _cost(latency: LatencyProfile, devices: Mapping[str, int]) -> float:
    return float(sum(latency.devices[d].price * n for d, n in devices.items()))


def simulate_e3(latency: LatencyProfile, plan: Plan, exit_ramp: np.ndarray, *, batch: int,
                settings: GpuSimSettings) -> Cell:
    """E3 serving ``plan`` at saturation; the router's work on ``settings.host_cores`` of the plan's GPUs."""
    device = plan.splits[0].device
    used: dict[str, int] = {}
    for s in plan.splits:
        used[s.device] = used.get(s.device, 0) + s.instances
    costs = gpu_call_costs(settings.request_ms, router_cores=settings.host_cores(sum(used.values())),
                           out_copy=settings.out_copy, slots_per_instance=settings.router_slots,
                           hop_fixed_latency=settings.hop_fixed_latency)
    best, sweep = saturate(lambda a: simulate_plan(latency, plan, exit_ramp, arrivals=a, device=device,
                                                   slo_ms=settings.slo_ms, costs=costs), batch, settings,
                           start=start_inflight(settings, sum(used.values())))
    return Cell("e3", batch, best.goodput_ips, best.p99_ms, describe_plan(plan), sweep, _cluster(used),
                _cost(latency, used), plan.predicted.get("throughput_rps", float("nan")))


def best_baseline(latency: LatencyProfile, kind: str, device: str, *, gpus: int, exit_ramp: np.ndarray, batch: int,
                  settings: GpuSimSettings) -> Cell:
    """``kind`` ("stock" | "ee") on ``gpus`` x ``device``, one instance per GPU, in the grid configuration
    with the highest goodput at saturation (each configuration saturated on its own)."""
    costs = gpu_call_costs(settings.request_ms)

    def run(base: Baseline) -> Callable[[Arrivals], SimResult]:
        return lambda a: simulate_baseline(latency, base, exit_ramp, arrivals=a, device=device, slo_ms=settings.slo_ms,
                                           costs=costs)

    choices = [Baseline(kind, instances=gpus, max_batch=b, preferred=b, delay_us=d) for b, d in baseline_grid(settings)]
    start = start_inflight(settings, gpus)
    scored = [(saturate(run(base), batch, settings, start=start), -i, base) for i, base in enumerate(choices)]
    (best, sweep), _, chosen = max(scored, key=lambda x: (x[0][0].goodput_ips, x[1]))
    config = f"{gpus} inst, max batch {chosen.max_batch}, delay {chosen.delay_us} us"
    return Cell(kind, batch, best.goodput_ips, best.p99_ms, config, sweep, f"{gpus} x {device}",
                _cost(latency, {device: gpus}))


def goodput_vs_batch(latency: LatencyProfile, batch_profile: BatchProfile, exit_ramp: np.ndarray,
                     *, settings: GpuSimSettings, progress: Callable[[str], None] | None = None,
                     plan_kw: Mapping | None = None) -> tuple[list[Cell], Plan]:
    """(1): stock, naive EE and E3 on ``settings.gpus`` x ``settings.device`` per request size."""
    plan = plan_for(latency, batch_profile, {settings.device: settings.gpus}, settings=settings, **(plan_kw or {}))
    cells = []
    for batch in settings.batches:
        for system in ("e3", "stock", "ee"):
            if system == "e3":
                cell = simulate_e3(latency, plan, exit_ramp, batch=batch, settings=settings)
            else:
                cell = best_baseline(latency, system, settings.device, gpus=settings.gpus, exit_ramp=exit_ramp, batch=batch, settings=settings)
            cells.append(cell)
            if progress:
                progress(f"batch {batch} {system}: {cell.goodput_ips:,.0f} inputs/s")
    return cells, plan


def clusters_at_budget(latency: LatencyProfile, budget_per_hour: float, types: Sequence[str],
                       *, max_per_type: int = 64) -> list[dict[str, int]]:
    """Fig. 13's clusters: each GPU type alone, as many as the budget buys, and every pair of types
    splitting the budget in half (as many of each as its half buys, the rest of the budget spent on the
    cheaper type). Clusters of fewer than 1 GPU of a type are left out."""
    price = {t: latency.devices[t].price for t in types}
    out: list[dict[str, int]] = []
    for t in types:
        n = min(max_per_type, int(budget_per_hour / price[t] + 1e-9))
        if n:
            out.append({t: n})
    for i, a in enumerate(types):
        for b in types[i + 1:]:
            cheap, dear = (a, b) if price[a] <= price[b] else (b, a)
            n_dear = int(budget_per_hour / 2 / price[dear] + 1e-9)
            n_cheap = min(max_per_type, int((budget_per_hour - n_dear * price[dear]) / price[cheap] + 1e-9))
            if n_dear and n_cheap:
                out.append({dear: n_dear, cheap: n_cheap})
    return out


def heterogeneity(latency: LatencyProfile, batch_profile: BatchProfile, exit_ramp: np.ndarray,
                  *, settings: GpuSimSettings, progress: Callable[[str], None] | None = None,
                  plan_kw: Mapping | None = None) -> dict:
    """(2a) Fig. 13: goodput of E3 (and the baselines on homogeneous clusters) at one hourly budget."""
    budget = settings.budget_gpus * latency.devices[settings.device].price
    rows = []
    for devices in clusters_at_budget(latency, budget, settings.hetero_types, max_per_type=settings.max_per_type):
        plan = plan_for(latency, batch_profile, devices, settings=settings, **(plan_kw or {}))
        cells = [simulate_e3(latency, plan, exit_ramp, batch=settings.hetero_batch, settings=settings)]
        if len(devices) == 1:
            (device, n), = devices.items()
            cells += [best_baseline(latency, kind, device, gpus=n, exit_ramp=exit_ramp, batch=settings.hetero_batch, settings=settings)
                      for kind in ("stock", "ee")]
        rows.append({"cluster": _cluster(devices), "cost_per_hour": _cost(latency, devices),
                     "cells": [c.to_dict() for c in cells]})
        if progress:
            progress(f"{_cluster(devices)}: E3 {cells[0].goodput_ips:,.0f} inputs/s")
    return {"budget_per_hour": budget, "batch": settings.hetero_batch, "rows": rows}


def _fewest_gpus(latency: LatencyProfile, kind: str, device: str, exit_ramp: np.ndarray, target: float,
                 settings: GpuSimSettings, probe_gpus: int = 4) -> Cell | None:
    """The fewest ``device`` GPUs on which baseline ``kind`` reaches ``target`` goodput (None: not within
    ``settings.max_per_type``)."""
    probe = best_baseline(latency, kind, device, gpus=probe_gpus, exit_ramp=exit_ramp, batch=settings.hetero_batch, settings=settings)
    if probe.goodput_ips <= 0:
        return None
    n = max(1, math.ceil(target / (probe.goodput_ips / probe_gpus)))
    tried: dict[int, Cell] = {}
    while 1 <= n <= settings.max_per_type and n not in tried:
        cell = tried[n] = best_baseline(latency, kind, device, gpus=n, exit_ramp=exit_ramp, batch=settings.hetero_batch, settings=settings)
        if cell.goodput_ips >= target:
            if n - 1 in tried or n == 1:
                return cell
            n -= 1
        else:
            if n + 1 in tried:
                return tried[n + 1]
            n += 1
    return min((c for c in tried.values() if c.goodput_ips >= target), key=lambda c: c.cost_per_hour, default=None)


def _cheapest(latency: LatencyProfile, batch_profile: BatchProfile, devices: Mapping[str, int], goodput_ips: float,
              settings: GpuSimSettings):
    """The planner's cheapest plan reaching ``goodput_ips``; with the router's work beside the GPUs, also the
    cheapest constant plan priced by :func:`beside_profile`, and the cheaper of the two (ties: the faster).
    Raises PlannerError when neither exists."""
    kw = dict(slo_ms=settings.slo_ms, goodput_rps=goodput_ips, rate_rps=settings.rate_rps, slack=settings.slack)
    found, errors = [], []
    for profile, forms in ((latency, None), (beside_profile(latency, settings.hop_fixed_latency), (CONSTANT,))):
        if forms is not None and settings.host_cores(1) <= 0:
            continue
        try:
            found.append(cheapest_plan(profile, batch_profile, devices,
                                       PlanOptions(**kw, **({"forms": forms} if forms else {}))))
        except PlannerError as err:
            errors.append(str(err))
    if not found:
        raise PlannerError("; ".join(errors))
    return min(found, key=lambda r: (r.cost, -r.throughput_rps))


def cost_at_goodput(latency: LatencyProfile, batch_profile: BatchProfile, exit_ramp: np.ndarray, *, target_ips: float,
                    settings: GpuSimSettings, progress: Callable[[str], None] | None = None,
                    plan_kw: Mapping | None = None) -> dict:
    """(2b) Figs. 14-15: the cheapest cluster reaching ``target_ips`` for E3 (the planner's
    ``cheapest_plan`` over ``hetero_types``, then simulated) and for each baseline (per GPU type).

    Where the planner's cheapest plan falls short in the simulator (its model of a compact split leaves
    out the inputs' copy the simulator charges), the planner is asked again for ``E3_ASK_MORE`` times
    the target, and so on, until the simulated plan reaches the target; every attempt is kept."""
    devices = {t: settings.max_per_type for t in settings.hetero_types}
    rows: list[dict] = []
    attempts: list[dict] = []
    kw = dict(plan_kw or {})
    for factor in E3_ASK_MORE:
        try:
            result = _cheapest(latency, batch_profile, devices, target_ips * factor, settings)
        except PlannerError as err:
            attempts.append({"asked_ips": target_ips * factor, "error": str(err)})
            break
        plan = result.to_plan(model=latency.model, num_blocks=latency.num_blocks,
                              exit_rule=dict(kw.get("exit_rule") or {"kind": "entropy", "tau_nats": 0.0}),
                              ramp_blocks=list(kw.get("ramp_blocks") or latency.ramp_blocks()),
                              slo_ms=settings.slo_ms, slack=settings.slack)
        cell = simulate_e3(latency, plan, exit_ramp, batch=settings.hetero_batch, settings=settings)
        attempts.append({"asked_ips": target_ips * factor, "cluster": cell.cluster, "goodput_ips": cell.goodput_ips})
        if cell.goodput_ips >= target_ips:
            rows.append({"system": "e3", "gpu": "any", **cell.to_dict(), "reaches": True, "attempts": attempts})
            break
    else:
        rows.append({"system": "e3", "gpu": "any", **cell.to_dict(), "reaches": False, "attempts": attempts})
    if not rows:
        rows.append({"system": "e3", "gpu": "any", "cluster": "-", "reaches": False, "attempts": attempts})
    if progress:
        progress(f"E3 cheapest: {rows[-1].get('cluster')}")
    for kind in ("stock", "ee"):
        for t in settings.hetero_types:
            cell = _fewest_gpus(latency, kind, t, exit_ramp, target_ips, settings)
            rows.append({"system": kind, "gpu": t, **(cell.to_dict() if cell else {"cluster": "-"}),
                         "reaches": cell is not None})
            if progress:
                progress(f"{kind} on {t}: {rows[-1]['cluster']}")
    return {"target_ips": target_ips, "batch": settings.hetero_batch, "rows": rows}


# -- tables, document, plot ---------------------------------------------------------------------------------

def _f(x: float, spec: str = ",.0f") -> str:
    return "-" if x is None or not math.isfinite(x) else format(x, spec)


def _by(cells: Sequence[Mapping], system: str, batch: int) -> Mapping | None:
    return next((c for c in cells if c["system"] == system and c["batch"] == batch), None)


def _sweep(c: Mapping | None, rise: float = 0.03) -> str:
    if not c:
        return "-"
    return " → ".join(f"{g / 1e3:,.0f}k" for _, g in c["sweep"]) + ("" if saturated(c["sweep"], rise) else " (rising)")


def _mark(c: Mapping, rise: float = 0.03) -> str:
    """A goodput, starred when its sweep was still rising (not saturated within the doublings allowed)."""
    return _f(c["goodput_ips"]) + ("" if saturated(c["sweep"], rise) else "*")


def batch_table(cells: Sequence[Mapping], cluster: str, profile: str = f"{MODELLED} GPU profiles") -> str:
    """(1)'s table: goodput (inputs/s, simulated; ``profile`` says from what) per request size, ratios, the
    sweep that shows saturation."""
    out = ["| inputs/request | E3 | stock | naive EE | E3 / EE | E3 / stock | E3 sweep (inputs in flight doubling) "
           "| stock sweep | EE sweep | stock config | EE config |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for batch in sorted({c["batch"] for c in cells}):
        e3, st, ee = (_by(cells, s, batch) for s in ("e3", "stock", "ee"))
        g = [c["goodput_ips"] if c else float("nan") for c in (e3, st, ee)]
        out.append(f"| {batch} | {_f(g[0])} | {_f(g[1])} | {_f(g[2])} | "
                   f"{_f(g[0] / g[2] if g[2] else math.nan, '.2f')}x | {_f(g[0] / g[1] if g[1] else math.nan, '.2f')}x | "
                   f"{_sweep(e3)} | {_sweep(st)} | {_sweep(ee)} | {st['config'] if st else '-'} | "
                   f"{ee['config'] if ee else '-'} |")
    return "\n".join(out) + f"\n\n{profile} ({cluster}), simulated; inputs/s within the SLO."


def heterogeneity_table(doc: Mapping) -> str:
    """(2a)'s table: one line per cluster at the budget."""
    out = ["| cluster (MODELLED) | $/hour | E3 | stock | naive EE | E3 plan |", "| --- | --- | --- | --- | --- | --- |"]
    for row in doc["rows"]:
        c = {x["system"]: x for x in row["cells"]}
        out.append(f"| {row['cluster']} | {row['cost_per_hour']:.2f} | {_mark(c['e3'])} | "
                   f"{_mark(c['stock']) if 'stock' in c else 'n/a'} | "
                   f"{_mark(c['ee']) if 'ee' in c else 'n/a'} | {c['e3']['config']} |")
    return "\n".join(out) + "\n\n\\* still rising at the last load tried (a lower bound)."


def cost_table(doc: Mapping) -> str:
    """(2b)'s table: the cheapest cluster per system (and GPU type for the baselines)."""
    out = ["| system | GPU type | cheapest cluster (MODELLED) | $/hour | simulated goodput | reaches target | "
           "planner asked for |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in doc["rows"]:
        asked = " → ".join(f"{a['asked_ips']:,.0f}" for a in r.get("attempts", [])) or "-"
        out.append(f"| {r['system']} | {r['gpu']} | {r.get('cluster', '-')} | {_f(r.get('cost_per_hour', math.nan), '.2f')} | "
                   f"{_f(r.get('goodput_ips', math.nan))} | {'yes' if r.get('reaches') else 'no'} | {asked} |")
    return "\n".join(out)


def goodput_ratios(cells: Sequence[Cell], batches: Sequence[int]) -> dict[str, dict[str, float | None]]:
    """Per request size with all three systems: E3's goodput over naive EE's and over stock's (None where
    the baseline answered nothing). Pure."""
    ratios = {}
    for batch in batches:
        e3, st, ee = (next((c for c in cells if c.system == s and c.batch == batch), None) for s in ("e3", "stock", "ee"))
        if e3 and st and ee:
            ratios[str(batch)] = {"e3_over_ee": e3.goodput_ips / ee.goodput_ips if ee.goodput_ips else None,
                                  "e3_over_stock": e3.goodput_ips / st.goodput_ips if st.goodput_ips else None}
    return ratios


def results_document(settings: GpuSimSettings, latency: LatencyProfile, cells: Sequence[Cell], *, plan: Plan,
                     hetero: Mapping | None, cost: Mapping | None, **extra) -> dict:
    """``artifacts/results/gpu_sim.json``: every figure, with MODELLED and the profile's source."""
    ratios = goodput_ratios(cells, settings.batches)
    return {"label": MODELLED, "profile_source": latency.source, "model": latency.model,
            "settings": asdict(settings), "plan": plan.to_dict(), "goodput_vs_batch": [c.to_dict() for c in cells],
            "ratios": ratios, "heterogeneity": hetero, "cost_at_goodput": cost, **extra}


def plot_goodput(cells: Sequence[Mapping], title: str, path) -> None:
    """(1)'s PNG: goodput against inputs per request, one line per system, MODELLED in the title."""
    # deferred: matplotlib loads only when a figure is drawn, its Agg backend chosen before pyplot
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt   # after the backend is chosen
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for system, label in (("e3", "E3"), ("stock", "stock"), ("ee", "naive EE")):
        pts = sorted((c["batch"], c["goodput_ips"]) for c in cells if c["system"] == system)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] / 1e3 for p in pts], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("inputs per request")
    ax.set_ylabel("goodput (thousand inputs/s)")
    ax.set_title(f"{MODELLED}: {title}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
