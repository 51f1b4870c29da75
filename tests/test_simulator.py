"""The discrete-event simulator (no server): exact where the answer is known in closed form, the real
scheduler's rules where it is not, and the validation table's arithmetic."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from e3.core import cost
from e3.core.plan import COMPACT, default_plan

from e3.serving.batcher import TritonBatcher
from e3.simulator.des import Arrivals, Baseline, CallCosts, next_enabled_exit, simulate_baseline, simulate_plan
from e3.simulator.load import with_host_share
from e3.benchmarks.report import validation_table, within_both
from e3.benchmarks.sim_validation import GOODPUT_TOLERANCE, P99_TOLERANCE, ValidationRow, parse_baseline_config
from helpers import synthetic_profile

L = 4
RULE = {"kind": "entropy", "tau_nats": 0.5}


def _exits(n=400, easy=0.8, seed=0):
    """Reference exit blocks: ``easy`` of the inputs leave at ramp 1, the rest at the head."""
    rng = np.random.default_rng(seed)
    return np.where(rng.random(n) < easy, 1, L)


def test_next_enabled_exit_moves_an_input_to_the_next_ramp_that_runs():
    assert next_enabled_exit(np.array([1, 2, 3, 4]), [2], 4).tolist() == [2, 2, 4, 4]
    assert next_enabled_exit(np.array([1, 3]), [], 4).tolist() == [4, 4]


def test_one_client_on_the_stock_model_runs_at_the_profiles_rate_exactly():
    lat = synthetic_profile()
    arrivals = Arrivals(batch=4, requests=50, clients=1, warmup=0, client_ms=0.0)
    result = simulate_baseline(lat, Baseline("stock", instances=1), _exits(), arrivals=arrivals)
    per_request_ms = lat.tx("cpu", 4) + sum(lat.block(k, "cpu", 4, with_ramp=False) for k in range(1, L + 1))
    assert result.p50_ms == pytest.approx(per_request_ms)
    assert result.inputs_per_s == pytest.approx(4 / (per_request_ms / 1e3), rel=1e-6)


def test_naive_early_exit_beats_stock_on_easy_inputs_and_not_on_hard_ones():
    lat = synthetic_profile()
    arrivals = Arrivals(batch=8, requests=200, clients=8)
    easy, hard = _exits(easy=0.8), _exits(easy=0.0)
    # batches of up to 64 rows (preferred 64), where the profile's per-call cost no longer dominates
    stock = simulate_baseline(lat, Baseline("stock", preferred=64), easy, arrivals=arrivals).inputs_per_s
    assert simulate_baseline(lat, Baseline("ee", preferred=64), easy, arrivals=arrivals).inputs_per_s > 1.5 * stock
    assert simulate_baseline(lat, Baseline("ee", preferred=64), hard, arrivals=arrivals).inputs_per_s < stock   # ramps cost, none exits


def test_a_saturated_constant_plan_runs_the_plans_batch_at_every_split_and_answers_everything():
    lat = synthetic_profile()
    plan = default_plan("tiny_ee", L, [(1, 1), (2, 4)], exit_rule=RULE, ramp_blocks=(1, 2, 3), batch_size=8, slo_ms=60_000)
    result = simulate_plan(lat, plan, _exits(easy=0.5), arrivals=Arrivals(batch=4, requests=300, clients=16))
    assert result.answered_inputs == 300 * 4 and result.dropped_inputs == 0
    survivors = np.array(result.batches[1])                  # half of every batch of split 1 goes on
    assert np.mean(survivors == 8) >= 0.9, np.bincount(survivors)   # merged into the plan's batch


def test_compact_plans_run_in_several_router_instances_and_shrink_inside():
    lat = synthetic_profile()
    # the plan's batch as large as the baseline's largest, so that both amortise the per-call cost alike
    plan = default_plan("tiny_ee", L, [(1, 4)], exit_rule=RULE, ramp_blocks=(1, 2, 3), batch_size=64, instances=2, slo_ms=60_000)
    plan = dataclasses.replace(plan, splits=(dataclasses.replace(plan.splits[0], form=COMPACT),))
    assert plan.router_instances == 2
    arrivals = Arrivals(batch=8, requests=200, clients=8)
    compact = simulate_plan(lat, plan, _exits(easy=0.8), arrivals=arrivals)
    ee = simulate_baseline(lat, Baseline("ee", delay_us=plan.router_queue_delay_us, preferred=64), _exits(easy=0.8),
                           arrivals=arrivals)   # the same wait in Triton's queue as the router instances get
    assert compact.answered_inputs == 1600
    assert compact.inputs_per_s == pytest.approx(ee.inputs_per_s, rel=0.15)   # the same work, the router's on top


def test_an_slo_the_plan_cannot_meet_drops_only_late_requests_and_counts_them():
    lat = synthetic_profile()
    plan = default_plan("tiny_ee", L, [(1, 1), (2, 4)], exit_rule=RULE, ramp_blocks=(1, 2, 3), batch_size=8, slo_ms=40)
    result = simulate_plan(lat, plan, _exits(easy=0.5), arrivals=Arrivals(batch=4, requests=300, clients=32))
    assert result.dropped_inputs > 0
    assert result.dropped_inputs + result.answered_inputs == 300 * 4
    assert len(result.drop_waited_ms) * 4 == result.dropped_inputs
    # Only late ones: a request is dropped when even its current split would end after the SLO, so it had
    # waited at least the SLO less one split's time. Bound that time by twice the slowest split at the plan's
    # batch with its hop (the scheduler learns it online); a request dropped with more time left was not late.
    slowest = max(s.stage_ms + s.tx_ms for s in (cost.stage_cost(lat, np.ones(L), sp.batch_size, first=sp.first_block,
                                                                  last=sp.last_block, device="cpu", instances=sp.instances)
                                                  for sp in plan.splits))
    assert 0 < slowest < plan.slo_ms / 2
    early = [round(w, 1) for w in result.drop_waited_ms if w < plan.slo_ms - 2 * slowest]
    assert not early, f"dropped after only {early} ms of a {plan.slo_ms:g} ms SLO (a split takes <= {slowest:.1f} ms)"


def test_the_validation_table_marks_settings_outside_the_bar():
    rows = [ValidationRow("a", 105.0, 100.0, 110.0, 100.0), ValidationRow("b", 120.0, 100.0, 100.0, 100.0)]
    assert rows[0].goodput_error == pytest.approx(0.05) and rows[1].goodput_error == pytest.approx(0.2)
    table = [r.to_dict() for r in rows]
    text = validation_table(table, GOODPUT_TOLERANCE, P99_TOLERANCE)
    assert "| **+20.0%** |" in text and "| +5.0% |" in text
    assert within_both(table, GOODPUT_TOLERANCE, P99_TOLERANCE) == 1
    assert parse_baseline_config("ee", "2 inst x 1 thr, delay 2000 us") == Baseline("ee", 2, 1, 2000)
    with pytest.raises(ValueError, match="cannot read"):
        parse_baseline_config("ee", "two instances")


def _batcher(rows_per_request, *, delay_s=0.0, preferred=(8,), max_batch=64, instances=2, now=0.0):
    b = TritonBatcher(instances=instances, preferred=preferred, max_batch=max_batch, delay_s=delay_s)
    for i, n in enumerate(rows_per_request):
        b.enqueue(now, n, i)
    return b


def _first_batch(b, now=0.0):
    """Turn the batcher until it hands over a payload; an instance takes it (its requests' rows)."""
    while b.form(now) == 0 and not b.ready:
        pass
    taken = b.take(now)
    return None if taken is None else taken.rows


def test_the_batcher_cuts_at_the_preferred_batch_for_a_free_instance():
    # as this Triton's batch_stats show (preferred 8, max batch 64, no delay): requests of 4 ran as batches of
    # 8, requests of 8 as batches of 8, requests of 16 one at a time
    assert _first_batch(_batcher([4] * 16)) == 8
    assert _first_batch(_batcher([8] * 10)) == 8
    assert _first_batch(_batcher([16] * 4)) == 16                 # a larger request runs alone
    assert _first_batch(_batcher([1] * 5)) == 5                   # no delay: all that wait, at once
    assert _first_batch(_batcher([1] * 12)) == 8
    assert _first_batch(_batcher([30, 30, 30], preferred=())) == 60   # no preferred size: up to the max batch


def test_with_a_delay_the_batcher_waits_for_a_preferred_batch_or_the_delay():
    b = _batcher([1] * 3, delay_s=0.002)
    assert b.form(0.0) == pytest.approx(0.002) and not b.ready     # the oldest has 2 ms to go
    assert not b.enqueue(0.001, 1, "late")                         # under the next preferred size: no wake-up
    assert _first_batch(b, now=0.002) == 4                         # the delay out: all that wait
    assert _first_batch(_batcher([1] * 8, delay_s=0.002)) == 8     # a preferred batch goes at once


def test_once_the_delay_is_exceeded_the_batcher_takes_up_to_the_max_batch():
    # Triton sends everything pending once the oldest request waited the delay out (E3's router, preferred
    # 32, delay 2 ms, both instances busy: batches of 40-64 rows measured)
    assert _first_batch(_batcher([4] * 20, delay_s=0.002, preferred=(32,)), now=0.005) == 64
    assert _first_batch(_batcher([4] * 20, delay_s=0.002, preferred=(32,))) == 32   # in time: the preferred


def test_a_payload_grows_while_no_instance_has_taken_it_and_waiting_ones_merge():
    # Triton's payloads (prefetching: no queue policy): handed over at once, still growing until an instance
    # takes them; measured with a 2 ms delay and requests of 1: batches of 1 to 15 inputs
    b = _batcher([1] * 3, delay_s=0.002)
    assert b.form(0.002) == 0 and b.ready and b.payload.rows == 3
    b.enqueue(0.003, 2, "more")
    assert b.form(0.003) == 0 and b.payload.rows == 5 and len(b.ready) == 1   # joined the waiting payload
    b.enqueue(0.0031, 4, "over")                                   # past the preferred 8: saturates it
    while b.form(0.0031) == 0 and b.queue:
        pass
    assert b.ready[0].rows == 9 and b.saturated
    # at a preferred size with a delay a payload is not saturated yet: the next request joins it and saturates
    # it (Triton's batches of 9 behind a preferred 8); a payload started more than the delay before an instance
    # takes the one ahead of it is merged into that one, within the max batch
    m = TritonBatcher(instances=1, preferred=(8,), max_batch=64, delay_s=0.002)
    for i in range(9):
        m.enqueue(0.0, 1, i)
    while m.form(0.0) == 0 and m.queue:
        pass
    assert [p.rows for p in m.ready] == [9]
    for i in range(7):
        m.enqueue(0.001, 1, i)
    assert m.form(0.001) == pytest.approx(0.002) and m.form(0.0031) == 0
    assert [p.rows for p in m.ready] == [9, 7]
    assert m.take(0.0101).rows == 16 and not m.ready
    # no delay: never merged, and at most 2 x instances payloads wait for an instance
    n = _batcher([8] * 10, instances=1)
    while n.form(0.0) == 0:
        pass
    assert [p.rows for p in n.ready] == [8, 8] and len(n.queue) == 8
    assert n.take(1.0).rows == 8


def test_the_stock_baseline_runs_the_profiles_one_graph_and_the_measured_second_thread():
    lat = synthetic_profile()
    B = lat.batch_sizes
    lat.stock_ms = {"cpu": [10.0 * b for b in B]}
    lat.stock_2t_ms = {"cpu": [10.0 * b / 1.6 for b in B]}   # the second thread: 1.6x at every batch
    arrivals = Arrivals(batch=4, requests=50, clients=1, warmup=0, client_ms=0.0)
    one = simulate_baseline(lat, Baseline("stock", instances=1), _exits(), arrivals=arrivals)
    assert one.p50_ms == pytest.approx(lat.tx("cpu", 4) + 40.0)
    two = simulate_baseline(lat, Baseline("stock", instances=1, threads=2), _exits(), arrivals=arrivals)
    assert two.p50_ms == pytest.approx(lat.tx("cpu", 4) + 40.0 / 1.6)


def test_a_compact_split_whose_rule_composes_is_priced_as_naive_ees_one_graph():
    """The router composes a compact split of an entropy rule into one graph, the code ``<m>_ee`` runs: each
    block at the profile's one-graph share of its own call (served in turns, the two spent the same CPU per
    input, 2026-11-28); a rule that does not compose (patience) runs block by block and is priced so."""
    lat = synthetic_profile()
    B = lat.batch_sizes
    blocks = [sum(lat.block(k, "cpu", b, with_ramp=False) for k in range(1, L + 1)) for b in B]
    lat.stock_ms = {"cpu": [0.8 * x for x in blocks]}     # one graph: 0.8 of its blocks' calls at every batch
    arrivals = Arrivals(batch=16, requests=40, clients=1, warmup=0, client_ms=0.0)
    hard = _exits(easy=0.0)                                 # every row runs every block at 16 rows

    def compact(rule):
        plan = default_plan("tiny_ee", L, [(1, 4)], exit_rule=rule, ramp_blocks=(1, 2, 3), batch_size=16,
                            instances=1, slo_ms=60_000)
        plan = dataclasses.replace(plan, splits=(dataclasses.replace(plan.splits[0], form=COMPACT),))
        return simulate_plan(lat, plan, hard, arrivals=arrivals, costs=CallCosts(service_cv=0.0)).p50_ms

    ramps_blocks = sum(lat.block(k, "cpu", 16, with_ramp=k < L) for k in range(1, L + 1))
    composed, by_block = compact(RULE), compact({"kind": "patience", "patience": 2})
    assert by_block - composed == pytest.approx(0.2 * ramps_blocks, rel=1e-6)
    ee = simulate_baseline(lat, Baseline("ee", instances=1), hard, arrivals=arrivals,
                           costs=CallCosts(service_cv=0.0)).p50_ms
    # the same graph; naive EE's call carries its inputs (the hop), the router's work is its own
    assert ee - lat.tx("cpu", 16) == pytest.approx(composed - lat.router("cpu", 16), rel=1e-6)


def test_the_load_generators_cpu_runs_one_request_at_a_time():
    lat = synthetic_profile()
    arrivals = Arrivals(batch=1, requests=400, clients=16, client_ms=0.0, client_cpu_ms=2.0)
    result = simulate_baseline(lat, Baseline("ee", instances=2), _exits(easy=1.0), arrivals=arrivals)
    assert result.inputs_per_s == pytest.approx(1000 / 2.0, rel=0.05)   # bound by the one GIL: 500 requests/s


def test_host_share_is_the_fixed_point_of_the_request_rate_times_its_cpu():
    lat = synthetic_profile()
    arrivals = Arrivals(batch=1, requests=300, clients=16)
    run = lambda p: simulate_baseline(p, Baseline("ee", instances=2), _exits(), arrivals=arrivals)  # noqa: E731
    plain = run(lat)
    lat.request_ms = {"cpu": [0.5] * len(lat.batch_sizes)}
    result, host = with_host_share(run, lat, batch=1, cores=2)
    assert host.converged and 0 < host.share < 0.9
    assert host.share == pytest.approx(result.inputs_per_s * 0.5 / 1e3 / 2, abs=0.01)   # the share it implies
    assert result.inputs_per_s == pytest.approx(plain.inputs_per_s * (1 - host.share), rel=0.05)
    assert with_host_share(run, synthetic_profile(), batch=1, cores=2)[1].share == 0.0   # no curve: no share


def test_a_slowed_profile_stretches_every_compute_curve_and_not_the_hosts():
    lat = synthetic_profile()
    lat.router_ms = {"cpu": [1.0] * len(lat.batch_sizes)}
    lat.request_ms = {"cpu": [0.5] * len(lat.batch_sizes)}
    slow = lat.slowed(2.0)
    assert slow.block(2, "cpu", 8) == pytest.approx(2 * lat.block(2, "cpu", 8))
    assert slow.tx("cpu", 8) == pytest.approx(2 * lat.tx("cpu", 8))
    assert slow.router("cpu", 8) == pytest.approx(2.0) and slow.request("cpu", 8) == pytest.approx(0.5)
    assert lat.block(2, "cpu", 8) == synthetic_profile().block(2, "cpu", 8)   # the original is untouched
    with pytest.raises(ValueError, match=">= 1"):
        lat.slowed(0.5)


def test_a_profile_at_the_runs_measured_speed_scales_the_hosts_work_too():
    lat = synthetic_profile()
    lat.request_ms = {"cpu": [0.5] * len(lat.batch_sizes)}
    lat.client_ms = {"cpu": [0.2] * len(lat.batch_sizes)}
    fast = lat.at_speed(0.8)                        # the machine 20% faster than when it was profiled
    assert fast.block(2, "cpu", 8) == pytest.approx(0.8 * lat.block(2, "cpu", 8))
    assert fast.request("cpu", 8) == pytest.approx(0.4) and fast.client("cpu", 8) == pytest.approx(0.16)
    with pytest.raises(ValueError, match="> 0"):
        lat.at_speed(0.0)


def test_validation_reads_the_machines_speed_from_the_other_baselines_executions_and_reports_the_cell_at_it():
    from e3.benchmarks.sim_validation import execution_speed, validate_side_by_side
    from e3.simulator.des import baseline_execution_ms
    lat = synthetic_profile()
    lat.stock_ms = {"cpu": [10.0 * b for b in lat.batch_sizes]}
    cell = {"mix": "80:20", "batch": 4}
    stock = {**cell, "system": "stock", "config": "1 inst x 1 thr, delay 0 us", "inputs_per_s": 100.0,
             "p99_ms": 100.0, "p50_ms": 50.0}
    ee = {**cell, "system": "ee", "config": "2 inst x 1 thr, delay 0 us", "inputs_per_s": 200.0,
          "p99_ms": 60.0, "p50_ms": 30.0}
    doc = {"settings": {"concurrency": 4, "inputs_per_run": 200}, "cores": 2, "rows": [stock, ee], "executed": []}
    assert execution_speed(doc, stock, lat, _exits()) == 1.0        # nothing recorded: the profile as it is
    # naive EE's executions of 8 rows (two requests of 4) took twice their price, the stock model's its price
    price = baseline_execution_ms(lat, Baseline("stock", 1), np.full(8, L), requests=2)
    doc["executed"] = [{**cell, "system": "ee", "config": ee["config"], "batches": {
                           "8": [10, 2 * baseline_execution_ms(lat, Baseline("ee", 2), np.full(8, L), requests=2)]}},
                       {**cell, "system": "stock", "config": stock["config"], "batches": {"8": [5, price]}}]
    hard = np.full(400, L)                                          # every row to the head: EE's price is exact
    assert execution_speed(doc, stock, lat, hard) == pytest.approx(2.0)   # the other baseline's, not its own
    assert execution_speed(doc, ee, lat, hard) == pytest.approx(1.0)
    plain = validate_side_by_side(doc, lat, {"80:20": hard}, groups=("rows",), seeds=1, at_speed=False)
    both = validate_side_by_side(doc, lat, {"80:20": hard}, groups=("rows",), seeds=1)
    assert both[0].speed_factor == pytest.approx(2.0) and plain[0].speed_factor == pytest.approx(2.0)
    assert both[0].predicted_goodput == pytest.approx(plain[0].predicted_goodput)   # the bar: the profile as is
    assert both[0].at_speed_goodput == pytest.approx(plain[0].predicted_goodput / 2, rel=0.1)   # beside it
    assert both[0].to_dict()["at_speed_goodput_error"] == pytest.approx(
        both[0].at_speed_goodput / both[0].measured_goodput - 1, abs=1e-4)
    assert np.isnan(plain[0].at_speed_goodput)
    assert np.isnan(both[1].at_speed_goodput)                       # EE's cell ran at the profile's speed


def test_the_p99_interval_holds_the_p99_and_narrows_with_more_requests():
    from e3.client.loadgen import percentile_interval_ms
    rng = np.random.default_rng(1)
    few, many = rng.exponential(50.0, 100), rng.exponential(50.0, 5000)
    low, high = percentile_interval_ms(few, 99)
    assert low <= np.percentile(few, 99) <= high
    low2, high2 = percentile_interval_ms(many, 99)
    assert high2 - low2 < (high - low) / 2
    assert all(np.isnan(percentile_interval_ms([5.0], 99)))   # one request: no interval


def test_jitter_spreads_a_closed_loops_latencies_and_keeps_its_rate():
    lat = synthetic_profile()
    arrivals = Arrivals(batch=8, requests=400, clients=16, client_ms=0.0)
    base = Baseline("stock", instances=2, max_batch=8)
    steady = simulate_baseline(lat, base, _exits(), arrivals=arrivals)
    assert steady.p99_ms == pytest.approx(steady.p50_ms)          # one request per batch: all alike
    lat.jitter_cv = {"cpu": [0.3] * len(lat.batch_sizes)}          # the profile's measured CV
    jittered = simulate_baseline(lat, base, _exits(), arrivals=arrivals)
    assert jittered.p99_ms > 1.1 * jittered.p50_ms
    assert jittered.inputs_per_s == pytest.approx(steady.inputs_per_s, rel=0.05)
    off = simulate_baseline(lat, base, _exits(), arrivals=arrivals, costs=CallCosts(service_cv=0.0))   # overridden
    assert off.p99_ms == pytest.approx(off.p50_ms)
    with pytest.raises(ValueError, match="service_cv"):
        CallCosts(service_cv=-0.1)


def test_the_machines_two_speeds_scaled_over_a_run_keep_its_level_and_widen_its_tail():
    """Simulator/speed.py: spells of a slow level 1.35x the fast one; each path scaled to a mean of 1 over the
    run keeps the run's rate at the profile's level while the requests that meet a slow spell make its tail."""
    from e3.simulator.speed import TwoSpeeds
    speeds = TwoSpeeds(ratio=1.35, fast_spell_s=8.5, slow_spell_s=3.0)
    fast, slow = speeds.levels()
    assert slow == pytest.approx(1.35 * fast) and speeds.slow_share == pytest.approx(3.0 / 11.5)
    assert (1 - speeds.slow_share) * fast + speeds.slow_share * slow == pytest.approx(1.0)
    scaled = dataclasses.replace(speeds, horizon_s=4.0)
    for seed in range(5):
        path = scaled.path(seed)
        grid = np.linspace(0, 4.0, 40_001)[:-1]
        assert np.mean([path(t) for t in grid[::50]]) == pytest.approx(1.0, abs=0.02)   # its mean over the run
        assert {round(path(t) / path.scale, 6) for t in grid[::50]} <= {round(fast, 6), round(slow, 6)}
    lat = synthetic_profile()
    arrivals = Arrivals(batch=8, requests=400, clients=16, client_ms=0.0)
    base = Baseline("stock", instances=2, max_batch=8)
    one = simulate_baseline(lat, base, _exits(), arrivals=arrivals)
    tails, rates = [], []
    for seed in range(8):
        run = simulate_baseline(lat, base, _exits(), arrivals=arrivals, costs=CallCosts(
            service_seed=seed, speed=dataclasses.replace(speeds, fast_spell_s=0.2, slow_spell_s=0.1,
                                                         horizon_s=one.duration_s)))
        tails.append(run.p99_ms / run.p50_ms)
        rates.append(run.inputs_per_s)
    assert one.p99_ms == pytest.approx(one.p50_ms)            # one speed, no jitter: every request alike
    assert np.median(tails) > 1.05                            # the slow spells make a tail
    assert np.median(rates) == pytest.approx(one.inputs_per_s, rel=0.06)   # at the profile's level
    with pytest.raises(ValueError, match="ratio"):
        TwoSpeeds(ratio=0.9, fast_spell_s=1.0, slow_spell_s=1.0)
    with pytest.raises(ValueError, match="machine-speed"):
        TwoSpeeds.from_trace({"readings": []})
    trace = {"spells": {"fast_ms": 74.6, "slow_ms": 100.7, "fast_spells_s": [2.0, 4.0], "slow_spells_s": [1.0]}}
    got = TwoSpeeds.from_trace(trace)
    assert (got.ratio, got.fast_spell_s, got.slow_spell_s) == (pytest.approx(100.7 / 74.6), 3.0, 1.0)
    trace["spells"]["slow_spells_s"] = []
    assert TwoSpeeds.from_trace(trace).ratio == 1.0


def test_e3_bench_simulator_refuses_a_speed_trace_it_cannot_read(tmp_path, capsys):
    from e3.cli import main
    assert main(["bench", "simulator", "--speed", str(tmp_path / "missing.json")]) == 2
    assert "e3 bench machine-speed" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text('{"readings": []}')
    assert main(["bench", "simulator", "--speed", str(bad)]) == 2
    assert "not a trace" in capsys.readouterr().err


def test_the_validation_scales_each_seeds_spells_over_its_own_run():
    """`e3 bench simulator --speed`: spells far longer than a run put the whole run in one of the two levels;
    scaled over the run (``_simulated``), the rate stays the profile's, the tail only may move."""
    from e3.benchmarks.sim_validation import validate_side_by_side
    from e3.simulator.speed import TwoSpeeds
    lat = synthetic_profile()
    row = {"mix": "80:20", "batch": 4, "system": "stock", "config": "2 inst x 1 thr, delay 0 us",
           "inputs_per_s": 100.0, "p99_ms": 100.0, "p50_ms": 50.0}
    doc = {"settings": {"concurrency": 8, "inputs_per_run": 400}, "cores": 2, "rows": [row], "executed": []}
    plain = validate_side_by_side(doc, lat, {"80:20": _exits()}, groups=("rows",), seeds=5)[0]
    long_spells = TwoSpeeds(ratio=1.5, fast_spell_s=1000.0, slow_spell_s=1000.0)
    spelled = validate_side_by_side(doc, lat, {"80:20": _exits()}, groups=("rows",), seeds=5, spells=long_spells)[0]
    assert spelled.predicted_goodput == pytest.approx(plain.predicted_goodput, rel=0.01)
    # unscaled, each seed's run would sit wholly in the fast (0.8) or the slow (1.2) level: its rate 25% or 17% off
    fast, slow = long_spells.levels()
    assert (fast, slow) == (pytest.approx(0.8), pytest.approx(1.2))
