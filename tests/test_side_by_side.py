"""`e3 bench side-by-side`'s pure parts: mixes, equal budgets, the ideal speedup, the table and document."""

from __future__ import annotations

import json

import pytest

from e3.benchmarks.side_by_side_report import (Row, baseline_configs, format_rows, ideal_speedup, parse_batches, parse_mixes,
                                    results_document, write_results)
from e3.core.profile import DeviceConfig, LatencyProfile


def _profile(block=(1.0, 1.0, 1.0, 1.0), ramp=(0.1, 0.1, 0.1, 0.0)) -> LatencyProfile:
    B = [1, 8]
    return LatencyProfile(model="m", num_blocks=4, batch_sizes=B, devices={"cpu": DeviceConfig("cpu")},
                          block_ms={"cpu": [[b * x for x in B] for b in block]},
                          ramp_ms={"cpu": [[r * x for x in B] for r in ramp]}, tx_ms={"cpu": [0.1, 0.2]})


def test_mixes_and_batches_parse_and_refuse_nonsense():
    assert parse_mixes("80-20,50-50,20:80") == [(80, 20), (50, 50), (20, 80)]
    for bad in ("80-30", "eighty-20", "", "-10-110"):
        with pytest.raises(ValueError):
            parse_mixes(bad)
    assert parse_batches("1,8") == [1, 8]
    with pytest.raises(ValueError):
        parse_batches("0,8")


def test_every_baseline_configuration_spends_exactly_the_budget():
    configs = baseline_configs(4, delays_us=(0,))
    assert {(c.instances, c.threads) for c in configs} == {(1, 4), (2, 2), (4, 1)}
    assert all(c.cores == 2 for c in baseline_configs(2))
    with pytest.raises(ValueError):
        baseline_configs(0)


def test_ideal_speedup_is_stock_compute_over_expected_compute_with_exits():
    # 4 blocks of 1 ms per input; ramps 0.1 ms each at blocks 1..3; half the inputs leave after block 1.
    reach = [1.0, 0.5, 0.5, 0.5]
    expected = 4.0 / (1.1 + 0.5 * 1.1 + 0.5 * 1.1 + 0.5 * 1.0)
    assert ideal_speedup(_profile(), reach, 8) == pytest.approx(expected)
    # no exits: the ramps only cost
    assert ideal_speedup(_profile(), [1, 1, 1, 1], 8) == pytest.approx(4.0 / 4.3)
    with pytest.raises(ValueError):
        ideal_speedup(_profile(), [1, 1], 8)


def test_table_shows_e3_against_the_best_baseline_and_its_share_of_the_ideal(tmp_path):
    rows = [Row("80:20", 8, "e3", 240.0, 30, 60, 0.8, "1-6 compact x2 b8"),
            Row("80:20", 8, "stock", 100.0, 70, 90, 0.82, "2 inst x 1 thr"),
            Row("80:20", 8, "ee", 250.0, 28, 50, 0.8, "2 inst x 1 thr")]
    text = format_rows(rows, 2, {"80:20": 2.5})
    e3_line = next(line for line in text.splitlines() if " e3 " in line)
    assert "2.40x" in e3_line and "0.96x" in e3_line and "96%" in e3_line
    assert "every system on 2 cores" in text
    doc = results_document("bert-ee", 2, {"80:20": 2.5}, rows=rows, commit="abc")
    path = write_results(tmp_path / "r.json", doc)
    back = json.loads(path.read_text())
    assert back["model"] == "bert-ee" and back["cores"] == 2 and back["ideal_speedup"] == {"80:20": 2.5}
    assert {r["system"] for r in back["rows"]} == {"e3", "stock", "ee"}
    assert set(back["rows"][0]) >= {"mix", "batch", "system", "inputs_per_s", "p50_ms", "p99_ms", "accuracy", "config"}


def test_a_cells_rate_is_its_runs_together_and_its_percentiles_the_median_runs_untouched_by_a_stall_or_a_slow_run():
    from e3.benchmarks.side_by_side import _row
    from e3.client.loadgen import LoadResult

    def run(ips, latencies):
        return LoadResult(model="m", requests=len(latencies), inputs=int(ips), duration_s=1.0,
                          latencies_ms=list(latencies))
    steady = [50.0] * 99 + [60.0]
    stalled = [50.0] * 97 + [200.0] * 3           # one run's stall: 3% of its requests
    row = _row("80:20", 1, "e3", [run(280, steady), run(300, stalled), run(310, steady)], "cfg", float("nan"))
    assert row.inputs_per_s == pytest.approx(890 / 3.0)        # every input over the three runs' time
    assert row.p99_ms < 100.0                                 # its own p99 is 200
    assert row.p50_ms == pytest.approx(50.0)
    assert row.p99_interval_ms[0] <= row.p99_ms <= row.p99_interval_ms[1]
    slow = [100.0] * 98 + [120.0] * 2             # a run while the machine was slow: every request later
    row = _row("80:20", 1, "e3", [run(280, steady), run(150, slow), run(310, steady)], "cfg", float("nan"))
    assert row.p99_ms < 100.0                                 # pooled, the slow run's requests made the p99
    # two speeds: 200 inputs in 1 s, 100 in 1 s, 200 in 1 s: 500 in 3 s, not the median run's 200
    two = [LoadResult(model="m", requests=100, inputs=n, duration_s=1.0, latencies_ms=steady) for n in (200, 100, 200)]
    assert _row("80:20", 1, "e3", two, "cfg", float("nan")).inputs_per_s == pytest.approx(500 / 3)


def test_validating_a_run_with_a_profile_other_than_its_own_says_so_and_takes_the_one_given(tmp_path, monkeypatch):
    from e3.benchmarks.side_by_side import run_simulator_validation
    from e3.core.files import sha256_of
    monkeypatch.setenv("E3_ARTIFACTS", str(tmp_path))
    (tmp_path / "profiles").mkdir()
    ours, newer = tmp_path / "run-profile.json", tmp_path / "profiles" / "m.cpu.json"
    _profile().save(ours)
    _profile(block=(2.0, 2.0, 2.0, 2.0)).save(newer)           # measured again since the run
    doc = {"model": "m", "plans": {}, "rows": [], "profile_sha256": sha256_of(ours)}
    measured = tmp_path / "run.json"
    measured.write_text(json.dumps(doc))
    said = []
    run_simulator_validation(measured, tmp_path / "v.json", echo=said.append)
    assert any("is not the profile run.json was planned and run with" in line for line in said)
    said.clear()
    run_simulator_validation(measured, tmp_path / "v.json", echo=said.append, profile=ours)
    assert not any("[warning]" in line for line in said)
