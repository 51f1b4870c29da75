"""ExeGPT's pure core: profile and length distributions, the RRA/WAA simulator, branch-and-bound against the
exhaustive grid. No server, no torch; well under 10 s."""

from __future__ import annotations

import math
import random

import pytest

from e3.generation.exegpt.search import (Variable, SearchSpace, branch_and_bound, grid_search, plan, rra_space,
                                         waa_space)
from e3.generation.exegpt.simulator import (Prediction, Workload, simulate, simulate_rra, simulate_waa,
                                            waa_allocation)
from e3.generation.exegpt.workload import LayerProfile, LengthDistribution


def make_profile(layers: int = 30, decode_base_ms: float = 0.3, decode_per_row_ms: float = 0.01,
                 prefill_base_ms: float = 0.3, prefill_per_token_ms: float = 0.005,
                 overhead_ms: float = 0.0) -> LayerProfile:
    """A linear per-layer profile (what the CPU measurements look like: a fixed cost per call plus a slope)."""
    tokens, batch = [1, 64, 1024], [1, 16, 256]
    return LayerProfile.from_dict({
        "num_layers": layers,
        "prefill": {"tokens": tokens, "ms": [prefill_base_ms + prefill_per_token_ms * t for t in tokens]},
        "decode": {"batch": batch, "ms": [decode_base_ms + decode_per_row_ms * b for b in batch]},
        "overhead_ms": overhead_ms})


def make_workload(workers: int = 4, profile: LayerProfile | None = None,
                  out_lengths: range = range(8, 129, 4), prompt: int = 30) -> Workload:
    return Workload(profile or make_profile(), LengthDistribution.fixed(prompt),
                    LengthDistribution.from_samples(list(out_lengths)), workers=workers)


# --- workload ----------------------------------------------------------------------------------------------

def test_profile_interpolates_and_extrapolates_linearly():
    p = make_profile()
    assert p.decode_layer_ms(16) == pytest.approx(0.3 + 0.16)
    assert p.decode_layer_ms(8) == pytest.approx(0.3 + 0.08)
    assert p.decode_layer_ms(512) == pytest.approx(0.3 + 5.12)     # past the last point: same slope
    assert p.decode_layer_ms(0) == 0.0
    assert LayerProfile.from_dict(p.to_dict()) == p


def test_fitted_profile_is_a_nonnegative_line_through_noisy_points():
    p = LayerProfile.from_dict({"num_layers": 2, "prefill": {"tokens": [1, 2], "ms": [1, 2]},
                                "decode": {"batch": [1, 2, 3, 4], "ms": [1.0, 5.0, 1.5, 2.5]},
                                "head": {"batch": [1, 2], "ms": [3.0, 1.0]}})
    f = p.fitted()
    assert f.decode_ms == pytest.approx((2.35, 2.45, 2.55, 2.65))     # slope 0.1, intercept 2.25
    assert f.head_ms == (2.0, 2.0)                                  # a falling fit is flattened: slope 0
    assert f.prefill_ms == pytest.approx((1.0, 2.0))


@pytest.mark.parametrize("bad, message", [
    ({}, "num_layers"),
    ({"num_layers": 2, "decode": {"batch": [1], "ms": [1]}}, "prefill"),
    ({"num_layers": 2, "prefill": {"tokens": [4, 2], "ms": [1, 2]}, "decode": {"batch": [1], "ms": [1]}},
     "strictly increasing"),
    ({"num_layers": 2, "prefill": {"tokens": [1], "ms": [-1]}, "decode": {"batch": [1], "ms": [1]}}, ">= 0"),
])
def test_bad_profile_is_named(bad, message):
    with pytest.raises(ValueError, match=message):
        LayerProfile.from_dict(bad)


def test_length_distribution_mean_and_p99():
    d = LengthDistribution.from_samples([1] * 98 + [50, 100])
    assert d.mean() == pytest.approx((98 + 150) / 100)
    assert d.quantile(0.99) == 50
    assert d.quantile(1.0) == 100
    with pytest.raises(ValueError, match=">= 1"):
        LengthDistribution.from_samples([0, 3])


# --- simulator: hand-computed cases -------------------------------------------------------------------------

def test_rra_by_hand_fixed_length():
    """Output length 5, N_D = 2, one worker: a query lives 3 phases, finishing at iteration 1 of the third."""
    p = make_profile(layers=2)
    w = Workload(p, LengthDistribution.fixed(10), LengthDistribution.fixed(5), workers=1)
    r = simulate_rra(w, batch_size=4, decode_iters=2)
    rows = 4 * 3                                             # 3 phases x 4 admitted per phase
    it1 = 2 * p.decode_layer_ms(rows)                         # everyone alive
    it2 = 2 * p.decode_layer_ms(rows - 4)                     # the 4 in their last phase left after iter 1
    enc = 2 * p.prefill_layer_ms(40)                          # (2*1-1)/1 * L * prefill(4 x 10 tokens)
    assert r.detail["decode_batch"] == pytest.approx(rows)
    assert r.throughput_seq_s == pytest.approx(4 / (enc + it1 + it2) * 1000)
    assert r.latency_ms == pytest.approx(3 * enc + 2 * (it1 + it2) + it1)


def test_the_final_head_is_paid_once_per_micro_batch():
    """RRA on 2 workers: 2 micro-batches per iteration, each reading the head on the last stage."""
    base = make_profile(layers=2)
    d = base.to_dict()
    d["head"] = {"batch": [1, 16], "ms": [1.0, 2.5]}
    p = LayerProfile.from_dict(d)
    w = lambda prof: Workload(prof, LengthDistribution.fixed(10), LengthDistribution.fixed(1), workers=2)
    a, b = simulate_rra(w(base), 8, 1), simulate_rra(w(p), 8, 1)
    # one encode (2 micro-batches of 4 prompts) and one decode iteration (2 micro-batches of 4 rows)
    assert b.detail["cycle_ms"] - a.detail["cycle_ms"] == pytest.approx(2 * p.head_call_ms(4) * 2)


def test_waa_by_hand():
    p = make_profile(layers=4)
    w = Workload(p, LengthDistribution.fixed(10), LengthDistribution.fixed(20), workers=4)
    n_enc, n_dec = waa_allocation(w, 2)
    assert (n_enc, n_dec) == (1, 3)   # encoding 20 tokens costs far less than decoding 40 rows
    r = simulate_waa(w, batch_size=2, micro_batches=3)
    stage = 4 * p.decode_layer_ms(40 / 3) / 3
    period = max(3 * stage, 4 * p.prefill_layer_ms(20))
    assert r.throughput_seq_s == pytest.approx(2 / period * 1000)
    assert r.latency_ms == pytest.approx(4 * p.prefill_layer_ms(20) + period + 20 * period)
    with pytest.raises(ValueError, match="at least 2 workers"):
        simulate_waa(Workload(p, w.input_lengths, w.output_lengths, workers=1), 2, 1)


def replay_rra(w: Workload, batch_size: int, decode_iters: int, cycles: int, seed: int) -> tuple[float, float]:
    """An oracle for the steady state: RRA run query by query with sampled output lengths.

    Returns (sequences/s, mean decode rows per iteration) over the second half of the run."""
    rng = random.Random(seed)
    p, n, out = w.profile, w.workers, w.output_lengths
    live: list[int] = []
    t = done = 0.0
    rows_sum = iters = 0
    tokens = batch_size * w.input_lengths.mean()
    for c in range(cycles):
        measuring = c >= cycles // 2
        live += rng.choices(out.lengths, out.probs, k=batch_size)
        t_cycle = (2 * n - 1) / n * p.num_layers * p.prefill_layer_ms(tokens / n)
        for _ in range(decode_iters):
            if measuring:
                rows_sum, iters = rows_sum + len(live), iters + 1
            t_cycle += p.num_layers * p.decode_layer_ms(len(live) / n) if live else 0.0
            live = [s - 1 for s in live]
            finished = sum(1 for s in live if s == 0)
            live = [s for s in live if s > 0]
            if measuring:
                done += finished
        if measuring:
            t += t_cycle
    return done / t * 1000, rows_sum / iters


@pytest.mark.parametrize("batch_size, decode_iters", [(4, 8), (16, 32), (8, 60)])
def test_rra_steady_state_matches_a_query_level_replay(batch_size, decode_iters):
    """The expected-value RRA model (Little's law for the decode batch, module doc) agrees with running the
    schedule query by query: throughput and mean decode batch within 3%."""
    w = make_workload(workers=2)
    pred = simulate_rra(w, batch_size, decode_iters)
    thr, mean_rows = replay_rra(w, batch_size, decode_iters, cycles=1500, seed=1)
    assert thr == pytest.approx(pred.throughput_seq_s, rel=0.03)
    # the model's mean rows per iteration: rows at phase start minus those already finished
    out, nd = w.output_lengths, decode_iters
    p_last = [0.0] * (nd + 1)
    for s, pr in zip(out.lengths, out.probs):
        p_last[1 + (s - 1) % nd] += pr
    rows0 = pred.detail["decode_batch"]
    model_rows = sum(rows0 - batch_size * sum(p_last[1:u]) for u in range(1, nd + 1)) / nd
    assert mean_rows == pytest.approx(model_rows, rel=0.03)


def test_the_variables_move_throughput_and_latency_as_declared():
    """The monotonicity branch-and-bound relies on (the paper's Table 5 analogue): along each variable, with
    the others fixed, at least 95% of steps move throughput and latency the declared way (5% tolerance)."""
    w = make_workload(workers=4)
    spaces = [rra_space(tuple(range(1, 41, 3)), tuple(range(1, 130, 8))), waa_space(tuple(range(1, 41, 3)), 3)]
    for space in spaces:
        grid = {(a, b): simulate(w, space.schedule, (a, b))
                for a in space.variables[0].values for b in space.variables[1].values}
        for k, var in enumerate(space.variables):
            good = total = 0
            for (a, b), p in grid.items():
                nxt = list((a, b))
                vals = var.values
                i = vals.index(nxt[k])
                if i + 1 == len(vals):
                    continue
                nxt[k] = vals[i + 1]
                q = grid[tuple(nxt)]
                thr_ok = (q.throughput_seq_s - p.throughput_seq_s) * var.throughput_dir >= -0.05 * p.throughput_seq_s
                lat_ok = (q.latency_ms - p.latency_ms) * var.latency_dir >= -0.05 * p.latency_ms
                good += thr_ok and lat_ok
                total += 1
            assert good / total >= 0.95, (space.schedule, var.name, good, total)


# --- branch-and-bound against the grid ----------------------------------------------------------------------

BOUNDS_MS = (1300, 1600, 2500, 4000, 8000, 20000, math.inf)


@pytest.mark.parametrize("workers", [1, 2, 4])
def test_branch_and_bound_finds_the_grid_optimum_with_fewer_evaluations(workers):
    """On every bound, B&B's schedule has the grid's throughput (tolerance: 0.1%, i.e. the same point or a tie)
    and needed far fewer simulations."""
    w = make_workload(workers=workers, profile=make_profile(overhead_ms=2.0))
    spaces = [rra_space(tuple(range(1, 49)), tuple(range(1, 97)))]
    if workers >= 2:
        spaces.append(waa_space(tuple(range(1, 49)), workers - 1))
    for space in spaces:
        memo: dict[tuple, Prediction] = {}     # the grid's points are simulated once for all bounds

        def evaluate(config, space=space, memo=memo):
            if config not in memo:
                memo[config] = simulate(w, space.schedule, config)
            return memo[config]

        for bound in BOUNDS_MS:
            g = grid_search(w, space, bound, evaluate=evaluate)
            b = branch_and_bound(w, space, bound, evaluate=evaluate)
            assert (g.best is None) == (b.best is None), (space.schedule, bound)
            if g.best is None:
                continue
            assert b.best.meets(bound)
            assert b.best.throughput_seq_s == pytest.approx(g.best.throughput_seq_s, rel=1e-3), \
                (space.schedule, bound, g.best.config, b.best.config)
            assert g.evaluations == space.size()
            if space.size() > 100:
                assert b.evaluations < g.evaluations / 4, (space.schedule, bound, b.evaluations)


def test_an_impossible_bound_has_no_schedule():
    w = make_workload(workers=2)
    r = plan(w, 1.0, tuple(range(1, 9)), decode_iters=tuple(range(1, 9)))
    assert r["best"].best is None and r["rra"].best is None and r["waa"].best is None


def test_plan_takes_the_faster_schedule_and_relaxing_the_bound_never_lowers_throughput():
    w = make_workload(workers=4)
    last = 0.0
    for bound in BOUNDS_MS[1:]:
        r = plan(w, bound, tuple(range(1, 33)), decode_iters=tuple(range(1, 65)))
        best = r["best"].best
        assert best is not None and best.meets(bound)
        assert best.throughput_seq_s == max(x.best.throughput_seq_s for k, x in r.items()
                                             if k != "best" and x.best is not None)
        assert best.throughput_seq_s >= last
        last = best.throughput_seq_s


def test_latency_tolerance_recovers_an_optimum_hidden_by_a_non_monotonic_dip():
    """Latency monotonic except for one cell far below its neighbours (the paper's reason for tolerances):
    with zero tolerance B&B drops the blocks whose latency bound is over the limit and misses it; with a
    latency tolerance wide enough it finds the grid's answer, at the price of more evaluations."""
    space = SearchSpace("rra", (Variable("x", tuple(range(16)), 1, 1), Variable("y", tuple(range(16)), 1, 1)))

    def f(config):
        x, y = config
        latency = 2.0 if (x, y) == (6, 6) else float(x + y)
        return Prediction("rra", config, float(x + y), float(x + y), latency)

    bound = 8.0
    g = grid_search(None, space, bound, evaluate=f)
    assert g.best.config == (6, 6)
    strict = branch_and_bound(None, space, bound, evaluate=f)
    assert strict.best.throughput_seq_s == 8.0          # a point on the monotonic frontier
    loose = branch_and_bound(None, space, bound, latency_tol=0.3, evaluate=f)
    assert loose.best.config == (6, 6)
    assert max(strict.evaluations, loose.evaluations) < g.evaluations


def test_bad_arguments_are_named():
    w = make_workload()
    with pytest.raises(ValueError, match="unknown schedule"):
        simulate(w, "orca", (1, 1))
    with pytest.raises(ValueError, match="decode_iters"):
        simulate_rra(w, 4, 0)
    with pytest.raises(ValueError, match="unknown method"):
        plan(w, 10.0, (1,), decode_iters=(1,), method="bayes")
    with pytest.raises(ValueError, match="strictly increasing"):
        Variable("b", (2, 1), 1, 1)


def test_the_scheduler_imports_without_torch_or_numpy():
    """The deciding modules stay light (STYLE): the scheduler loads in milliseconds wherever it runs."""
    import subprocess
    import sys
    code = ("import sys, e3.generation.exegpt.search, e3.generation.exegpt.simulator\n"
            "print(' '.join(m for m in ('torch', 'numpy', 'onnxruntime') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""
