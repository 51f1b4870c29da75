"""The shared helpers of the vocabulary: atomic files, per-request rows, ramps in a block range,
the Triton dtype map, Prometheus samples, the one interpolation, and the one cost model."""

from __future__ import annotations

import dataclasses
import math
import os
import stat

import numpy as np
import pytest

from e3.core import cost
from e3.core.files import atomic_path, copy_atomic, write_atomic, write_json_atomic
from e3.core.names import ramps_in_range
from e3.core.plan import COMPACT, CONSTANT
from e3.core.profile import DeviceConfig, LatencyProfile, interp_linear
from e3.core.rows import request_slices, split_rows
from e3.core.spec import NUMPY_DTYPES, config_dtype, dtype_from_config
from e3.core.telemetry import metric_samples


# ---------------------------------------------------------------- files

def test_write_atomic_replaces_whole_file_and_leaves_no_temporaries(tmp_path):
    target = tmp_path / "sub" / "plan.json"
    write_json_atomic(target, {"a": 1})
    write_atomic(target, "second")
    assert target.read_text() == "second"
    assert sorted(p.name for p in target.parent.iterdir()) == ["plan.json"]
    # a normal file mode (not mkstemp's private 0600), so another reader (a Triton container) can read it
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o666 & ~_umask()


def test_failed_write_keeps_the_old_file(tmp_path):
    target = tmp_path / "x.npz"
    write_atomic(target, b"old")
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            np.savez(tmp, a=np.arange(3))
            raise RuntimeError("writer died")
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["x.npz"]


def test_atomic_path_keeps_the_suffix_for_writers_that_choose_by_it(tmp_path):
    with atomic_path(tmp_path / "a.npz") as tmp:
        assert tmp.suffix == ".npz" and tmp.parent == tmp_path
        np.savez(tmp, a=np.arange(3))
    assert np.load(tmp_path / "a.npz")["a"].tolist() == [0, 1, 2]


def test_copy_atomic_keeps_the_mode(tmp_path):
    src = tmp_path / "stub"
    src.write_bytes(b"\x7fELF")
    src.chmod(0o755)
    dest = copy_atomic(src, tmp_path / "out" / "stub")
    assert dest.read_bytes() == b"\x7fELF" and stat.S_IMODE(dest.stat().st_mode) == 0o755


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# ---------------------------------------------------------------- rows, ramps, dtypes, metrics

def test_request_slices_and_split_rows():
    assert request_slices([2, 1, 3]) == [slice(0, 2), slice(2, 3), slice(3, 6)]
    parts = split_rows({"x": np.arange(6), "y": np.arange(12).reshape(6, 2)}, [2, 1, 3])
    assert [p["x"].tolist() for p in parts] == [[0, 1], [2], [3, 4, 5]]
    assert parts[2]["y"].tolist() == [[6, 7], [8, 9], [10, 11]]
    with pytest.raises(ValueError, match="x: 6 rows, the requests hold 5"):
        split_rows({"x": np.arange(6)}, [2, 3])


def test_ramps_in_range():
    assert ramps_in_range([3, 1, 2, 2, 5], 2, 4) == (2, 3)
    assert ramps_in_range([1, 2, 3, 4], 3, 4, num_blocks=4) == (3,)     # the head is no ramp
    assert ramps_in_range([1, 2, 3, 4], 3, 4) == (3, 4)
    assert ramps_in_range([], 1, 4) == ()


def test_dtype_map_round_trips_and_rejects_unknown_types():
    for dtype in NUMPY_DTYPES:
        assert dtype_from_config(config_dtype(dtype)) == dtype
    assert dtype_from_config("TYPE_STRING") == "BYTES" and config_dtype("BYTES") == "TYPE_STRING"
    with pytest.raises(ValueError, match="TYPE_FP64"):
        dtype_from_config("TYPE_FP64")


def test_metric_samples_strips_the_counter_suffix():
    text = ("# HELP e3_inputs_total inputs\n# TYPE e3_inputs_total counter\n"
            'e3_inputs_total{model="m"} 12\n'
            "# HELP nv_inference_request_failure failures\n# TYPE nv_inference_request_failure counter\n"
            'nv_inference_request_failure{model="m_router",version="1"} 3\n')
    got = list(metric_samples(text))
    assert ("e3_inputs", {"model": "m"}, 12.0) in got
    assert ("nv_inference_request_failure", {"model": "m_router", "version": "1"}, 3.0) in got


# ---------------------------------------------------------------- interpolation and the cost model

def test_interp_linear_between_below_beyond_and_at_zero():
    xs, ys = [1, 2, 4], [1.0, 3.0, 4.0]
    assert interp_linear(xs, ys, 1.5) == pytest.approx(2.0)
    assert interp_linear(xs, ys, 0.5) == pytest.approx(1.0)    # below the first point: its value
    assert interp_linear(xs, ys, 8) == pytest.approx(6.0)      # past the last: slope 0.5 continues
    assert interp_linear(xs, ys, 0) == 0.0                     # no input, no work
    assert interp_linear(xs, ys, np.array([[1.5, 8.0]])).tolist() == [[2.0, 6.0]]


def linear_profile() -> LatencyProfile:
    """Block k on 'cpu' at batch b: k + b ms; ramps 0.5 ms; hop 1 + 0.1 b ms. Prices cpu 1, gpu 3."""
    batches = [1, 2, 4, 8]
    return LatencyProfile(
        model="toy", num_blocks=3, batch_sizes=batches,
        devices={"cpu": DeviceConfig("cpu", 1.0), "gpu": DeviceConfig("gpu", 3.0)},
        block_ms={"cpu": [[k + b for b in batches] for k in (1, 2, 3)],
                  "gpu": [[0.1 * (k + b) for b in batches] for k in (1, 2, 3)]},
        ramp_ms={d: [[0.5] * 4, [0.5] * 4, [0.0] * 4] for d in ("cpu", "gpu")},
        tx_ms={d: [1 + 0.1 * b for b in batches] for d in ("cpu", "gpu")})


def test_plan_cost_against_hand_computed_numbers():
    lat = linear_profile()
    reach = [1.0, 0.5, 0.25]
    # B0 = 8: split 1-1 on cpu x2 (4 inputs each), split 2-3 on gpu x1 (4 inputs enter block 2)
    pc = cost.plan_cost(lat, reach, [(1, 1, "cpu", 2), (2, 3, "gpu", 1)], b0=8, rate_rps=1000)
    s1, s2 = pc.stages
    # the router sends split 1 the model inputs by BLS too: no tx_in_ms curve here, so Tx(4) = 1.4 ms
    assert s1.batch_per_instance == 4 and s1.stage_ms == pytest.approx(1 + 4 + 0.5) and s1.tx_ms == pytest.approx(1.4)
    # no shrinking inside a split: block 3 runs at the 4 inputs that entered block 2
    assert s2.stage_ms == pytest.approx(0.1 * (2 + 4) + 0.5 + 0.1 * (3 + 4))
    assert s2.tx_ms == pytest.approx(1 + 0.4)
    assert pc.cycle_ms == pytest.approx(5.5)
    assert pc.throughput_rps == pytest.approx(1e3 * 8 / 5.5)
    assert pc.latency_ms == pytest.approx(7.0 + 1.4 + 5.5 + 1.8 + 1.4)   # fill 7 ms at 1000/s + hops + stages
    assert pc.cost == pytest.approx(2 * 1.0 + 3.0) and pc.devices_used == {"cpu": 2, "gpu": 1}
    unpiped = cost.plan_cost(lat, reach, [(1, 1, "cpu", 2), (2, 3, "gpu", 1)], b0=8, rate_rps=1000,
                             pipelined=False)
    assert unpiped.cycle_ms == pytest.approx(1.4 + 5.5 + 1.8 + 1.4)
    # split 2-3 compact: run in the router, the batch shrinks at ramp 2 (4 -> 2 inputs), no hop
    shrunk = cost.plan_cost(lat, reach, [(1, 1, "cpu", 2), (2, 3, "gpu", 1, "compact")], b0=8, rate_rps=1000)
    assert shrunk.stages[1].stage_ms == pytest.approx(0.1 * (2 + 4) + 0.5 + 0.1 * (3 + 2))
    assert shrunk.stages[1].tx_ms == 0 and shrunk.stages[1].form == "compact"


def _stage_by_hand(lat, b, a, j, m, form):
    """The module docstring's formula, block by block with the profile's scalar curves (not cost._stages):
    constant T = sum P(k, B_a/m) + R(B_a/m), hop Tx(B_a/m) (Tx_in into split 1); compact T = sum P(k, B_k/m)
    + check(B_k/m) at every ramp before the head + R(B_a/m), no hop."""
    per_a = b[a - 1] / m
    T = float(lat.router("cpu", per_a))
    for k in range(a, j + 1):
        at = per_a if form == CONSTANT else b[k - 1] / m
        T += lat.block(k, "cpu", at, with_ramp=True)
        if form == COMPACT and k < lat.num_blocks:
            T += float(lat.check("cpu", at))
    if form == COMPACT:
        return T, 0.0
    return T, float(lat.tx_in("cpu", per_a) if a == 1 else lat.tx("cpu", per_a))


@pytest.mark.parametrize("form", [CONSTANT, COMPACT])
def test_stage_table_equals_the_cost_formula_for_every_split(form):
    """Every (a, j, m) of the table and of stage_cost against the formula computed by hand, with a router, a
    check and an input hop curve that differ from the others so a wrong term shows."""
    lat = dataclasses.replace(linear_profile(), router_ms={"cpu": [0.2 + 0.05 * b for b in (1, 2, 4, 8)]},
                              check_ms={"cpu": [0.03 * b for b in (1, 2, 4, 8)]},
                              tx_in_ms={"cpu": [2 + 0.2 * b for b in (1, 2, 4, 8)]})
    reach = np.array([1.0, 0.5, 0.25])
    T, tx = cost.stage_table(lat, "cpu", 8 * reach, max_instances=3, form=form)
    for a in range(1, 4):
        for j in range(1, 4):
            for m in range(1, 4):
                if j < a:
                    assert math.isinf(T[a - 1, j - 1, m - 1])
                    continue
                want_T, want_tx = _stage_by_hand(lat, 8 * reach, a, j, m, form)
                assert T[a - 1, j - 1, m - 1] == pytest.approx(want_T), (a, j, m)
                assert tx[a - 1, m - 1] == pytest.approx(want_tx), (a, m)
                s = cost.stage_cost(lat, reach, 8, first=a, last=j, device="cpu", instances=m, form=form)
                assert (s.stage_ms, s.tx_ms) == pytest.approx((want_T, want_tx)), (a, j, m)


def test_plan_cost_rejects_unknown_devices_and_other_models():
    lat = linear_profile()
    with pytest.raises(ValueError, match="'tpu' is not in the latency profile"):
        cost.plan_cost(lat, [1.0, 0.5, 0.25], [(1, 3, "tpu", 1)], b0=8, rate_rps=100)
    with pytest.raises(ValueError, match="2 blocks"):
        cost.plan_cost(lat, [1.0, 0.5], [(1, 3, "cpu", 1)], b0=8, rate_rps=100)
