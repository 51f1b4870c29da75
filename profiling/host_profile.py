"""The host-side curves of ``e3 profile`` (:mod:`e3.profiling.profiler`): the exit check between blocks
(``check_ms``), the router's own work per batch (``router_ms``) and the state a hop carries (the heaviest
cut). In-process, no Triton; the router's work runs the serving code itself (:func:`router_batch`).

Both are timed with the model's compute run, untimed, before every timed call (``between``; the profile
passes :func:`stock_runner` at batch 1: every weight passes through the caches at the least compute): in a
served batch they follow the blocks, and find the CPU's caches full of the blocks' weights, not of their own
code and data. Timed back to back instead, the router's work on the walk-through's model
(docs/examples/summit, batch 32) took 0.14 ms, with the stock graph run between 0.46 ms, inside the served
router 0.49 ms (its CPU time per batch outside the blocks, ``e3_router_overhead_us``), and the exit check
0.019 ms against 0.17 ms.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence, TypeVar

import numpy as np

from e3.core.spec import ModelCard, TensorSpec
from e3.deploy.server import group_cpu_s

if TYPE_CHECKING:
    from e3.models.api import EarlyExitModel

T = TypeVar("T")

__all__ = ["cut_state", "measure_check", "measure_router", "router_batch", "stock_runner", "machine_busy_s",
           "cpu_jiffies", "quietest", "MAX_FOREIGN_CORES", "ForeignLoad"]

# Cores other processes may use while a thread-count pair is timed before it is measured again (see quietest)
MAX_FOREIGN_CORES = 0.2


def cut_state(card: ModelCard) -> tuple[TensorSpec, ...]:
    """The tensors of the heaviest cut (most bytes per input). A profile has one Tx curve per device;
    where the state shrinks with depth (CNNs) this is the conservative choice."""
    if card.num_blocks < 2 or not hasattr(card, "state_after"):
        return tuple(card.state)
    cuts = [card.state_after(k) for k in range(1, card.num_blocks)]
    return max(cuts, key=lambda specs: sum(int(np.prod(t.shape)) * np.dtype(t.numpy_dtype).itemsize for t in specs))


def _check_inputs(card: ModelCard, batch: int, rng: np.random.Generator) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Random ramp logits [batch, C] (every other row confident: about half exit under an entropy rule) and
    the heaviest cut's state tensors for ``batch`` rows."""
    logits = rng.normal(size=(batch, card.num_classes)).astype(np.float32)
    logits[::2, 0] += 12.0
    state = {t.name: rng.normal(size=(batch, *t.shape)).astype(t.numpy_dtype) for t in cut_state(card)}
    return logits, state


def _route(card: ModelCard, batch: int):
    # deferred: the serving code and the model (torch) load only when they are timed
    from e3.core.exits import make_exit_rule
    from e3.serving.policy import BatchRoute
    return BatchRoute(batch, card.num_classes, card.num_blocks, make_exit_rule(card.exit_rule))


def _first_ramp(card: ModelCard) -> int:
    return min(card.ramp_blocks) if card.ramp_blocks else card.num_blocks


def _between_calls(between, batch: int) -> None:
    """Run ``between(batch)`` (the model's compute, untimed) where given."""
    if between is not None:
        between(batch)


def measure_check(card: ModelCard, batch_sizes: Sequence[int], repeats: int, *, warmup: int = 3,
                  seed: int = 0, between=None) -> list[np.ndarray]:
    """Timings (ms) of one exit check between blocks at each batch size: ``BatchRoute.observe`` on one
    ramp's logits, then the compaction of the survivors' state rows (numpy fancy indexing). In-process.
    ``between(batch)``: untimed work run before every timed call (the profile runs the model's stock graph
    at that batch): in a served batch a check follows a block, whose weights have evicted the check's code
    and data from the CPU's caches (measured on the walk-through's model: the router's work 0.14 ms hot,
    0.46 ms with the blocks run between, 0.49 ms inside the served router)."""
    rng = np.random.default_rng(seed)
    ramp = _first_ramp(card)
    out = []
    for batch in batch_sizes:
        logits, state = _check_inputs(card, batch, rng)
        times = np.empty(repeats)
        for r in range(-warmup, repeats):
            route = _route(card, batch)       # one per batch of a split: the router's work, not the check's
            _between_calls(between, batch)
            start = time.perf_counter()
            keep = route.observe({ramp: logits})
            _ = {name: x[keep] for name, x in state.items()}
            if r >= 0:
                times[r] = (time.perf_counter() - start) * 1e3
        out.append(times)
    return out


def router_batch(card: ModelCard, batch: int, rng: np.random.Generator):
    """``run() -> answers``: the router's own work on one batch of ``batch`` inputs of a split that ends the
    model, with the serving code itself (:mod:`e3.serving`): ``batch`` requests of one input each are
    checked and taken in (``check_request``, the scheduler's job and admission of rows), the batch is
    dispatched and its rows' tensors stacked (``Scheduler.poll``, ``Scheduler.stack``), the exit rule
    decides at the first ramp and the head answers the rest (``BatchRoute``), the rows' answers go back to
    their requests (``Scheduler.finish``) and every request's answer is checked as the router sends it
    (``nonfinite_output``). One request per input: the worst case of requests per batch. Only the blocks'
    compute and Triton's own transport are left out."""
    # deferred: the serving code and the model (torch) load only when they are timed
    from e3.core.exits import make_exit_rule
    from e3.serving.input_policy import check_request
    from e3.serving.output_policy import nonfinite_output
    from e3.serving.policy import BatchRoute
    from e3.serving.scheduler import Scheduler, make_queues

    rule = make_exit_rule(card.exit_rule)
    C, L = card.num_classes, card.num_blocks
    # zeros: valid for every input the card can declare (token ids, masks, features); the checks' cost
    # does not depend on the values
    requests = [{t.name: np.zeros((1, *t.shape), dtype=t.numpy_dtype) for t in card.inputs} for _ in range(batch)]
    ramp_logits = rng.normal(size=(batch, C)).astype(np.float32)
    ramp_logits[::2, 0] += 12.0
    head_logits = rng.normal(size=(batch, C)).astype(np.float32)
    ramp = _first_ramp(card)

    def run() -> list:
        sched = Scheduler(make_queues([batch], [1], [0]), slo_s=60.0, slack=0.0)
        now = time.monotonic()
        for arrays in requests:
            n = check_request(card.inputs, arrays)
            sched.admit(sched.job(None, n, now, C), arrays, rule.init_state(n), now)
        (d,), _, _ = sched.poll(now)
        _feed, rule_state = Scheduler.stack(d.rows)
        route = BatchRoute(len(d.rows), C, L, rule, rule_state)
        keep = route.observe({ramp: ramp_logits}) if ramp < L else np.zeros(batch, dtype=bool)
        if route.active.size:
            route.observe({L: head_logits[keep] if ramp < L else head_logits})
        answers = []
        for job in sched.finish(d, route, None, 0.0, now):
            out = {"label": job.label[:, None], "exit_ramp": job.exit_ramp[:, None], "probs": job.probs}
            nonfinite_output(out)
            answers.append(out)
        return answers
    return run


def measure_router(card: ModelCard, batch_sizes: Sequence[int], repeats: int, *, warmup: int = 3,
                   seed: int = 0, between=None) -> list[np.ndarray]:
    """Timings (ms) of the router's own work on one batch of a split at each batch size
    (:func:`router_batch`: the serving code's path for one input per request). In-process, no Triton.
    ``between(batch)``: untimed work before every timed batch (the profile runs the model's stock graph at
    that batch: a served batch's work follows its blocks, with the CPU's caches full of their weights; see
    :func:`measure_check`)."""
    rng = np.random.default_rng(seed)
    out = []
    for batch in batch_sizes:
        run = router_batch(card, batch, rng)
        times = np.empty(repeats)
        for r in range(-warmup, repeats):
            _between_calls(between, batch)
            start = time.perf_counter()
            run()
            if r >= 0:
                times[r] = (time.perf_counter() - start) * 1e3
        out.append(times)
    return out


def stock_runner(model: "EarlyExitModel", *, workdir: Path, seed: int = 0):
    """``run(batch)``: the model's stock graph (``workdir/stock.onnx``, exported when missing) once on
    ``batch`` example inputs, 1 intra-op thread: the compute the profile runs between timed calls of the
    router's work and the exit check."""
    # deferred: the serving code and the model (torch) load only when they are timed
    from e3.models.api import SplitModule
    from e3.export.onnx_export import export_onnx, split_inputs
    from e3.core.session import make_session

    card = model.card
    module = SplitModule(model, 1, card.num_blocks, ())
    path = workdir / "stock.onnx"
    if not path.exists():
        export_onnx(module, path, max_batch_size=card.max_batch_size, seed=seed)
    session = make_session(str(path), intra_op_threads=1)
    reads = [i.name for i in session.get_inputs()]
    names = [t.name for t in module.input_specs]
    feeds: dict[int, dict] = {}

    def run(batch: int) -> None:
        if batch not in feeds:
            every = {n: t.numpy() for n, t in zip(names, split_inputs(module, batch, seed))}
            feeds[batch] = {n: every[n] for n in reads}
        session.run(None, feeds[batch])
    return run


def cpu_jiffies() -> list[int] | None:
    """The machine's CPU counters since boot, the first line of ``/proc/stat`` (user, nice, system, idle,
    iowait, irq, softirq, steal, in clock ticks); None where there is none."""
    try:
        fields = open("/proc/stat").readline().split()
    except OSError:
        return None
    return [int(v) for v in fields[1:9]] if fields and fields[0] == "cpu" and len(fields) >= 9 else None


def machine_busy_s() -> float | None:
    """CPU seconds every process on the machine has used since boot (:func:`cpu_jiffies`: user, nice, system,
    irq, softirq, steal); None where there is no ``/proc/stat``."""
    counters = cpu_jiffies()
    if counters is None:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = counters
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def quietest(measure: Callable[[], T], *, tries: int = 3, max_foreign: float = MAX_FOREIGN_CORES,
             wait_s: float = 2.0) -> tuple[T, float]:
    """``measure()`` run until the other processes on the machine used at most ``max_foreign`` cores while it
    ran (at most ``tries`` times, ``wait_s`` apart); returns the result of the quietest try and the cores the
    others used during it (nan where the machine's counters cannot be read).

    Why: on a shared machine a graph on 2 intra-op threads is the first casualty of someone else's work.
    Each of its operators waits for both threads, so one core lent to another process stalls every
    operator, while 1 thread only loses that core's share. Measured on this 2-core machine (bert-ee's stock
    graph at batch 8, other engineers' tests and a training run beside it, load average 6.5): 1 thread
    690-748 ms, 2 threads 679-687 ms, a gain of 1.02-1.09x where the quiet machine gives 1.76x; a profile
    measured so prices a 2-thread instance at half its served speed (issue 42: 72 simulated against 218
    inputs/s measured). The simulator models the host work it knows about (the front door's and
    the clients' CPU per request, :func:`e3.simulator.load.with_host_share`) on top of a quiet profile, so
    the profile must be quiet, or say how loud it was."""
    best, best_foreign = None, float("inf")
    for attempt in range(max(1, tries)):
        busy0, own0, wall0 = machine_busy_s(), time.process_time(), time.perf_counter()
        result = measure()
        busy1, own1, wall1 = machine_busy_s(), time.process_time(), time.perf_counter()
        if busy0 is None or busy1 is None:
            return result, float("nan")
        foreign = max(0.0, (busy1 - busy0) - (own1 - own0)) / max(wall1 - wall0, 1e-9)
        if foreign < best_foreign:
            best, best_foreign = result, foreign
        if foreign <= max_foreign:
            break
        if attempt + 1 < tries:
            time.sleep(wait_s)
    return best, best_foreign


class ForeignLoad:
    """The cores other processes used between :meth:`start` and :meth:`stop`: the machine's CPU time less
    this process's and the server's process group's (``pgid``), over the wall time; nan without ``/proc``.
    A measured run records it beside its figures: the simulator models the work of the server and the
    load generator, not another engineer's. The group is counted process by process (a stub that a reload
    ended before :meth:`stop` takes its whole past with it; one it started counts from 0)."""

    def __init__(self, pgid: int | None):
        self.pgid = pgid
        self._start: tuple[float | None, float, dict[int, float], float] | None = None

    def _now(self) -> tuple[float | None, float, dict[int, float], float]:
        return (machine_busy_s(), time.process_time(), group_cpu_s(self.pgid) if self.pgid else {},
                time.perf_counter())

    def start(self) -> None:
        self._start = self._now()

    def stop(self) -> float:
        (busy0, own0, group0, wall0), (busy1, own1, group1, wall1) = self._start, self._now()
        if busy0 is None or busy1 is None:
            return float("nan")
        ours = own1 - own0 + sum(cpu - group0.get(pid, 0.0) for pid, cpu in group1.items())
        return max(0.0, (busy1 - busy0) - ours) / max(wall1 - wall0, 1e-9)
