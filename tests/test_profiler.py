"""e3 profile: pure aggregation, merging and the table; one real measurement of tiny-ee (blocks + Tx)."""

import json
import time

import numpy as np
import pytest

from e3.core.profile import DeviceConfig, LatencyProfile, ProfileError
from e3.profiling.profiler import (ProfileSettings, assemble_profile, cut_state, default_batch_sizes, format_table,
                                measure_check, measure_router, measure_stock, merge_profiles, parse_batch_sizes,
                                second_thread_gain, summarize)


def make_profile(device="cpu", batches=(1, 2, 4), L=2, scale=1.0, modelled=False, model="m") -> LatencyProfile:
    """A hand-built profile: block k costs scale*k*b ms at batch b, ramp k 0.1*scale*b, Tx 0.5+b."""
    return LatencyProfile(
        model=model, num_blocks=L, batch_sizes=list(batches),
        devices={device: DeviceConfig(device, 2.0, modelled)},
        block_ms={device: [[scale * k * b for b in batches] for k in range(1, L + 1)]},
        ramp_ms={device: [[0.1 * scale * b for b in batches] for _ in range(L)]},
        tx_ms={device: [0.5 + b for b in batches]},
        spread_ms={} if modelled else {device: [[0.01] * len(batches) for _ in range(L)]},
        source=f"test {device}")


def test_summarize_median_and_iqr():
    s = summarize([1, 2, 3, 4, 100])
    assert s.median_ms == 3 and s.iqr_ms == pytest.approx(2.0)
    with pytest.raises(ValueError):
        summarize([])


def test_batch_sizes_default_and_parsing():
    assert default_batch_sizes(64) == [1, 2, 4, 8, 16, 32, 64]
    assert default_batch_sizes(48) == [1, 2, 4, 8, 16, 32, 48]
    assert default_batch_sizes(1) == [1]
    assert parse_batch_sizes("4,1, 2,2", 64) == [1, 2, 4]
    assert parse_batch_sizes(None, 8) == [1, 2, 4, 8]
    for bad in ("0,1", "1,65", "a,b", ","):
        with pytest.raises(ValueError, match="batch sizes"):
            parse_batch_sizes(bad, 64)


def test_assemble_profile_takes_medians_clamps_ramps_and_keeps_spread():
    without = [[[1.0, 2.0, 3.0], [2.0, 2.0, 2.0]], [[5.0, 5.0, 5.0], [6.0, 8.0, 10.0]]]
    with_ramp = [[[1.5, 2.5, 3.5], [1.0, 1.0, 1.0]], None]  # block 1 at batch 2: "with" measured faster
    tx = [[0.4, 0.5, 0.6], [0.9, 1.0]]
    p = assemble_profile("m", [1, 2], without, with_ramp=with_ramp, tx=tx, source="unit")
    assert p.block_ms["cpu"] == [[2.0, 2.0], [5.0, 8.0]]
    assert p.ramp_ms["cpu"] == [[0.5, 0.0], [0.0, 0.0]]  # max(0, with - without); no ramp -> 0
    assert p.tx_ms["cpu"] == [0.5, 0.95]
    assert p.spread_ms["cpu"][1][1] == pytest.approx(2.0)  # IQR of 6, 8, 10
    assert p.devices["cpu"] == DeviceConfig("cpu", 1.0, False) and not p.modelled
    assert p.check_ms == {} and p.router_ms == {}   # not measured: no curves (the planner reads 0)
    LatencyProfile.from_dict(json.loads(json.dumps(p.to_dict())))  # round-trips and validates
    p = assemble_profile("m", [1, 2], without, with_ramp=with_ramp, tx=tx, check=[[0.05, 0.07, 0.06], [0.08]],
                         router=[[0.2, 0.1, 0.3], [0.4, 0.5]])
    assert p.check_ms == {"cpu": [0.06, 0.08]} and p.router_ms == {"cpu": [0.2, 0.45]}   # medians
    LatencyProfile.from_dict(json.loads(json.dumps(p.to_dict())))
    p = assemble_profile("m", [1, 2], without, with_ramp=with_ramp, tx=tx, stock=[[9.0, 10.0, 11.0], [18.0, 20.0]],
                         stock_2t=[[5.0, 6.0], [11.0]], request=[0.7, 0.8], client=[0.5, 0.6])
    # the level is the median's, the second thread's gain the ratio of the least disturbed calls (25th pct)
    assert p.stock_ms == {"cpu": [10.0, 19.0]}
    assert p.stock_2t_ms["cpu"] == pytest.approx([10.0 / (9.5 / 5.25), 19.0 / (18.5 / 11.0)])
    assert p.thread_speedup("cpu", 2, 2) == pytest.approx(18.5 / 11.0) and p.thread_speedup("cpu", 2, 1) == 1.0
    assert p.thread_speedup("cpu", 2, 4) is None and p.stock("cpu", 1.5) == pytest.approx(14.5)
    back = LatencyProfile.from_dict(json.loads(json.dumps(p.to_dict())))
    assert (back.request_ms, back.client_ms) == ({"cpu": [0.7, 0.8]}, {"cpu": [0.5, 0.6]})
    assert back.request("cpu", 2) == pytest.approx(0.8) and back.client("cpu", 1) == pytest.approx(0.5)


def test_the_second_threads_gain_is_the_median_of_its_passes():
    """Issue 42: one pass per profile gave the 2-thread curve one draw of a gain that moves with the machine's
    speed; several passes give the median of their ratios (each between the least disturbed calls)."""
    one = [[10.0] * 4, [20.0, 20.0, 21.0, 22.0], [12.0] * 4]
    two = [[5.0, 5.0, 5.0, 6.0], [16.0] * 4, [8.0, 8.0, 9.0, 9.0]]
    # per pass 2.0, 1.25 and 1.5: their median; the pooled calls' least disturbed would give 10 / 5 = 2.0
    assert second_thread_gain(one, two) == pytest.approx(1.5)
    assert second_thread_gain(one[:1], two[:1]) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="per pass"):
        second_thread_gain(one, two[:2])
    without = [[[1.0, 2.0, 3.0]]]
    p = assemble_profile("m", [1], without, with_ramp=[None], tx=[[0.5]], stock=[np.concatenate(one)],
                         stock_2t=[np.concatenate(two)], thread_gain=[second_thread_gain(one, two)])
    assert p.stock_ms["cpu"] == [pytest.approx(12.0)] and p.thread_speedup("cpu", 1, 2) == pytest.approx(1.5)
    with pytest.raises(ValueError, match="thread_passes"):
        ProfileSettings(thread_passes=0)


def test_the_stock_graph_is_timed_in_passes(tiny_model, tmp_path):
    """Every pass times every batch size on both thread counts (``repeats`` calls each)."""
    stock, foreign = measure_stock(tiny_model, [1, 4], ProfileSettings(repeats=3, warmup=1, thread_passes=2),
                                   workdir=tmp_path)
    assert sorted(stock) == [1, 2] and len(foreign) == 2
    assert [[a.shape for a in passes] for passes in stock[2]] == [[(3,), (3,)], [(3,), (3,)]]
    assert all((a > 0).all() for t in stock for passes in stock[t] for a in passes)


def test_format_table_shows_every_block_ramps_tx_and_spread():
    text = format_table(make_profile(L=3))
    lines = text.splitlines()
    assert "measured" in lines[0] and "median±IQR" in lines[0]
    assert lines[1].split() == ["block", "B=1", "B=2", "B=4"]
    assert lines[2].startswith("1 (+stem)") and "1.000±0.010" in lines[2]
    assert any(line.startswith("3 (+head)") for line in lines)
    assert sum(line.strip().startswith("ramp") for line in lines) == 3
    assert any(line.startswith("Tx (hop)") and "4.500" in line for line in lines)
    modelled = format_table(make_profile("v100", modelled=True))
    assert "MODELLED" in modelled.splitlines()[0] and "±" not in modelled
    assert "check" not in text and "router" not in text
    p = make_profile()
    p.check_ms, p.router_ms, p.tx_in_ms = {"cpu": [0.05, 0.06, 0.07]}, {"cpu": [0.1, 0.2, 0.3]}, {"cpu": [0.3] * 3}
    lines = format_table(p).splitlines()
    assert any(line.startswith("check (per ramp)") and "0.070" in line for line in lines)
    assert any(line.startswith("router (per batch)") and "0.300" in line for line in lines)
    assert any(line.startswith("Tx in (inputs)") for line in lines)


def test_merge_profiles_same_and_different_batch_sizes():
    cpu, v100 = make_profile("cpu"), make_profile("v100", scale=0.1, modelled=True)
    merged = merge_profiles([cpu, v100])
    assert list(merged.devices) == ["cpu", "v100"] and merged.modelled
    assert merged.block_ms["v100"] == v100.block_ms["v100"] and merged.tx_ms["cpu"] == cpu.tx_ms["cpu"]
    assert "test cpu" in merged.source and "test v100" in merged.source
    t4 = make_profile("t4", batches=(1, 8), modelled=True)
    merged = merge_profiles([cpu, t4])
    assert merged.batch_sizes == [1, 2, 4, 8]
    # cpu resampled: linear extrapolation past batch 4; t4 interpolated between 1 and 8
    assert merged.block(2, "cpu", 8, with_ramp=False) == pytest.approx(16.0)
    assert merged.block(1, "t4", 4, with_ramp=False) == pytest.approx(4.0)
    assert merged.ramp_ms["t4"][0][2] == pytest.approx(0.4)
    merged.validate()
    # the optional curves travel with their device, resampled like the others
    cpu.check_ms, cpu.router_ms = {"cpu": [0.05, 0.06, 0.08]}, {"cpu": [0.1, 0.2, 0.4]}
    t4.tx_in_ms = {"t4": [0.2, 0.3]}
    merged = merge_profiles([cpu, t4])
    assert merged.check_ms == {"cpu": pytest.approx([0.05, 0.06, 0.08, 0.12])}
    assert merged.router_ms == {"cpu": pytest.approx([0.1, 0.2, 0.4, 0.8])}
    assert set(merged.tx_in_ms) == {"t4"} and merged.tx_in("cpu", 2) == merged.tx("cpu", 2)
    merged.validate()


def test_merge_profiles_rejects_clashes():
    with pytest.raises(ProfileError, match="appears in two"):
        merge_profiles([make_profile("cpu"), make_profile("cpu")])
    with pytest.raises(ProfileError, match="cannot merge"):
        merge_profiles([make_profile("cpu"), make_profile("t4", L=3)])
    with pytest.raises(ProfileError, match="nothing"):
        merge_profiles([])


def test_check_and_router_are_measured_in_process(tiny_model):
    """The exit check and the router's per-batch work: numpy only, one timing per repeat and batch size."""
    card = tiny_model.card
    check = measure_check(card, [1, 8, 64], repeats=5, warmup=1)
    router = measure_router(card, [1, 8, 64], repeats=5, warmup=1)
    assert [t.shape for t in check] == [(5,)] * 3 and [t.shape for t in router] == [(5,)] * 3
    assert all((t > 0).all() and (t < 100).all() for t in check + router)
    # the router answers every row of the batch: its work at 64 rows exceeds its work at 1
    assert np.median(router[2]) > np.median(router[0])


@pytest.mark.e2e
def test_e3_profile_measures_tiny_ee_blocks_and_tx_on_a_real_server(tmp_path, capsys):
    from e3.cli import main
    out = tmp_path / "tiny.cpu.json"
    start = time.monotonic()
    assert main(["profile", "tiny-ee", "--batch-sizes", "1,2,4", "--repeats", "2", "--warmup", "1",
                 "--out", str(out)]) == 0
    elapsed = time.monotonic() - start
    p = LatencyProfile.load(out)
    assert (p.model, p.num_blocks, p.batch_sizes, list(p.devices)) == ("tiny_ee", 4, [1, 2, 4], ["cpu"])
    assert p.devices["cpu"].price == 1 and not p.modelled
    assert all(v > 0 for row in p.block_ms["cpu"] for v in row)
    assert all(v >= 0 for row in p.ramp_ms["cpu"] for v in row)
    assert p.ramp_ms["cpu"][3] == [0.0, 0.0, 0.0]  # block L: the head is part of the block
    assert all(v > 0 for v in p.tx_ms["cpu"])  # a real BLS hop costs something
    assert np.shape(p.spread_ms["cpu"]) == (4, 3)
    assert "BLS hop" in p.source and "ONNX Runtime" in p.source and "BatchRoute.observe" in p.source
    assert len(p.check_ms["cpu"]) == 3 and all(v > 0 for v in p.check_ms["cpu"])
    assert len(p.router_ms["cpu"]) == 3 and all(v > 0 for v in p.router_ms["cpu"])
    # the stock graph, on 1 and 2 threads; the front door's host CPU per request, the client's part of it
    assert len(p.stock_ms["cpu"]) == 3 and all(v > 0 for v in p.stock_ms["cpu"])
    assert len(p.stock_2t_ms["cpu"]) == 3 and all(v > 0 for v in p.stock_2t_ms["cpu"])
    assert all(0 < c <= r < 50 for c, r in zip(p.client_ms["cpu"], p.request_ms["cpu"]))
    # 2 copies at once: a CV (a tiny model's calls of microseconds, once pre-empted on a busy machine, vary a lot)
    assert len(p.jitter_cv["cpu"]) == 3 and all(0 <= v < float("inf") for v in p.jitter_cv["cpu"])
    table = capsys.readouterr().out
    assert "tiny_ee on cpu (measured" in table and "Tx (hop)" in table and str(out) in table
    assert "check (per ramp)" in table and "router (per batch)" in table
    assert elapsed < 60, f"profiling took {elapsed:.0f} s"


def test_e3_profile_rejects_bad_batch_sizes(capsys):
    from e3.cli import main
    assert main(["profile", "tiny-ee", "--batch-sizes", "0,128", "--no-tx"]) == 2
    assert "within 1..64" in capsys.readouterr().err


def test_tx_carries_the_heaviest_cut():
    """A CNN-like card whose state changes shape at every cut: the heaviest cut between two blocks
    (here the middle one; the stem's output, k = 0, is no cut between splits) sets the Tx tensors."""
    from e3.core.spec import ModelCard, TensorSpec
    card = ModelCard(name="cnn", num_blocks=4, ramp_blocks=(1, 2, 3), num_classes=10,
                     inputs=(TensorSpec("pixels", "FP32", (1, 28, 28)),),
                     state=(TensorSpec("features", "FP32", (4, 7, 7)),),
                     state_shapes={0: ((64, 28, 28),), 1: ((4, 7, 7),), 2: ((16, 14, 14),), 3: ((8, 7, 7),)})
    got = cut_state(card)
    assert [(t.name, t.dtype, t.shape) for t in got] == [("features", "FP32", (16, 14, 14))]


def test_tx_of_an_encoder_is_its_state(tiny_model):
    assert cut_state(tiny_model.card) == tiny_model.card.state  # an encoder's state is the same at every cut


def test_tx_of_the_resnet_is_its_heaviest_real_cut():
    """On the untrained ResNet-EE architecture, cut_state names the tensor that really crosses the
    heaviest cut: shapes measured by running the blocks, not read from the card."""
    import torch
    from e3.models.zoo.resnet import ResNetEE
    model = ResNetEE("resnet-ee", {"kind": "entropy", "tau_nats": 0.5}).eval()
    crossing = []
    with torch.no_grad():
        state = model.stem(*model.example_inputs(1, seed=3))
        for k in range(1, model.card.num_blocks):       # the cuts between two blocks
            state = model.block(k, *state)
            crossing.append(tuple(tuple(t.shape[1:]) for t in state))
    heaviest = max(crossing, key=lambda shapes: sum(int(np.prod(s)) for s in shapes))
    assert len(set(crossing)) > 1                       # the state does change shape between cuts
    assert tuple(t.shape for t in cut_state(model.card)) == heaviest


def test_block_order_runs_the_other_blocks_between_two_calls_of_a_block():
    """One timing round calls every block as a served batch does: 1..L without ramps, then 1..L-1 with;
    between two calls of a block at least L-2 other blocks run, so no call finds its own weights warm."""
    from e3.profiling.profiler import block_order
    order = block_order(5, (1, 2, 3, 4))
    assert order == [(1, "without"), (2, "without"), (3, "without"), (4, "without"), (5, "without"),
                     (1, "with"), (2, "with"), (3, "with"), (4, "with")]
    assert block_order(3, (2,)) == [(1, "without"), (2, "without"), (3, "without"), (2, "with")]
    rounds = order * 3
    for i, (k, _) in enumerate(rounds[:-len(order)]):
        nxt = next(j for j in range(i + 1, len(rounds)) if rounds[j][0] == k)
        assert len({b for b, _ in rounds[i + 1:nxt]}) >= 5 - 2


def test_router_work_runs_the_serving_code_and_the_compute_between_calls(tiny_model):
    """router_batch answers every input of the batch through the scheduler (one request each, every exit
    ramp decided); the `between` work runs once before every timed call, warmup included, and is not timed."""
    from e3.profiling.profiler import router_batch
    card = tiny_model.card
    answers = router_batch(card, 8, np.random.default_rng(0))()
    assert len(answers) == 8
    assert all(a["label"].shape == (1, 1) and a["label"][0, 0] >= 0 and a["exit_ramp"][0, 0] >= 1 for a in answers)
    calls = []
    slow = lambda b: (calls.append(b), time.sleep(0.02))   # noqa: E731 - 20 ms per call, never timed
    router = measure_router(card, [1, 4], repeats=3, warmup=1, between=slow)
    check = measure_check(card, [4], repeats=2, warmup=0, between=slow)
    assert calls == [1] * 4 + [4] * 4 + [4] * 2
    assert all((t < 15).all() for t in router + check)
