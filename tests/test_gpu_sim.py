"""GPU clusters by simulation (`e3 bench gpu`), the pure parts: no server, a tiny synthetic GPU-like
profile (flat in the batch, as a GPU's is below its knee), the real planner and simulator."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from e3.core.plan import Plan, SplitPlan
from e3.core.profile import BatchProfile, DeviceConfig, LatencyProfile
from e3.benchmarks.gpu_sim import BEGIN, replace_gpu_section
from e3.simulator.des import Arrivals, CallCosts, SimResult, simulate_baseline, simulate_plan
from e3.simulator.des import Baseline
from e3.benchmarks.gpu_clusters import (MODELLED, Cell, GpuSimSettings, batch_table, beside_profile, best_baseline,
                              clusters_at_budget,
                              cost_at_goodput,
                              cost_table, gpu_call_costs, heterogeneity_table, plan_for, plot_goodput,
                              results_document, saturate, simulate_e3, with_link)

L = 4
BATCHES = [1, 2, 4, 8, 16, 32, 64]


def gpu_profile(block_ms: float = 1.0, router_ms: float = 0.0, tx_fixed_ms: float = 0.05) -> LatencyProfile:
    """A GPU-like profile: a block costs nearly the same at batch 1 and 64 (batching pays), hops are
    cheap; two device types, the second half as fast at a third of the price."""
    def dev(scale):
        return {"block": [[block_ms * scale * (1 + b / 640) for b in BATCHES] for _ in range(L)],
                "ramp": [[0.01 * scale] * len(BATCHES) if k < L else [0.0] * len(BATCHES) for k in range(1, L + 1)]}
    fast, slow = dev(1.0), dev(2.0)
    tx = [tx_fixed_ms + 0.001 * b for b in BATCHES]
    return LatencyProfile(
        model="toy", num_blocks=L, batch_sizes=list(BATCHES),
        devices={"g1": DeviceConfig("g1", 3.0, modelled=True), "g2": DeviceConfig("g2", 1.0, modelled=True)},
        block_ms={"g1": fast["block"], "g2": slow["block"]}, ramp_ms={"g1": fast["ramp"], "g2": slow["ramp"]},
        tx_ms={"g1": tx, "g2": tx}, spread_ms={}, source="synthetic (test)", tx_in_ms={"g1": tx, "g2": tx},
        check_ms={"g1": [0.2] * len(BATCHES), "g2": [0.2] * len(BATCHES)},
        router_ms={"g1": [router_ms] * len(BATCHES), "g2": [router_ms] * len(BATCHES)})


def exits(n=512, seed=0) -> tuple[np.ndarray, BatchProfile]:
    """Exactly half of the inputs leave at ramp 1, a quarter at ramp 2, the rest at the head (shuffled)."""
    rng = np.random.default_rng(seed)
    ex = rng.permutation(np.repeat([1, 2, L], [n // 2, n // 4, n - n // 2 - n // 4]))
    reach = [float(np.mean(ex >= k)) for k in range(1, L + 1)]
    return ex, BatchProfile(model="toy", batch_size=8, reach=reach)


SMALL = GpuSimSettings(device="g1", gpus=8, batches=(8,), slo_ms=200.0, inflight_start=512, max_doublings=3,
                       min_requests=200, max_batch_grid=(64,), delay_grid_us=(0,))


def test_where_batching_pays_e3_beats_naive_early_exit_and_stock_at_batch_8():
    lat = gpu_profile()
    ex, bp = exits()
    plan = plan_for(lat, bp, {"g1": 8}, settings=SMALL)
    e3 = simulate_e3(lat, plan, ex, batch=8, settings=SMALL)
    ee = best_baseline(lat, "ee", "g1", gpus=8, exit_ramp=ex, batch=8, settings=SMALL)
    stock = best_baseline(lat, "stock", "g1", gpus=8, exit_ramp=ex, batch=8, settings=SMALL)
    # the ideal here: stock runs 4 blocks per batch, E3 1 + 0.5 + 0.25 + 0.25 = 2 blocks per input batch
    assert e3.goodput_ips > 1.3 * ee.goodput_ips
    assert e3.goodput_ips > 1.3 * stock.goodput_ips
    assert e3.cluster == "8 x g1" and e3.cost_per_hour == pytest.approx(24.0)
    # every level of the sweep is kept, and the best is the one reported
    assert len(e3.sweep) >= 2 and e3.goodput_ips == pytest.approx(max(g for _, g in e3.sweep))


def test_a_router_slower_than_the_blocks_costs_e3_its_advantage_only_where_it_waits_on_the_router():
    """Router work of 3 ms per batch against blocks of 1 ms: inside every split's time (the CPU's model) E3
    loses to naive early exit; beside the GPUs on 4 host cores per GPU it overlaps the compute and E3 wins
    again; on one host core it caps E3 at 64 rows per 3 ms, whatever the GPUs."""
    lat = gpu_profile(router_ms=3.0)
    ex, bp = exits()
    ee = best_baseline(lat, "ee", "g1", gpus=8, exit_ramp=ex, batch=8, settings=SMALL)

    def e3(**changes):
        settings = dataclasses.replace(SMALL, **changes)
        return simulate_e3(lat, plan_for(lat, bp, {"g1": 8}, settings=settings), ex, batch=8, settings=settings)

    assert e3(router_cores_per_gpu=0.0).goodput_ips < ee.goodput_ips
    beside = e3()
    assert beside.goodput_ips > 1.2 * ee.goodput_ips and "constant" in beside.config
    assert e3(router_cores=1).goodput_ips <= 64 / 3.0e-3 * 1.02


def _one_split(batch: int = 64) -> Plan:
    return Plan(model="toy", num_blocks=L, exit_rule={"kind": "entropy", "tau_nats": 0.0}, slo_ms=1e4,
                splits=(SplitPlan("toy_split_1-2", 1, 2, batch, 1, "g1", 0, (1,)),
                        SplitPlan("toy_split_3-4", 3, 4, batch, 1, "g1", 0, (2,))))


def test_a_constant_splits_stages_beside_the_gpu_overlap_its_compute_with_a_batch_in_flight_per_stage():
    """One instance per split, every input to the end (exit ramp L); copy in 2.06 ms, compute 2.21 ms, router
    work 2 ms per batch of 64: with a batch in flight per stage the compute sets the rate; with two (today's
    router: instances + 1 slots) the stages' sum over two; with the router's work inside the instance's time
    (the CPU's model) compute + router."""
    lat = gpu_profile(router_ms=2.0, tx_fixed_ms=2.0)
    ex = np.full(512, L)
    arrivals = Arrivals(batch=64, requests=300, clients=8, warmup=8, client_ms=0.0, steady=True)
    compute_ms = lat.block(1, "g1", 64, with_ramp=True) + lat.block(2, "g1", 64, with_ramp=False)
    copy_in, copy_out = lat.tx_in("g1", 64), 0.001 * 64

    def rate(**kw) -> float:
        return simulate_plan(lat, _one_split(), ex, arrivals=arrivals, device="g1", costs=gpu_call_costs(**kw)).inputs_per_s

    assert rate(router_cores=4, out_copy=True) == pytest.approx(64e3 / compute_ms, rel=0.05)
    assert rate(router_cores=4, out_copy=True, slots_per_instance=1) == pytest.approx(
        2 * 64e3 / (copy_in + compute_ms + copy_out + 2.0), rel=0.08)
    assert rate() == pytest.approx(64e3 / (compute_ms + 2.0), rel=0.05)
    # a copy in of 2 ms fixed + bytes holding its engine for the bytes only: still the compute's rate, with
    # the fixed part as one more stage in flight even when the router's work is inside the instance's time
    lat.router_ms = {d: [0.0] * len(BATCHES) for d in lat.router_ms}
    assert rate(hop_fixed_latency=True) == pytest.approx(64e3 / compute_ms, rel=0.05)


def test_the_beside_profile_puts_the_router_and_the_copies_in_the_hops_pipeline_term():
    lat = gpu_profile(router_ms=0.3, tx_fixed_ms=0.05)
    out = beside_profile(lat)
    assert out.router_ms == {} and lat.router("g1", 64) == pytest.approx(0.3)     # the original is left alone
    assert out.tx("g1", 1) == pytest.approx(0.3) and out.tx("g1", 64) == pytest.approx(0.3)   # max(tx, R)
    lat2 = gpu_profile(router_ms=0.01, tx_fixed_ms=0.05)
    assert beside_profile(lat2).tx("g1", 64) == pytest.approx(0.05 + 0.064)
    # a hop's fixed part as latency: the pipeline term holds the bytes only
    assert beside_profile(lat2, hop_fixed_latency=True).tx("g1", 64) == pytest.approx(0.064)
    assert beside_profile(lat, hop_fixed_latency=True).tx("g1", 64) == pytest.approx(0.3)
    # the first split's term also carries its copy out: the bytes part of a cut's hop
    assert beside_profile(lat2).tx_in("g1", 64) == pytest.approx(0.05 + 0.064)
    assert beside_profile(lat2).tx_in("g1", 1) == pytest.approx(0.05 + 0.001)


def test_overlapped_input_copies_raise_a_baselines_throughput_by_the_copy_time():
    lat = gpu_profile(tx_fixed_ms=0.5)
    ex, _ = exits()
    arrivals = Arrivals(batch=64, requests=300, clients=4, warmup=4, client_ms=0.0, steady=True)
    serial = simulate_baseline(lat, Baseline("stock", instances=1, max_batch=64), ex, arrivals=arrivals, device="g1",
                               costs=CallCosts(input_curve="tx_in", request_ms=0.0))
    overlapped = simulate_baseline(lat, Baseline("stock", instances=1, max_batch=64), ex, arrivals=arrivals, device="g1",
                                   costs=gpu_call_costs())
    compute_ms = sum(lat.block(k, "g1", 64, with_ramp=False) for k in range(1, L + 1))
    assert serial.inputs_per_s == pytest.approx(64e3 / (compute_ms + lat.tx_in("g1", 64)), rel=0.02)
    assert overlapped.inputs_per_s == pytest.approx(64e3 / compute_ms, rel=0.02)


def test_saturate_doubles_the_load_until_goodput_stops_rising():
    seen = []

    def run(a: Arrivals) -> SimResult:
        inflight = a.clients * a.batch
        seen.append(inflight)
        return SimResult(inputs_per_s=0, p50_ms=1, p99_ms=2, goodput_ips=min(inflight, 400) * 10.0)

    best, sweep = saturate(run, 4, GpuSimSettings(inflight_start=100, max_doublings=6))
    assert seen == [100, 200, 400, 800]                 # 800 rose by 0%: stop
    assert [g for _, g in sweep] == [1000, 2000, 4000, 4000]
    assert best.goodput_ips == 4000


def test_clusters_at_budget_fit_the_budget_and_spend_most_of_it():
    lat = gpu_profile()
    clusters = clusters_at_budget(lat, 12.0, ["g1", "g2"])
    assert {"g1": 4} in clusters and {"g2": 12} in clusters and {"g1": 2, "g2": 6} in clusters
    for c in clusters:
        cost = sum(lat.devices[d].price * n for d, n in c.items())
        assert cost <= 12.0 and cost > 12.0 - 3.0


def test_with_link_reprices_only_the_bytes_term_of_every_hop():
    lat = gpu_profile()
    fast = with_link(lat, 100.0, modelled_gbit_s=25.0, fixed_ms=0.05)
    assert fast.tx("g1", 64) == pytest.approx(0.05 + 0.064 / 4)
    assert fast.tx_in("g2", 1) == pytest.approx(0.05 + 0.001 / 4)
    assert lat.tx("g1", 64) == pytest.approx(0.05 + 0.064)        # the original is left alone


def _cells():
    return [Cell("e3", 8, 300.0, 5.0, "1-4 constant 4xg1 b64", [(128, 200e3), (256, 300e3)], "4 x g1", 12.0, 320.0),
            Cell("stock", 8, 150.0, 4.0, "4 inst, max batch 64, delay 0 us", [(128, 150.0)], "4 x g1", 12.0),
            Cell("ee", 8, 200.0, 4.0, "4 inst, max batch 64, delay 0 us", [(128, 200.0)], "4 x g1", 12.0)]


def test_tables_and_document_say_modelled_and_carry_the_ratios():
    cells = _cells()
    table = batch_table([c.to_dict() for c in cells], "4 x g1")
    row = next(line for line in table.splitlines() if line.startswith("| 8 |"))
    assert "| 1.50x | 2.00x |" in row and "200k → 300k" in row
    assert MODELLED in table
    lat = gpu_profile()
    ex, bp = exits()
    plan = plan_for(lat, bp, {"g1": 8}, settings=SMALL)
    doc = results_document(SMALL, lat, cells, plan=plan, hetero=None, cost=None, commit="abc")
    assert doc["label"] == MODELLED and doc["ratios"]["8"] == {"e3_over_ee": 1.5, "e3_over_stock": 2.0}
    hetero = {"rows": [{"cluster": "4 x g1", "cost_per_hour": 12.0, "cells": [c.to_dict() for c in cells]},
                       {"cluster": "2 x g1 + 6 x g2", "cost_per_hour": 12.0, "cells": [cells[0].to_dict()]}]}
    text = heterogeneity_table(hetero)
    assert "MODELLED" in text and "| 2 x g1 + 6 x g2 | 12.00 | 300* | n/a | n/a |" in text and "| 4 x g1 | 12.00 | 300* | 150* | 200* |" in text
    cost = cost_table({"rows": [{"system": "e3", "gpu": "any", **cells[0].to_dict(), "reaches": True},
                                {"system": "stock", "gpu": "g2", "cluster": "-", "reaches": False}]})
    assert "| e3 | any | 4 x g1 | 12.00 | 300 | yes | - |" in cost and "| stock | g2 | - | - | - | no | - |" in cost


def test_the_section_is_replaced_between_its_markers_only(tmp_path):
    doc = "# Results\n\nintro\n"
    once = replace_gpu_section(doc, "first")
    twice = replace_gpu_section(once + "\nafter\n", "second")
    assert twice.count(BEGIN) == 1 and "second" in twice and "first" not in twice and twice.endswith("after\n")
    with pytest.raises(ValueError, match="broken `gpu-sim` section"):
        replace_gpu_section(BEGIN + "\n", "x")
    png = tmp_path / "g.png"
    plot_goodput([c.to_dict() for c in _cells()], "toy", png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cost_at_goodput_finds_clusters_that_reach_the_target_and_e3_is_cheapest_where_batching_pays():
    lat = gpu_profile()
    ex, bp = exits()
    # the router's work inside each split's time: the lighter simulation (the router beside the GPUs is
    # tested above); the search is what this test is about
    settings = GpuSimSettings(**{**SMALL.__dict__, "hetero_types": ("g1", "g2"), "max_per_type": 16,
                                 "router_cores_per_gpu": 0.0})
    e3_on_8 = simulate_e3(lat, plan_for(lat, bp, {"g1": 8}, settings=settings), ex, batch=8, settings=settings)
    target = 0.5 * e3_on_8.goodput_ips
    doc = cost_at_goodput(lat, bp, ex, target_ips=target, settings=settings)
    rows = {(r["system"], r["gpu"]): r for r in doc["rows"]}
    reached = {k: r for k, r in rows.items() if r["reaches"]}
    assert ("e3", "any") in reached and ("stock", "g1") in reached and ("stock", "g2") in reached
    assert all(r["goodput_ips"] >= target for r in reached.values())
    assert all(r["cluster"] == "-" for r in rows.values() if not r["reaches"])   # none within max_per_type
    e3_cost = rows[("e3", "any")]["cost_per_hour"]
    assert e3_cost < min(r["cost_per_hour"] for (system, _), r in reached.items() if system != "e3")
    # a baseline's cluster is the fewest GPUs: one fewer does not reach the target
    stock = rows[("stock", "g1")]
    n = int(stock["cluster"].split(" x ")[0])
    assert n == 1 or best_baseline(lat, "stock", "g1", gpus=n - 1, exit_ramp=ex, batch=8, settings=settings).goodput_ips < target
