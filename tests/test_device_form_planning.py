"""The device form (docs/design.md §2b) in the one engine: priced by E3's cost model (e3.core.cost), chosen by the
planner against the plans of constant and compact splits, written by `e3 plan`, run by the simulator under
the device router's own dispatch rule. Pure: no server, no torch.

The hand computations below share nothing with the code but the formulas of e3.core.cost's docstring; the
cut search is checked against every subset of the ramps; the planner's device plan against a brute force over
B0 and cuts priced by plan_cost; the simulator against the cost model's throughput on the kept H200 profile.
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest

from e3.controller.planner import PlanOptions, PlannerError, best_plan, cheapest_plan, stock_baseline
from e3.controller.planner.device import best_device_cuts, choose_device_cuts, device_cycle_ms, plan_time_ms
from e3.controller.planner.result import DEVICE_KIND, SPLIT_KIND
from e3.controller.planner.tables import runs_device_form
from e3.core import cost
from e3.core.names import ranges_from_cuts
from e3.core.plan import COMPACT, CONSTANT, DEVICE, Plan
from e3.core.profile import BatchProfile, DeviceConfig, LatencyProfile
from e3.serving.device.dispatch import choose
from e3.simulator.des import Arrivals, Baseline, CallCosts, simulate_baseline, simulate_plan

ROOT = Path(__file__).resolve().parents[1]
H200 = ROOT / "docs" / "data" / "h200" / "bert_ee.h200.json"
REACH_80_20 = [1.0, 0.35, 0.25, 0.22, 0.21, 0.21]   # bert-ee's 80:20 mix
BATCHES = [1, 2, 4, 8]


def toy_gpu(**over) -> LatencyProfile:
    """Block k on 'gpu' at batch b: 0.1 k + 0.01 b ms; ramps 0.02 ms; check 0.05 + 0.005 b; router
    0.03 + 0.002 b; hop 1 + 0.1 b (ms)."""
    d = dict(model="toy", num_blocks=3, batch_sizes=list(BATCHES), devices={"gpu": DeviceConfig("gpu", 2.0)},
             block_ms={"gpu": [[0.1 * k + 0.01 * b for b in BATCHES] for k in (1, 2, 3)]},
             ramp_ms={"gpu": [[0.02] * 4, [0.02] * 4, [0.0] * 4]},
             tx_ms={"gpu": [1 + 0.1 * b for b in BATCHES]},
             check_ms={"gpu": [0.05 + 0.005 * b for b in BATCHES]},
             router_ms={"gpu": [0.03 + 0.002 * b for b in BATCHES]})
    d.update(over)
    return LatencyProfile(**d)


def h200() -> LatencyProfile:
    return LatencyProfile.load(H200)


def bert_batch() -> BatchProfile:
    return BatchProfile(model="bert_ee", batch_size=64, reach=list(REACH_80_20))


# ---------------------------------------------------------------- the cost model

def test_device_stage_and_cycle_by_hand():
    """A plan cut after block 1 at B0 = 8, ramps 1 and 2 enabled: every split runs at the constant batch 8;
    split 2-3 is entered by 4 rows per cycle, so it runs half a time per cycle; the two share one device."""
    lat, reach = toy_gpu(), [1.0, 0.5, 0.25]
    pc = cost.plan_cost(lat, reach, [(1, 1, "gpu", 1, DEVICE), (2, 3, "gpu", 1, DEVICE)], b0=8, rate_rps=1000,
                        ramps=(1, 2))
    s1, s2 = pc.stages
    check8, router8 = 0.05 + 0.005 * 8, 0.03 + 0.002 * 8
    T1 = (0.1 + 0.08) + 0.02 + check8 + router8                           # block 1 + its ramp, at 8
    T2 = (0.2 + 0.08) + 0.02 + (0.3 + 0.08) + check8 + router8            # blocks 2 (+ ramp), 3 at 8, not at 4
    assert (s1.stage_ms, s2.stage_ms) == pytest.approx((T1, T2))
    assert (s1.tx_ms, s2.tx_ms) == (0.0, 0.0)                             # no hop: the gather is in check
    assert (s1.runs, s2.runs) == pytest.approx((1.0, 0.5))                # B_a / b
    assert (s1.batch_per_instance, s2.batch_per_instance) == (8, 8) and s2.preferred_batch == 8
    assert pc.cycle_ms == pytest.approx(T1 + 0.5 * T2)                    # one device: the loads add
    assert pc.throughput_rps == pytest.approx(8e3 / (T1 + 0.5 * T2))
    assert pc.latency_ms == pytest.approx(1e3 * 7 / 1000 + T1 + T2)      # fill + one run of each
    assert pc.cost == 2.0 and pc.devices_used == {"gpu": 1}               # two splits, one device
    # not pipelined: the same (the splits never overlap on one device)
    flat = cost.plan_cost(lat, reach, [(1, 1, "gpu", 1, DEVICE), (2, 3, "gpu", 1, DEVICE)], b0=8, rate_rps=1000,
                          ramps=(1, 2), pipelined=False)
    assert flat.cycle_ms == pytest.approx(pc.cycle_ms)
    # a split batch other than B0 (the sixth element): B_a / b runs, every block at b
    pc4 = cost.plan_cost(lat, reach, [(1, 1, "gpu", 1, DEVICE, 8), (2, 3, "gpu", 1, DEVICE, 4)], b0=8,
                         rate_rps=1000, ramps=(1, 2))
    T2_at4 = (0.2 + 0.04) + 0.02 + (0.3 + 0.04) + 0.05 + 0.02 + 0.03 + 0.008
    assert pc4.stages[1].runs == pytest.approx(1.0) and pc4.stages[1].stage_ms == pytest.approx(T2_at4)
    assert pc4.cycle_ms == pytest.approx(T1 + T2_at4)


def test_device_split_has_one_instance_and_is_not_a_per_split_form():
    lat = toy_gpu()
    with pytest.raises(ValueError, match="one instance"):
        cost.plan_cost(lat, [1.0, 0.5, 0.25], [(1, 3, "gpu", 2, DEVICE)], b0=8, rate_rps=1000)
    with pytest.raises(ValueError, match="device_table"):
        cost.stage_table(lat, "gpu", np.array([8.0, 4.0, 2.0]), max_instances=1, form=DEVICE)
    # form_table passes the device form over and chooses among constant and compact only
    T, _, f = cost.form_table(lat, "gpu", np.array([8.0, 4.0, 2.0]), max_instances=1)
    assert set(np.unique(f[np.isfinite(T)])) <= {0, 1}
    with pytest.raises(ValueError):
        cost.form_table(lat, "gpu", np.array([8.0, 4.0, 2.0]), max_instances=1, forms=(DEVICE,))


def test_device_table_is_the_stage_of_every_split_and_what_the_simulator_charges_a_run():
    lat = h200()
    ramps = (1, 3)
    batch_in = 16 * cost.effective_reach(REACH_80_20, ramps)
    T, runs = cost.device_table(lat, "h200", batch_in, batch=16, ramps=ramps)
    assert runs == pytest.approx(batch_in / 16)
    for a in range(1, 7):
        for j in range(1, 7):
            if j < a:
                assert math.isinf(T[a - 1, j - 1])
                continue
            by_hand = (sum(lat.block(k, "h200", 16, with_ramp=k in ramps) for k in range(a, j + 1))
                       + lat.check("h200", 16) + lat.router("h200", 16))
            assert T[a - 1, j - 1] == pytest.approx(by_hand)
            run = cost.batch_ms(lat, "h200", a, last=j, exit_block=np.full(16, 6), ramps=ramps, form=DEVICE)
            assert run + lat.router("h200", 16) == pytest.approx(by_hand)


def test_the_cut_search_of_the_gpu_benches_is_the_cost_models_cycle():
    """controller/planner/device.py's time per B inputs (sum reach(first) x (blocks + run_ms)) is the cost
    model's cycle with every split at b = B0 and run_ms = check + router."""
    lat, B = h200(), 32
    ramps = (1, 2, 3, 4, 5)
    block = [lat.block(k, "h200", B, with_ramp=k in ramps) for k in range(1, 7)]
    run_ms = lat.check("h200", B) + lat.router("h200", B)
    for cuts in [(), (1,), (1, 3), (2, 4, 5)]:
        splits = [(a, b, "h200", 1, DEVICE) for a, b in ranges_from_cuts(list(cuts), 6)]
        pc = cost.plan_cost(lat, REACH_80_20, splits, b0=B, rate_rps=1e4, ramps=ramps)
        assert plan_time_ms(cuts, REACH_80_20, block, run_ms=run_ms) == pytest.approx(pc.cycle_ms)
    got = choose_device_cuts(REACH_80_20, block, run_ms, enabled_ramps=ramps)
    assert got.cuts == (1,)       # 65% leave after block 1; a second cut costs more runs than it saves


# ---------------------------------------------------------------- the cut search

def _brute(T, runs, candidates, budget):
    best = None
    L = T.shape[0]
    cands = [k for k in candidates if 1 <= k < L]
    for r in range(len(cands) + 1):
        for cuts in itertools.combinations(cands, r):
            cycle, lat = device_cycle_ms(cuts, T, runs)
            if lat <= budget * (1 + 1e-9) and (best is None or cycle < best[0] - 1e-12):
                best = (cycle, lat, cuts)
    return best


@pytest.mark.parametrize("seed", range(40))
def test_best_device_cuts_is_the_brute_force_minimum_within_the_budget(seed):
    rng = np.random.default_rng(seed)
    L = int(rng.integers(2, 8))
    lat = LatencyProfile(model="toy", num_blocks=L, batch_sizes=[1], devices={"g": DeviceConfig("g")},
                         block_ms={"g": [[float(x)] for x in rng.uniform(0.05, 1.0, L)]},
                         ramp_ms={"g": [[float(x)] for x in rng.uniform(0.0, 0.1, L - 1)] + [[0.0]]},
                         tx_ms={"g": [0.0]}, check_ms={"g": [float(rng.uniform(0.0, 0.6))]},
                         router_ms={"g": [float(rng.uniform(0.0, 0.3))]})
    reach = [1.0] + sorted(rng.uniform(0.0, 1.0, L - 1), reverse=True)
    ramps = tuple(k for k in range(1, L) if rng.random() < 0.8)
    T, runs = cost.device_table(lat, "g", np.asarray(reach), batch=1.0, ramps=ramps)
    unbounded = _brute(T, runs, ramps, math.inf)
    # budgets from generous to impossible, so that the latency bound binds in some cases
    for budget in (math.inf, unbounded[1], unbounded[1] * float(rng.uniform(0.6, 1.0)), 0.5 * float(T[0, L - 1])):
        want, got = _brute(T, runs, ramps, budget), best_device_cuts(T, runs, ramps, budget_ms=budget)
        if want is None:
            assert got is None
            continue
        assert got.time_ms == pytest.approx(want[0], rel=1e-9)
        assert got.latency_ms <= budget * (1 + 1e-9)
        assert set(got.cuts) <= set(ramps)
        assert (got.time_ms, got.latency_ms) == pytest.approx(device_cycle_ms(got.cuts, T, runs))


# ---------------------------------------------------------------- the planner

def test_planner_chooses_the_device_form_on_the_h200_profile_at_80_20():
    lat, batch = h200(), bert_batch()
    r = best_plan(lat, batch, {"h200": 1}, PlanOptions(slo_ms=100, rate_rps=20000))
    assert r.on_device and all(s.form == DEVICE and s.instances == 1 for s in r.splits)
    assert len(r.splits) >= 2                       # cut where 65% of the inputs leave
    rps = dict(r.compared)
    assert rps[DEVICE_KIND] == pytest.approx(r.throughput_rps) and rps[SPLIT_KIND] < r.throughput_rps
    split_only = best_plan(lat, batch, {"h200": 1}, PlanOptions(slo_ms=100, rate_rps=20000, forms=(CONSTANT, COMPACT)))
    assert rps[SPLIT_KIND] == pytest.approx(split_only.throughput_rps)
    assert any("the device form pays" in n for n in r.notes)
    # re-priced by the cost model from the splits alone
    pc = cost.plan_cost(lat, batch.reach, [(s.first_block, s.last_block, s.device, 1, DEVICE) for s in r.splits],
                        b0=r.input_batch_size, rate_rps=20000, ramps=r.enabled_ramps)
    assert (pc.throughput_rps, pc.latency_ms, pc.cost) == pytest.approx((r.throughput_rps, r.latency_ms, r.cost))
    # the plan document: all-device, one batch, valid
    plan = r.to_plan(model="bert_ee", num_blocks=6, exit_rule={"kind": "entropy", "tau_nats": 0.5},
                     ramp_blocks=(1, 2, 3, 4, 5), slo_ms=100, slack=0.2)
    again = Plan.from_json(plan.to_json())
    assert again.on_device and {s.batch_size for s in again.splits} == {r.input_batch_size}
    assert again.router_instances == 1 and not again.triton_splits


def test_planners_device_plan_is_the_brute_force_best_over_b0_and_cuts():
    """With every ramp kept (no exit-wrapper), the device plan is the best of every B0 candidate and every
    subset of the ramps, each priced by plan_cost and checked against the latency budget."""
    lat, batch = h200(), bert_batch()
    slo, rate = 12.0, 8000.0                        # tight: the fill time rules out the largest B0s
    r = best_plan(lat, batch, {"h200": 1}, PlanOptions(slo_ms=slo, rate_rps=rate, forms=(DEVICE,), exit_wrapper=False,
                                                       ramp_blocks=(1, 2, 3, 4, 5), alpha=None))
    best = None
    for b0 in (1, 2, 4, 8, 16, 32, 64):
        for n in range(6):
            for cuts in itertools.combinations(range(1, 6), n):
                splits = [(a, b, "h200", 1, DEVICE) for a, b in ranges_from_cuts(list(cuts), 6)]
                pc = cost.plan_cost(lat, batch.reach, splits, b0=b0, rate_rps=rate, ramps=(1, 2, 3, 4, 5))
                if pc.latency_ms <= slo * 0.8 and (best is None or pc.throughput_rps > best[0]):
                    best = (pc.throughput_rps, b0, cuts)
    assert r.throughput_rps == pytest.approx(best[0], rel=1e-9)
    assert r.input_batch_size < 64 and r.latency_ms <= slo * 0.8


def test_planner_does_not_choose_the_device_form_on_a_cpu_profile():
    """The same H200 prices under a CPU's name are not offered the form (the rule of runs_device_form), and
    a CPU-like profile (linear in the batch) is planned as before: compact, no device split."""
    d = json.loads(H200.read_text())
    for key in ("devices", "block_ms", "ramp_ms", "tx_ms", "tx_in_ms", "check_ms", "router_ms", "stock_ms"):
        d[key] = {"cpu": d[key]["h200"]}
    as_cpu = LatencyProfile.from_dict(d)
    assert not runs_device_form(as_cpu, "cpu") and runs_device_form(h200(), "h200")
    r = best_plan(as_cpu, bert_batch(), {"cpu": 1}, PlanOptions(slo_ms=100, rate_rps=20000))
    assert not r.on_device and DEVICE not in {s.form for s in r.splits} and r.compared == ()
    with pytest.raises(PlannerError, match="accelerator"):
        best_plan(as_cpu, bert_batch(), {"cpu": 1}, PlanOptions(slo_ms=100, rate_rps=20000, forms=(DEVICE,)))
    B = [1, 2, 4, 8, 16, 32, 64]
    linear = LatencyProfile(model="toy", num_blocks=4, batch_sizes=B, devices={"cpu": DeviceConfig("cpu", 1.0)},
                            block_ms={"cpu": [[0.05 + 0.9 * b for b in B] for _ in range(4)]},
                            ramp_ms={"cpu": [[0.002 * b for b in B] for _ in range(3)] + [[0.0] * 7]},
                            tx_ms={"cpu": [0.4 + 0.07 * b for b in B]},
                            check_ms={"cpu": [0.05 + 0.0005 * b for b in B]},
                            router_ms={"cpu": [0.09 + 0.006 * b for b in B]})
    r = best_plan(linear, BatchProfile(model="toy", batch_size=8, reach=[1.0, 0.4, 0.3, 0.2]), {"cpu": 2},
                  PlanOptions(slo_ms=200, rate_rps=500))
    assert {s.form for s in r.splits} == {COMPACT} and r.compared == ()


def test_a_gpu_profile_without_an_exit_check_price_is_not_offered_the_form():
    """Without check_ms every device run's sync would read 0: the planner does not offer the form."""
    lat = toy_gpu(check_ms={})
    assert not runs_device_form(lat, "gpu")
    r = best_plan(lat, BatchProfile(model="toy", batch_size=8, reach=[1.0, 0.5, 0.25]), {"gpu": 1},
        PlanOptions(slo_ms=100, rate_rps=1000))
    assert not r.on_device and r.compared == ()


def test_device_form_loses_where_more_devices_pay_more():
    """On four H200s the constant form's instances outrun one device holding every split: the planner keeps
    the plan of constant and compact splits and says what the device form would give."""
    r = best_plan(h200(), bert_batch(), {"h200": 4}, PlanOptions(slo_ms=100, rate_rps=100000, alpha=None))
    rps = dict(r.compared)
    assert not r.on_device and r.throughput_rps == pytest.approx(rps[SPLIT_KIND]) and rps[DEVICE_KIND] < rps[SPLIT_KIND]
    assert r.devices_used["h200"] > 1
    assert any("does not pay" in n for n in r.notes)


def test_cheapest_plan_takes_one_device_of_the_device_form_where_it_reaches_the_goodput():
    lat = h200()
    split_only = best_plan(lat, bert_batch(), {"h200": 1}, PlanOptions(slo_ms=100, rate_rps=1e5, alpha=None,
                                                                       forms=(CONSTANT, COMPACT)))
    goodput = split_only.throughput_rps * 1.05     # one device reaches it only in the device form
    r = cheapest_plan(lat, bert_batch(), {"h200": 4}, PlanOptions(slo_ms=100, goodput_rps=goodput))
    assert r.on_device and r.cost == lat.devices["h200"].price and r.throughput_rps >= goodput
    with pytest.raises(PlannerError):        # without the device form one device cannot reach it
        cheapest_plan(lat, bert_batch(), {"h200": 1}, PlanOptions(slo_ms=100, goodput_rps=goodput,
                                                                  forms=(CONSTANT, COMPACT)))


# ---------------------------------------------------------------- the simulator

def exits_for(reach, n: int = 2000, seed: int = 0) -> np.ndarray:
    """A pool of n inputs whose exit blocks follow ``reach`` exactly (shuffled)."""
    L = len(reach)
    counts = [int(round((reach[k] - (reach[k + 1] if k + 1 < L else 0.0)) * n)) for k in range(L)]
    ex = np.concatenate([np.full(c, k + 1) for k, c in enumerate(counts)])[:n]
    ex = np.concatenate([ex, np.full(n - len(ex), L)])
    np.random.default_rng(seed).shuffle(ex)
    return ex


@pytest.mark.parametrize("b0", [8, 64])
def test_simulated_device_plan_reaches_the_cost_models_throughput_and_beats_stock_where_it_says(b0):
    """The planner's device plan on the kept H200 profile at B0 = b0, simulated (closed loop, enough clients
    to keep the device busy, a generous SLO so that no batch is forced): its throughput is the cost model's
    within 3%, and it beats the simulated stock model (one instance behind Triton's batcher at the same
    batch, its input copy beside the compute) exactly where the cost model's stock price says it should
    (at 8 it does; at 64 the router's work per run costs more than the exits save)."""
    lat = h200()
    r = best_plan(lat, bert_batch(), {"h200": 1}, PlanOptions(slo_ms=1000, rate_rps=1e5, b0s=[b0], alpha=None))
    assert r.on_device
    plan = r.to_plan(model="bert_ee", num_blocks=6, exit_rule={"kind": "entropy", "tau_nats": 0.5},
                     ramp_blocks=(1, 2, 3, 4, 5), slo_ms=1000, slack=0.2)
    ex = exits_for(REACH_80_20)
    load = Arrivals(batch=8, requests=1200 if b0 == 8 else 2400, clients=4 * b0, client_ms=0.0, steady=True)
    sim = simulate_plan(lat, plan, ex, arrivals=load, device="h200", dispatch=choose)
    assert sim.dropped_inputs == 0
    assert sim.inputs_per_s == pytest.approx(r.throughput_rps, rel=0.03)
    assert np.mean(sim.batches[0]) == pytest.approx(b0, rel=0.02)          # constant batches at split 1 ...
    assert np.mean(sim.batches[len(plan.splits) - 1]) > 0.9 * b0           # ... and after the cuts
    stock = simulate_baseline(lat, Baseline("stock", instances=1, max_batch=b0, preferred=b0), ex, arrivals=load,
                              device="h200", costs=CallCosts(input_curve="tx_in", request_ms=0.0, overlap_hop=True))
    predicted_stock = stock_baseline(lat, {"h200": 1}, PlanOptions(slo_ms=1000, rate_rps=1e5, b0s=[b0])).throughput_rps
    assert (r.throughput_rps > predicted_stock) == (b0 == 8)               # what the cost model says ...
    assert (sim.inputs_per_s > stock.inputs_per_s) == (r.throughput_rps > predicted_stock)   # ... the simulator does


def test_simulator_runs_a_device_plan_under_the_routers_dispatch_rule_and_drops_what_cannot_make_its_slo():
    lat = h200()
    r = best_plan(lat, bert_batch(), {"h200": 1}, PlanOptions(slo_ms=1000, rate_rps=1e5, b0s=[8], alpha=None))
    plan = r.to_plan(model="bert_ee", num_blocks=6, exit_rule={"kind": "entropy", "tau_nats": 0.5},
                     ramp_blocks=(1, 2, 3, 4, 5), slo_ms=1000, slack=0.2)
    ex = exits_for(REACH_80_20, n=400)
    # the router's own rule by default: the same run as with it passed explicitly
    by_default = simulate_plan(lat, plan, ex, arrivals=Arrivals(batch=8, requests=40, clients=2), device="h200")
    explicit = simulate_plan(lat, plan, ex, arrivals=Arrivals(batch=8, requests=40, clients=2), device="h200",
                             dispatch=choose)
    assert by_default.batches == explicit.batches and by_default.answered_inputs == 40 * 8
    # an SLO below one run of the plan: every request is dropped with an explicit answer, none is lost
    tight = Plan.from_dict(dict(plan.to_dict(), slo_ms=0.3))
    sim = simulate_plan(lat, tight, ex, arrivals=Arrivals(batch=8, requests=50, clients=4, warmup=0),
                        device="h200", dispatch=choose)
    # (the router's rule: a request goes when even its split's run would end past the deadline; split 1 alone
    # fits in 0.3 ms, so the few requests whose every row leaves at ramp 1 (0.65^8 of them) are answered late)
    assert sim.dropped_inputs + sim.answered_inputs == 50 * 8 and sim.dropped_inputs >= 0.8 * 50 * 8
    # a light open loop: partial batches run at once (nothing upstream can add rows), latency a few runs
    light = simulate_plan(lat, plan, ex, arrivals=Arrivals(batch=1, requests=300, clients=None, rate_rps=500),
                          device="h200", dispatch=choose)
    assert light.dropped_inputs == 0 and light.p99_ms < 5.0


# ---------------------------------------------------------------- e3 plan

def test_e3_plan_writes_an_all_device_plan_from_the_kept_h200_profile_and_says_why(tmp_path, capsys):
    from e3.cli import main
    args = ["plan", "--latency-profile", str(H200), "--reach", ",".join(str(r) for r in REACH_80_20),
            "--devices", "h200:1", "--slo-ms", "100", "--rate-rps", "20000"]
    assert main(args + ["--out", str(tmp_path / "plan.json")]) == 0
    out = capsys.readouterr().out
    plan = Plan.from_json((tmp_path / "plan.json").read_text())
    assert plan.on_device and all(s.form == DEVICE and s.instances == 1 and s.device == "h200" for s in plan.splits)
    assert "the device form pays" in out and "best constant/compact plan" in out
    # the same without the device form: a plan of constant or compact splits, nothing of the device form
    assert main(args + ["--forms", "constant,compact", "--out", str(tmp_path / "split.json")]) == 0
    out = capsys.readouterr().out
    split = Plan.from_json((tmp_path / "split.json").read_text())
    assert not split.on_device and "device form" not in out
    assert split.predicted["throughput_rps"] < plan.predicted["throughput_rps"]
    assert main(args[:4] + ["1,0.35,0.5,0.2,0.2,0.2"] + args[5:]) == 2   # a reach that rises again: refused
    assert "non-increasing" in capsys.readouterr().err


def test_the_controller_counts_one_device_for_a_device_plan():
    from e3.controller.decisions import devices_used
    from e3.core.plan import CONSTANT, Plan, SplitPlan
    device = Plan(model="m", num_blocks=4, exit_rule={"kind": "entropy", "tau_nats": 0.1}, splits=(
        SplitPlan("m_split_1-2", 1, 2, 8, device="h200", form="device", enabled_ramps=(1, 2)),
        SplitPlan("m_split_3-4", 3, 4, 8, device="h200", form="device", enabled_ramps=(3,))))
    assert devices_used(device) == {"h200": 1}
    constant = Plan(model="m", num_blocks=4, exit_rule={"kind": "entropy", "tau_nats": 0.1}, splits=(
        SplitPlan("m_split_1-2", 1, 2, 8, instances=2, device="h200", form=CONSTANT),
        SplitPlan("m_split_3-4", 3, 4, 8, device="h200", form=CONSTANT)))
    assert devices_used(constant) == {"h200": 3}
