"""ExeGPT's profiler on a real exported split (tiny-gen's, ONNX Runtime) and the plan command's tables."""

from __future__ import annotations

import json
import math

import pytest

from e3.generation.exegpt.cli import main as plan_main
from e3.generation.exegpt.profiler import ProfileSettings, cached_profile
from e3.generation.exegpt.report import default_bounds_ms, format_schedule_table, format_search_table, plan_rows
from e3.generation.exegpt.simulator import Workload
from e3.generation.exegpt.workload import LayerProfile, LengthDistribution

SMALL = ProfileSettings(prompt_tokens=8, prefill_rows=(1, 4), decode_batches=(1, 8), decode_context=8, repeats=2)


@pytest.fixture(scope="module")
def tiny_split(tmp_path_factory):
    """Layers 3..4 of tiny-gen (its last split) exported with the serving exporter (input: hidden)."""
    from e3.generation.decoder import tiny_decoder
    from e3.generation.onnx_splits import export_split
    path = tmp_path_factory.mktemp("split") / "model.onnx"
    export_split(tiny_decoder(), 3, 4, path=path)
    return path


def test_profile_of_a_real_split_is_positive_and_cached(tiny_split, tmp_path):
    cache = tmp_path / "profile.json"
    p = cached_profile(tiny_split, 2, 4, cache=cache, settings=SMALL, progress=False)
    assert p.num_layers == 4 and p.prefill_tokens == (8.0, 32.0) and p.decode_batch == (1.0, 8.0)
    assert all(ms > 0 for ms in p.prefill_ms + p.decode_ms)
    stamp = cache.stat().st_mtime_ns
    assert cached_profile(tiny_split, 2, 4, cache=cache, settings=SMALL, progress=False) == p      # reused, not re-measured
    assert cache.stat().st_mtime_ns == stamp
    other = ProfileSettings(**{**SMALL.__dict__, "decode_batches": (1, 2, 8)})
    with_head = cached_profile(tiny_split, 2, 4, cache=cache, settings=other, progress=False, final_head=True)
    assert with_head.decode_batch == (1.0, 2.0, 8.0) and with_head.head_batch == (1.0, 2.0, 8.0)
    assert all(ms >= 0 for ms in with_head.head_ms)
    assert LayerProfile.from_dict(with_head.to_dict()) == with_head


def test_the_first_split_is_refused_with_a_reason(tmp_path):
    from e3.generation.decoder import tiny_decoder
    from e3.generation.onnx_splits import export_split
    path = tmp_path / "first.onnx"
    export_split(tiny_decoder(), 1, 1, path=path)
    with pytest.raises(ValueError, match="does not hold layer 1"):
        cached_profile(path, 1, 4, cache=tmp_path / "c.json", settings=SMALL, progress=False)


def _cpu_like_profile() -> LayerProfile:
    return LayerProfile.from_dict({"num_layers": 30, "prefill": {"tokens": [32, 256], "ms": [4.5, 27.5]},
                                   "decode": {"batch": [1, 8, 32], "ms": [1.8, 3.2, 9.0]}})


def test_tables_hold_both_searches_per_bound():
    w = Workload(_cpu_like_profile(), LengthDistribution.fixed(32),
                 LengthDistribution.from_samples(list(range(8, 65))), workers=2)
    bs, nd = tuple(range(1, 17)), tuple(range(1, 33))
    bounds = default_bounds_ms(w, bs, nd)
    assert len(bounds) == 5 and math.isinf(bounds[-1]) and list(bounds) == sorted(bounds)
    rows = plan_rows(w, bounds, bs, decode_iters=nd, throughput_tol=0.05, latency_tol=0.05)
    assert all(r.same_optimum() for r in rows)
    assert all(r.bnb.evaluations < r.grid.evaluations for r in rows)
    assert all(r.bnb.best.latency_ms <= r.bound_ms for r in rows)
    search, chosen = format_search_table(rows), format_schedule_table(rows)
    assert search.count("\n") == 1 + len(rows) and "| inf |" in search
    assert chosen.count("\n") == 1 + len(rows)


def test_plan_command_from_a_profile_file(tmp_path, capsys):
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps(_cpu_like_profile().to_dict()))
    out = tmp_path / "rows.json"
    rc = plan_main(["--profile", str(prof), "--batch-sizes", "1:8", "--decode-iters", "1:16",
                    "--bounds-ms", "3000,20000,inf", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0
    assert "Branch-and-bound against the exhaustive grid" in text and "Table 6 analogue" in text
    doc = json.loads(out.read_text())
    assert [r["bound_ms"] for r in doc["rows"]] == [3000.0, 20000.0, None]
    assert all(r["same_optimum"] for r in doc["rows"])


def test_plan_command_names_bad_input(tmp_path):
    with pytest.raises(SystemExit, match="LOW:HIGH"):
        plan_main(["--profile", "x.json", "--batch-sizes", "eight"])
    bad = tmp_path / "bad.json"
    bad.write_text('{"num_layers": 0}')
    with pytest.raises(SystemExit, match="num_layers"):
        plan_main(["--profile", str(bad)])
    with pytest.raises(SystemExit, match="export-generate"):
        plan_main(["--repo", str(tmp_path / "none")])


def test_rra_run_by_the_engine_admits_per_phase_and_measures_the_p99_sequences(tmp_path):
    """The validation run on tiny-gen: every sequence admitted in the measured phases is counted once, the
    p99-length ones are all followed to their end, and the simulator's prediction sits beside it."""
    from e3.generation.exegpt.validate import measure_rra, validate_rra
    from e3.generation.repository import export_generation_repository
    export_generation_repository("tiny-gen", tmp_path, progress=False)
    w = Workload(_cpu_like_profile(), LengthDistribution.fixed(6), LengthDistribution.fixed(3), workers=1)
    m = measure_rra(tmp_path, "tiny-gen", w, batch_size=3, decode_iters=2, phases=8, warmup_phases=2)
    # 3 tokens: the prefill's and one decode step in the admitting phase, the last at the next phase's first
    # step, so each of the 6 measured phases finishes exactly the 3 admitted before it
    assert m.sequences == 3 * 6
    assert m.throughput_seq_s > 0 and math.isfinite(m.latency_ms) and m.latency_ms > 0
    with pytest.raises(ValueError, match="workers=1"):
        validate_rra(tmp_path, "tiny-gen", Workload(w.profile, w.input_lengths, w.output_lengths, workers=2),
                     configs=[(1, 1)], phases=6)
