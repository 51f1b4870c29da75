"""The planner's DP against brute-force enumeration, hand-checked cases and the converse (E3 §3.2, §5.3).

The brute force below shares nothing with the DP but the model it implements (see the planner's
docstring): it enumerates every cut set, configuration and instance count per split and input batch,
prices both forms of every split with LatencyProfile.block / .tx / .tx_in / .check / .router directly and
keeps the one with the smaller stage time (tie: constant). With the exit-wrapper on it takes the
wrapper's ramps (a pure function with its own tests, tests/test_split_forms.py) and the reach they leave.
"""

from __future__ import annotations

import itertools
import math
from functools import lru_cache

import numpy as np
import pytest

from e3.controller.planner import (PlanOptions, PlannerError, best_plan, cheapest_plan, parse_devices, parse_forms,
                                   stock_baseline)
from e3.controller.planner.ramps import candidate_ramps, wrap_for_devices
from e3.core.cost import SPLIT_FORMS, effective_reach, plan_cost
from e3.core.plan import COMPACT, CONSTANT, FORMS, Plan
from e3.core.profile import BatchProfile, DeviceConfig, LatencyProfile
from e3.controller.planner.reference import reference_best_plan

BATCHES = [1, 2, 4, 8]


# ---------------------------------------------------------------- factories

def make_profile(num_blocks: int, devices: dict[str, tuple[float, float, float]], *, tx_ms: float = 0.2,
                 tx_per_input_ms: float = 0.01, ramp_ms: float = 0.05, block_scale: list[float] | None = None,
                 batches: list[int] = BATCHES, tx_in_ms: float | None = None) -> LatencyProfile:
    """Linear-in-batch GPU-like profile: block k on c at batch b = scale_k * (fixed_c + per_input_c * b);
    ``tx_in_ms``: a flat hop into split 1 (None: no such curve, the hop is tx_ms's)."""
    scale = block_scale or [1.0] * num_blocks
    return LatencyProfile(
        tx_in_ms={} if tx_in_ms is None else {n: [tx_in_ms] * len(batches) for n in devices},
        model="toy", num_blocks=num_blocks, batch_sizes=list(batches),
        devices={n: DeviceConfig(n, price) for n, (_, _, price) in devices.items()},
        block_ms={n: [[scale[k] * (fx + pi * b) for b in batches] for k in range(num_blocks)]
                  for n, (fx, pi, _) in devices.items()},
        ramp_ms={n: [[(ramp_ms * (1 + 0.1 * b) if k < num_blocks - 1 else 0.0) for b in batches]
                     for k in range(num_blocks)] for n in devices},
        tx_ms={n: [tx_ms + tx_per_input_ms * b for b in batches] for n in devices})


def random_profile(rng: np.random.Generator, num_blocks: int, names: list[str],
                   extras: bool = False) -> LatencyProfile:
    """Arbitrary (not necessarily monotone) latencies: the DP must not rely on shape. ``extras``: random
    tx_in_ms, check_ms and router_ms curves too (drawn after the others, so the rest is unchanged)."""
    devices = {n: DeviceConfig(n, float(rng.choice([0.5, 1.0, 2.0, 3.0]))) for n in names}
    def table(lo, hi, rows):
        return [sorted(rng.uniform(lo, hi, len(BATCHES)).tolist()) if rng.random() < 0.8
                else rng.uniform(lo, hi, len(BATCHES)).tolist() for _ in range(rows)]
    lat = LatencyProfile(model="toy", num_blocks=num_blocks, batch_sizes=list(BATCHES), devices=devices,
                         block_ms={n: table(0.5, 6.0, num_blocks) for n in names},
                         ramp_ms={n: table(0.0, 0.5, num_blocks - 1) + [[0.0] * len(BATCHES)] for n in names},
                         tx_ms={n: table(0.0, 8.0, 1)[0] for n in names})
    if extras:
        lat.tx_in_ms = {n: table(0.0, 2.0, 1)[0] for n in names}
        lat.check_ms = {n: table(0.0, 0.6, 1)[0] for n in names}
        lat.router_ms = {n: table(0.0, 1.0, 1)[0] for n in names}
        lat.validate()
    return lat


def make_batch(reach: list[float]) -> BatchProfile:
    return BatchProfile(model="toy", batch_size=8, reach=list(reach))


def random_reach(rng: np.random.Generator, num_blocks: int) -> list[float]:
    return [1.0] + sorted(rng.uniform(0.0, 1.0, num_blocks - 1).round(3).tolist(), reverse=True)


# ---------------------------------------------------------------- brute force

def split_forms(lat: LatencyProfile, Bk, a: int, b: int, c: str, m: int, ramps, forms=FORMS):
    """Both forms of split a..b on c with m instances priced by hand; the one with the smaller stage time
    (compact only when faster by more than 1e-9 relative): (form, T, Tx)."""
    L, x = lat.num_blocks, Bk[a - 1] / m
    priced = {}
    if CONSTANT in forms:
        T = sum(lat.block(k, c, x, with_ramp=k in ramps) for k in range(a, b + 1)) + lat.router(c, x)
        priced[CONSTANT] = (T, lat.tx_in(c, x) if a == 1 else lat.tx(c, x))
    if COMPACT in forms:
        T = sum(lat.block(k, c, Bk[k - 1] / m, with_ramp=k in ramps)
                + (lat.check(c, Bk[k - 1] / m) if k in ramps and k < L else 0.0) for k in range(a, b + 1))
        priced[COMPACT] = (T + lat.router(c, x), 0.0)
    if len(priced) == 2 and priced[COMPACT][0] < priced[CONSTANT][0] - 1e-9 * max(1.0, priced[CONSTANT][0]):
        return (COMPACT, *priced[COMPACT])
    form = CONSTANT if CONSTANT in priced else COMPACT
    return (form, *priced[form])


def enumerate_plans(lat: LatencyProfile, batch: BatchProfile, res: dict[str, int], *, slo_ms: float,
                    slack: float, rate_rps: float, b0s: list[int], pipelined: bool = True,
                    cost_bound: float | None = None, stock: bool = False, forms=FORMS, exit_wrapper: bool = False):
    """Every legal plan meeting latency, devices and cost: (throughput, cost, latency, b0, splits), splits as
    ((first, last), config, instances, form). ``stock``: the model without ramps served without a router
    (constant, no hop, no router work)."""
    L, budget, bmax = lat.num_blocks, slo_ms * (1 - slack), lat.batch_sizes[-1]
    configs = [c for c, n in res.items() if n > 0]
    for b0 in b0s:
        ramps = () if stock else candidate_ramps(lat, batch)
        if exit_wrapper and not stock:
            ramps = wrap_for_devices(lat, batch.reach, configs, b0=b0, ramps=ramps)[0]
        Bk = b0 * effective_reach(batch.reach, ramps)

        @lru_cache(maxsize=None)
        def priced(a, b, c, m):
            if stock:
                return CONSTANT, sum(lat.block(k, c, Bk[a - 1] / m, with_ramp=False) for k in range(a, b + 1)), 0.0
            return split_forms(lat, tuple(Bk), a, b, c, m, ramps, forms)

        for cut_mask in itertools.product([False, True], repeat=L - 1):
            cuts = [k for k, cut in zip(range(1, L), cut_mask) if cut]
            ranges = list(zip([1] + [c + 1 for c in cuts], cuts + [L]))
            for cfg in itertools.product(configs, repeat=len(ranges)):
                for ms in itertools.product(*[range(1, res[c] + 1) for c in cfg]):
                    used = {c: 0 for c in configs}
                    for c, m in zip(cfg, ms):
                        used[c] += m
                    if any(used[c] > res[c] for c in configs):
                        continue
                    stages, ok = [], True
                    for (a, b), c, m in zip(ranges, cfg, ms):
                        ba = Bk[a - 1]
                        if m > max(1, math.ceil(ba - 1e-9)) or ba / m > bmax + 1e-9:
                            ok = False
                            break
                        stages.append(priced(a, b, c, m))
                    if not ok:
                        continue
                    pipe = sum(T + tx for _, T, tx in stages)
                    cycle = max(max(T, tx) for _, T, tx in stages) if pipelined else pipe
                    latency = 1e3 * (b0 - 1) / rate_rps + pipe
                    cost = sum(lat.devices[c].price * n for c, n in used.items())
                    if latency > budget * (1 + 1e-9) or (cost_bound is not None and cost > cost_bound * (1 + 1e-9)):
                        continue
                    yield 1e3 * b0 / cycle, cost, latency, b0, list(zip(ranges, cfg, ms, [f for f, _, _ in stages]))


def brute_best(plans):
    plans = list(plans)
    if not plans:
        return None
    top = max(p[0] for p in plans)
    plans = [p for p in plans if p[0] >= top * (1 - 1e-9)]
    cheapest = min(p[1] for p in plans)
    plans = [p for p in plans if p[1] <= cheapest * (1 + 1e-9) + 1e-12]
    return min(plans, key=lambda p: p[2])


def assert_feasible(r, lat, batch, res, slo_ms, slack, rate_rps, cost_bound=None, forms=FORMS):
    """Re-evaluate the returned plan independently of the DP's tables (every ramp the result was priced
    with; each split in the form it chose)."""
    assert r.latency_ms <= slo_ms * (1 - slack) * (1 + 1e-9)
    assert all(r.devices_used[c] <= res[c] for c in r.devices_used)
    if cost_bound is not None:
        assert r.cost <= cost_bound * (1 + 1e-9)
    assert [s.first_block for s in r.splits] == [1] + [s.last_block + 1 for s in r.splits[:-1]]
    assert r.splits[-1].last_block == lat.num_blocks
    pipe = 0.0
    Bk = tuple(r.input_batch_size * effective_reach(batch.reach, r.enabled_ramps))
    for s in r.splits:
        form, T, tx = split_forms(lat, Bk, s.first_block, s.last_block, s.device, s.instances, r.enabled_ramps,
                                  forms)
        assert (s.form, s.stage_ms, s.tx_ms) == (form, pytest.approx(T, rel=1e-9), pytest.approx(tx, rel=1e-9))
        pipe += T + tx
    assert r.latency_ms == pytest.approx(1e3 * (r.input_batch_size - 1) / rate_rps + pipe, rel=1e-9)


# ---------------------------------------------------------------- DP == brute force

@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("names,counts", [(["gpu"], [3]), (["a", "b"], [2, 2])], ids=["homogeneous", "two-configs"])
@pytest.mark.parametrize("forms,extras,wrapper", [((CONSTANT,), False, False), (SPLIT_FORMS, False, False),
                                                  (SPLIT_FORMS, True, False), (SPLIT_FORMS, True, True)],
                         ids=["constant", "forms", "forms+curves", "forms+curves+wrapper"])
def test_best_plan_matches_brute_force(seed, names, counts, forms, extras, wrapper):
    rng = np.random.default_rng(seed * 7 + len(names))
    L = 4
    lat = random_profile(rng, L, names, extras=extras)
    batch = make_batch(random_reach(rng, L))
    res = dict(zip(names, counts))
    slo, slack, rate = float(rng.uniform(10, 60)), 0.2, float(rng.uniform(100, 2000))
    pipelined = bool(seed % 4 != 3)
    cost_bound = float(rng.uniform(1, 6)) if seed % 2 else None
    b0s = [1, 2, 4, 8]
    want = brute_best(enumerate_plans(lat, batch, res, slo_ms=slo, slack=slack, rate_rps=rate, b0s=b0s,
                                      pipelined=pipelined, cost_bound=cost_bound, forms=forms, exit_wrapper=wrapper))
    kw = dict(slo_ms=slo, slack=slack, rate_rps=rate, b0s=b0s, pipelined=pipelined, alpha=None,
              cost_bound=cost_bound, forms=forms, exit_wrapper=wrapper)
    if want is None:
        with pytest.raises(PlannerError):
            best_plan(lat, batch, res, PlanOptions(**kw))
        return
    got = best_plan(lat, batch, res, PlanOptions(**kw))
    assert got.throughput_rps == pytest.approx(want[0], rel=1e-7)
    assert got.cost == pytest.approx(want[1], rel=1e-9)
    assert got.latency_ms == pytest.approx(want[2], rel=1e-7)
    assert_feasible(got, lat, batch, res, slo, slack, rate, cost_bound, forms)


@pytest.mark.parametrize("seed", range(30))
def test_fast_search_matches_reference_search(seed):
    """The fast search (best-first over B0, 1-D DP, racing probes) returns the original search's plan on
    instances too big for brute force: 1-3 configurations, up to 10 blocks and 12 devices, cost bounds."""
    rng = np.random.default_rng(1000 + seed)
    names = ["a", "b", "c"][: 1 + seed % 3]
    L = int(rng.integers(3, 11))
    lat = random_profile(rng, L, names, extras=seed % 5 != 4)
    batch = make_batch(random_reach(rng, L))
    res = {n: int(rng.integers(1, 12 // len(names) + 2)) for n in names}
    kw = dict(slo_ms=float(rng.uniform(15, 120)), slack=0.2, rate_rps=float(rng.uniform(200, 5000)),
              alpha=None, cost_bound=float(rng.uniform(2, 12)) if seed % 4 == 1 else None,
              b0s=None if seed % 2 else [1, 2, 4, 8, 16, 32], exit_wrapper=seed % 7 != 6,
              forms=(CONSTANT,) if seed % 6 == 5 else SPLIT_FORMS)
    try:
        want = reference_best_plan(lat, batch, res, PlanOptions(**kw))
    except PlannerError:
        with pytest.raises(PlannerError):
            best_plan(lat, batch, res, PlanOptions(**kw))
        return
    got = best_plan(lat, batch, res, PlanOptions(**kw))
    assert (got.input_batch_size, got.splits) == (want.input_batch_size, want.splits)
    assert (got.throughput_rps, got.cost, got.latency_ms) == (want.throughput_rps, want.cost, want.latency_ms)


def test_random_instances_are_not_trivial():
    """Guard for the property test: the random instances exercise cuts, both configs and the SLO."""
    seen_cuts, seen_configs, seen_infeasible, seen_forms, seen_disabled = False, set(), 0, set(), False
    for seed in range(8):
        rng = np.random.default_rng(seed * 7 + 2)
        lat = random_profile(rng, 4, ["a", "b"], extras=True)
        batch = make_batch(random_reach(rng, 4))
        slo, rate = float(rng.uniform(10, 60)), float(rng.uniform(100, 2000))
        try:
            r = best_plan(lat, batch, {"a": 2, "b": 2}, PlanOptions(slo_ms=slo, rate_rps=rate, b0s=[1, 2, 4, 8],
                                                                    alpha=None, forms=SPLIT_FORMS))
        except PlannerError:
            seen_infeasible += 1
            continue
        seen_cuts |= len(r.splits) > 1
        seen_configs |= set(r.devices_used)
        seen_forms |= {s.form for s in r.splits}
        seen_disabled |= bool(r.disabled_ramps)
    assert seen_cuts and seen_configs == {"a", "b"} and seen_forms == set(SPLIT_FORMS) and seen_disabled


@pytest.mark.parametrize("seed", range(4))
def test_cheapest_plan_matches_brute_force(seed):
    rng = np.random.default_rng(100 + seed)
    lat = random_profile(rng, 4, ["a", "b"])
    batch = make_batch(random_reach(rng, 4))
    res = {"a": 2, "b": 2}
    slo, b0s = 60.0, [1, 2, 4, 8]
    top = brute_best(enumerate_plans(lat, batch, res, slo_ms=slo, slack=0.2, rate_rps=500.0, b0s=b0s,
                                     exit_wrapper=True))
    goal = top[0] * float(rng.uniform(0.3, 0.9))
    plans = [p for p in enumerate_plans(lat, batch, res, slo_ms=slo, slack=0.2, rate_rps=goal, b0s=b0s,
                                        exit_wrapper=True)
             if p[0] >= goal * (1 - 1e-9)]
    cheapest = min(p[1] for p in plans)
    got = cheapest_plan(lat, batch, res, PlanOptions(slo_ms=slo, goodput_rps=goal, b0s=b0s))
    assert got.cost == pytest.approx(cheapest, rel=1e-9)
    assert got.throughput_rps >= goal * (1 - 1e-9)
    best_at_that_cost = max(p[0] for p in plans if p[1] <= cheapest * (1 + 1e-9))
    assert got.throughput_rps == pytest.approx(best_at_that_cost, rel=1e-7)
    assert_feasible(got, lat, batch, res, slo, 0.2, goal)


# ---------------------------------------------------------------- hand-checked cases

def test_huge_tx_gives_one_split():
    # constant splits only (compact ones have no hop); the model inputs' hop into split 1 is cheap
    lat = make_profile(4, {"gpu": (1.0, 0.2, 1.0)}, tx_ms=1000.0, tx_in_ms=0.2)
    r = best_plan(lat, make_batch([1.0, 0.5, 0.3, 0.2]), {"gpu": 4}, PlanOptions(slo_ms=500, rate_rps=1000,
                                                                                 alpha=None, forms=(CONSTANT,)))
    assert len(r.splits) == 1 and r.splits[0].instances == 4 and r.splits[0].tx_ms == pytest.approx(0.2)


def shrinking_case(tx_ms: float = 0.01, tx_in_ms: float = 0.01, forms=(CONSTANT,)):
    """Hand-checked (constant splits): 4 equal blocks P(b) = 1 + 0.5 b ms, 3 in 4 inputs exit after
    block 2, B0 = 8, 2 GPUs. One split, 2 instances (4 inputs each): 4 x 3 = 12 ms. Cut after 2, one
    instance each: split 1 runs 8 inputs (2 x 5 = 10 ms), split 2 the 2 survivors (2 x 2 = 4 ms): cycle
    10 ms. Cutting after 1 or 3 leaves a 3-block split at batch 8 (15 ms). Split 1's hop is tx_in_ms."""
    lat = make_profile(4, {"gpu": (1.0, 0.5, 1.0)}, tx_ms=tx_ms, tx_per_input_ms=0.0, ramp_ms=0.0,
                       tx_in_ms=tx_in_ms)
    return best_plan(lat, make_batch([1.0, 1.0, 0.25, 0.25]), {"gpu": 2}, PlanOptions(slo_ms=1000, rate_rps=10000,
                                                                                      b0s=[8], alpha=None, forms=forms))


def test_cheap_tx_and_exits_give_a_cut_where_the_batch_shrinks():
    r = shrinking_case()
    assert r.cuts == [2]
    assert [(s.instances, s.form) for s in r.splits] == [(1, CONSTANT), (1, CONSTANT)]
    assert r.cycle_ms == pytest.approx(10.0) and r.throughput_rps == pytest.approx(800.0)
    # fill + the hop into split 1 (the model inputs) + split 1 + the hop into split 2 + split 2
    assert r.latency_ms == pytest.approx(1e3 * 7 / 10000 + 0.01 + 10.0 + 0.01 + 4.0)


def test_a_hop_slower_than_the_stages_sets_the_pipelined_cycle():
    r = shrinking_case(tx_ms=11.0)        # cut: max(0.01, 10, 11, 4) = 11 ms < 12 ms for one split
    assert r.cuts == [2] and r.cycle_ms == pytest.approx(11.0)
    r = shrinking_case(tx_ms=13.0)        # the hop now costs more than the whole model on two instances
    assert r.cuts == [] and r.cycle_ms == pytest.approx(12.0)
    r = shrinking_case(tx_ms=0.01, tx_in_ms=13.0)   # every constant plan pays the hop into split 1 ...
    assert r.cycle_ms == pytest.approx(13.0)
    r = shrinking_case(tx_ms=0.01, tx_in_ms=13.0, forms=FORMS)   # ... a compact split does not
    assert r.splits[0].form == COMPACT and r.splits[0].tx_ms == 0.0 and r.cycle_ms < 13.0


def test_expensive_late_block_reached_by_few_inputs_gets_fewer_instances():
    # block 4 costs 4x the others, but only 1 input in 8 reaches it (4 of B0 = 32)
    lat = make_profile(4, {"gpu": (0.2, 0.1, 1.0)}, tx_ms=0.01, tx_per_input_ms=0.0, ramp_ms=0.0,
                       block_scale=[1.0, 1.0, 1.0, 4.0])
    r = best_plan(lat, make_batch([1.0, 1.0, 1.0, 0.125]), {"gpu": 8}, PlanOptions(slo_ms=1000, rate_rps=100000,
                                                                                   b0s=[32], alpha=None))
    assert r.splits[-1].first_block == 4
    assert r.splits[-1].instances < r.splits[0].instances
    assert sum(s.instances for s in r.splits) <= 8


def test_slo_limits_the_input_batch():
    lat = make_profile(2, {"gpu": (1.0, 0.1, 1.0)})
    batch = make_batch([1.0, 0.5])
    loose = best_plan(lat, batch, {"gpu": 1}, PlanOptions(slo_ms=1000, rate_rps=1000, alpha=None))
    tight = best_plan(lat, batch, {"gpu": 1}, PlanOptions(slo_ms=10, rate_rps=1000, alpha=None))
    assert tight.input_batch_size < loose.input_batch_size
    assert tight.latency_ms <= 8.0 + 1e-9 and loose.throughput_rps > tight.throughput_rps


def test_heterogeneous_split_puts_instances_of_one_split_on_one_config():
    lat = make_profile(4, {"fast": (0.5, 0.05, 4.0), "slow": (2.0, 0.4, 1.0)})
    r = best_plan(lat, make_batch([1.0, 0.6, 0.3, 0.1]), {"fast": 2, "slow": 3}, PlanOptions(slo_ms=200,
                                                                                             rate_rps=5000, alpha=None))
    # the answer is the brute force's best plan, which here needs both configurations
    want = brute_best(enumerate_plans(lat, make_batch([1.0, 0.6, 0.3, 0.1]), {"fast": 2, "slow": 3}, slo_ms=200,
                                      slack=0.2, rate_rps=5000, b0s=[r.input_batch_size]))
    assert want[4] == [((s.first_block, s.last_block), s.device, s.instances, s.form) for s in r.splits]
    assert {s.device for s in r.splits} == {"fast", "slow"}
    assert r.devices_used.get("fast", 0) <= 2 and r.devices_used.get("slow", 0) <= 3


def test_cost_bound_from_alpha_and_stock_baseline():
    lat = make_profile(4, {"gpu": (1.0, 0.2, 2.0)})
    batch = make_batch([1.0, 0.5, 0.3, 0.2])
    base = stock_baseline(lat, {"gpu": 8}, PlanOptions(slo_ms=200, rate_rps=500))
    assert base is not None and len(base.splits) == 1 and base.throughput_rps >= 500
    # the stock baseline by hand: the cheapest single split (no ramps, every input through every block)
    # reaching 500 inputs/s within 160 ms is the brute force's cheapest stock plan
    stock = make_profile(4, {"gpu": (1.0, 0.2, 2.0)}, ramp_ms=0.0)
    stocks = [p for p in enumerate_plans(stock, make_batch([1.0] * 4), {"gpu": 8}, slo_ms=200, slack=0.2,
                                         rate_rps=500, b0s=[1, 2, 4, 8, 16, 32, 64], stock=True)
              if len(p[4]) == 1 and p[0] >= 500]
    assert base.cost == pytest.approx(min(p[1] for p in stocks))
    r = best_plan(lat, batch, {"gpu": 8}, PlanOptions(slo_ms=200, rate_rps=500, alpha=1.0))
    assert r.cost_baseline == base.cost and r.cost <= base.cost + 1e-9
    unbounded = best_plan(lat, batch, {"gpu": 8}, PlanOptions(slo_ms=200, rate_rps=500, alpha=None))
    assert unbounded.cost > base.cost       # the bound binds here: without it the planner buys more devices
    bounded = brute_best(enumerate_plans(lat, batch, {"gpu": 8}, slo_ms=200, slack=0.2, rate_rps=500,
                                         b0s=[r.input_batch_size], cost_bound=base.cost, exit_wrapper=True))
    assert r.throughput_rps == pytest.approx(bounded[0], rel=1e-9)


def test_pipelining_gains_what_the_brute_force_says():
    lat = make_profile(4, {"gpu": (1.0, 0.2, 1.0)}, tx_ms=0.5)
    batch = make_batch([1.0, 0.5, 0.3, 0.2])
    b0s = [1, 2, 4, 8]
    pipe = best_plan(lat, batch, {"gpu": 4}, PlanOptions(slo_ms=200, rate_rps=2000, alpha=None, b0s=b0s))
    serial = best_plan(lat, batch, {"gpu": 4}, PlanOptions(slo_ms=200, rate_rps=2000, alpha=None, pipelined=False,
                                                           b0s=b0s))
    for got, pipelined in ((pipe, True), (serial, False)):
        want = brute_best(enumerate_plans(lat, batch, {"gpu": 4}, slo_ms=200, slack=0.2, rate_rps=2000, b0s=b0s,
                                          pipelined=pipelined))
        assert got.throughput_rps == pytest.approx(want[0], rel=1e-9)
    assert pipe.throughput_rps > 1.2 * serial.throughput_rps   # several splits overlap only when pipelined


def test_cost_model_reproduces_the_planners_numbers_and_the_brute_force():
    """The planner's result, re-priced by e3.core.cost from its splits alone, and by the brute force's
    own formulas (LatencyProfile.block / .tx), gives the same throughput, latency and cost."""
    rng = np.random.default_rng(5)
    lat = random_profile(rng, 5, ["a", "b"], extras=True)
    batch = make_batch(random_reach(rng, 5))
    r = best_plan(lat, batch, {"a": 3, "b": 2}, PlanOptions(slo_ms=80, rate_rps=800, alpha=None, forms=SPLIT_FORMS))
    assert {s.form for s in r.splits} == set(SPLIT_FORMS)   # both forms, so both are re-priced
    pc = plan_cost(lat, batch.reach, [(s.first_block, s.last_block, s.device, s.instances, s.form)
                                      for s in r.splits], b0=r.input_batch_size, rate_rps=800, ramps=r.enabled_ramps)
    assert (pc.throughput_rps, pc.latency_ms, pc.cost) == pytest.approx((r.throughput_rps, r.latency_ms, r.cost))
    assert pc.stages == r.splits
    ranges = [(s.first_block, s.last_block) for s in r.splits]
    same = [p for p in enumerate_plans(lat, batch, {"a": 3, "b": 2}, slo_ms=80, slack=0.2, rate_rps=800,
                                       b0s=[r.input_batch_size], exit_wrapper=True)
            if p[4] == [(rg, s.device, s.instances, s.form) for rg, s in zip(ranges, r.splits)]]
    assert len(same) == 1
    assert (same[0][0], same[0][2], same[0][1]) == pytest.approx((r.throughput_rps, r.latency_ms, r.cost))


def test_to_plan_builds_a_valid_shared_plan():
    r = shrinking_case()
    plan = r.to_plan(model="toy", num_blocks=4, exit_rule={"kind": "entropy", "tau_nats": 0.3}, ramp_blocks=(1, 2, 3),
                     slo_ms=1000, slack=0.2)
    again = Plan.from_json(plan.to_json())
    assert again.cuts == [2]
    # no input exits at ramps 1 and 3, but here they cost nothing (ramp_ms 0, no check_ms): the exit-wrapper
    # disables a ramp only when its cost exceeds its saving, so every ramp stays
    assert r.disabled_ramps == ()
    assert [(s.model, s.instances, s.device, s.batch_size, s.enabled_ramps, s.form) for s in again.splits] == [
        ("toy_split_1-2", 1, "gpu", 8, (1, 2), CONSTANT), ("toy_split_3-4", 1, "gpu", 2, (3,), CONSTANT)]
    assert again.predicted["throughput_rps"] == pytest.approx(800.0)
    assert again.predicted["latency_ms"] == pytest.approx(r.latency_ms)
    assert again.predicted["cost"] == pytest.approx(2.0)
    assert again.slo_ms == 1000 and again.slack == 0.2


# ---------------------------------------------------------------- errors

def test_unknown_device_is_a_clear_error():
    lat = make_profile(2, {"cpu": (1.0, 0.1, 1.0)})
    with pytest.raises(PlannerError, match="v100.*profile.*cpu"):
        best_plan(lat, make_batch([1.0, 0.5]), {"v100": 2}, PlanOptions(slo_ms=100, rate_rps=10))


def test_impossible_slo_is_a_clear_error():
    lat = make_profile(2, {"cpu": (50.0, 1.0, 1.0)})
    with pytest.raises(PlannerError, match="no plan meets latency"):
        best_plan(lat, make_batch([1.0, 0.5]), {"cpu": 2}, PlanOptions(slo_ms=20, rate_rps=10, alpha=None))


def test_mismatched_batch_profile_is_rejected():
    lat = make_profile(3, {"cpu": (1.0, 0.1, 1.0)})
    with pytest.raises(PlannerError, match="same model"):
        best_plan(lat, make_batch([1.0, 0.5]), {"cpu": 2}, PlanOptions(slo_ms=100, rate_rps=10))


def test_parse_forms():
    assert parse_forms("compact, constant") == (CONSTANT, COMPACT)   # always in FORMS order
    assert parse_forms(["constant"]) == (CONSTANT,)
    for bad in ("", "gpu", "constant,fast"):
        with pytest.raises(PlannerError, match="split forms"):
            parse_forms(bad)


def test_parse_devices():
    assert parse_devices("v100:6, t4:8,K80:15") == {"v100": 6, "t4": 8, "k80": 15}
    for bad in ("v100", "v100:x", ":3", "", "a:-1"):
        with pytest.raises(PlannerError):
            parse_devices(bad)


def test_e3_plan_cli_prints_and_writes_a_valid_plan(tmp_path, capsys):
    from e3.cli import main
    from e3.core.plan import Plan
    make_profile(4, {"cpu": (1.0, 0.1, 1.0)}).save(tmp_path / "p.json")
    make_batch([1.0, 0.5, 0.3, 0.2]).save(tmp_path / "x.json")
    base = ["plan", "--profile", str(tmp_path / "p.json"), "--exits", str(tmp_path / "x.json"),
            "--slo-ms", "500", "--rate-rps", "50", "--devices", "cpu:2"]
    assert main([*base, "--model", "tiny-ee", "--out", str(tmp_path / "plan.json")]) == 0
    out = capsys.readouterr().out
    assert "predicted throughput" in out and "worst-case latency" in out
    plan = Plan.from_json((tmp_path / "plan.json").read_text())
    assert plan.exit_rule["kind"] == "entropy" and plan.exit_rule["tau_nats"] > 0  # tiny-ee's own τ
    assert all(s.form in FORMS for s in plan.splits) and "exit-wrapper" in out
    assert main([*base, "--alpha", "none", "--forms", "constant", "--out", str(tmp_path / "c.json")]) == 0
    out = capsys.readouterr().out
    assert {s.form for s in Plan.from_json((tmp_path / "c.json").read_text()).splits} == {CONSTANT}
    assert " constant " in out and " compact " not in out
    assert main([*base, "--no-exit-wrapper"]) == 0
    assert "exit-wrapper" not in capsys.readouterr().out
    assert main([*base, "--forms", "fast"]) == 2
    assert "split forms are some of constant,compact" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*base, "--alpha", "cheap"])
    assert main([*base[:-1], "gpu:2"]) == 2  # a device the profile does not have: a clear error
    assert "not in the latency profile" in capsys.readouterr().err
