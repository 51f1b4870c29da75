"""The discrete-event simulator (no server): exact where the answer is known in closed form, the real
scheduler's rules where it is not, and the validation table's arithmetic."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from e3.core.plan import COMPACT, default_plan
from e3.simulator.des import Arrivals, Baseline, next_enabled_exit, simulate_baseline, simulate_plan
from e3.simulator.validate import ValidationRow, format_validation, parse_baseline_config
from test_controller import synthetic_profile

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
    result = simulate_baseline(lat, Baseline("stock", instances=1), _exits(), arrivals)
    per_request_ms = lat.tx("cpu", 4) + sum(lat.block(k, "cpu", 4, with_ramp=False) for k in range(1, L + 1))
    assert result.p50_ms == pytest.approx(per_request_ms)
    assert result.inputs_per_s == pytest.approx(4 / (per_request_ms / 1e3), rel=1e-6)


def test_naive_early_exit_beats_stock_on_easy_inputs_and_not_on_hard_ones():
    lat = synthetic_profile()
    arrivals = Arrivals(batch=8, requests=200, clients=8)
    easy, hard = _exits(easy=0.8), _exits(easy=0.0)
    stock = simulate_baseline(lat, Baseline("stock"), easy, arrivals).inputs_per_s
    assert simulate_baseline(lat, Baseline("ee"), easy, arrivals).inputs_per_s > 1.5 * stock
    assert simulate_baseline(lat, Baseline("ee"), hard, arrivals).inputs_per_s < stock   # ramps cost, none exits


def test_a_saturated_constant_plan_runs_the_plans_batch_at_every_split_and_answers_everything():
    lat = synthetic_profile()
    plan = default_plan("tiny_ee", L, [(1, 1), (2, 4)], RULE, (1, 2, 3), batch_size=8, slo_ms=60_000)
    result = simulate_plan(lat, plan, _exits(easy=0.5), Arrivals(batch=4, requests=300, clients=16))
    assert result.answered_inputs == 300 * 4 and result.dropped_inputs == 0
    survivors = np.array(result.batches[1])                  # half of every batch of split 1 goes on
    assert np.mean(survivors == 8) >= 0.9, np.bincount(survivors)   # merged into the plan's batch


def test_compact_plans_run_in_several_router_instances_and_shrink_inside():
    lat = synthetic_profile()
    # the plan's batch as large as the baseline's largest, so that both amortise the per-call cost alike
    plan = default_plan("tiny_ee", L, [(1, 4)], RULE, (1, 2, 3), batch_size=64, instances=2, slo_ms=60_000)
    plan = dataclasses.replace(plan, splits=(dataclasses.replace(plan.splits[0], form=COMPACT),))
    assert plan.router_instances == 2
    arrivals = Arrivals(batch=8, requests=200, clients=8)
    compact = simulate_plan(lat, plan, _exits(easy=0.8), arrivals)
    ee = simulate_baseline(lat, Baseline("ee", delay_us=plan.router_queue_delay_us, preferred=64), _exits(easy=0.8),
                           arrivals)   # the same wait in Triton's queue as the router instances get
    assert compact.answered_inputs == 1600
    assert compact.inputs_per_s == pytest.approx(ee.inputs_per_s, rel=0.15)   # the same work, the router's on top


def test_an_slo_the_plan_cannot_meet_drops_only_late_requests_and_counts_them():
    lat = synthetic_profile()
    plan = default_plan("tiny_ee", L, [(1, 1), (2, 4)], RULE, (1, 2, 3), batch_size=8, slo_ms=40)
    result = simulate_plan(lat, plan, _exits(easy=0.5), Arrivals(batch=4, requests=300, clients=32))
    assert result.dropped_inputs > 0
    assert result.dropped_inputs + result.answered_inputs == 300 * 4


def test_the_validation_table_marks_settings_outside_the_bar():
    rows = [ValidationRow("a", 105.0, 100.0, 110.0, 100.0), ValidationRow("b", 120.0, 100.0, 100.0, 100.0)]
    assert rows[0].goodput_error == pytest.approx(0.05) and rows[1].goodput_error == pytest.approx(0.2)
    text = format_validation(rows)
    assert "+20.0%*" in text and "+5.0% " in text and "1 of 2 settings within both" in text
    assert parse_baseline_config("ee", "2 inst x 1 thr, delay 2000 us") == Baseline("ee", 2, 1, 2000)
    with pytest.raises(ValueError, match="cannot read"):
        parse_baseline_config("ee", "two instances")
