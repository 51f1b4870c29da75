"""`e3 bench admission`'s pure parts: the burst schedule, latency per phase, throughput at the QoS target."""

from __future__ import annotations

import numpy as np
import pytest

from e3.benchmarks.admission_report import (Phase, RatePoint, burst_schedule, format_burst, format_throughput,
                                        phase_latencies, throughput_at_qos)


def test_the_burst_schedule_has_each_phases_rate_back_to_back():
    phases = [Phase("low", 20, 50), Phase("high", 200, 50), Phase("low", 20, 50)]
    times, which = burst_schedule(phases, seed=3)
    assert np.all(np.diff(times) > 0) and times[0] >= 0 and times[-1] < 150
    for i, p in enumerate(phases):
        mine = times[which == i]
        assert mine.min() >= 50 * i and mine.max() < 50 * (i + 1)
        assert len(mine) == pytest.approx(p.rate_rps * p.duration_s, rel=0.15)
    with pytest.raises(ValueError, match="rate and duration"):
        burst_schedule([Phase("x", 0, 1)])


def test_phase_latencies_judge_each_phase_by_its_own_p99_and_failures():
    phases = [Phase("low", 1, 1), Phase("high", 1, 1)]
    lat = np.array([10.0] * 100 + [10.0] * 98 + [500.0, 500.0])
    which = np.array([0] * 100 + [1] * 100)
    failed = np.zeros(200, bool)
    rows = phase_latencies(lat, which, failed, phases=phases, qos_ms=100)
    assert [r["meets_qos"] for r in rows] == [True, False] and rows[1]["p99_ms"] > 100
    failed[3] = True
    assert phase_latencies(lat, which, failed, phases=phases, qos_ms=100)[0]["meets_qos"] is False


def test_throughput_at_qos_is_the_last_rate_met_before_the_first_miss():
    points = [RatePoint(10, 10, 50, 0), RatePoint(20, 19.8, 80, 0), RatePoint(30, 29, 190, 0),  # p99 missed
              RatePoint(40, 39.9, 95, 0)]                                                        # after a miss
    assert throughput_at_qos(points, qos_ms=100) == 19.8
    behind = [RatePoint(10, 10, 50, 0), RatePoint(30, 25, 90, 0)]
    assert throughput_at_qos(behind, qos_ms=100) == 25 and throughput_at_qos(behind, 100, keep_up=0.95) == 10
    assert throughput_at_qos([RatePoint(10, 10, 150, 0)], qos_ms=100) == 0.0
    assert throughput_at_qos([RatePoint(10, 10, 50, 1)], qos_ms=100) == 0.0      # a failure misses it


def test_the_tables_name_the_budget_and_the_ratio_to_opt_wait():
    rows = [{"system": "OPT_Wait (1000 us)", "throughput_rps": 20.0, "config": "a"},
            {"system": "E-Ebird", "throughput_rps": 30.0, "config": "b"}]
    text = format_throughput(rows, 100, "2 cores")
    assert "2 cores" in text and "1.50x" in text
    burst = [{"system": "E-Ebird", "phase": "high", "rate_rps": 9.0, "requests": 5, "p50_ms": 1.0, "p99_ms": 2.0,
              "meets_qos": False, "failed": 1}]
    assert "MISSED (1 failed)" in format_burst(burst, 100, "2 cores")


def test_the_results_section_has_both_analogues_per_model():
    from e3.benchmarks.admission_report import admission_markdown
    model = {"stock": "bert_ee_stock", "qos_ms": 700.0, "budget": "2 cores", "capacity_ips": 40.0,
             "offline": {"max_bs": 16, "latency_ms": {"1": 20.0}, "confs": {"4": [2, 2]}},
             "throughput": [{"system": "OPT_Wait (1000 us)", "throughput_rps": 30.0, "config": "a"},
                            {"system": "E-Ebird", "throughput_rps": 45.0, "config": "b"}],
             "burst": [{"system": "NO_Wait", "phase": "high", "rate_rps": 50.0, "requests": 400, "p50_ms": 900.0,
                        "p99_ms": 2000.0, "meets_qos": False, "failed": 0}],
             "burst_figure": "figures/admission_burst_bert_ee.png", "load_avg": [1.5, 2.25],
             "closed_loop": {"E-Ebird": {"inputs_per_s": 120.0, "cpu_ms_per_input": 16.5}}, "burst_rounds": 2}
    text = admission_markdown({"commit": "abc", "models": {"bert-ee": model}}, "e3 bench admission")
    assert "| E-Ebird | 45.0 | 1.50x | b |" in text and "| NO_Wait | high | 50.0 | 400 | 900.0 | 2000.0 | **no** |" in text
    assert "QoS target p99 <= 700 ms, MaxBS 16" in text and "(figures/admission_burst_bert_ee.png)" in text
    assert "E-Ebird's throughput at the target 1.50x OPT_Wait's (**>=**)" in text
    assert "in every burst phase: **no**; NO_Wait's p99 over it in the high phase: **yes**" in text
    assert "| E-Ebird | 120.0 | 16.50 |" in text and "start / end: 1.5 / 2.2" in text and "2 rounds" in text


def test_a_ratio_the_sweep_cannot_separate_is_said_so_and_opt_wait_at_0_us_is_named_no_wait():
    from e3.benchmarks.admission_report import verdict, shown_system
    point = lambda rate, p99: {"offered_rps": rate, "answered_rps": rate, "p99_ms": p99, "failed": 0}  # noqa: E731
    same = [point(10.0, 50.0), point(20.0, 90.0), point(30.0, 400.0)]
    m = {"qos_ms": 100.0, "burst": [],
         "throughput": [{"system": "OPT_Wait (0 us)", "throughput_rps": 20.0},
                        {"system": "E-Ebird", "throughput_rps": 20.0}],
         "sweep": {"NO_Wait": {"points": same}, "E-Ebird": {"points": same}}}
    assert "1.00x OPT_Wait's: **not separated**" in verdict(m)
    m["sweep"]["E-Ebird"] = {"points": [point(10.0, 50.0), point(20.0, 90.0), point(30.0, 95.0)]}
    m["throughput"][1]["throughput_rps"] = 30.0
    assert "1.50x OPT_Wait's (**>=**)" in verdict(m)
    assert shown_system("OPT_Wait (0 us)") == "OPT_Wait (0 us, the same system as NO_Wait)"
    assert shown_system("OPT_Wait (500 us)") == "OPT_Wait (500 us)"


def test_a_model_whose_server_failed_is_named_not_measured():
    from e3.benchmarks.admission_report import admission_markdown
    text = admission_markdown({"commit": "abc", "models": {"resnet-ee": {"error": "cannot reach 127.0.0.1:1"}}}, "x")
    assert "### resnet-ee: not measured" in text and "cannot reach 127.0.0.1:1" in text


def test_a_baselines_copy_of_the_stock_model_has_its_own_config_and_leaves_the_stocks_alone(tmp_path):
    from e3.benchmarks.admission import _copy_model
    stock = tmp_path / "m_stock"
    (stock / "1").mkdir(parents=True)
    (stock / "1" / "model.onnx").write_bytes(b"weights")
    (stock / "config.pbtxt").write_text('name: "m_stock"\nmax_batch_size: 8\n')
    assert _copy_model(tmp_path, "m_stock", "m_stock_bench_0") == "m_stock_bench_0"
    assert (tmp_path / "m_stock_bench_0" / "config.pbtxt").read_text().startswith('name: "m_stock_bench_0"')
    assert (stock / "config.pbtxt").read_text().startswith('name: "m_stock"')        # not written through a link
    assert (tmp_path / "m_stock_bench_0" / "1" / "model.onnx").read_bytes() == b"weights"
    _copy_model(tmp_path, "m_stock", "m_stock_bench_0")                                 # again: replaced, not nested
    assert not (tmp_path / "m_stock_bench_0" / "m_stock").exists()
