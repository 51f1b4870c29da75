"""The device-resident constant form (serving/device) on the CPU: the dispatch rule, the cut search, forced
exits, and answers equal to the PyTorch reference for every zoo model, every cut form and both pipeline
depths, through the same executors a GPU runs (eagerly here)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from e3.controller.planner.device import choose_device_cuts, plan_time_ms
from e3.core.exits import EntropyRule, ForcedRule, PatienceRule, entropy_nats, make_exit_rule, row_uniform
from e3.models.reference import reference_answers
from e3.serving.device.dispatch import QueueView, choose
from e3.serving.device.executor import DeviceSettings, bucket_for, buckets_for, build_model
from e3.serving.device.pipeline import DevicePipeline, NaiveRunner, StockRunner
from e3.serving.scheduler import WARM_BATCHES

TIE = 1e-5


# -- the dispatch rule (pure) -------------------------------------------------------------------------------------
def q(rows, batch=8, target=None, expected=0.0):
    return QueueView(rows, batch, target, expected)


def test_a_full_batch_goes_first_latest_split_first():
    assert choose([q(8), q(8), q(3)], now=0.0).split == 1
    assert choose([q(9), q(2), q(3)], now=0.0).split == 0
    assert choose([q(9), q(2), q(3)], now=0.0).rows == 8


def test_split_one_takes_what_is_there_but_a_later_partial_batch_waits_while_upstream_has_rows():
    c = choose([q(3), q(5, target=10.0, expected=0.5), q(0)], now=0.0)
    assert (c.split, c.rows) == (0, 3)
    # upstream empty: nothing can add rows, the later partial batch goes
    c = choose([q(0), q(5, target=10.0), q(0)], now=0.0)
    assert (c.split, c.rows) == (1, 5)


def test_a_later_partial_batch_goes_when_waiting_would_break_its_target():
    # split 2 (index 1) holds 5 of 8 rows while split 1 still has rows upstream of it; its oldest row's target
    # is 10 s; it and the split after it are expected to take 1 s and 2 s: it must go by 10 - 3 = 7 s
    views = [q(2), q(5, target=10.0, expected=1.0), q(0, expected=2.0)]
    assert choose(views, now=6.9).split == 0      # not forced yet: split 1 takes what it has
    assert choose(views, now=7.0).split == 1      # forced now, and it goes before split 1's partial batch


def test_with_upstream_empty_the_earliest_waiting_split_goes_and_later_ones_wait_for_it():
    c = choose([q(0), q(5, target=10.0, expected=1.0), q(2, target=20.0)], now=0.0)
    assert (c.split, c.rows) == (1, 5)            # its survivors may still fill split 3's batch
    idle = choose([q(0), q(0), q(0)], now=0.0)
    assert idle.split is None


def test_while_any_row_waits_something_runs():
    """The lowest non-empty queue always has an empty upstream (or is split 1): no row can wait forever."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        rows = [int(r) for r in rng.integers(0, 10, 4)]
        views = [q(r, target=float(rng.uniform(0, 5)), expected=float(rng.uniform(0, 1))) for r in rows]
        c = choose(views, now=0.0)
        assert (c.split is None) == (sum(rows) == 0)
        if c.split is not None:
            assert 0 < c.rows <= min(rows[c.split], 8)


# -- the cut search (pure) ------------------------------------------------------------------------------------
def test_cut_search_is_the_brute_force_minimum():
    rng = np.random.default_rng(3)
    for trial in range(30):
        L = int(rng.integers(3, 8))
        block = list(rng.uniform(0.1, 1.0, L))
        reach = [1.0] + sorted(rng.uniform(0.0, 1.0, L - 1), reverse=True)
        run_ms = float(rng.uniform(0.0, 0.5))
        enabled = tuple(k for k in range(1, L) if rng.random() < 0.7)
        got = choose_device_cuts(reach, block, run_ms, enabled_ramps=enabled)
        best = min(plan_time_ms(c, reach, block, run_ms=run_ms)
                   for r in range(len(enabled) + 1) for c in itertools.combinations(enabled, r))
        assert got.time_ms == pytest.approx(best)   # the one search is a DP (tests/test_device_form_planning.py)
        assert got.time_ms == pytest.approx(plan_time_ms(got.cuts, reach, block, run_ms=run_ms))


def test_cut_search_cuts_where_most_inputs_leave_and_not_where_nobody_does():
    block = [1.0] * 12
    reach = [1.0, 1.0] + [0.2] * 10   # 80% leave after block 2
    assert choose_device_cuts(reach, block, 0.1, enabled_ramps=tuple(range(1, 12))).cuts == (2,)
    assert choose_device_cuts([1.0] * 12, block, 0.1, enabled_ramps=tuple(range(1, 12))).cuts == ()


def test_plan_time_counts_each_split_at_the_share_reaching_it():
    assert plan_time_ms((2,), [1.0, 1.0, 0.5, 0.5], [1.0, 1.0, 1.0, 1.0], run_ms=0.5) == pytest.approx(2.5 + 0.5 * 2.5)


# -- forced exits -------------------------------------------------------------------------------------------------
def test_forced_exits_follow_the_stated_distribution_and_the_input_alone():
    rule = ForcedRule([1.0, 0.35, 0.25, 0.22, 0.21, 0.21])
    x = {"input_ids": np.random.default_rng(0).integers(0, 30000, (20000, 16))}
    at = rule.init_state_for(x, 20000)["exit_at"]
    share = np.bincount(at, minlength=7)[1:] / 20000
    assert share == pytest.approx([0.65, 0.10, 0.03, 0.01, 0.0, 0.21], abs=0.012)
    again = rule.init_state_for({"input_ids": x["input_ids"][::-1].copy()}, 20000)["exit_at"][::-1]
    assert np.array_equal(at, again)    # a row's exit depends on its own bytes only
    assert make_exit_rule(rule.to_dict()).reach == rule.reach
    u = row_uniform(x, 20000)
    assert 0.0 <= u.min() and u.max() < 1.0 and abs(u.mean() - 0.5) < 0.01


def test_forced_rule_refuses_a_bad_distribution_and_a_state_without_inputs():
    with pytest.raises(ValueError, match="reach"):
        ForcedRule([0.9, 0.5])
    with pytest.raises(ValueError, match="reach"):
        ForcedRule([1.0, 0.2, 0.5])
    with pytest.raises(ValueError, match="inputs"):
        ForcedRule([1.0, 0.5]).init_state(3)


def test_buckets():
    assert buckets_for(32) == (1, 2, 4, 8, 16, 32)
    assert buckets_for(24) == (1, 2, 4, 8, 16, 24)
    assert bucket_for(buckets_for(32), 5) == 8
    with pytest.raises(ValueError):
        bucket_for((1, 2), 3)


# -- answers equal to the reference ---------------------------------------------------------------------------
def _rules(model, arrays):
    """The rules each model is checked under: entropy at a τ that exits some inputs at the first ramp, patience
    2, and forced exits spread over every ramp."""
    card = model.card
    with torch.no_grad():
        first = min(card.ramp_blocks)
        state = model.stem(*(torch.from_numpy(arrays[s.name]) for s in card.inputs))
        for k in range(1, first + 1):
            state = model.block(k, *state)
        ent = entropy_nats(model.ramp(first, *state).numpy())
    L = card.num_blocks
    reach = [1.0] + [1.0 - 0.6 * k / L for k in range(1, L)]
    return {"entropy": EntropyRule(float(np.quantile(ent, 0.4))), "patience": PatienceRule(2), "forced": ForcedRule(reach)}


MODELS = {"tiny-ee": 64, "bert-ee": 24, "pabee": 16, "resnet-ee": 24, "bert-base-ee": 4}


@pytest.mark.parametrize("name", list(MODELS))
def test_device_pipeline_answers_as_the_reference_for_every_zoo_model(name):
    """Every cut form (no cut, each single cut, a cut after every ramp), pipeline depth 1 and 2, the naive
    runner and the stock runner: labels and exit ramps equal to the reference run one input at a time
    (the tie band of docs/design.md §2 excluded and counted)."""
    torch.set_num_threads(1)
    model = build_model(name, seed=0, trained=False)
    n = MODELS[name]
    arrays = model.example_arrays(n, seed=5)
    inputs = tuple(arrays[s.name] for s in model.card.inputs)
    L = model.card.num_blocks
    ramps = tuple(model.card.ramp_blocks)
    settings = DeviceSettings(max_batch=8)
    # every single cut where a model is cheap; the encoders of real size: no cut, one cut, a cut at every ramp
    cut_forms = [(), *[(k,) for k in ramps], ramps] if name in ("tiny-ee", "resnet-ee") else [(), (ramps[0],), ramps]
    for rule_name, rule in _rules(model, arrays).items():
        ref = reference_answers(model, inputs, rule, enabled_ramps=ramps)
        clear = ref.min_margin > TIE
        assert clear.mean() > 0.9, f"{rule_name}: too many inputs in the tie band"
        for cuts in cut_forms:
            for depth in ((1, 2) if cuts == ramps else (1,)):
                got, failed = {}, []
                pipe = DevicePipeline(model, cuts=cuts, batch_sizes=[8] * (len(cuts) + 1), enabled_ramps=ramps,
                                      rule=rule, settings=settings, slo_ms=1e6, answer=got.__setitem__,
                                      fail=lambda h, m: failed.append(m), depth=depth)
                sizes = [1, 3, 5, 2, 7, 4] * n
                at, handles = 0, []
                for i, size in enumerate(sizes):
                    if at >= n:
                        break
                    size = min(size, n - at)
                    pipe.admit(i, {k: v[at:at + size] for k, v in arrays.items()})
                    handles.append((i, at, size))
                    at += size
                pipe.run_until_idle()
                assert not failed
                label = np.concatenate([got[i]["label"][:, 0] for i, _, _ in handles])
                exit_ramp = np.concatenate([got[i]["exit_ramp"][:, 0] for i, _, _ in handles])
                where = f"{name} {rule_name} cuts {cuts} depth {depth}"
                assert np.array_equal(exit_ramp[clear], ref.exit_ramp[clear]), where
                assert np.array_equal(label[clear], ref.label[clear]), where
        naive = NaiveRunner(model, enabled_ramps=ramps, rule=rule, settings=settings).run(arrays)
        assert np.array_equal(naive.exit_ramp[clear], ref.exit_ramp[clear]) and \
            np.array_equal(naive.label[clear], ref.label[clear]), f"{name} {rule_name} naive"
    stock = StockRunner(model, settings).run(arrays)
    head = reference_answers(model, inputs, EntropyRule(0.0), enabled_ramps=())
    assert np.array_equal(stock.label, head.label) and (stock.exit_ramp == L).all()


def test_forced_exits_really_spread_over_the_ramps_in_the_pipeline():
    model = build_model("tiny-ee", seed=0, trained=False)
    arrays = model.example_arrays(200, seed=1)
    rule = ForcedRule([1.0, 0.5, 0.35, 0.3])
    got = {}
    pipe = DevicePipeline(model, cuts=(1, 2), batch_sizes=[8, 8, 8], enabled_ramps=(1, 2, 3), rule=rule,
                          settings=DeviceSettings(max_batch=8), slo_ms=1e6, answer=got.__setitem__,
                          fail=lambda h, m: None)
    for i in range(0, 200, 8):
        pipe.admit(i, {k: v[i:i + 8] for k, v in arrays.items()})
    pipe.run_until_idle()
    exits = np.concatenate([got[i]["exit_ramp"][:, 0] for i in range(0, 200, 8)])
    assert set(np.unique(exits)) == {1, 2, 3, 4}
    # every split ran at the plan's batch except the tail: constant batches
    assert pipe.counts["runs"][0] == 25 and pipe.counts["rows"][0] == 200
    assert pipe.counts["rows"][1] == int(np.sum(exits > 1))


def _slo_pipeline():
    """tiny-ee cut after block 2, batches of 8, an SLO of 50 ms and a clock the test moves: (pipeline, 64 rows of
    inputs, the clock's [now], answers by handle, errors by handle)."""
    model = build_model("tiny-ee", seed=0, trained=False)
    now = [0.0]
    got, failed = {}, {}
    pipe = DevicePipeline(model, cuts=(2,), batch_sizes=[8, 8], enabled_ramps=(1, 2, 3), rule=ForcedRule([1, .5, .5, .5]),
                          settings=DeviceSettings(max_batch=8), slo_ms=50.0, answer=got.__setitem__,
                          fail=failed.__setitem__, clock=lambda: now[0])
    return pipe, model.example_arrays(64, seed=2), now, got, failed


def test_requests_that_cannot_make_their_slo_are_dropped_with_an_error_and_the_rest_answered():
    pipe, arrays, now, got, failed = _slo_pipeline()
    for i in range(8):
        pipe.admit(i, {k: v[8 * i:8 * i + 8] for k, v in arrays.items()})
    for _ in range(3):
        pipe.step()   # learn some runs
    for q in pipe.queues:
        for _ in range(4 * WARM_BATCHES):   # every split now expected to take about 90 ms: past the 50 ms SLO
            q.learn(8, 0.090)
        assert q.trusted and q.expected_s > 0.050
    pipe.run_until_idle()
    assert len(got) + len(failed) == 8                  # every request answered exactly once
    assert failed and all("deadline" in m for m in failed.values())
    assert set(got).isdisjoint(failed)


def test_only_requests_that_would_finish_late_are_dropped():
    """The drop rule's other half: a request is dropped only when its split's run would end past *its* deadline.
    Four requests admitted at 0 and four at 40 ms, an SLO of 50 ms, every split expected to take 30 ms: at 40 ms
    the first four would end at 70 ms, past their 50 ms, and are dropped; the last four would end at 70 ms too,
    inside their 90 ms, and are answered (the fake clock stands still while the pipeline runs)."""
    pipe, arrays, now, got, failed = _slo_pipeline()
    for q in pipe.queues:
        for _ in range(4 * WARM_BATCHES):
            q.learn(8, 0.030)
        assert q.trusted and 0.025 < q.expected_s < 0.035
    for i in range(4):
        pipe.admit(i, {k: v[8 * i:8 * i + 8] for k, v in arrays.items()})
    now[0] = 0.040
    for i in range(4, 8):
        pipe.admit(i, {k: v[8 * i:8 * i + 8] for k, v in arrays.items()})
    pipe.run_until_idle()
    assert sorted(failed) == [0, 1, 2, 3] and all("deadline" in m for m in failed.values())
    assert sorted(got) == [4, 5, 6, 7]


def test_device_settings_refuse_half_precision_on_the_cpu():
    with pytest.raises(ValueError, match="fp16"):
        DeviceSettings(device="cpu", precision="fp16")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA graphs)")
def test_cuda_graph_pipeline_answers_as_the_reference_in_fp32():
    model = build_model("tiny-ee", seed=0, trained=False)
    arrays = model.example_arrays(96, seed=4)
    rule = ForcedRule([1.0, 0.5, 0.35, 0.3])
    ref = reference_answers(model, tuple(arrays[s.name] for s in model.card.inputs), rule, enabled_ramps=(1, 2, 3))
    from e3.serving.device.executor import prepare_model
    settings = DeviceSettings(device="cuda", max_batch=16)
    on_gpu = prepare_model(build_model("tiny-ee", seed=0, trained=False), settings)
    got = {}
    pipe = DevicePipeline(on_gpu, cuts=(1,), batch_sizes=[16, 16], enabled_ramps=(1, 2, 3), rule=rule,
                          settings=settings, slo_ms=1e6, answer=got.__setitem__, fail=lambda h, m: None)
    for i in range(0, 96, 8):
        pipe.admit(i, {k: v[i:i + 8] for k, v in arrays.items()})
    pipe.run_until_idle()
    exits = np.concatenate([got[i]["exit_ramp"][:, 0] for i in range(0, 96, 8)])
    assert np.array_equal(exits, ref.exit_ramp)


def test_measured_hops_replace_the_assumed_exchange_in_a_cuda_profile(tmp_path):
    """e3 profile --cuda --hops RUN_DIR: Tx is the BLS hop the side-by-side measured (interpolated in log2 batch,
    the nearest figure outside), not the copies plus an assumed 0.2 ms; a run without hops is refused."""
    import json

    from e3.core.profile import ProfileError
    from e3.profiling.cuda_profile import profile_cuda
    from e3.profiling.cuda_profile import CudaSettings, bls_from_run, measured_hop_ms
    run = tmp_path / "run"
    run.mkdir()
    (run / "side_by_side.json").write_text(json.dumps({"hops": [
        {"model": "tiny-ee", "zoo": "tiny-ee", "max_batch": 2, "bls_ms": 1.0, "host_ms": 0.1, "handoff_ms": 0.01},
        {"model": "tiny-ee", "zoo": "tiny-ee", "max_batch": 8, "bls_ms": 2.0, "host_ms": 0.1, "handoff_ms": 0.01}]}))
    hops = bls_from_run(run, "tiny-ee")
    assert hops == ((2, 1.0), (8, 2.0))
    assert measured_hop_ms(hops, [1, 2, 4, 8, 16]) == pytest.approx([1.0, 1.0, 1.5, 2.0, 2.0])
    with pytest.raises(ProfileError, match="no measured hop"):
        bls_from_run(run, "bert-ee")
    p = profile_cuda("tiny-ee", CudaSettings(torch_device="cpu", graphs=False, precision="fp32", repeats=2,
                                                   warmup=1, batch_sizes=(1, 4), bls_ms=hops), progress=False)
    (device,) = p.devices
    assert p.tx_ms[device] == pytest.approx([1.0, 1.5], abs=1e-9)
    assert "MEASURED in Triton" in p.source


def test_fail_all_answers_every_request_still_queued_or_in_flight_once():
    model = build_model("tiny-ee", seed=0, trained=False)
    arrays = model.example_arrays(40, seed=6)
    got, failed = {}, {}
    pipe = DevicePipeline(model, cuts=(1,), batch_sizes=[8, 8], enabled_ramps=(1, 2, 3), rule=ForcedRule([1, .5, .5, .5]),
                          settings=DeviceSettings(max_batch=8), slo_ms=1e6, answer=got.__setitem__,
                          fail=failed.__setitem__, depth=2)
    for i in range(5):
        pipe.admit(i, {k: v[8 * i:8 * i + 8] for k, v in arrays.items()})
    pipe.step()
    pipe.step()   # one run in flight at least, rows queued behind it
    pipe.fail_all("unloading")
    assert sorted([*got, *failed]) == list(range(5)) and set(failed.values()) == {"unloading"}
    assert pipe.idle() and not pipe.step()
