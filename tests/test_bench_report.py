"""`e3 bench`'s tables and its section of docs/RESULTS.md."""

from __future__ import annotations

import pytest

from e3.benchmarks.report import BEGIN, END, goodput_table, replace_section, validation_table


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
    from e3.benchmarks.sim_validation import ValidationRow
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
