"""`e3 bench repeatability`: two side-by-side runs against each other with the simulator's bar."""

import json

import pytest

from e3.benchmarks.repeatability import compare


def _doc(rows, alternatives=(), model="bert-ee"):
    return {"model": model, "commit": "abc", "rows": list(rows), "alternatives": list(alternatives)}


def _row(batch, system, config, ips, p99):
    return {"mix": "80:20", "batch": batch, "system": system, "config": config, "inputs_per_s": ips, "p99_ms": p99}


def test_compare_pairs_the_cells_both_runs_measured_and_applies_the_bar():
    a = _doc([_row(1, "e3", "x", 300.0, 100.0), _row(8, "stock", "2 inst x 1 thr, delay 0 us", 180.0, 800.0)],
             [_row(8, "stock", "1 inst x 2 thr, delay 0 us", 150.0, 900.0)])
    b = _doc([_row(1, "e3", "x", 290.0, 112.0), _row(8, "stock", "2 inst x 1 thr, delay 0 us", 160.0, 810.0),
              _row(8, "ee", "2 inst x 1 thr, delay 0 us", 400.0, 300.0)])
    shared = compare(a, b)
    assert [x.cell for x in shared] == ["80:20 batch 1 e3 (x)", "80:20 batch 8 stock (2 inst x 1 thr, delay 0 us)"]
    e3, stock = shared
    assert e3.goodput_diff == pytest.approx(300 / 290 - 1) and e3.p99_diff == pytest.approx(100 / 112 - 1)
    assert e3.within()                                   # +3.4% and -10.7%
    assert stock.goodput_diff == pytest.approx(0.125) and not stock.within()   # the same p99, 12.5% apart
    assert not e3.within(p99_tol=0.10)


def test_e3_bench_repeatability_prints_the_table_and_refuses_what_it_cannot_compare(tmp_path, capsys):
    from e3.cli import main
    a, b, other = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "other.json"
    a.write_text(json.dumps(_doc([_row(1, "e3", "x", 300.0, 100.0)])))
    b.write_text(json.dumps(_doc([_row(1, "e3", "x", 240.0, 100.0)])))
    other.write_text(json.dumps(_doc([_row(1, "e3", "y", 300.0, 100.0)])))
    assert main(["bench", "repeatability", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "**+25.0%**" in out and "0 of 1 shared cells agree" in out
    assert main(["bench", "repeatability", str(a), str(other)]) == 2
    assert "share no cell" in capsys.readouterr().err
    assert main(["bench", "repeatability", str(a), str(tmp_path / "missing.json")]) == 2
    assert "does not exist" in capsys.readouterr().err
    other.write_text(json.dumps(_doc([{"batch": 1}])))
    assert main(["bench", "repeatability", str(a), str(other)]) == 2
    assert "not a results file" in capsys.readouterr().err
    other.write_text(json.dumps(_doc([_row(1, "e3", "x", 300.0, 100.0)], model="resnet-ee")))
    assert main(["bench", "repeatability", str(a), str(other)]) == 2
    assert "compare runs of one model" in capsys.readouterr().err
