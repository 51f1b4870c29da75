"""`e3 bench`'s tables and its section of docs/RESULTS.md."""

from __future__ import annotations

import pytest

from e3.benchmarks.report import BEGIN, END, goodput_table, replace_section, validation_report, validation_table
from e3.benchmarks.side_by_side import _batch_stats, _stats_delta
from e3.benchmarks.side_by_side_report import BaselineConfig
from e3.benchmarks.sim_validation import ValidationRow
from e3.cli.bench import parse_forced_baselines


def test_the_goodput_table_has_the_ratios_and_the_share_of_the_ideal():
    rows = [{"mix": "80:20", "batch": 8, "system": "e3", "inputs_per_s": 280.0, "config": "1-6 compact x2 b16"},
            {"mix": "80:20", "batch": 8, "system": "stock", "inputs_per_s": 140.0},
            {"mix": "80:20", "batch": 8, "system": "ee", "inputs_per_s": 290.0}]
    text = goodput_table(rows, {"80:20": 2.5})
    assert "| 80:20 | 8 | 280.0 | 140.0 | 290.0 | 2.00x | 0.97x | 80% (2.50x) | 1-6 compact x2 b16 |" in text


def test_the_validation_table_marks_misses():
    rows = [{"setting": "a", "predicted_goodput": 110.0, "measured_goodput": 100.0, "predicted_p99_ms": 50.0,
             "measured_p99_ms": 50.0}]
    text = validation_table(rows, 0.08, 0.15)
    assert "**+10.0%**" in text and "| +0.0% |" in text
    assert "interval" not in text                     # older rows: no interval, p50 or share columns


def test_the_validation_table_shows_the_measured_p99s_interval_and_whether_the_simulation_is_inside():
    inside = ValidationRow("a", 100.0, 100.0, 60.0, 80.0, 40.0, 42.0, 0.1, (55.0, 90.0)).to_dict()
    outside = ValidationRow("b", 100.0, 100.0, 50.0, 80.0, 40.0, 42.0, 0.1, (55.0, 90.0)).to_dict()
    assert inside["p99_inside_interval"] is True and outside["p99_inside_interval"] is False
    assert inside["measured_p99_interval_ms"] == [55.0, 90.0]
    text = validation_table([inside, outside], 0.08, 0.15)
    assert "| **-25.0%** | 55-90 (simulated inside) | 40.0 / 42.0 | 10% |" in text
    assert "| **-37.5%** | 55-90 | 40.0 / 42.0 | 10% |" in text


def test_the_section_is_replaced_in_place_and_the_rest_kept():
    doc = "# Results\n\nhand-written\n"
    once = replace_section(doc, "table 1")
    assert once.startswith(doc.rstrip("\n")) and once.count(BEGIN) == 1 and "table 1" in once
    twice = replace_section(once + "\n## after\nmore\n", "table 2")
    assert "table 1" not in twice and "table 2" in twice and twice.endswith("## after\nmore\n")
    with pytest.raises(ValueError, match="broken"):
        replace_section(f"{END}\n{BEGIN}\n", "x")
    other = replace_section(twice, "admission table", name="e3 bench admission")   # sections side by side
    assert "table 2" in other and "admission table" in other


def test_the_validation_report_has_one_table_per_group_with_its_count():
    rows = [ValidationRow("a", 100.0, 100.0, 50.0, 50.0).to_dict(),
            ValidationRow("b", 120.0, 100.0, 50.0, 50.0, group="forced").to_dict(),
            ValidationRow("c", 101.0, 100.0, 50.0, 52.0, group="calibration").to_dict(),
            ValidationRow("d", 100.0, 100.0, 90.0, 50.0, group="calibration").to_dict()]
    text = validation_report(rows, 0.08, 0.15)
    chosen, forced, calibration = (text.index(word) for word in ("chosen configuration", "forced", "calibration"))
    assert chosen < forced < calibration
    assert "1 of 1 settings" in text and "0 of 1 settings" in text and "1 of 2 settings" in text
    assert text.count("| setting |") == 3


def test_forced_baselines_use_every_core_and_refuse_anything_else():
    assert parse_forced_baselines("1x2,2x1") == (BaselineConfig(1, 2, 0), BaselineConfig(2, 1, 0))
    assert parse_forced_baselines(None) is None
    for bad in ("1x1", "2", "ax2", ","):
        with pytest.raises(ValueError, match="--baselines"):
            parse_forced_baselines(bad)


def test_a_runs_executions_are_the_difference_of_tritons_counts():
    stats = lambda pairs: {"model_stats": [{"batch_stats": [  # noqa: E731
        {"batch_size": b, "compute_infer": {"count": n, "ns": ns}} for b, n, ns in pairs]}]}
    before = _batch_stats(stats([(8, 10, 500_000_000)]))
    after = _batch_stats(stats([(8, 30, 1_500_000_000), (16, 2, 200_000_000)]))
    assert _stats_delta(before, after) == {"8": [20, 50.0], "16": [2, 100.0]}
    assert _stats_delta(after, before) == {"8": [10, 50.0]}      # a reload reset the counts: the new ones alone
