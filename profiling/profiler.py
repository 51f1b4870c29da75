"""``e3 profile``: measure E3's ``P(k, c, B)`` and ``Tx`` on the runtime that serves the splits.

What is measured (device configuration ``cpu``: one core, one instance, one thread, price 1):

* **blocks** -- every block k alone, exported as a one-block split
  (:class:`~e3.models.api.SplitModule`; block 1 includes the stem, block L
  the final head) twice: with its ramp and without it. Each file runs in ONNX
  Runtime exactly as a split instance runs it (``make_session``: CPU provider,
  1 intra-op thread, sequential), at batch sizes 1, 2, 4, ... up to the model's
  maximum batch, on valid inputs (the state the earlier blocks produce). After
  ``warmup`` calls, ``repeats`` rounds are timed; one round calls every block
  once in the order a served batch does (blocks 1..L without ramps, then 1..L-1
  with them, :func:`block_order`), so that each call finds the CPU's caches as a
  split's call does (the other blocks' weights ran through them since), not warm
  with its own weights, and drift hits every variant alike. ``block_ms`` is the median without the ramp,
  ``ramp_ms = max(0, median(with) - median(without))`` (0 for blocks without a
  ramp and for block L, whose head is part of the block), ``spread_ms`` the IQR
  of the block's repeats.
* **Tx** -- one BLS hop carrying one cut's tensors (``card.state``, e.g. hidden
  state + mask) at each batch size, between two Python-backend models on the
  real ``tritonserver`` (a caller and an echo model, :mod:`e3.serving.tx_probe`),
  timed inside the caller: that is what the router pays per cut. The tensors
  are zeros: a hop copies bytes, their values do not matter. (The hop of the
  model inputs into split 1 is not measured apart: the profile has no
  ``tx_in_ms`` and the planner uses ``tx_ms`` for it, an upper bound.)
* **check** (``check_ms``) -- what a compact split pays between two blocks at
  an enabled ramp: the exit rule (:class:`~e3.serving.policy.BatchRoute`'s
  ``observe``, the model's own rule from :mod:`e3.core.exits`) on random
  logits for B rows, about half of them confident, then the numpy fancy-index
  compaction of the survivors' rows of the heaviest cut's state. In-process,
  pure numpy, no Triton; the model's stock graph runs (untimed, at batch 1:
  every weight through the caches) before every timed call, as blocks run
  before a check in a served batch (:mod:`e3.profiling.host_profile`).
* **router** (``router_ms``) -- the router's own work per batch of a split,
  with the serving code itself (:func:`router_batch`): one request per input
  (the worst case) checked and admitted by the scheduler, the batch dispatched
  and its rows stacked, the exit rule at the split's end, the answers handed
  back to their requests and checked. In-process, no Triton; the stock graph
  runs before every timed batch as for the check. Timed hot, the same work
  takes a third of what it takes beside the blocks (0.14 against 0.46 ms at
  batch 32 on the walk-through's model, 0.49 ms inside the served router).
* **stock graph** (``stock_ms``, ``stock_2t_ms``) -- the whole model without
  ramps (blocks 1..L, the graph ``<m>_stock`` serves) on 1 and on 2 intra-op
  threads (the 2-thread curve only where the host has 2 CPUs), the two taking
  turns in runs of 5 consecutive calls (a served instance calls its session
  back to back), each batch size timed again while other processes use the
  cores (:func:`e3.profiling.host_profile.quietest`), in ``thread_passes``
  passes over the batch sizes (the second thread's gain moves with the
  machine's speed: :func:`second_thread_gain`). The pair is the
  simulator's thread model: a 2-thread instance of any graph gains the second
  thread's measured gain at the rows each block runs. ``jitter_cv`` and
  ``corun_ms``: the stock graph's spread and time while one copy per core runs
  it at once (as that many instances do); the simulator draws each batch's
  time with the one and prices instances side by side with the other. The
  ratios (the second thread's gain, a neighbour's cost) are taken between the
  least disturbed calls (:func:`assemble_profile`).
* **request** (``request_ms``) -- host CPU per request that no instance's time
  holds: the real load generator (16 clients, B inputs per request) against a
  Python model that answers the front door's tensors at once
  (:mod:`e3.serving.tx_probe`'s ``front`` role, no compute); the CPU of this
  process (the clients) and of tritonserver's own process (HTTP, queues, the
  hand-over to the model) over the run, per request; ``client_ms`` is the load
  generator's part (one Python process: its clients share one GIL). The
  Python model's own handling is left out: the hop (Tx) prices it. Skipped
  with ``--no-tx``, as Tx is.

The measuring code is thin; aggregation (:func:`summarize`,
:func:`assemble_profile`), merging (:func:`merge_profiles`) and the table
(:func:`format_table`) are pure functions.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np

from e3.core.names import served_name
from e3.core.profile import OPTIONAL_CURVES, DeviceConfig, LatencyProfile, ProfileError
from e3.profiling.host_profile import (_check_inputs, _first_ramp, _route, cut_state, measure_check,  # noqa: F401
                                       measure_router, quietest, router_batch, stock_runner,
                                       MAX_FOREIGN_CORES)
from e3.paths import artifacts_dir

if TYPE_CHECKING:
    from e3.models.api import EarlyExitModel

__all__ = ["ProfileSettings", "Stats", "summarize", "default_batch_sizes", "parse_batch_sizes",
           "assemble_profile", "merge_profiles", "format_table", "default_profile_path",
           "block_order", "measure_blocks", "measure_stock", "second_thread_gain", "measure_jitter", "measure_check",
           "measure_router", "router_batch", "stock_runner", "time_calls",
           "profile_model"]

log = logging.getLogger(__name__)
CPU_DEVICE = "cpu"


@dataclass(frozen=True)
class ProfileSettings:
    batch_sizes: tuple[int, ...] | None = None  # None: 1, 2, 4, ... up to the model's max batch
    repeats: int = 20                           # timed calls per (block, variant, batch)
    warmup: int = 3                             # untimed calls before them
    tx: bool = True                             # measure Tx on a real tritonserver
    tx_repeats: int | None = None               # hops timed per batch (default: repeats)
    device: str = CPU_DEVICE                    # device configuration name in the profile
    price: float = 1.0                          # its price (relative units)
    seed: int = 0
    thread_passes: int = 5                      # passes over the batch sizes timing the stock graph on 1 and 2
    #                                             threads (``repeats`` calls each per pass): the second thread's
    #                                             gain is the median of the passes' (:func:`second_thread_gain`)

    def __post_init__(self) -> None:
        if self.repeats < 1 or self.warmup < 0 or self.thread_passes < 1:
            raise ValueError(f"repeats and thread_passes must be >= 1 and warmup >= 0, got {self.repeats}, "
                             f"{self.thread_passes} and {self.warmup}")


@dataclass(frozen=True)
class Stats:
    median_ms: float   # median over repeats
    iqr_ms: float      # interquartile range (p75 - p25) over repeats


def summarize(samples_ms: Sequence[float]) -> Stats:
    """Median and IQR of timed repeats (ms)."""
    a = np.asarray(samples_ms, dtype=float)
    if a.size == 0:
        raise ValueError("no samples to summarize")
    p25, p50, p75 = np.percentile(a, [25, 50, 75])
    return Stats(float(p50), float(p75 - p25))


def default_batch_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, ... up to ``max_batch_size`` (which is included even if not a power of 2)."""
    sizes, b = [], 1
    while b < max_batch_size:
        sizes.append(b)
        b *= 2
    return [*sizes, max_batch_size]


def parse_batch_sizes(text: str | None, max_batch_size: int) -> list[int]:
    """``"1,2,4"`` -> [1, 2, 4] (sorted, distinct), each within 1..max_batch_size; None -> the default."""
    if text is None or not str(text).strip():
        return default_batch_sizes(max_batch_size)
    try:
        sizes = sorted({int(x) for x in str(text).split(",") if x.strip()})
    except ValueError:
        raise ValueError(f"batch sizes must be comma-separated integers, e.g. 1,2,4; got {text!r}") from None
    bad = [b for b in sizes if not 1 <= b <= max_batch_size]
    if not sizes or bad:
        raise ValueError(f"batch sizes must lie within 1..{max_batch_size} (the model's max batch); got {text!r}")
    return sizes


def assemble_profile(model: str, batch_sizes: Sequence[int], without_ramp: Sequence[Sequence[Sequence[float]]],
                     *, with_ramp: Sequence[Sequence[Sequence[float]] | None], tx: Sequence[Sequence[float]],
                     device: str = CPU_DEVICE, price: float = 1.0, source: str = "",
                     check: Sequence[Sequence[float]] | None = None,
                     router: Sequence[Sequence[float]] | None = None,
                     stock: Sequence[Sequence[float]] | None = None,
                     stock_2t: Sequence[Sequence[float]] | None = None,
                     request: Sequence[float] | None = None,
                     client: Sequence[float] | None = None,
                     jitter: Sequence[float] | None = None,
                     corun: Sequence[Sequence[float]] | None = None,
                     thread_gain: Sequence[float] | None = None) -> LatencyProfile:
    """A one-device :class:`LatencyProfile` from raw timings (ms).

    without_ramp[k-1][i]: repeats of block k alone at batch_sizes[i];
    with_ramp[k-1][i]: the same with ramp k, or ``with_ramp[k-1] is None`` when
    block k has no separately measured ramp; tx[i]: repeats of one hop;
    check[i] / router[i]: repeats of one exit check / of the router's work on one
    batch; stock[i] / stock_2t[i]: repeats of the stock graph on 1 / 2 threads;
    request[i] / client[i]: host CPU ms per request, and the load generator's part
    of it, jitter[i]: the CV of a batch's time beside its neighbours (one figure per
    batch size each); corun[i]: repeats of the stock graph on 1 thread beside one copy per core; thread_gain[i]:
    the second thread's gain measured over several passes (:func:`second_thread_gain`; None: the one pass of
    stock[i] and stock_2t[i]). None: not
    measured, the profile has no such curve. Medians throughout, but for the two ratios the simulator takes
    from the stock graph: ``stock_2t_ms`` is the 1-thread median over the gain of the second thread and
    ``corun_ms`` the 1-thread median times the cost of a neighbour per core, each ratio taken between the
    25th percentiles of its two sets of repeats (:func:`_least_disturbed`).

    Decision: another process's work only adds time, and far more to 2 threads than to 1 (each operator
    waits for both threads; see :func:`e3.profiling.host_profile.quietest`). Measured on this shared 2-core
    machine (bert-ee, batches 1-32): with 0.6-1.5 cores taken by others while the pair was timed, the
    medians gave 2 threads 0.47-1.55x the speed of one; with none taken (a profile minutes later),
    1.39x at batch 1 to 1.89x at 32. A ratio of medians is the others' load, not the thread model; the
    least disturbed calls of each set keep the ratio where a quiet machine cannot be had. The level stays
    the median's, as the blocks' is.
    """
    L = len(without_ramp)
    if len(with_ramp) != L:
        raise ValueError("without_ramp and with_ramp must hold one row per block")
    block = [[summarize(s) for s in row] for row in without_ramp]
    ramp = [[0.0] * len(batch_sizes) if w is None else
             [max(0.0, summarize(s).median_ms - b.median_ms) for s, b in zip(w, brow)]
            for w, brow in zip(with_ramp, block)]
    profile = LatencyProfile(
        model=model, num_blocks=L, batch_sizes=list(batch_sizes),
        devices={device: DeviceConfig(device, price, modelled=False)},
        block_ms={device: [[s.median_ms for s in row] for row in block]},
        ramp_ms={device: ramp},
        tx_ms={device: [summarize(s).median_ms for s in tx]},
        spread_ms={device: [[s.iqr_ms for s in row] for row in block]},
        source=source,
        check_ms={} if check is None else {device: [summarize(s).median_ms for s in check]},
        router_ms={} if router is None else {device: [summarize(s).median_ms for s in router]},
        stock_ms={} if stock is None else {device: [summarize(s).median_ms for s in stock]},
        stock_2t_ms={} if stock_2t is None or stock is None else
        {device: [summarize(one).median_ms / (second_thread_gain([one], [two]) if thread_gain is None else gain)
                  for one, two, gain in zip(stock, stock_2t, thread_gain or [None] * len(stock))]},
        request_ms={} if request is None else {device: [float(v) for v in request]},
        client_ms={} if client is None else {device: [float(v) for v in client]},
        jitter_cv={} if jitter is None else {device: [float(v) for v in jitter]},
        corun_ms={} if corun is None or stock is None else
        {device: [summarize(one).median_ms * _least_disturbed(together) / _least_disturbed(one)
                  for one, together in zip(stock, corun)]})
    profile.validate()
    return profile


def _least_disturbed(samples_ms: Sequence[float]) -> float:
    """The 25th percentile of timed repeats (ms): the calls another process's work disturbed least."""
    return float(np.percentile(np.asarray(samples_ms, dtype=float), 25))


def second_thread_gain(one: Sequence[Sequence[float]], two: Sequence[Sequence[float]]) -> float:
    """How many times faster the stock graph ran on 2 threads than on 1 at one batch size, from ``one[p]`` /
    ``two[p]``: the calls (ms) of pass p on 1 / 2 threads: the median over the passes of the ratio of their
    least disturbed calls (:func:`_least_disturbed`). One pass: the ratio of that pass's.

    Decision (issue 42): the gain is measured in several passes over the batch sizes, not once. This 2-core
    machine moves between two speeds for 5-40 s at a time (docs/data/cpu/machine_speed_trace_20261128.json),
    and the second thread's gain moves with them: bert-ee's stock graph timed in 6 passes over batches 1, 4,
    8 and 16 (2026-11-28, about 03:00, quiet, 10 calls per thread count per pass, about 6 s a pass) gained 1.52-1.92x
    at 1 row, 1.38-1.69x at 4, 1.44-1.99x at 8 and 1.50-1.95x at 16 from pass to pass (medians 1.60, 1.51,
    1.74, 1.65); one pass per profile gave its 2-thread curve one draw of that spread (the profile of 01:33:
    1.31-1.35x at 1-4 rows), and the served 2-thread instances of the benches after it executed 20-25% faster
    than it priced. A served instance runs for the whole of a run and a cell's runs span about a minute: the
    median of passes spread over the profile is what it meets."""
    if len(one) != len(two) or not len(one):
        raise ValueError(f"one pass of each thread count per pass: got {len(one)} and {len(two)}")
    return float(np.median([_least_disturbed(a) / _least_disturbed(b) for a, b in zip(one, two)]))


def merge_profiles(profiles: Sequence[LatencyProfile]) -> LatencyProfile:
    """One multi-configuration profile from several (e.g. v100 + t4 + k80, or cpu + modelled GPUs).

    Every profile must describe the same model and block count, and device names
    must not repeat. Where batch sizes differ, each device's curves are resampled
    onto the union of batch sizes with the profile's own interpolation
    (:meth:`LatencyProfile.block`, :meth:`LatencyProfile.tx`).
    """
    if not profiles:
        raise ProfileError("nothing to merge")
    first = profiles[0]
    for p in profiles[1:]:
        if (p.model, p.num_blocks) != (first.model, first.num_blocks):
            raise ProfileError(f"cannot merge profiles of {first.model} ({first.num_blocks} blocks) and "
                               f"{p.model} ({p.num_blocks} blocks)")
    seen: dict[str, int] = {}
    for i, p in enumerate(profiles):
        for dev in p.devices:
            if dev in seen:
                raise ProfileError(f"device configuration {dev!r} appears in two profiles (#{seen[dev]} and #{i}); "
                                   "rename one or merge without it")
            seen[dev] = i
    batches = sorted({b for p in profiles for b in p.batch_sizes})
    merged = LatencyProfile(model=first.model, num_blocks=first.num_blocks, batch_sizes=batches, devices={},
                            block_ms={}, ramp_ms={}, tx_ms={}, spread_ms={},
                            source=" | ".join(dict.fromkeys(p.source for p in profiles if p.source)))
    for p in (p.at_batch_sizes(batches) for p in profiles):
        for dev, cfg in p.devices.items():
            merged.devices[dev] = cfg
            merged.block_ms[dev] = [list(r) for r in p.block_ms[dev]]
            merged.ramp_ms[dev] = [list(r) for r in p.ramp_ms[dev]]
            merged.tx_ms[dev] = list(p.tx_ms[dev])
            for name in OPTIONAL_CURVES:
                if dev in getattr(p, name):
                    getattr(merged, name)[dev] = list(getattr(p, name)[dev])
            if dev in p.spread_ms:
                merged.spread_ms[dev] = [list(r) for r in p.spread_ms[dev]]
    merged.validate()
    return merged


def _cell(value: float, spread: float | None) -> str:
    return f"{value:.3f}" if spread is None else f"{value:.3f}±{spread:.3f}"


def format_table(profile: LatencyProfile, device: str | None = None) -> str:
    """Per block, latency (ms) against batch size with the spread (IQR) where measured;
    ramp rows where a ramp costs anything; the Tx row, and the rows of the optional curves the
    device has (Tx of the model inputs, exit check per ramp, router per batch). Modelled devices say so."""
    devices = [device] if device else list(profile.devices)
    lines = []
    for dev in devices:
        cfg = profile.devices[dev]
        label = "MODELLED from public figures, not measured" if cfg.modelled else "measured"
        lines.append(f"{profile.model} on {dev} ({label}; price {cfg.price:g}): latency in ms"
                     + (", median±IQR over repeats" if dev in profile.spread_ms else ""))
        header = ["block"] + [f"B={b}" for b in profile.batch_sizes]
        rows = []
        spread = profile.spread_ms.get(dev)
        for k in range(1, profile.num_blocks + 1):
            name = f"{k}" + (" (+stem)" if k == 1 else "") + (" (+head)" if k == profile.num_blocks else "")
            rows.append([name] + [_cell(v, spread[k - 1][i] if spread else None)
                                  for i, v in enumerate(profile.block_ms[dev][k - 1])])
            if any(v > 0 for v in profile.ramp_ms[dev][k - 1]):
                rows.append([f"  ramp {k}"] + [f"{v:.3f}" for v in profile.ramp_ms[dev][k - 1]])
        rows.append(["Tx (hop)"] + [f"{v:.3f}" for v in profile.tx_ms[dev]])
        for name, curves in (("Tx in (inputs)", profile.tx_in_ms), ("check (per ramp)", profile.check_ms),
                             ("router (per batch)", profile.router_ms), ("stock graph", profile.stock_ms),
                             ("stock, 2 threads", profile.stock_2t_ms), ("request (host CPU)", profile.request_ms),
                             ("  of it the client", profile.client_ms), ("jitter (CV, 2 at once)", profile.jitter_cv),
                             ("stock, 2 at once", profile.corun_ms)):
            if dev in curves:
                rows.append([name] + [f"{v:.3f}" for v in curves[dev]])
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        for r in [header, *rows]:
            lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
        lines.append("")
    if profile.source:
        lines.append(f"source: {profile.source}")
    return "\n".join(lines).rstrip() + "\n"


def default_profile_path(model_name: str, devices: Sequence[str], modelled: bool = False) -> Path:
    """artifacts/profiles/<m>.<dev>[+<dev>...][.modelled].json"""
    suffix = ".modelled" if modelled else ""
    return artifacts_dir() / "profiles" / f"{served_name(model_name)}.{'+'.join(devices)}{suffix}.json"


# -- measuring (thin) ------------------------------------------------------------------------------

def time_calls(run, repeats: int, warmup: int) -> np.ndarray:
    """``warmup`` untimed calls of ``run()``, then the times (ms) of ``repeats`` calls, back to back."""
    for _ in range(warmup):
        run()
    times = np.empty(repeats)
    for i in range(repeats):
        start = time.perf_counter()
        run()
        times[i] = (time.perf_counter() - start) * 1e3
    return times


def block_order(num_blocks: int, ramp_blocks) -> list[tuple[int, str]]:
    """The order of one timing round of :func:`measure_blocks`: every block without its ramp, 1..L, then
    every block with its ramp (those in ``ramp_blocks``, below L). Between two calls of a block the other
    blocks run (L-2 or L-1 of them), as in a served batch that passes every block: each call finds in the
    caches what a split's call finds, not its own weights of the call before."""
    ramps = {int(k) for k in ramp_blocks}
    return [(k, "without") for k in range(1, num_blocks + 1)] + \
        [(k, "with") for k in range(1, num_blocks + 1) if k in ramps and k < num_blocks]


def measure_blocks(model: "EarlyExitModel", batch_sizes: Sequence[int], settings: ProfileSettings,
                   *, workdir: Path, bar=None) -> tuple[list[list[np.ndarray]], list[list[np.ndarray] | None]]:
    """Timings (ms) of every block without and with its ramp: ([k-1][i] repeats, same or None).

    All blocks are timed in one round per repeat and batch size, in :func:`block_order` (block 1..L, then
    1..L-1 with ramps), every batch size in every round, never one block over and over: a block timed alone finds its weights in the CPU's caches from
    its previous call, which a served batch does not (the other blocks ran in between). Measured on the
    walk-through's model (8 MB of weights per block, 32 MB L3 shared by 2 cores): 0.12 ms a block alone
    at batch 1, 0.42-0.51 ms in sequence, the whole stock graph 2.2 ms (the sequence's sum); at batch 64
    the two agree (compute-bound)."""
    # deferred: torch (the model, its export) and ONNX Runtime load only when a profile is measured
    from e3.models.api import SplitModule
    from e3.export.onnx_export import export_onnx, split_inputs
    from e3.core.session import make_session

    card = model.card
    L = card.num_blocks
    modules = {}
    for k, tag in block_order(L, card.ramp_blocks):
        modules[k, tag] = SplitModule(model, k, k, (k,) if tag == "with" else ())
    sessions = {}
    for (k, tag), module in modules.items():
        path = workdir / f"block_{k}_{tag}.onnx"
        export_onnx(module, path, max_batch_size=card.max_batch_size, seed=settings.seed)
        sessions[k, tag] = make_session(str(path), intra_op_threads=1)
    feeds = {}   # batch -> session key -> the inputs its graph reads
    for batch in batch_sizes:
        feeds[batch] = {}
        for k in range(1, L + 1):
            base = modules[k, "without"]
            names = [t.name for t in base.input_specs]
            block_feed = {n: t.numpy() for n, t in zip(names, split_inputs(base, batch, settings.seed))}
            for tag in ("without", "with"):
                if (k, tag) in sessions:
                    feeds[batch][k, tag] = {i.name: block_feed[i.name] for i in sessions[k, tag].get_inputs()}
        for key, session in sessions.items():
            time_calls(lambda s=session, f=feeds[batch][key]: s.run(None, f), 0, settings.warmup)
    # Every round passes every batch size (one call of every block at each): a disturbance of a few seconds
    # spreads over the batch sizes instead of lifting one of them. Measured (bert-ee, 10 repeats, batch
    # size after batch size): blocks at batch 4 came out 15.9 ms per input against 12.6 at 2 and 13.3 at 8,
    # while the stock graph beside them gave 11.9 at 4; naive EE's blocks after its ramps run 1-4 rows.
    samples = {key: np.empty((len(batch_sizes), settings.repeats)) for key in sessions}
    for r in range(settings.repeats):
        for i, batch in enumerate(batch_sizes):
            for key, session in sessions.items():
                samples[key][i, r] = time_calls(lambda s=session, f=feeds[batch][key]: s.run(None, f), 1, 0)[0]
    if bar is not None:
        bar.update(L * len(batch_sizes))
    rows = {key: list(v) for key, v in samples.items()}
    without = [rows[k, "without"] for k in range(1, L + 1)]
    with_ = [rows.get((k, "with")) for k in range(1, L + 1)]
    for k in range(1, L + 1):
        log.debug("block %d: %s", k, [f"{np.median(s):.3f}" for s in without[k - 1]])
    return without, with_


def _in_runs(sessions: dict, feeds: dict, settings: ProfileSettings, run: int = 5) -> dict:
    """``warmup`` untimed calls of every session, then ``repeats`` timed calls of each (ms), in runs of ``run``
    consecutive calls of one session, the sessions taking turns run by run: a served instance calls its own
    session back to back, and drift still hits every session alike."""
    own = {key: {i.name: feeds[i.name] for i in s.get_inputs()} for key, s in sessions.items()}
    for key, s in sessions.items():
        time_calls(lambda s=s, f=own[key]: s.run(None, f), 0, settings.warmup)
    samples: dict = {key: [] for key in sessions}
    while any(len(v) < settings.repeats for v in samples.values()):
        for key, s in sessions.items():
            n = min(run, settings.repeats - len(samples[key]))
            if n > 0:
                samples[key].extend(time_calls(lambda s=s, f=own[key]: s.run(None, f), n, 0))
    return {key: np.asarray(v) for key, v in samples.items()}


def measure_stock(model: "EarlyExitModel", batch_sizes: Sequence[int], settings: ProfileSettings, *, workdir: Path,
                  threads: Sequence[int] = (1, 2), bar=None) -> tuple[dict[int, list[list[np.ndarray]]], list[float]]:
    """Timings (ms) of the stock graph (blocks 1..L, no ramp) at each batch size, per intra-op thread count, in
    ``settings.thread_passes`` passes over the batch sizes: ({threads: [i][pass] repeats}, [i] the most cores
    other processes used meanwhile in any pass). Within a pass the thread counts take turns in runs of
    consecutive calls (:func:`_in_runs`), each batch size measured again while the machine is not quiet
    (:func:`e3.profiling.host_profile.quietest`): the pair is the simulator's thread model, its gain the median
    of the passes' (:func:`second_thread_gain`: why passes)."""
    # deferred: torch (the model, its export) and ONNX Runtime load only when a profile is measured
    from e3.models.api import SplitModule
    from e3.export.onnx_export import export_onnx, split_inputs
    from e3.core.session import make_session

    card = model.card
    module = SplitModule(model, 1, card.num_blocks, ())
    path = workdir / "stock.onnx"
    export_onnx(module, path, max_batch_size=card.max_batch_size, seed=settings.seed)
    sessions = {t: make_session(str(path), intra_op_threads=t) for t in threads}
    names = [t.name for t in module.input_specs]
    feeds = [{n: t.numpy() for n, t in zip(names, split_inputs(module, batch, settings.seed))}
             for batch in batch_sizes]
    out: dict[int, list[list[np.ndarray]]] = {t: [[] for _ in batch_sizes] for t in threads}
    foreign = [0.0] * len(batch_sizes)
    for _ in range(settings.thread_passes):
        for i, feed in enumerate(feeds):
            samples, others = quietest(lambda feed=feed: _in_runs(sessions, feed, settings))
            for t in threads:
                out[t][i].append(samples[t])
            foreign[i] = others if not np.isfinite(others) else max(foreign[i], others)
            if bar is not None:
                bar.update(1)
    return out, foreign


def measure_jitter(model: "EarlyExitModel", batch_sizes: Sequence[int], settings: ProfileSettings, *, workdir: Path,
                   copies: int = 2, bar=None) -> tuple[list[float], list[np.ndarray]]:
    """The stock graph at each batch size while ``copies`` sessions of 1 thread run it at once, one per core, as
    that many Triton instances do: (the coefficient of variation (std / mean) of one call's time, how much one
    batch's time varies beside its neighbours (``jitter_cv``; the simulator draws each batch's time with it);
    every call's time, ms (``corun_ms``: the graph beside its neighbours, whose median over ``stock_ms`` is
    what sharing the caches and the memory with them costs)). Each copy times ``2 x repeats`` calls; ONNX
    Runtime releases the GIL while it runs; each batch size is measured again while the machine is not
    quiet (:func:`e3.profiling.host_profile.quietest`)."""
    # deferred: torch (the model, its export) and ONNX Runtime load only when a profile is measured
    from e3.models.api import SplitModule
    from e3.export.onnx_export import export_onnx, split_inputs
    from e3.core.session import make_session

    card = model.card
    module = SplitModule(model, 1, card.num_blocks, ())
    path = workdir / "stock.onnx"
    if not path.exists():
        export_onnx(module, path, max_batch_size=card.max_batch_size, seed=settings.seed)
    sessions = [make_session(str(path), intra_op_threads=1) for _ in range(copies)]
    names = [t.name for t in module.input_specs]
    cvs, times = [], []
    for batch in batch_sizes:
        feeds = {n: t.numpy() for n, t in zip(names, split_inputs(module, batch, settings.seed))}

        def together() -> np.ndarray:
            samples: list[np.ndarray] = [np.empty(0)] * copies
            start = threading.Barrier(copies)

            def run(i: int) -> None:
                time_calls(lambda: sessions[i].run(None, feeds), 0, settings.warmup)
                start.wait()
                samples[i] = time_calls(lambda: sessions[i].run(None, feeds), 2 * settings.repeats, 0)

            threads = [threading.Thread(target=run, args=(i,)) for i in range(copies)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            return np.concatenate(samples)

        x, _ = quietest(together)
        cvs.append(float(np.std(x) / np.mean(x)))
        times.append(x)
        if bar is not None:
            bar.update(1)
    return cvs, times


def _cores_text(foreign: Sequence[float]) -> str:
    """'0.02-0.31' cores (the range over batch sizes), or 'an unknown share' without the machine's counters."""
    known = [f for f in foreign if np.isfinite(f)]
    return f"{min(known):.2f}-{max(known):.2f}" if known else "an unknown share"


def profile_model(model_name: str, settings: ProfileSettings = ProfileSettings(), progress: bool = True,
                  *, tritonserver: str | None = None, data: str | Path | None = None) -> LatencyProfile:
    """Measure ``model_name`` on this machine (see the module docstring); returns the profile. ``data``: a
    ``.npz`` of the model's inputs (:mod:`e3.models.user_data`): the blocks are timed on states computed from
    its rows instead of the model's random example inputs."""
    # deferred: torch (the model, its export) and ONNX Runtime load only when a profile is measured
    import onnxruntime as ort
    from tqdm import tqdm
    from e3.models.zoo import resolve_model

    model = resolve_model(model_name)
    card = model.card
    if data is not None:
        # deferred: the model's data loader (torch)
        from e3.models.user_data import load_data, use_data_inputs
        use_data_inputs(model, load_data(data, card)[0])
    batches = list(settings.batch_sizes or default_batch_sizes(card.max_batch_size))
    if batches != sorted(set(batches)) or batches[0] < 1 or batches[-1] > card.max_batch_size:
        raise ValueError(f"batch sizes must be ascending within 1..{card.max_batch_size}, got {batches}")
    tx_repeats = settings.tx_repeats or settings.repeats
    router_repeats = settings.repeats   # each timed call follows one untimed run of the stock graph
    threads = (1, 2) if (os.cpu_count() or 1) >= 2 else (1,)
    total = ((card.num_blocks + settings.thread_passes + (len(threads) > 1)) * len(batches)
             + (2 * len(batches) if settings.tx else 0))
    with tqdm(total=total, desc=f"profile {served_name(model_name)}", unit="step", disable=not progress) as bar, \
            tempfile.TemporaryDirectory(prefix="e3-profile-") as tmp:
        without, with_ = measure_blocks(model, batches, settings, workdir=Path(tmp), bar=bar)
        stock, foreign = measure_stock(model, batches, settings, workdir=Path(tmp), threads=threads, bar=bar)
        if any(f > MAX_FOREIGN_CORES for f in foreign):
            log.warning("other processes used %s of the cores while the stock graph was timed on 1 and 2 threads: "
                        "the 2-thread curve is slowed by them (measure on a quieter machine)", _cores_text(foreign))
        jitter, corun = measure_jitter(model, batches, settings, workdir=Path(tmp), copies=len(threads), bar=bar) \
            if len(threads) > 1 else (None, None)
        request = None
        if settings.tx:
            # deferred: torch (the model, its export) and ONNX Runtime load only when a profile is measured
            from e3.profiling.server_profile import REQUEST_CLIENTS, measure_request, measure_tx, probe_server
            with probe_server(card, max(batches), settings.warmup, tritonserver=tritonserver) as server:
                tx = measure_tx(card, batches, tx_repeats, warmup=settings.warmup, bar=bar, server=server)
                request = measure_request(card, batches, bar=bar, server=server)
        else:
            log.warning("Tx not measured (tx=False): the profile records a hop as 0 ms (and no request CPU)")
            tx = [[0.0] for _ in batches]
        # caches as a served batch finds them: the stock graph at batch 1 streams every weight through them
        # (at the timed batch it would cost minutes for a large model and evict nothing more)
        stock_once = stock_runner(model, workdir=Path(tmp), seed=settings.seed)
        between = lambda batch: stock_once(1)   # noqa: E731
        check = measure_check(card, batches, router_repeats, warmup=settings.warmup, seed=settings.seed,
                              between=between)
        router = measure_router(card, batches, router_repeats, warmup=settings.warmup, seed=settings.seed,
                                between=between)
    source = (f"measured: ONNX Runtime {ort.__version__} CPUExecutionProvider, 1 intra-op thread, sequential; "
              f"{settings.repeats} repeats after {settings.warmup} warmup calls, medians, spread = IQR; "
              f"Tx: {'one BLS hop between two Python-backend models on tritonserver, timed in the caller, ' + str(tx_repeats) + ' repeats' if settings.tx else 'not measured (0)'}; "
              f"check and router: in-process, the serving code (BatchRoute.observe, compaction; the scheduler's "
              f"admission, stacking, answers, one input per request), the stock graph at batch 1 run before each call, "
              f"{router_repeats} repeats; stock graph on {' and '.join(map(str, threads))} thread(s) in runs of 5 "
              f"calls, {settings.thread_passes} passes over the batch sizes (the second thread's gain: the passes' "
              f"median), other processes using {_cores_text(foreign)} of the cores meanwhile; "
              + (f"request: host CPU per request, {REQUEST_CLIENTS} load-generator clients against a front door "
                 "without compute (clients + tritonserver's process); " if request else "")
              + f"{os.cpu_count()} CPUs on the host"
              + (f"; blocks fed with states of {Path(data).name}'s inputs" if data is not None else ""))
    return assemble_profile(served_name(model_name), batches, without, with_ramp=with_, tx=tx, device=settings.device, price=settings.price,
                            source=source, check=check, router=router,
                            stock=[np.concatenate(passes) for passes in stock[1]],
                            stock_2t=None if 2 not in stock else [np.concatenate(passes) for passes in stock[2]],
                            thread_gain=None if 2 not in stock else
                            [second_thread_gain(one, two) for one, two in zip(stock[1], stock[2])], request=None if request is None else [r[0] for r in request],
                            client=None if request is None else [r[1] for r in request], jitter=jitter, corun=corun)
