"""`e3 bench machine-speed`: the trace of the machine's speed and its split into fast and slow spells."""

import json

import numpy as np
import pytest

from e3.benchmarks.machine_speed import SpeedSettings, run_machine_speed, spells, trace


def test_spells_split_two_speeds_at_halfway_between_the_levels():
    """Fast (about 80 ms) for 3 readings, slow (about 108) for 5, fast for 2: two fast spells and a slow one,
    split halfway between the 10th and 90th percentiles of the readings."""
    t = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0]
    ms = [80, 81, 79, 108, 107, 109, 108, 110, 80, 82]
    s = spells(t, ms)
    assert s.fast_ms == pytest.approx(80.0) and s.slow_ms == pytest.approx(108.0)
    assert s.slow_share == pytest.approx(0.5)
    assert s.fast_spells_s == [3.0, 2.0] and s.slow_spells_s == [5.0]
    assert s.to_dict()["ratio"] == pytest.approx(108.0 / 80.0, abs=1e-3)
    # one speed: no slow spell, one fast spell over the whole trace
    steady = spells(t, [80 + (i % 2) for i in range(10)])
    assert steady.slow_spells_s == [] and steady.fast_spells_s == [10.0] and steady.slow_share == 0.0
    with pytest.raises(ValueError, match="one time per reading"):
        spells(t, ms[:3])


def test_trace_times_readings_of_calls_until_the_time_is_up():
    calls = []
    readings = trace(lambda: calls.append(1), 0.05, 4)
    assert readings and len(calls) == 1 + 4 * len(readings)    # one warm-up call first
    assert all(len(r) == 4 and r[1] <= r[2] for r in readings)
    assert [r[0] for r in readings] == sorted(r[0] for r in readings) and readings[-1][0] >= 0.05


def test_e3_bench_machine_speed_traces_the_stock_graph(tmp_path, capsys):
    from e3.cli import main
    out = tmp_path / "speed.json"
    assert main(["bench", "machine-speed", "--model", "tiny-ee", "--seconds", "1", "--batch", "2",
                 "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["columns"] == ["t_s", "p25_ms", "median_ms", "steal_jiffies"] and len(doc["readings"]) >= 1
    assert np.all(np.asarray(doc["readings"])[:, 2] > 0) and "tiny-ee at 2 rows" in doc["what"]
    assert set(doc["spells"]) >= {"fast_ms", "slow_ms", "slow_share"}
    assert "wrote" in capsys.readouterr().out
    assert main(["bench", "machine-speed", "--model", "tiny-ee", "--seconds", "0"]) == 2
    assert "--seconds must be > 0" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--batch"):
        SpeedSettings(batch=0)
