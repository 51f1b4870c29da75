"""perf_analyzer against the load generator (`e3 bench perf`), the pure parts: the input file, the command,
the report's figure and the verdict. The run itself (a real perf_analyzer against a real server) is
`e3 bench perf` and a step of `e3 bench`; tests/test_e2e.py runs perf_analyzer against the router."""

from __future__ import annotations

import json

import numpy as np
import pytest

from e3.client.loadgen import RequestRecord
from e3.benchmarks.perf_check import (TOLERANCE, PerfCheck, agreement, format_check, perf_arguments, perf_input_document,
                           read_perf_csv, steady_ips, write_input_data)


def pool(n: int = 5, seq: int = 3) -> dict[str, np.ndarray]:
    ids = np.arange(n * seq, dtype=np.int64).reshape(n, seq)
    return {"input_ids": ids, "attention_mask": (ids % 2).astype(np.int64)}


def test_the_input_file_holds_one_step_per_input_without_the_batch_dimension(tmp_path):
    doc = perf_input_document(pool(), rows=4)
    assert len(doc["data"]) == 4
    assert doc["data"][2]["input_ids"] == {"content": [6, 7, 8], "shape": [3]}
    assert doc["data"][3]["attention_mask"]["content"] == [1, 0, 1]
    assert len(perf_input_document(pool(), rows=99)["data"]) == 5        # no more rows than the workload has
    path = write_input_data(pool(), tmp_path / "in.json")
    assert json.loads(path.read_text()) == perf_input_document(pool())
    with pytest.raises(ValueError, match="disagree"):
        perf_input_document({"a": np.zeros((2, 3)), "b": np.zeros((3, 3))})
    with pytest.raises(ValueError, match="no inputs"):
        perf_input_document({})


def test_the_command_measures_one_concurrency_with_real_data_and_no_stability_wait():
    args = perf_arguments("localhost:8000", "bert_ee_router", 8, concurrency=16, input_data="in.json", csv_path="out.csv",
                          window_requests=40, windows=3)
    flags = dict(zip(args[::2], args[1::2]))
    assert flags["-m"] == "bert_ee_router" and flags["-b"] == "8" and flags["--concurrency-range"] == "16"
    assert flags["--input-data"] == "in.json" and flags["-f"] == "out.csv" and flags["-i"] == "http"
    assert flags["--measurement-request-count"] == "40" and flags["--max-trials"] == "3"
    assert flags["--stability-percentage"] == "999"
    with pytest.raises(ValueError):
        perf_arguments("u", "m", 0, concurrency=16, input_data="in.json")


def test_the_report_gives_inputs_per_second(tmp_path):
    csv = tmp_path / "r.csv"
    csv.write_text("Concurrency,Inferences/Second,Client Send,Network+Server Send/Recv,p99 latency\n"
                   "16,141.6,51,90000,1200000\n")
    assert read_perf_csv(csv) == pytest.approx(141.6)
    csv.write_text("Concurrency,p99 latency\n16,5\n")
    with pytest.raises(ValueError, match="Inferences/Second"):
        read_perf_csv(csv)


def test_the_verdict_compares_medians_within_the_bar():
    check = PerfCheck("m_router", 8, 16, loadgen_ips=[100.0, 140.0, 120.0], perf_ips=[130.0, 125.0, 200.0])
    assert check.loadgen_median == 120.0 and check.perf_median == 130.0
    assert check.difference == pytest.approx(130 / 120 - 1) and check.agrees
    far = PerfCheck("m_router", 8, 16, loadgen_ips=[100.0], perf_ips=[100.0 * (1 + TOLERANCE) + 1])
    assert not far.agrees and not PerfCheck("m", 1, 1).agrees         # nothing measured: no agreement
    assert np.isnan(agreement(1.0, 0.0))
    table = format_check([check, far])
    assert "| m_router | 8 | 16 | 120.0 (100.0, 140.0, 120.0) | - | 130.0 (130.0, 125.0, 200.0) | +8.3% | yes (±10%) |" \
        in table and "**no**" in table
    assert check.to_dict()["agrees"] is True


def test_the_load_generators_steady_part_leaves_out_the_fill_and_the_drain():
    """Two clients, 4 inputs per request, one answer every 0.1 s from t=1.0 to 2.0 (both clients busy), the
    last send at 2.0; then the drain: the last two answers at 2.5 and 3.0 (one client left)."""
    recs = [RequestRecord(i, 0, 4, s, s, d) for i, (s, d) in enumerate(
        [(0.0, 1.0), (0.0, 1.1)] + [(1.0 + 0.1 * k, 1.2 + 0.1 * k) for k in range(9)] + [(2.0, 2.5), (2.0, 3.0)])]
    recs.append(RequestRecord(99, 0, 4, 1.5, 1.5, 1.6, error="boom"))   # a failure counts nothing
    # answers in (1.0, 2.0]: 1.1, 1.2, ..., 2.0 -> 10 requests of 4 inputs in 1 s
    assert steady_ips(recs) == pytest.approx(40.0)
    assert sum(r.inputs for r in recs if r.error is None) / 3.0 < 40.0     # the whole run reads low
    assert np.isnan(steady_ips([RequestRecord(0, 0, 1, 0.0, 0.0, 1.0)]))
