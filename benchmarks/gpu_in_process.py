"""The GPU side-by-side's in-process part (``benchmarks/gpu_side_by_side.py``, step 1): the three systems with
nothing around them, on the very executors the served models use, and the prices E3's cuts are chosen from.

**Equal overlap.** E3's pipeline keeps up to two split runs in flight on a GPU
(:data:`e3.serving.device.pipeline.DEPTH`): the device runs the next batch while the host decides the last. The
baselines get the same here (:func:`overlapped`): every batch is a generator that launches its device work,
yields, and only then waits for its one copy to the host (a pinned buffer and an event, as the pipeline's runs
do); up to ``depth`` batches are in flight, so the stock model's next batch (or the naive model's next segment of
another batch) is queued on the device before the host waits for the last. One stream: the device work of two
batches is ordered, so a graph's static outputs are copied (the logits to the host, the naive model's state to a
buffer of its own) before the next replay overwrites them. On the CPU the depth is 1, as the pipeline's.

The answers of the overlapped runners equal the served runners' (:class:`~e3.serving.device.pipeline.
StockRunner`, :class:`~e3.serving.device.pipeline.NaiveRunner`); ``tests/test_gpu_side_by_side.py`` checks it
at depth 2 on the CPU. Heavy imports (torch, the project) stay inside the functions: this module is imported on
a bare host before the project's namespace exists.
"""

from __future__ import annotations

import dataclasses
import sys
from collections import deque
from pathlib import Path
from typing import Callable, Generator, Iterable

if __package__:
    from e3.benchmarks.gpu_load import INPUTS_PER_REQUEST
else:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_load import INPUTS_PER_REQUEST

# Deferred imports: torch, numpy and the project load inside the functions: a bare GPU host imports this module
# before the project's namespace exists (the module docstring).
__all__ = ["mixed_pool", "reach_of", "in_process", "overlapped", "stock_batch", "naive_batch", "overlap_depth"]


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


# -- two batches in flight for the baselines --------------------------------------------------------------------
def overlap_depth(settings) -> int:
    """Runs in flight: the pipeline's (``DEPTH`` on a GPU, 1 on the CPU)."""
    from e3.serving.device.pipeline import DEPTH
    return DEPTH if settings.cuda else 1


class _HostCopy:
    """Logits on their way to the host: a pinned buffer and an event after the copy on a GPU; the tensor itself
    on the CPU."""

    def __init__(self, logits, cuda: bool):
        import torch
        self.event = None
        if cuda:
            self.host = torch.empty(logits.shape, dtype=torch.float32, pin_memory=True)
            self.host.copy_(logits, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = logits.float()

    def numpy(self):
        if self.event is not None:
            self.event.synchronize()   # the one sync of this launch
        return self.host.numpy()


def stock_batch(runner, arrays: dict) -> Generator[None, None, object]:
    """One batch of the stock model (a :class:`StockRunner`'s executor, at most its max batch rows): launch,
    yield, then wait for its logits and answer (:func:`e3.serving.device.pipeline.head_answer`)."""
    import numpy as np
    import torch

    from e3.serving.device.pipeline import head_answer
    card = runner.card
    n = len(next(iter(arrays.values())))
    with torch.inference_mode():
        chunk = tuple(torch.from_numpy(np.ascontiguousarray(arrays[s.name])) for s in card.inputs)
        (logits,) = runner.executor.run([chunk], n)
        copy = _HostCopy(logits.float(), runner.settings.cuda)
    yield
    return head_answer(copy.numpy(), card)


def naive_batch(runner, arrays: dict) -> Generator[None, None, object]:
    """One batch of the naive early-exit model (a :class:`NaiveRunner`'s segments, at most its max batch rows),
    yielding after every segment's launch: the segment's state is copied to a buffer of its own and its ramps'
    logits to the host before the generator yields; on resuming it waits for them, applies the rule and gathers
    the survivors on the device for the next segment. Returns its :class:`Answer`."""
    import numpy as np
    import torch

    from e3.serving.device.pipeline import Answer
    from e3.serving.policy import BatchRoute
    card, settings = runner.card, runner.settings
    n = len(next(iter(arrays.values())))
    L, C = card.num_blocks, card.num_classes
    route = BatchRoute(n, C, L, runner.rule, runner.rule.init_state_for(arrays, n))
    with torch.inference_mode():
        feed = tuple(torch.from_numpy(np.ascontiguousarray(arrays[s.name])) for s in card.inputs)
    for s, executor in enumerate(runner.executors):
        last = s == len(runner.executors) - 1
        with torch.inference_mode():
            outs = executor.run([feed], len(route.active))
            held = () if last else outs[:len(card.state)]
            state = tuple(t.clone() for t in held) if settings.cuda else held   # the next replay overwrites outs
            copy = _HostCopy(torch.stack([o.float() for o in outs[len(held):]]), settings.cuda)
        yield
        logits = copy.numpy()
        keep = route.observe({k: logits[i] for i, k in enumerate(runner.ramps[s])})
        if route.done:
            break
        with torch.inference_mode():
            where = torch.from_numpy(np.flatnonzero(keep)).to(settings.device, non_blocking=True)
            feed = tuple(t.index_select(0, where) for t in state)
    answer = Answer(np.zeros(n, np.int64), np.zeros(n, np.int32), np.zeros((n, C), np.float32))
    answer.label[:], answer.exit_ramp[:], answer.probs[:] = route.label, route.exit_ramp, route.probs
    return answer


def overlapped(batches: Iterable[dict], start: Callable[[dict], Generator], depth: int) -> list:
    """Run ``batches`` with up to ``depth`` of them in flight: ``start(batch)`` is a generator that launches its
    device work and yields before each wait (:func:`stock_batch`, :func:`naive_batch`); the oldest batch is
    resumed (it waits, decides, launches its next segment or finishes) while the others' work is queued on the
    device. Returns the batches' answers in order."""
    pending = iter(batches)
    live: deque = deque()   # (index, generator)
    answers: dict[int, object] = {}
    count = 0

    def launch() -> None:
        nonlocal count
        while len(live) < depth:
            batch = next(pending, None)
            if batch is None:
                return
            g = start(batch)
            next(g)   # its first launch
            live.append((count, g))
            count += 1

    launch()
    while live:
        i, g = live.popleft()
        try:
            next(g)
            live.append((i, g))
        except StopIteration as done:
            answers[i] = done.value
            launch()
    return [answers[i] for i in range(count)]


# -- the limit ---------------------------------------------------------------------------------------------------
def _timed(fn, reps: int, sync) -> float:
    """Median ms of ``fn`` and a ``sync`` after 3 untimed calls: the profile's own timer
    (:func:`e3.serving.device.timing.timed`), so the in-process prices and ``e3 profile --cuda`` time alike."""
    import numpy as np

    from e3.serving.device.timing import timed
    return float(np.median(timed({"call": fn}, repeats=reps, warmup=3, sync=sync)["call"]))


def _batches(pool: dict, B: int, count: int) -> list[dict]:
    """``count`` batches of B rows of ``pool`` in turn."""
    n = len(next(iter(pool.values())))
    return [{k: v[[(i * B + j) % n for j in range(B)]] for k, v in pool.items()} for i in range(count)]


def in_process(model, rule, enabled: tuple[int, ...], *, device_settings, pools: dict[str, dict], B: int,
               reps: int, echo) -> dict:
    """Prices at batch B, E3's cuts per mix, and the in-process inputs/s of the three systems: each system is
    given the same inputs (``12 x B`` per timing), the baselines with two batches in flight on a GPU as E3's
    pipeline (module docstring; ``*_sync_ips``: one batch at a time, as before)."""

    import numpy as np
    import torch

    from e3.controller.planner.device import choose_device_cuts
    from e3.serving.device.executor import make_executor
    from e3.serving.device.pipeline import DevicePipeline, NaiveRunner, StockRunner
    from e3.serving.policy import BatchRoute

    card, L = model.card, model.card.num_blocks
    sync = torch.cuda.synchronize if device_settings.cuda else (lambda: None)
    depth = overlap_depth(device_settings)
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
    stock_ms = _timed(lambda: stock.run(first), reps, sync)   # one batch, synced: the planner's price
    n_batches = 12
    stock_feed = _batches(any_pool, B, n_batches)
    stock_total = _timed(lambda: overlapped(stock_feed, lambda b: stock_batch(stock, b), depth), max(3, reps // 4), sync)
    stock_ips = n_batches * B / stock_total * 1e3
    out = {"max_batch": B, "block_ms": block_ms, "run_ms": run_ms, "stock_ms": stock_ms, "stock_ips": stock_ips,
           "stock_sync_ips": B / stock_ms * 1e3, "depth": depth, "mixes": {}}
    full = dataclasses.replace(device_settings, max_batch=B, buckets=None)
    naive = NaiveRunner(model, enabled_ramps=enabled, rule=rule, settings=full)
    for mix, pool in pools.items():
        reach = reach_of(rule, pool, L)
        plan = choose_device_cuts(reach, block_ms, run_ms, enabled_ramps=enabled, stock_ms=stock_ms)
        batch = {k: v[:B] for k, v in pool.items()}
        naive_sync_ms = _timed(lambda: naive.run(batch), reps, sync)
        naive_feed = _batches(pool, B, n_batches)
        naive_total = _timed(lambda: overlapped(naive_feed, lambda b: naive_batch(naive, b), depth),
                             max(3, reps // 4), sync)
        naive_ips = n_batches * B / naive_total * 1e3
        n_req = max(4, n_batches * B // INPUTS_PER_REQUEST)

        def e3_ips_at(cuts: tuple[int, ...]) -> float:
            pipe = DevicePipeline(model, cuts=cuts, batch_sizes=[B] * (len(cuts) + 1), enabled_ramps=enabled,
                                  rule=rule, settings=full, slo_ms=1e6, answer=lambda h, o: None,
                                  fail=lambda h, m: None)

            def e3_once():
                n = len(next(iter(pool.values())))
                for r in range(n_req):
                    rows = [(r * INPUTS_PER_REQUEST + j) % n for j in range(INPUTS_PER_REQUEST)]
                    pipe.admit(r, {k: v[rows] for k, v in pool.items()})
                pipe.run_until_idle()
            return n_req * INPUTS_PER_REQUEST / _timed(e3_once, max(3, reps // 4), sync) * 1e3
        e3_ips = e3_ips_at(tuple(plan.cuts))
        # E3 with cuts the planner did not choose, measured beside its choice (on the H100 its choice lost to
        # naive early exit, docs/gpu.md): a cut after every enabled ramp before the head
        forced = {}
        for cuts in {tuple(r for r in sorted(enabled) if r < L)} - {tuple(plan.cuts)}:
            forced[",".join(map(str, cuts))] = e3_ips_at(cuts)
        ideal = L / sum(reach)
        out["mixes"][mix] = {"reach": reach, "cuts": list(plan.cuts), "predicted_ms_per_b": plan.time_ms,
                             "naive_ips": naive_ips, "naive_sync_ips": B / naive_sync_ms * 1e3, "e3_ips": e3_ips,
                             "ideal": ideal, "e3_vs_stock": e3_ips / stock_ips, "e3_vs_naive": e3_ips / naive_ips,
                             "e3_forced_cuts_ips": forced}
        echo(f"  in process B={B} {mix} ({depth} in flight for every system): stock {stock_ips:,.0f}/s "
             f"naive {naive_ips:,.0f}/s E3 {e3_ips:,.0f}/s (cuts {list(plan.cuts)}; "
             f"{out['mixes'][mix]['e3_vs_stock']:.2f}x stock, {out['mixes'][mix]['e3_vs_naive']:.2f}x naive; "
             f"ideal {ideal:.2f}x; one batch at a time: stock {out['stock_sync_ips']:,.0f}/s "
             f"naive {out['mixes'][mix]['naive_sync_ips']:,.0f}/s)"
             + "".join(f"; E3 cut at [{c}]: {ips:,.0f}/s" for c, ips in forced.items()))
    if device_settings.cuda:
        torch.cuda.empty_cache()
    return out
