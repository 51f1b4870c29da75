"""Load generator: arrival schedules, percentile/goodput math, phase bucketing, workload files (no server);
the open loop's queueing accounting against a fake client; one short open loop on the real tritonserver."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import pytest

from e3.client import loadgen
from e3.client.loadgen import (LoadResult, RequestRecord, open_loop, percentile_ms, poisson_arrivals,
                               replay_workload, request_rows, summarize, summarize_phases)
from e3.client.report import format_table
from e3.client.workloads import Phase, load_workload, phase_index


def record(index, *, first_row=None, inputs=2, scheduled_s=0.0, sent_s=None, done_s=0.01, label=None,
           exit_ramp=None, error=None) -> RequestRecord:
    """A hand-built request record (times in s from the run's start)."""
    first_row = index * inputs if first_row is None else first_row
    if error is None:
        label = np.zeros(inputs, np.int64) if label is None else np.asarray(label)
        exit_ramp = np.full(inputs, 4, np.int32) if exit_ramp is None else np.asarray(exit_ramp)
    return RequestRecord(index, first_row, inputs, scheduled_s, scheduled_s if sent_s is None else sent_s, done_s,
                         label, exit_ramp, error)


def write_workload(stem, n=12, phases=((0, 4, "80:20"), (4, 4, "50:50"), (8, 4, "20:80")), rate_rps=40.0,
                   ids=None, mask=None):
    """A workload file in the format `e3 workload` writes (models/workload.py)."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 50, size=(n, 16)) if ids is None else ids
    mask = np.ones((n, 16), np.int64) if mask is None else mask
    np.savez_compressed(stem.with_suffix(".npz"), input_ids=ids, attention_mask=mask,
                        exit_ramp=np.arange(n) % 4 + 1, label=np.arange(n) % 2, hard=np.arange(n) % 4 >= 2)
    meta = {"model": "tiny-ee", "inputs": ["input_ids", "attention_mask"], "rate_rps": rate_rps, "count": n,
            "phases": [{"mix": m, "start_index": s, "count": c, "start_s": s / rate_rps} for s, c, m in phases],
            "exit_ramp": (np.arange(n) % 4 + 1).tolist()}
    stem.with_suffix(".json").write_text(json.dumps(meta))
    return stem.with_suffix(".npz")


# -- arrival schedule ---------------------------------------------------------------------------------------

def test_poisson_arrivals_are_seeded_increasing_and_bounded():
    a = poisson_arrivals(50.0, duration_s=10.0, seed=1)
    assert np.array_equal(a, poisson_arrivals(50.0, duration_s=10.0, seed=1))
    assert not np.array_equal(a, poisson_arrivals(50.0, duration_s=10.0, seed=2))
    assert np.all(np.diff(a) > 0) and a[0] > 0 and a[-1] < 10.0
    assert len(poisson_arrivals(50.0, count=37, seed=1)) == 37


def test_poisson_schedule_prefixes_agree():
    """A shorter run of the same seed sees the same first arrivals (chunked drawing changes nothing)."""
    long = poisson_arrivals(20.0, duration_s=30.0, seed=5)
    short = poisson_arrivals(20.0, duration_s=3.0, seed=5)
    assert np.array_equal(short, long[:len(short)])
    assert np.array_equal(poisson_arrivals(20.0, count=len(short), seed=5), short)


def test_poisson_gaps_are_exponential_with_the_rate():
    gaps = np.diff(poisson_arrivals(100.0, count=20000, seed=3), prepend=0.0)
    assert gaps.mean() == pytest.approx(0.01, rel=0.03)
    assert gaps.std() == pytest.approx(0.01, rel=0.05)         # exponential: std == mean
    assert np.mean(gaps > 0.01) == pytest.approx(np.exp(-1), abs=0.02)


@pytest.mark.parametrize("kwargs", [dict(rate_rps=0, count=3), dict(rate_rps=5), dict(rate_rps=5, count=3,
                                    duration_s=1.0), dict(rate_rps=5, duration_s=0)])
def test_poisson_arrivals_reject_bad_settings(kwargs):
    with pytest.raises(ValueError):
        poisson_arrivals(**kwargs)


def test_request_rows_wrap_or_end_short():
    assert request_rows(0, 4, 10).tolist() == [0, 1, 2, 3]
    assert request_rows(2, 4, 10).tolist() == [8, 9, 0, 1]
    assert request_rows(2, 4, 10, wrap=False).tolist() == [8, 9]


# -- percentiles, goodput -------------------------------------------------------------------------------

def test_percentiles():
    assert np.isnan(percentile_ms([], 50))
    assert percentile_ms([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile_ms(list(range(101)), 99) == 99.0


def test_latency_counts_from_the_scheduled_arrival_not_the_send():
    """A request that waited 500 ms for a free client worker is 600 ms late, not 100 ms."""
    r = summarize([record(0, scheduled_s=1.0, sent_s=1.5, done_s=1.6)], "m", duration_s=2.0, slo_ms=200)
    assert r.latencies_ms == [pytest.approx(600.0)]
    assert r.max_send_lag_ms == pytest.approx(500.0)
    assert (r.good_inputs, r.slo_misses) == (0, 2)


def test_goodput_counts_inputs_answered_within_the_slo():
    records = [record(0, done_s=0.050), record(1, done_s=0.100),          # within 100 ms (inclusive)
               record(2, done_s=0.150, inputs=3, first_row=4),             # late: 3 inputs miss
               record(3, error="Request timeout expired", done_s=0.02)]    # dropped: neither good nor a miss
    r = summarize(records, "m", duration_s=2.0, slo_ms=100)
    assert (r.requests, r.errors, r.inputs) == (4, 1, 7)
    assert (r.good_inputs, r.slo_misses) == (4, 3)
    assert r.throughput_ips == 3.5 and r.goodput_ips == 2.0
    assert r.error_messages == {"Request timeout expired": 1}
    assert r.exit_counts == {4: 7}
    assert len(r.latencies_ms) == 3
    no_slo = summarize(records, "m", duration_s=2.0)
    assert no_slo.goodput_ips == no_slo.throughput_ips and no_slo.slo_misses == 0


def test_default_duration_spans_first_arrival_to_last_answer():
    r = summarize([record(0, scheduled_s=1.0, done_s=1.2), record(1, scheduled_s=1.5, done_s=3.0)], "m")
    assert r.duration_s == pytest.approx(2.0)
    assert summarize([], "m").duration_s == 0.0 and summarize([], "m").throughput_ips == 0.0


def test_accuracy_and_exit_mismatches_against_the_workload():
    true = np.array([0, 1, 1, 0])
    expected_exit = np.array([1, 2, 4, 4])
    records = [record(0, inputs=2, label=[0, 0], exit_ramp=[1, 2]), record(1, inputs=2, label=[1, 0],
                                                                          exit_ramp=[4, 3])]
    r = summarize(records, "m", duration_s=1.0, true_label=true, expected_exit=expected_exit)
    assert (r.labelled, r.correct, r.exit_mismatches) == (4, 3, 1)
    assert r.accuracy == 0.75
    assert np.isnan(LoadResult("m").accuracy)


# -- phases ------------------------------------------------------------------------------------------------

def test_phase_index_by_first_input():
    phases = [Phase("80:20", 0, 4), Phase("50:50", 4, 4), Phase("20:80", 8, 4)]
    assert phase_index(np.array([0, 3, 4, 7, 8, 11, 12]), phases).tolist() == [0, 0, 1, 1, 2, 2, -1]


def test_summarize_phases_buckets_requests_and_times_each_phase():
    phases = [Phase("80:20", 0, 4), Phase("20:80", 4, 4)]
    records = [record(0, scheduled_s=0.0, done_s=0.1), record(1, scheduled_s=0.5, done_s=1.0),
               record(2, scheduled_s=1.0, done_s=1.1, exit_ramp=[1, 1]), record(3, scheduled_s=1.5, done_s=3.0)]
    a, b = summarize_phases(records, phases, "m", slo_ms=200)
    assert (a.phase, a.requests, a.inputs, b.phase, b.requests) == ("80:20", 2, 4, "20:80", 2)
    assert a.duration_s == pytest.approx(1.0) and b.duration_s == pytest.approx(2.0)
    assert (a.good_inputs, a.slo_misses, b.good_inputs, b.slo_misses) == (2, 2, 2, 2)
    assert b.exit_counts == {1: 2, 4: 2}


# -- workload files -------------------------------------------------------------------------------------

def test_load_workload_reads_the_exporter_format(tmp_path):
    wl = load_workload(write_workload(tmp_path / "stream"))
    assert wl.name == "stream" and wl.size == 12 and wl.rate_rps == 40.0
    assert list(wl.inputs) == ["input_ids", "attention_mask"] and wl.inputs["input_ids"].shape == (12, 16)
    assert [p.mix for p in wl.phases] == ["80:20", "50:50", "20:80"] and wl.phases[2].start_s == 0.2
    assert wl.exit_ramp.tolist()[:5] == [1, 2, 3, 4, 1] and wl.hard.dtype == bool
    assert load_workload(tmp_path / "stream.json").size == 12  # either file names the workload


def test_load_workload_without_metadata_is_one_phase(tmp_path):
    path = write_workload(tmp_path / "w")
    path.with_suffix(".json").unlink()
    wl = load_workload(path)
    assert [(p.mix, p.start_index, p.count) for p in wl.phases] == [("all", 0, 12)]
    assert sorted(wl.inputs) == ["attention_mask", "input_ids"] and wl.rate_rps is None


def test_load_workload_errors_are_clear(tmp_path):
    with pytest.raises(ValueError, match="e3 workload"):
        load_workload(tmp_path / "missing.npz")
    with pytest.raises(ValueError, match="phases cover 8 inputs"):
        load_workload(write_workload(tmp_path / "bad", phases=((0, 4, "a"), (4, 4, "b"))))


def test_client_side_imports_stay_light():
    """The load generator loads without torch or e3.export (it runs where the server is not)."""
    code = ("import sys, e3.client.loadgen, e3.client.report, e3.client.workloads; "
            "bad = [m for m in ('torch', 'e3.export') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


# -- report ---------------------------------------------------------------------------------------------

def test_table_shows_goodput_slo_and_phases():
    r = summarize([record(0, done_s=0.05), record(1, done_s=0.3)], "tiny_ee_router", duration_s=1.0, slo_ms=100)
    r.phases = summarize_phases([record(0, done_s=0.05)], [Phase("80:20", 0, 4)], "tiny_ee_router", slo_ms=100)
    text = format_table([r, *r.phases])
    assert "goodput/s" in text and "SLO misses" in text
    assert "tiny_ee_router [80:20]" in text
    row = text.splitlines()[2].split()
    assert row[:6] == ["tiny_ee_router", "2", "4.0", "2.0", "100", "2"]
    assert "goodput" not in format_table([summarize([record(0)], "m", duration_s=1.0)])


# -- the run, against a fake client -------------------------------------------------------------------------

class SlowClient:
    """Stands in for E3Client: every request takes ``service_s`` (one server, one request at a time)."""
    service_s = 0.05
    lock = None

    def __init__(self, url, protocol="http", timeout_s=60.0, shm=False):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def infer(self, model, inputs):
        from e3.client.sdk import Answers
        with SlowClient.lock:
            time.sleep(self.service_s)
        n = len(next(iter(inputs.values())))
        return Answers(np.zeros(n, np.int64), np.full(n, 4, np.int32), np.zeros((n, 2), np.float32))


def test_open_loop_charges_queueing_when_the_server_falls_behind(monkeypatch):
    """Offered 40 req/s to a server that does 20/s: arrivals keep their schedule, latency grows with the queue."""
    import threading
    monkeypatch.setattr(loadgen, "E3Client", SlowClient)
    monkeypatch.setattr(SlowClient, "lock", threading.Lock())
    pool = {"x": np.zeros((8, 3), np.int64)}
    r = open_loop("fake", "m", pool, rate_rps=40.0, requests=16, batch=2, workers=4, slo_ms=150, warmup=0, seed=0)
    assert (r.requests, r.inputs, r.errors) == (16, 32, 0)
    assert r.offered_rps == 40.0
    assert r.duration_s >= 16 * SlowClient.service_s * 0.95
    # a closed-loop measurement (send to answer) would see at most 4 x 50 ms; from arrival it is longer
    assert 250 < max(r.latencies_ms) < 5000      # and every latency is measured from the same start
    assert r.max_send_lag_ms > 50                       # 4 workers were not enough: arrivals waited in the client
    assert r.slo_misses > 0 and r.goodput_ips < r.throughput_ips


# -- one short run on the real server --------------------------------------------------------------------

@pytest.mark.e2e
def test_open_loop_and_replay_on_the_real_server(server, tiny_model, tmp_path):
    ids, mask = tiny_model.example_inputs(64, seed=3)
    pool = {"input_ids": ids.numpy(), "attention_mask": mask.numpy()}
    r = open_loop(server.http_url, "tiny_ee_router", pool, rate_rps=25.0, duration_s=2.0, batch=2, slo_ms=1000,
                  workers=8, seed=1)
    expected = len(poisson_arrivals(25.0, duration_s=2.0, seed=1))
    assert (r.requests, r.errors, r.inputs) == (expected, 0, 2 * expected)
    assert 0 < r.goodput_ips <= r.throughput_ips
    assert r.percentile_ms(50) <= r.percentile_ms(99) < 10_000
    assert sum(r.exit_counts.values()) == r.inputs

    path = write_workload(tmp_path / "stream", n=24, phases=((0, 8, "80:20"), (8, 8, "50:50"), (16, 8, "20:80")),
                          ids=pool["input_ids"][:24], mask=pool["attention_mask"][:24], rate_rps=80.0)
    w = replay_workload(server.grpc_url, "tiny_ee_router", path, batch=4, slo_ms=1000, protocol="grpc")
    assert (w.requests, w.inputs, w.errors, w.labelled) == (6, 24, 0, 24)
    assert [(p.phase, p.inputs) for p in w.phases] == [("80:20", 8), ("50:50", 8), ("20:80", 8)]
    c = replay_workload(server.http_url, "tiny_ee_router", path, batch=5, concurrency=3)
    assert (c.requests, c.inputs, c.errors, c.offered_rps) == (5, 24, 0, None)


def test_demo_gives_every_system_the_same_core_budget_and_prints_it():
    from e3.core.plan import default_plan
    from e3.cli.demo import core_budgets
    from e3.export.repository import ExportSettings
    plan = default_plan("m", 4, [(1, 2), (3, 4)], exit_rule={"kind": "entropy", "tau_nats": 0.3}, ramp_blocks=(1, 2, 3), instances=1)
    budgets = core_budgets(plan, ExportSettings(split_instances=1, baseline_instances=2))
    assert budgets == {"m_router": "2 (1-2 constant x1, 3-4 constant x1; router x1)", "m_ee": "2 (x2 inst.)",
                       "m_stock": "2 (x2 inst.)"}
    table = format_table([summarize([record(0)], "m_router", duration_s=1.0),
                          summarize([record(0)], "m_stock", duration_s=2.0)], reference="m_stock", budgets=budgets)
    header, _, router_row, stock_row = table.splitlines()
    assert header.split()[:2] == ["model", "cores"]
    assert "2 (1-2 constant x1, 3-4 constant x1; router x1)" in router_row and "2 (x2 inst.)" in stock_row


def test_demo_splits_share_exactly_the_baselines_cores():
    from e3.cli.demo import split_instances
    assert split_instances(2, 2) == [1, 1]
    assert split_instances(3, 2) == [2, 1]          # the remainder goes to the first split (every input)
    assert split_instances(4, 3) == [2, 1, 1]
    assert all(sum(split_instances(c, n)) == c for c in range(1, 9) for n in range(1, c + 1))
    with pytest.raises(ValueError, match="--cores 2 is fewer than the 3 splits"):
        split_instances(2, 3)
