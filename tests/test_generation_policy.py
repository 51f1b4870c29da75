"""Never slower and quality targets, as pure logic: the speculation policy's choices and fallback, calibration
of CALM's thresholds against a held-out set, resolving a min_agreement. No model, no server."""

from __future__ import annotations

import numpy as np
import pytest

from e3.generation.calibration import NEVER, calibrate, predict
from e3.generation.policy import (Costs, SpeculationPolicy, SplitCost, choose_draft, expected_tokens,
                                  plain_step_s, resolve_target, speculation_round_s)

# a CPU-like table: cost grows with every position computed; a GPU-like one: each call's fixed cost dominates
CPU = Costs(splits=(SplitCost(1e-4, 1e-3),) * 3, head_s=8e-4, fill_fixed_s=1e-4, fill_per_row_s=1e-5)
GPU = Costs(splits=(SplitCost(2e-3, 1e-6),) * 3, head_s=1e-6, fill_fixed_s=1e-3, fill_per_row_s=1e-7)


def test_expected_tokens_matches_a_simulated_round():
    rng = np.random.default_rng(0)
    for alpha, k in [(0.3, 4), (0.8, 3), (0.95, 6)]:
        sims = []
        for _ in range(20000):
            a = 0
            while a < k and rng.random() < alpha:
                a += 1
            sims.append(k if a == k else a + 1)
        assert expected_tokens(alpha, k) == pytest.approx(np.mean(sims), rel=0.02)


def test_costs_round_trip_and_a_round_costs_its_calls():
    assert Costs.from_dict(CPU.to_dict()) == CPU
    # k = 1 from the first split: the same calls as a plain step plus one draft head
    assert speculation_round_s(CPU, 4, 0, 1) == pytest.approx(plain_step_s(CPU, 4) + CPU.head_s * 4)


def test_speculation_falls_back_where_verifying_costs_per_position():
    """On a CPU-like table even 90% acceptance does not pay; on a GPU-like one it does, with a long draft."""
    depth, k, gain = choose_draft(CPU, 16, {0: 0.9, 1: 0.95}, max_k=6)
    assert (depth, k, gain) == (-1, 0, 1.0)
    depth, k, gain = choose_draft(GPU, 16, {0: 0.9}, max_k=6)
    assert depth == 0 and k > 1 and gain > 1.5
    # and low acceptance falls back on the GPU too
    assert choose_draft(GPU, 16, {0: 0.05}, max_k=6)[1] == 0


def test_policy_backs_off_when_observed_acceptance_drops():
    """The fallback engages from what serving observes, even when calibration promised high acceptance."""
    policy = SpeculationPolicy(GPU, {0: 0.95}, prior=10.0, probe_every=0)
    assert policy.choose(8, 4)[1] > 0
    for _ in range(60):                        # every draft rejected at once
        policy.observe(0, 0, 4)
    assert policy.alpha(0) < 0.25               # decayed counts: recent rounds outweigh the prior
    assert policy.choose(8, 4) == (-1, 0) and policy.fallbacks == 1
    policy.probe_every = 2                     # while fallen back, a cheap probe now and then
    assert [policy.choose(8, 4)[1] for _ in range(4)].count(1) == 2


def _records(n: int, seed: int, positions: int = 24):
    """Synthetic calibration records with a known truth: a score s at an exit is right with probability s
    (well calibrated), the deeper exit more often confident."""
    rng = np.random.default_rng(seed)
    scores, correct = [], []
    for _ in range(n):
        s = np.stack([rng.beta(2, 2, positions), rng.beta(4, 1.5, positions)], 1)
        scores.append(s)
        correct.append(rng.random(s.shape) < s)
    return {"scores": {m: scores for m in ("softmax", "saturation", "classifier")}, "correct": correct}


def test_calibration_meets_its_target_on_a_held_out_set():
    calib, held = _records(300, 0), _records(300, 1)
    doc = calibrate(calib, CPU, targets=(0.5, 0.7, 0.9), batch=16)
    for t in doc["targets"]:
        assert not t["fallback"] and any(r > 0 for r in t["predicted_exit_rate"])
        got = predict(held["scores"]["classifier"], held["correct"], t["thresholds"], CPU,
                      measure=t["measure"], batch=16)
        assert got["agreement"] >= t["min_agreement"], t
    # a looser target lets more tokens leave
    rates = [sum(t["predicted_exit_rate"]) for t in doc["targets"]]
    assert rates[0] > rates[1] > rates[2]


def test_predicted_agreement_stops_at_the_first_wrong_exit():
    scores = [np.array([[0.9, 0.0], [0.9, 0.0], [0.1, 0.0]])]
    correct = [np.array([[True, True], [False, True], [False, False]])]
    got = predict(scores, correct, [0.5, NEVER], GPU, measure="classifier", batch=1)
    assert got["agreement"] == pytest.approx(2 / 4)     # tokens 0 (prefill) and 1 agree, 2 left wrong
    assert got["exit_rate"] == pytest.approx([2 / 3, 0.0])


def test_calibration_falls_back_when_exits_do_not_pay():
    """With the softmax head as the only way to decide and a head dearer than what an exit saves, no target
    gets exits: the calibrated entry is plain decoding."""
    dear = Costs(splits=(SplitCost(0.0, 1e-4),) * 3, head_s=1e-2)
    recs = _records(50, 2)
    recs["scores"] = {"softmax": recs["scores"]["softmax"]}
    from e3.generation import calibration
    saved = calibration.MEASURE_COLUMNS
    calibration.MEASURE_COLUMNS = ("softmax",)
    try:
        doc = calibrate(recs, dear, targets=(0.5,), batch=16)
    finally:
        calibration.MEASURE_COLUMNS = saved
    t = doc["targets"][0]
    assert t["fallback"] and t["thresholds"] == [NEVER, NEVER] and t["predicted_speedup"] == 1.0


def test_resolve_target_takes_the_nearest_stricter_calibration():
    cal = {"targets": [{"min_agreement": 0.9, "measure": "classifier", "thresholds": [0.8, 0.7]},
                       {"min_agreement": 0.95, "measure": "saturation", "thresholds": [0.99, 0.98]}]}
    assert resolve_target(cal, 0.9) == ("classifier", [0.8, 0.7])
    assert resolve_target(cal, 0.92) == ("saturation", [0.99, 0.98])
    with pytest.raises(ValueError, match="calibrated targets: 0.9, 0.95"):
        resolve_target(cal, 0.99)
    with pytest.raises(ValueError, match="not calibrated"):
        resolve_target(None, 0.9)


# Issue 40: the table as served. SmolLM2 on this CPU, as the router timed it: the 49,152-token head 7.7 ms
# per call + 0.41 ms per row, each exit's kv fill its own call of 11-17 ms; splits ~ 10 ms + 1 ms/row.
SERVED = Costs(splits=(SplitCost(1e-2, 1e-3),) * 3, head_s=4.1e-4, head_fixed_s=7.7e-3,
               fills=(SplitCost(1.7e-2, 3e-5), SplitCost(1.1e-2, 2e-5)))


def test_cost_meter_fits_each_kind_of_call_as_served():
    from e3.generation.policy import CostMeter
    meter = CostMeter(CPU, min_calls=4)
    rng = np.random.default_rng(1)
    for rows in (1, 4, 8, 16) * 5:
        meter.observe("split", 0, True, rows, 7.7e-3 + 4.1e-4 * rows + (0.05 if rng.random() < 0.1 else 0))
        meter.observe("fill", 1, False, rows, 1.1e-2 + 2e-5 * rows)
    meter.observe("split", 2, False, 8, 0.02)   # one call: below min_calls, the profile's entry stays
    got = meter.costs()
    fit = got.call("split", 0, head=True)
    assert fit.fixed_s == pytest.approx(7.7e-3, rel=1e-6) and fit.per_position_s == pytest.approx(4.1e-4, rel=1e-6)
    assert got.call("fill", 1).fixed_s == pytest.approx(1.1e-2, rel=1e-6)
    assert got.call("split", 2) == CPU.splits[2]
    assert got.call("split", 1, head=True) == SplitCost(CPU.splits[1].fixed_s, CPU.splits[1].per_position_s
                                                        + CPU.head_s)   # composed from the profile
    assert Costs.from_dict(got.to_dict()) == got


def test_a_call_is_paid_once_per_step_whatever_few_rows_make_it():
    from e3.generation.policy import calm_s_per_token
    # 8 rows, 1/8 of the tokens leave at exit 0 (saturation: head inside the fill): by brute force over which
    # rows leave, the expected step is the splits' calls + P(any leaves) x (fill + head calls) + per-row parts
    B, r = 8, 0.125
    rates = [r, 0.0, 1 - r]
    brute = 0.0
    for leaving in range(B + 1):
        from math import comb
        p = comb(B, leaving) * r ** leaving * (1 - r) ** (B - leaving)
        stay = B - leaving
        step = SERVED.splits[0].fixed_s + B * SERVED.splits[0].per_position_s
        if leaving:
            f = SERVED.call("fill", 0, head=True)
            step += f.fixed_s + leaving * f.per_position_s
        if stay:
            for j in (1, 2):
                c = SERVED.call("split", j, head=j == 2)
                step += c.fixed_s + stay * c.per_position_s
        brute += p * step
    assert calm_s_per_token(SERVED, rates, measure="saturation", batch=B) * B == pytest.approx(brute, rel=1e-9)


def _engine(costs: Costs, exit_rate=(0.3, 0.1)):
    from e3.generation.engine import EngineSpec, GenerationEngine
    raw = {"taus": [0.0, 1.0, NEVER], "exit_rate": [list(exit_rate), list(exit_rate), [0.0, 0.0]],
           "agreement": [0.5, 0.5, 1.0]}
    spec = EngineSpec(model="m", ranges=((1, 1), (2, 2), (3, 3)), kv_heads=1, head_dim=2, max_active=8,
                      vocab_size=64, costs=costs.to_dict(),
                      calibration={"targets": [], "raw": {m: raw for m in ("softmax", "saturation", "classifier")}})
    return GenerationEngine(spec, lambda name, inputs: {})


def test_a_raw_threshold_predicted_slower_is_decoded_plainly_or_refused():
    from e3.generation.engine import GenRequest
    cheap = Costs(splits=(SplitCost(1e-4, 1e-2),) * 3, head_s=1e-5, fills=(SplitCost(1e-5, 1e-5),) * 2)
    engine = _engine(cheap)   # exits save whole per-row split costs: they pay
    engine.submit(GenRequest(0, [1, 2], 4, tau=0.5, measure="classifier"))
    req = engine.waiting[-1][0]
    assert req.thresholds is None and req.note["e3_mode"] == "calm" and float(req.note["e3_predicted_speedup"]) > 1.01
    engine = _engine(SERVED)   # the served table: a head call and a kv-fill call cost more than the layers saved
    engine.submit(GenRequest(1, [1, 2], 4, tau=0.5, measure="softmax"))
    req = engine.waiting[-1][0]
    assert req.thresholds == (NEVER, NEVER) and req.note["e3_fallback"] and "predicted at" in req.note["e3_reason"]
    with pytest.raises(ValueError, match="refused.*predicted at 0\\.[0-9]+x"):
        engine.submit(GenRequest(2, [1, 2], 4, tau=0.5, measure="softmax", on_slower="refuse"))
    engine.submit(GenRequest(3, [1, 2], 4, tau=0.5, measure="softmax", on_slower="serve"))
    assert engine.waiting[-1][0].thresholds is None


def test_the_decision_reads_the_costs_as_served():
    """The same request under the same profile: admitted with exits, then, once the engine has timed expensive
    kv-fill calls while serving, decoded plainly."""
    from e3.generation.engine import REFRESH_STEPS, GenRequest
    cheap = Costs(splits=(SplitCost(1e-4, 1e-2),) * 3, head_s=1e-5, fills=(SplitCost(1e-5, 1e-5),) * 2)
    engine = _engine(cheap)
    engine.submit(GenRequest(0, [1, 2], 4, tau=0.5, measure="classifier"))
    assert engine.waiting[-1][0].thresholds is None
    for _ in range(16):
        for j in (0, 1):
            engine.meter.observe("fill", j, True, 2, 0.5)   # served: half a second per kv fill
    engine.steps += REFRESH_STEPS
    engine.submit(GenRequest(1, [1, 2], 4, tau=0.5, measure="classifier"))
    assert engine.waiting[-1][0].note.get("e3_fallback") is True
