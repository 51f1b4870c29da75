"""Split forms (constant / compact), the first hop, the router's work and the exit-wrapper in E3's cost model
and planner: hand-computed costs, the form each device gets, the wrapper's verdicts, old profile files.

The DP against brute force and the reference search with forms, curves and the wrapper is in
tests/test_planner.py (test_best_plan_matches_brute_force, test_fast_search_matches_reference_search).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from e3.controller.planner import PlanOptions, PlannerError, best_plan, judge_ramps, ramps_worth_keeping
from e3.controller.planner.ramps import candidate_ramps, wrap_for_devices
from e3.core.cost import effective_reach, form_table, plan_cost, stage_cost
from e3.core.plan import COMPACT, CONSTANT, FORMS, Plan
from e3.core.profile import BatchProfile, DeviceConfig, LatencyProfile, ProfileError
from e3.profiling.modelled_profile import (CHECK_FIXED_MS, CHECK_PER_ROW_MS, REF_LAYER_FLOPS, default_data_file,
                                        load_reference_curves, modelled_profile)
from e3.controller.planner.reference import reference_best_plan

BATCHES = [1, 2, 4, 8]


# ---------------------------------------------------------------- factories

def hand_profile(num_blocks: int = 3, **over) -> LatencyProfile:
    """Every block 1 + 0.5 b ms, ramps 0.1 ms (blocks < L), Tx 1 + 0.1 b, Tx into split 1 0.2 ms,
    exit check 0.05 + 0.01 b, router 0.2 + 0.02 b (ms at batch b)."""
    L, B = num_blocks, BATCHES
    d = dict(model="toy", num_blocks=L, batch_sizes=list(B), devices={"cpu": DeviceConfig("cpu", 1.0)},
             block_ms={"cpu": [[1 + 0.5 * b for b in B] for _ in range(L)]},
             ramp_ms={"cpu": [[0.1] * len(B) for _ in range(L - 1)] + [[0.0] * len(B)]},
             tx_ms={"cpu": [1 + 0.1 * b for b in B]}, tx_in_ms={"cpu": [0.2] * len(B)},
             check_ms={"cpu": [0.05 + 0.01 * b for b in B]}, router_ms={"cpu": [0.2 + 0.02 * b for b in B]})
    d.update(over)
    return LatencyProfile(**d)


def cpu_like_profile(num_blocks: int = 4) -> LatencyProfile:
    """What `e3 profile` measures on this CPU for a MiniLM-sized model (docs/design.md §5): every block linear in
    the batch (0.05 + 0.9 ms per input), a BLS hop 0.4 ms + 0.07 ms per input, an exit check of
    0.05 ms + 0.5 us per row, the router 0.09 ms + 6 us per row."""
    B = [1, 2, 4, 8, 16, 32, 64]
    L = num_blocks
    return LatencyProfile(
        model="toy", num_blocks=L, batch_sizes=B, devices={"cpu": DeviceConfig("cpu", 1.0)},
        block_ms={"cpu": [[0.05 + 0.9 * b for b in B] for _ in range(L)]},
        ramp_ms={"cpu": [[0.002 * b for b in B] for _ in range(L - 1)] + [[0.0] * len(B)]},
        tx_ms={"cpu": [0.4 + 0.07 * b for b in B]},
        check_ms={"cpu": [0.05 + 0.0005 * b for b in B]}, router_ms={"cpu": [0.09 + 0.006 * b for b in B]},
        source="measured-like (tests)")


def batch(reach) -> BatchProfile:
    return BatchProfile(model="toy", batch_size=8, reach=list(reach))


# ---------------------------------------------------------------- the cost of each form, by hand

def test_constant_form_by_hand():
    lat = hand_profile()
    # blocks 1-3 on 2 instances, B0 = 8 -> 4 inputs each; every block at 4: 3 x (1 + 2) = 9, ramps 1 and 2:
    # 0.2, router at 4: 0.28; the hop into split 1 carries the model inputs: tx_in 0.2
    s = stage_cost(lat, [1.0, 0.5, 0.25], 8, first=1, last=3, device="cpu", instances=2, ramps=(1, 2), form=CONSTANT)
    assert (s.form, s.batch_per_instance) == (CONSTANT, 4.0)
    assert s.stage_ms == pytest.approx(9 + 0.2 + 0.28) and s.tx_ms == pytest.approx(0.2)
    # blocks 2-3 on 1 instance: B_2 = 4 enter; no shrinking inside: 2 x 3 + ramp 2 + router(4); hop Tx(4)
    s = stage_cost(lat, [1.0, 0.5, 0.25], 8, first=2, last=3, device="cpu", instances=1, ramps=(1, 2), form=CONSTANT)
    assert s.stage_ms == pytest.approx(6 + 0.1 + 0.28) and s.tx_ms == pytest.approx(1.4)
    # without a tx_in_ms curve the first hop is priced as a cut's
    plain = hand_profile(tx_in_ms={})
    assert stage_cost(plain, [1.0, 0.5, 0.25], 8, first=1, last=3, device="cpu", instances=2).tx_ms == pytest.approx(1 + 0.1 * 4)


def test_compact_form_by_hand():
    lat = hand_profile()
    # blocks 1-3 on 2 instances, rows leave between blocks: block 1 at 4 (3 + ramp 0.1 + check(4) 0.09),
    # block 2 at 2 (2 + 0.1 + check(2) 0.07), block 3 at 1 (1.5, the head: no check), router at 4: 0.28
    s = stage_cost(lat, [1.0, 0.5, 0.25], 8, first=1, last=3, device="cpu", instances=2, ramps=(1, 2), form=COMPACT)
    assert s.form == COMPACT and s.tx_ms == 0.0
    assert s.stage_ms == pytest.approx(3.19 + 2.17 + 1.5 + 0.28)
    # blocks 2-3 on 1 instance: block 2 at 4 (3 + 0.1 + 0.09), block 3 at 2 (2), router at 4
    s = stage_cost(lat, [1.0, 0.5, 0.25], 8, first=2, last=3, device="cpu", instances=1, ramps=(1, 2), form=COMPACT)
    assert s.stage_ms == pytest.approx(3.19 + 2.0 + 0.28) and s.tx_ms == 0.0
    # a disabled ramp is neither computed nor checked, and its exits go on to the next ramp (reach 1, 1, 0.25)
    s = stage_cost(lat, [1.0, 0.5, 0.25], 8, first=1, last=3, device="cpu", instances=2, ramps=(2,), form=COMPACT)
    assert s.stage_ms == pytest.approx(3.0 + (3 + 0.1 + 0.09) + 1.5 + 0.28)


def test_plan_cost_mixes_forms_and_takes_the_form_as_a_fifth_element():
    lat = hand_profile()
    reach = [1.0, 0.5, 0.25]
    pc = plan_cost(lat, reach, [(1, 1, "cpu", 1), (2, 3, "cpu", 1, COMPACT)], b0=8, rate_rps=1000, ramps=(1, 2))
    s1, s2 = pc.stages
    # split 1 constant at 8: 5 + ramp 0.1 + router(8) 0.36, hop 0.2; split 2 compact: 3.19 + 2 + 0.28, no hop
    assert (s1.form, s1.stage_ms, s1.tx_ms) == (CONSTANT, pytest.approx(5.46), pytest.approx(0.2))
    assert (s2.form, s2.stage_ms, s2.tx_ms) == (COMPACT, pytest.approx(5.47), 0.0)
    assert pc.cycle_ms == pytest.approx(5.47) and pc.throughput_rps == pytest.approx(8000 / 5.47)
    assert pc.latency_ms == pytest.approx(7.0 + 0.2 + 5.46 + 5.47)      # fill 7 ms at 1000 inputs/s
    with pytest.raises(ValueError, match="form 'fast'"):
        plan_cost(lat, reach, [(1, 3, "cpu", 1, "fast")], b0=8, rate_rps=1000)


def test_form_table_keeps_the_faster_form_and_constant_on_a_tie():
    lat = hand_profile()
    Bk = 8 * np.array([1.0, 0.5, 0.25])
    T, tx, form = form_table(lat, "cpu", Bk, max_instances=2, ramps=(1, 2))
    # blocks 1-3, 2 instances: compact 7.14 < constant 9.48
    assert FORMS[form[0, 2, 1]] == COMPACT and T[0, 2, 1] == pytest.approx(7.14) and tx[0, 2, 1] == 0.0
    # block 3 alone: no ramp inside, the same work either way: constant (with its hop)
    assert FORMS[form[2, 2, 0]] == CONSTANT and tx[2, 2, 0] == pytest.approx(1 + 0.1 * 2)
    T1, _, form1 = form_table(lat, "cpu", Bk, max_instances=2, ramps=(1, 2), forms=(CONSTANT,))
    assert (form1 == 0).all() and T1[0, 2, 1] == pytest.approx(9.48)
    with pytest.raises(ValueError, match="forms must be"):
        form_table(lat, "cpu", Bk, max_instances=2, forms=("fast",))


# ---------------------------------------------------------------- which form each device gets

def test_a_cpu_whose_latency_grows_with_the_batch_gets_compact_splits():
    lat = cpu_like_profile()
    r = best_plan(lat, batch([1.0, 0.6, 0.4, 0.3]), {"cpu": 2}, PlanOptions(slo_ms=200, rate_rps=500, alpha=None))
    assert {s.form for s in r.splits} == {COMPACT}
    forced = best_plan(lat, batch([1.0, 0.6, 0.4, 0.3]), {"cpu": 2}, PlanOptions(slo_ms=200, rate_rps=500, alpha=None,
                                                                                 forms=(CONSTANT,)))
    assert {s.form for s in forced.splits} == {CONSTANT} and forced.throughput_rps < r.throughput_rps


def v100_profile(curves) -> LatencyProfile:
    """tiny-ee-sized blocks (a thousandth of a BERT-base layer: the GPU's flat region) on a modelled V100,
    with the router measured-like on a CPU."""
    B = [1, 2, 4, 8, 16, 32, 64]
    return modelled_profile("toy", B, [REF_LAYER_FLOPS / 1000] * 4, ramp_flops=[REF_LAYER_FLOPS / 100000] * 3 + [0.0],
                            state_bytes=16 * 32 * 4 + 16 * 8, gpus=["v100"], curves=curves, input_bytes=2 * 16 * 8,
                            router_ms=[0.09 + 0.006 * b for b in B])


@pytest.mark.skipif(not default_data_file().exists(), reason=f"no public GPU figures at {default_data_file()}")
@pytest.mark.parametrize("reach", [[1.0, 0.6, 0.4, 0.3], [1.0, 0.3, 0.2, 0.1], [1.0, 0.9, 0.85, 0.8]])
@pytest.mark.parametrize("gpus", [1, 2, 4])
def test_a_modelled_v100_gets_constant_splits(reach, gpus):
    lat = v100_profile(load_reference_curves())
    assert lat.check("v100", 8) == pytest.approx(CHECK_FIXED_MS + 8 * CHECK_PER_ROW_MS)
    for rate in (1000, 10000):
        r = best_plan(lat, batch(reach), {"v100": gpus}, PlanOptions(slo_ms=100, rate_rps=rate, alpha=None))
        assert {s.form for s in r.splits} == {CONSTANT}


def test_merged_cpu_and_v100_profile_gives_each_its_form():
    """Flat GPU curve (as the modelled ones): constant on the GPU, compact on the CPU, in one profile."""
    from e3.profiling.modelled_profile import Curve
    from e3.profiling.profiler import merge_profiles
    flat = Curve((1, 8, 64), (1.15, 1.2, 1.3), "flat test curve")
    both = merge_profiles([cpu_like_profile(), v100_profile({"v100": flat})])
    reach = batch([1.0, 0.6, 0.4, 0.3])
    on_gpu = best_plan(both, reach, {"v100": 1}, PlanOptions(slo_ms=200, rate_rps=500, alpha=None))
    on_cpu = best_plan(both, reach, {"cpu": 2}, PlanOptions(slo_ms=200, rate_rps=500, alpha=None))
    assert {s.form for s in on_gpu.splits} == {CONSTANT} and {s.form for s in on_cpu.splits} == {COMPACT}


# ---------------------------------------------------------------- the plan document and the oracle

def test_to_plan_writes_each_splits_form_and_leaves_disabled_ramps_out():
    lat = cpu_like_profile()
    # nobody exits at ramp 1: the wrapper disables it; half exit at ramp 2
    r = best_plan(lat, batch([1.0, 1.0, 0.5, 0.5]), {"cpu": 2}, PlanOptions(slo_ms=200, rate_rps=500, alpha=None))
    assert 1 in r.disabled_ramps and 2 not in r.disabled_ramps
    plan = Plan.from_json(r.to_plan(model="toy", num_blocks=4, exit_rule={"kind": "entropy", "tau_nats": 0.3},
                                    ramp_blocks=(1, 2, 3), slo_ms=200, slack=0.2).to_json())
    assert [s.form for s in plan.splits] == [s.form for s in r.splits]
    assert 1 not in plan.enabled_ramps and 2 in plan.enabled_ramps
    keep_all = best_plan(lat, batch([1.0, 1.0, 0.5, 0.5]), {"cpu": 2}, PlanOptions(slo_ms=200, rate_rps=500,
                                                                                   alpha=None, exit_wrapper=False))
    assert keep_all.disabled_ramps == () and keep_all.ramp_verdicts == ()
    assert keep_all.to_plan(model="toy", num_blocks=4, exit_rule={"kind": "entropy", "tau_nats": 0.3},
                            ramp_blocks=(1, 2, 3), slo_ms=200, slack=0.2).enabled_ramps == (1, 2, 3)


@pytest.mark.parametrize("seed", range(6))
def test_dp_equals_the_reference_search_on_cpu_and_gpu_like_profiles(seed):
    rng = np.random.default_rng(77 + seed)
    both = cpu_like_profile(5)
    both.devices["gpu"] = DeviceConfig("gpu", 3.0)
    B = both.batch_sizes
    fixed = [float(rng.uniform(3.0, 8.0)) for _ in range(5)]
    both.block_ms["gpu"] = [[f + 0.002 * b for b in B] for f in fixed]
    both.ramp_ms["gpu"] = [[0.01] * len(B) for _ in range(4)] + [[0.0] * len(B)]
    both.tx_ms["gpu"] = [0.2 + 0.002 * b for b in B]
    both.check_ms["gpu"] = [0.05 + 0.0005 * b for b in B]
    both.router_ms["gpu"] = list(both.router_ms["cpu"])
    both.validate()
    reach = [1.0] + sorted(rng.uniform(0.1, 1.0, 4).round(3).tolist(), reverse=True)
    kw = dict(slo_ms=float(rng.uniform(30, 200)), rate_rps=float(rng.uniform(200, 4000)), alpha=None,
              b0s=[1, 2, 4, 8, 16, 32, 64])
    devices = {"cpu": int(rng.integers(1, 4)), "gpu": int(rng.integers(1, 3))}
    try:
        want = reference_best_plan(both, batch(reach), devices, PlanOptions(**kw))
    except PlannerError:
        with pytest.raises(PlannerError):
            best_plan(both, batch(reach), devices, PlanOptions(**kw))
        return
    got = best_plan(both, batch(reach), devices, PlanOptions(**kw))
    assert (got.input_batch_size, got.splits) == (want.input_batch_size, want.splits)
    assert all((s.form == COMPACT) == (s.device == "cpu") for s in got.splits if s.first_block < s.last_block)


# ---------------------------------------------------------------- the exit-wrapper

def test_effective_reach_moves_a_disabled_ramps_exits_to_the_next_ramp():
    reach = [1.0, 0.5, 0.4, 0.3]
    assert effective_reach(reach, None).tolist() == reach
    assert effective_reach(reach, (1, 2, 3)).tolist() == reach
    assert effective_reach(reach, (2, 3)).tolist() == [1.0, 1.0, 0.4, 0.3]
    assert effective_reach(reach, (1,)).tolist() == [1.0, 0.5, 0.5, 0.5]
    assert effective_reach(reach, ()).tolist() == [1.0, 1.0, 1.0, 1.0]


def test_a_ramp_without_exits_is_disabled_and_one_with_many_exits_kept():
    lat = hand_profile()
    verdicts = judge_ramps(lat, batch([1.0, 1.0, 0.5]), "cpu", b0=8)
    v1, v2 = verdicts
    # ramp 1: 8 inputs reach it, none exits; it costs ramp 0.1 + check(8) 0.13
    assert (v1.block, v1.kept, v1.exits, v1.saving_ms) == (1, False, 0.0, 0.0)
    assert v1.cost_ms == pytest.approx(0.23)
    # ramp 2: 4 of 8 exit and skip block 3, which costs (1 + 0.5 x 4) / 4 = 0.75 ms per input at its batch of 4
    assert (v2.block, v2.kept, v2.reached, v2.exits) == (2, True, 8.0, 4.0)
    assert v2.saving_ms == pytest.approx(4 * 0.75) and v2.cost_ms == pytest.approx(0.23)
    assert ramps_worth_keeping(lat, batch([1.0, 1.0, 0.5]), "cpu", b0=8) == (2,)
    assert "ramp 1 disabled on cpu: saves 0.000 ms, costs 0.230 ms" in v1.describe()


def test_inputs_of_a_disabled_ramp_exit_at_the_next_and_its_saving_grows():
    # ramp 1 is made useless by a huge cost; its exits (0.5) then count at ramp 2, which saves more
    lat = hand_profile(4, ramp_ms={"cpu": [[50.0] * 4, [0.1] * 4, [0.1] * 4, [0.0] * 4]})
    reach = [1.0, 0.5, 0.4, 0.3]
    v = {x.block: x for x in judge_ramps(lat, reach, "cpu", b0=8)}
    assert not v[1].kept and v[2].kept and v[3].kept
    # with ramp 1 off, 8 inputs reach ramp 2 and 8 x (1 - 0.4) = 4.8 leave there, skipping block 3 at its
    # batch of 3.2 (the next enabled ramp is 3): (1 + 0.5 x 3.2) / 3.2 per input
    assert v[2].reached == pytest.approx(8.0) and v[2].exits == pytest.approx(4.8)
    assert v[2].saving_ms == pytest.approx(4.8 * (1 + 0.5 * 3.2) / 3.2)


def test_the_wrapper_keeps_a_ramp_any_configuration_keeps():
    lat = hand_profile()
    lat.devices["gpu"] = DeviceConfig("gpu", 2.0)
    lat.block_ms["gpu"] = [[1.0] * 4 for _ in range(3)]                # flat: exits save little per input
    lat.ramp_ms["gpu"] = [[0.5] * 4, [0.5] * 4, [0.0] * 4]
    lat.tx_ms["gpu"] = list(lat.tx_ms["cpu"])
    lat.validate()
    reach = [1.0, 0.9, 0.5]
    assert ramps_worth_keeping(lat, reach, "gpu", b0=8) == (2,)
    assert ramps_worth_keeping(lat, reach, "cpu", b0=8) == (1, 2)
    kept, verdicts = wrap_for_devices(lat, reach, ["gpu", "cpu"], b0=8)
    assert kept == (1, 2) and [(v.block, v.device) for v in verdicts] == [(1, "cpu"), (2, "gpu")]


def test_candidate_ramps_are_priced_ramps_and_blocks_where_inputs_exit():
    lat = hand_profile(4, ramp_ms={"cpu": [[0.1] * 4, [0.0] * 4, [0.0] * 4, [0.0] * 4]})
    assert candidate_ramps(lat, [1.0, 1.0, 0.5, 0.5]) == (1, 2)
    with pytest.raises(ValueError, match="not in the latency profile"):
        judge_ramps(lat, [1.0, 1.0, 0.5, 0.5], "tpu", b0=8)


def test_e3_plan_prints_the_disabled_ramps(tmp_path, capsys):
    from e3.cli import main
    cpu_like_profile().save(tmp_path / "p.json")
    batch([1.0, 1.0, 0.5, 0.5]).save(tmp_path / "x.json")
    base = ["plan", "--latency-profile", str(tmp_path / "p.json"), "--batch-profile", str(tmp_path / "x.json"),
            "--slo-ms", "200", "--rate-rps", "500", "--devices", "cpu:2", "--alpha", "none"]
    assert main(base) == 0
    out = capsys.readouterr().out
    assert "exit-wrapper: disabled ramps [1" in out and "ramp 1 disabled on cpu: saves 0.000 ms, costs" in out
    assert " compact " in out


# ---------------------------------------------------------------- profile files

def test_old_profile_files_still_load_with_the_new_curves_absent(tmp_path):
    lat = hand_profile()
    old = lat.to_dict()
    for name in ("tx_in_ms", "check_ms", "router_ms"):
        del old[name]
    (tmp_path / "old.json").write_text(json.dumps(old))
    got = LatencyProfile.load(tmp_path / "old.json")
    assert got.version == 1 and got.check_ms == {} and got.router_ms == {} and got.tx_in_ms == {}
    assert got.check("cpu", 4) == 0.0 and got.router("cpu", 4) == 0.0
    assert got.tx_in("cpu", 4) == pytest.approx(got.tx("cpu", 4))
    assert got.router("cpu", np.array([1.0, 2.0])).tolist() == [0.0, 0.0]
    # and a profile with them round-trips
    lat.save(tmp_path / "new.json")
    again = LatencyProfile.load(tmp_path / "new.json")
    assert (again.check_ms, again.router_ms, again.tx_in_ms) == (lat.check_ms, lat.router_ms, lat.tx_in_ms)


@pytest.mark.parametrize("name", ["tx_in_ms", "check_ms", "router_ms"])
def test_new_curves_are_validated_like_tx(name):
    d = hand_profile().to_dict()
    for bad, match in (([0.1, 0.2], "must hold 4 latencies"), ([0.1, -1.0, 0.2, 0.3], "negative"),
                       ([0.1, float("nan"), 0.2, 0.3], "non-finite")):
        with pytest.raises(ProfileError, match=match):
            LatencyProfile.from_dict({**d, name: {"cpu": bad}})
    with pytest.raises(ProfileError, match="'gpu'.*does not list"):
        LatencyProfile.from_dict({**d, name: {"gpu": [0.1] * 4}})


def test_at_batch_sizes_resamples_the_new_curves():
    lat = hand_profile().at_batch_sizes([1, 3, 16])
    assert lat.check_ms["cpu"] == pytest.approx([0.06, 0.08, 0.21])     # 0.05 + 0.01 b, extrapolated past 8
    assert lat.router_ms["cpu"] == pytest.approx([0.22, 0.26, 0.52])
    assert lat.tx_in_ms["cpu"] == pytest.approx([0.2, 0.2, 0.2])
    lat.validate()
