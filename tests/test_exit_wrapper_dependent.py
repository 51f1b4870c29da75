"""The exit-wrapper under a dependent rule (PABEE's patience): it never disables a ramp another ramp relies
on unless measured exits re-price it, and the plan's prediction then uses the exits the kept ramps give.

The case (issue 30): a patience-1 model exits nothing at its first ramp (nothing to agree with yet), so the
wrapper's per-ramp approximation saw a ramp that costs and saves nothing and disabled it; ramp 2 then had
nothing to agree with and nothing exited anywhere, while the planner still priced the old exits."""

from __future__ import annotations

import numpy as np
import pytest

from e3.controller.planner import PlanOptions, best_plan, judge_ramps
from e3.core.cost import effective_reach
from e3.core.exits import PatienceRule
from e3.core.profile import BatchProfile, DeviceConfig, LatencyProfile
from e3.models.training import simulate_exits
from e3.models.workload import reach_by_ramps

B = [1, 2, 4, 8, 16]


def profile(ramp_ms: float = 0.3) -> LatencyProfile:
    """3 blocks of 1 ms per input, ramps of ``ramp_ms``, a check of 0.05 ms, no hops (ms at batch b)."""
    return LatencyProfile(model="toy", num_blocks=3, batch_sizes=B, devices={"cpu": DeviceConfig("cpu", 1.0)},
                          block_ms={"cpu": [[1.0 * b for b in B] for _ in range(3)]},
                          ramp_ms={"cpu": [[ramp_ms] * len(B), [ramp_ms] * len(B), [0.0] * len(B)]},
                          tx_ms={"cpu": [0.0] * len(B)}, check_ms={"cpu": [0.05] * len(B)},
                          router_ms={"cpu": [0.01] * len(B)})


def patience_logits(n: int = 200, seed: int = 0) -> dict[int, np.ndarray]:
    """Ramp and head logits where ramps 1 and 2 agree for 80% of the inputs."""
    rng = np.random.default_rng(seed)
    first = rng.integers(0, 2, n)
    second = np.where(rng.random(n) < 0.8, first, 1 - first)
    onehot = lambda c: np.eye(2, dtype=np.float32)[c] * 4.0   # noqa: E731
    return {1: onehot(first), 2: onehot(second), 3: onehot(rng.integers(0, 2, n))}


def test_measured_reach_of_a_patience_chain():
    rule = PatienceRule(1)
    exact = reach_by_ramps(patience_logits(), rule, 3, (1, 2))
    assert exact["1,2"][2] == pytest.approx(0.2, abs=0.06)       # 80% agree at ramp 2 and leave
    assert exact["2"] == exact["1"] == exact[""] == [1.0, 1.0, 1.0]   # one ramp alone never exits
    # the approximation would have said: without ramp 1, the same 80% still leave at ramp 2
    assert effective_reach(exact["1,2"], (2,))[2] == pytest.approx(exact["1,2"][2])


def test_the_wrapper_keeps_a_ramp_another_relies_on():
    lat = profile()
    reach = [1.0, 1.0, 0.2]                                        # with ramps 1 and 2: exits at ramp 2 only
    plain = {v.block: v for v in judge_ramps(lat, reach, "cpu", b0=8, ramps=(1, 2))}
    assert not plain[1].kept                                       # the old verdict: costs, exits nothing
    guarded = {v.block: v for v in judge_ramps(lat, reach, "cpu", b0=8, ramps=(1, 2),
                                               relies_on=PatienceRule(1).relies_on)}
    assert guarded[1].kept and guarded[2].kept


def test_measured_exits_reprice_the_ramps_and_the_plan():
    lat = profile()
    rule = PatienceRule(1)
    logits = patience_logits()
    exact = reach_by_ramps(logits, rule, 3, (1, 2))
    batch = BatchProfile(model="toy", batch_size=8, reach=exact["1,2"], reach_by_ramps=exact,
                         exit_rule=rule.to_dict())
    verdicts = {v.block: v for v in judge_ramps(lat, batch, "cpu", b0=8, ramps=(1, 2))}
    assert verdicts[1].kept and verdicts[1].saving_ms > verdicts[1].cost_ms   # without it, ramp 2 stops exits
    plan = best_plan(lat, batch, {"cpu": 1}, PlanOptions(slo_ms=10_000, rate_rps=100, alpha=None, ramp_blocks=(1, 2),
                                                         relies_on=rule.relies_on))
    assert plan.enabled_ramps == (1, 2)
    # ramp 2 alone, priced from measured exits: nothing leaves, so block 3 runs every input (the approximation
    # would have let ramp 1's agreement count and priced 80% exits at ramp 2)
    only2 = best_plan(lat, batch, {"cpu": 1}, PlanOptions(slo_ms=10_000, rate_rps=100, alpha=None, ramp_blocks=(2,),
                                                          exit_wrapper=False, b0s=[8]))
    approx = best_plan(lat, BatchProfile(model="toy", batch_size=8, reach=exact["1,2"]), {"cpu": 1},
        PlanOptions(slo_ms=10_000, rate_rps=100, alpha=None, ramp_blocks=(2,), exit_wrapper=False, b0s=[8]))
    assert (simulate_exits(logits, rule, 3, enabled=(2,)).exit_ramp == 3).all()
    assert only2.throughput_rps < approx.throughput_rps * 0.8
    # with ramps so dear that even the measured saving does not pay, both go: then nothing exits, and the plan
    # says so (its throughput is the model's without ramps)
    costly = best_plan(profile(ramp_ms=50.0), batch, {"cpu": 1}, PlanOptions(slo_ms=100_000, rate_rps=1, alpha=None,
                                                                             ramp_blocks=(1, 2),
                                                                             relies_on=rule.relies_on))
    assert costly.enabled_ramps == ()
