"""Exit forecaster: telemetry parsing, window deltas, resets, clamping, ARIMA and its fallbacks.

Unit tier: hand-built Prometheus text and synthetic series; statsmodels is real.
"""

from __future__ import annotations

import http.server
import threading

import numpy as np
import pytest

from e3.controller.forecast import (ArimaForecaster, LastValueForecaster, clamp_reach, drifted, forecast_error,
                                    make_forecaster)
from e3.controller.telemetry import RouterSnapshot, TelemetryReader, parse_snapshots, read_snapshot, window_profile
from e3.core.profile import BatchProfile


def metrics_text(model="tiny_ee", inputs=0, batches=0, reached=None, exited=None, dropped=None,
                 plan_id=None, typed=True) -> str:
    """Triton-style metrics page: router counters for ``model`` plus some of Triton's own metrics."""
    lines = ['# HELP nv_inference_count Number of inferences', '# TYPE nv_inference_count counter',
             f'nv_inference_count{{model="{model}_split_1-2",version="1"}} 99']

    def family(name, samples):
        if typed:
            lines.extend([f"# HELP {name} e3", f"# TYPE {name} counter"])
        lines.extend(samples)

    family("e3_inputs_total", [f'e3_inputs_total{{model="{model}"}} {inputs}'])
    family("e3_batches_total", [f'e3_batches_total{{model="{model}"}} {batches}'])
    family("e3_ramp_reached_total",
           [f'e3_ramp_reached_total{{model="{model}",ramp="{k}"}} {v}' for k, v in (reached or {}).items()])
    family("e3_ramp_exited_total",
           [f'e3_ramp_exited_total{{model="{model}",ramp="{k}"}} {v}' for k, v in (exited or {}).items()])
    family("e3_dropped_total",
           [f'e3_dropped_total{{model="{model}",reason="{r}"}} {v}' for r, v in (dropped or {}).items()])
    if plan_id:
        lines += ["# TYPE e3_plan_info gauge", f'e3_plan_info{{model="{model}",plan_id="{plan_id}"}} 1']
    return "\n".join(lines) + "\n"


def snap(inputs, reached, exited, batches=None, at_s=0.0, dropped=0.0, model="m") -> RouterSnapshot:
    return RouterSnapshot(model=model, at_s=at_s, inputs=inputs, batches=inputs / 8 if batches is None else batches,
                          dropped=dropped, reached=dict(reached), exited=dict(exited))


def profile(reach, b0=8) -> BatchProfile:
    return BatchProfile(model="m", batch_size=b0, reach=list(reach))


def counters_for(ramps: np.ndarray, L: int) -> tuple[dict, dict]:
    """Cumulative reached/exited counters of inputs with these exit ramps."""
    return ({k: float(np.count_nonzero(ramps >= k)) for k in range(1, L + 1)},
            {k: float(np.count_nonzero(ramps == k)) for k in range(1, L + 1)})


# ----------------------------------------------------------------------------- parsing

@pytest.mark.parametrize("typed", [True, False], ids=["counter-typed", "untyped"])
def test_parse_reads_router_counters_with_or_without_total_suffix_stripping(typed):
    text = metrics_text(inputs=100, batches=25, reached={1: 100, 2: 60, 3: 60, 4: 30},
                        exited={1: 40, 2: 0, 3: 30, 4: 30}, dropped={"deadline": 2, "error": 1},
                        plan_id="p7", typed=typed)
    snaps = parse_snapshots(text, at_s=5.0)
    assert set(snaps) == {"tiny_ee"}           # Triton's own nv_* metrics are ignored
    s = snaps["tiny_ee"]
    assert (s.inputs, s.batches, s.dropped, s.at_s) == (100, 25, 3, 5.0)
    assert s.reached == {1: 100, 2: 60, 3: 60, 4: 30}
    assert s.exited == {1: 40, 2: 0, 3: 30, 4: 30}
    assert s.plan_id == "p7"


def test_parse_separates_models_and_skips_bad_ramp_labels():
    text = (metrics_text(model="a", inputs=4, reached={1: 4}, exited={1: 1})
            + metrics_text(model="b", inputs=9, reached={1: 9}, exited={1: 2}, typed=False)
            + 'e3_ramp_exited_total{model="a",ramp="x"} 5\n')
    snaps = parse_snapshots(text)
    assert snaps["a"].inputs == 4 and snaps["b"].inputs == 9
    assert snaps["a"].exited == {1: 1}


def test_reader_scrapes_a_metrics_endpoint():
    pages = [metrics_text(inputs=0), metrics_text(inputs=80, batches=10, reached={1: 80, 2: 40},
                                                  exited={1: 40, 2: 40})]

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            assert self.path == "/metrics"
            body = pages.pop(0).encode() if len(pages) > 1 else pages[0].encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        url = f"127.0.0.1:{srv.server_address[1]}"
        reader = TelemetryReader(url, "tiny_ee", window_s=2)
        reader.start()
        win = reader.close_window()
        assert win.inputs == 80 and win.mean_batch == 8
        assert win.profile.reach == [1.0, 0.5]
        assert read_snapshot(f"http://{url}/metrics", "other_model").inputs == 0  # not exported yet: zeros
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.mark.parametrize("window_s", [0.5, 0, float("nan"), "120"])
def test_reader_rejects_bad_window(window_s):
    with pytest.raises(ValueError, match="window_s must be a number of seconds >= 1"):
        TelemetryReader("127.0.0.1:8002", "m", window_s=window_s)


# ----------------------------------------------------------------------------- windows

def test_window_reach_from_counter_deltas():
    # Before: 100 inputs. In the window: 200 inputs; 80 exit at ramp 1, 30 at ramp 2, 50 at 3, 40 at the head.
    start = snap(100, {1: 100, 2: 50, 3: 30, 4: 10}, {1: 50, 2: 20, 3: 20, 4: 10}, at_s=10.0)
    end = snap(300, {1: 300, 2: 170, 3: 120, 4: 50}, {1: 130, 2: 50, 3: 70, 4: 50}, at_s=130.0)
    win = window_profile(start, end)
    assert win.inputs == 200 and win.duration_s == 120.0 and not win.reset
    assert win.reached == {1: 200, 2: 120, 3: 90, 4: 40}
    assert win.profile.reach == pytest.approx([1.0, 120 / 200, 90 / 200, 40 / 200])
    assert win.profile.batch_size == 8       # mean router batch
    # with no drops, the product of pass-through shares equals (reached_k - exited_k) / inputs
    for k in (1, 2, 3):
        assert win.profile.reach[k] == pytest.approx((win.reached[k] - win.exited[k]) / win.inputs)


def test_window_with_drops_describes_served_inputs():
    # 100 inputs; half exit at ramp 1; 10 of the 50 survivors are dropped before split 2 (deadline);
    # of the 40 that reach ramp 2, half exit there.
    start = snap(0, {}, {})
    end = snap(100, {1: 100, 2: 40, 3: 20}, {1: 50, 2: 20, 3: 20}, dropped=10)
    win = window_profile(start, end, batch_size=16)
    assert win.dropped == 10 and win.profile.batch_size == 16
    assert win.profile.reach == pytest.approx([1.0, 0.5, 0.25])


def test_empty_window_has_no_profile():
    s = snap(50, {1: 50, 2: 10}, {1: 40, 2: 10})
    win = window_profile(s, s)
    assert win.inputs == 0 and win.profile is None and not win.reset
    assert window_profile(snap(0, {}, {}), snap(5, {}, {})).profile is None    # L unknown yet


def test_counter_reset_counts_from_zero():
    # Router reloaded mid-window: its counters restart, so end < start.
    start = snap(1000, {1: 1000, 2: 400, 3: 100}, {1: 600, 2: 300, 3: 100})
    end = snap(40, {1: 40, 2: 30, 3: 10}, {1: 10, 2: 20, 3: 10})
    win = window_profile(start, end)
    assert win.reset and win.inputs == 40
    assert win.profile.reach == pytest.approx([1.0, 0.75, 0.25])
    # A ramp series that vanished (new plan without it) is a reset too.
    end2 = snap(1100, {1: 1100, 3: 110}, {1: 650, 3: 110})
    assert window_profile(start, end2).reset


def test_disabled_ramp_lets_everything_through_and_inconsistent_scrape_is_clamped():
    # Ramp 2 disabled (no counters); ramp 1's exited counter ran ahead of reached in a torn scrape.
    win = window_profile(snap(0, {}, {}), snap(10, {1: 10, 3: 5}, {1: 12, 3: 5}), num_blocks=3)
    assert win.profile.reach == [1.0, 0.0, 0.0]
    win = window_profile(snap(0, {}, {}), snap(10, {1: 10, 3: 6}, {1: 4, 3: 6}), num_blocks=3)
    assert win.profile.reach == pytest.approx([1.0, 0.6, 0.6])


def test_window_rejects_mixed_models():
    with pytest.raises(ValueError, match="different models"):
        window_profile(snap(0, {}, {}, model="a"), snap(1, {}, {}, model="b"))


# ----------------------------------------------------------------------------- clamping, factory

def test_clamp_reach_makes_profiles_feasible():
    assert clamp_reach([0.7, 1.2, -0.1, 0.3]) == [1.0, 1.0, 0.0, 0.0]
    assert clamp_reach([1.0, 0.6, 0.8, float("nan"), 0.2]) == [1.0, 0.6, 0.6, 0.6, 0.2]
    BatchProfile(model="m", batch_size=8, reach=clamp_reach([3, 0.9, 0.95, -2])).validate()


def test_factory_builds_both_and_rejects_unknown_names():
    assert isinstance(make_forecaster("arima"), ArimaForecaster)
    assert isinstance(make_forecaster("last"), LastValueForecaster)
    with pytest.raises(ValueError, match=r"unknown forecaster 'prophet'; choose one of: arima, last"):
        make_forecaster("prophet")
    with pytest.raises(ValueError, match="bad options for forecaster 'last'"):
        make_forecaster("last", order=(1, 0, 0))
    with pytest.raises(ValueError, match="max_history"):
        make_forecaster("arima", min_history=10, max_history=5)


def test_forecasters_refuse_a_history_of_another_shape():
    fc = make_forecaster("last")
    assert fc.forecast() is None
    fc.observe(profile([1.0, 0.5]))
    with pytest.raises(ValueError, match="does not continue"):
        fc.observe(profile([1.0, 0.5, 0.2]))


# ----------------------------------------------------------------------------- forecasting

def test_arima_uses_last_value_while_history_is_short():
    fc = make_forecaster("arima", min_history=8)
    for reach in ([1.0, 0.5, 0.2], [1.0, 0.7, 0.4], [1.0, 0.55, 0.3]):
        fc.observe(profile(reach))
    f = fc.forecast()
    assert f.reach == [1.0, 0.55, 0.3] and f.model == "m" and f.batch_size == 8


class _Broken(ArimaForecaster):
    """ARIMA whose fit result is replaced: statsmodels rarely fails on its own, so the seam is ours."""

    def __init__(self, outcome, **kw):
        super().__init__(**kw)
        self.outcome = outcome

    def _fit_forecast(self, y):
        if isinstance(self.outcome, Exception):
            raise self.outcome
        return self.outcome


@pytest.mark.parametrize("outcome", [float("nan"), float("inf"), np.linalg.LinAlgError("singular matrix")],
                         ids=["nan", "inf", "raises"])
def test_arima_falls_back_to_last_value_when_a_fit_fails(outcome):
    fc = _Broken(outcome, min_history=3)
    for x in (0.5, 0.6, 0.4, 0.55):
        fc.observe(profile([1.0, x]))
    assert fc.forecast().reach == [1.0, 0.55]
    assert fc.fallbacks == 1


def test_arima_keeps_statsmodels_warnings_quiet():
    import warnings
    fc = make_forecaster("arima", order=(2, 0, 0), min_history=3)   # too few points: statsmodels warns
    for x in (0.5, 0.6, 0.4, 0.55):
        fc.observe(profile([1.0, x]))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        f = fc.forecast()
    assert not caught
    f.validate()


def test_arima_constant_series_and_clamped_forecast():
    fc = make_forecaster("arima", min_history=3)
    for _ in range(4):
        fc.observe(profile([1.0, 1.0, 0.0]))
    assert fc.forecast().reach == [1.0, 1.0, 0.0]
    # a trend heading below zero is clamped to a feasible profile
    fc = make_forecaster("arima", order=(0, 2, 0), min_history=3)
    for x in (0.4, 0.2, 0.05):
        fc.observe(profile([1.0, x]))
    f = fc.forecast()
    assert f.reach == [1.0, 0.0]
    f.validate()


def test_arima_tracks_a_stationary_noisy_series():
    rng = np.random.default_rng(7)
    L, n_in, windows = 3, 400, 22
    p_exit = [0.5, 0.3, 1.0]                   # per-ramp exit probability of inputs that reach it
    obs, start = [], snap(0, {}, {})
    cum = {"n": 0.0, "r": np.zeros(L + 1), "x": np.zeros(L + 1)}
    for _ in range(windows):
        ramps = np.full(n_in, L)
        alive = np.ones(n_in, bool)
        for k in range(1, L):
            out = alive & (rng.random(n_in) < p_exit[k - 1])
            ramps[out] = k
            alive &= ~out
        r, x = counters_for(ramps, L)
        cum["n"] += n_in
        for k in range(1, L + 1):
            cum["r"][k] += r[k]
            cum["x"][k] += x[k]
        end = snap(cum["n"], {k: cum["r"][k] for k in range(1, L + 1)}, {k: cum["x"][k] for k in range(1, L + 1)})
        obs.append(window_profile(start, end).profile)
        start = end
    fc = make_forecaster("arima", min_history=6)
    forecasts = []
    for p in obs:
        forecasts.append(fc.forecast())
        fc.observe(p)
    rep = forecast_error(forecasts[8:], obs[8:])   # score windows that ARIMA (not the fallback) forecast
    assert rep.windows == windows - 8 and fc.fallbacks == 0
    assert rep.mae < 0.05                          # well under 10% of B0 (binomial sd here is ~0.025)
    assert set(rep.per_ramp_mae) == {1, 2}
    truth = [1.0, 0.5, 0.35]
    assert np.allclose(forecasts[-1].reach, truth, atol=0.06)
    # On a stationary series smoothing beats chasing the noise: the naive forecast's error is higher
    # (measured on this series: 0.023 against 0.030), so a forecaster that returned the last value fails here.
    naive = make_forecaster("last")
    naive_forecasts = []
    for p in obs:
        naive_forecasts.append(naive.forecast())
        naive.observe(p)
    assert rep.mae < 0.9 * forecast_error(naive_forecasts[8:], obs[8:]).mae


# A level of 0.5 with window-to-window noise (no trend), then one window well above it: ARIMA(0, 1, 1)
# is exponential smoothing, whose forecast is a weighted mean of the history; fitted on a noisy level its
# weight on the last window is small, so the outlier moves the forecast only a little.
NOISY_LEVEL = [0.5 + e for e in (0.03, -0.02, 0.01, -0.03, 0.02, -0.01, 0.03, -0.02, 0.02, -0.03, 0.01, -0.02,
                                 0.03, -0.01)] + [0.62]


def _smooths_the_outlier(forecaster) -> tuple[bool, float]:
    """Feeds NOISY_LEVEL; True when the forecast lies strictly between the level (the mean before the
    outlier) and the outlier, and within a quarter of the way from the level to the outlier."""
    for x in NOISY_LEVEL:
        forecaster.observe(profile([1.0, x]))
    got = forecaster.forecast().reach[1]
    level, last = float(np.mean(NOISY_LEVEL[:-1])), NOISY_LEVEL[-1]
    return level < got < last and got - level < 0.25 * (last - level), got


def test_arima_forecast_of_a_noisy_level_is_near_the_level_not_the_last_window():
    arima = make_forecaster("arima", min_history=8)
    ok, got = _smooths_the_outlier(arima)
    assert arima.fallbacks == 0                    # statsmodels fitted every ramp
    assert ok, f"ARIMA forecast {got:.4f}: level {np.mean(NOISY_LEVEL[:-1]):.4f}, last window {NOISY_LEVEL[-1]}"
    ok_naive, naive = _smooths_the_outlier(make_forecaster("last"))
    assert not ok_naive and naive == NOISY_LEVEL[-1]   # the check tells ARIMA from the last-value forecast


# ----------------------------------------------------------------------------- error, drift

def test_forecast_error_reports_switch_windows_apart():
    obs = [profile([1.0, 0.8, 0.4])] * 3 + [profile([1.0, 0.2, 0.1])] * 3
    fc = make_forecaster("last")
    forecasts = []
    for p in obs:
        forecasts.append(fc.forecast())
        fc.observe(p)
    rep = forecast_error(forecasts, obs, switch_windows=[3], settle_windows=1)
    assert rep.windows == 4 and rep.switch_windows == 1     # window 0 has no forecast
    assert rep.mae == 0.0 and rep.per_ramp_mae == {1: 0.0, 2: 0.0}
    assert rep.per_ramp_mae_switch == pytest.approx({1: 0.6, 2: 0.3})
    assert rep.mae_switch == pytest.approx(0.45)
    assert np.isnan(rep.per_window[0])
    assert rep.to_dict()["per_window"][0] is None
    rep2 = forecast_error(forecasts, obs, switch_windows=[3], settle_windows=2)
    assert rep2.switch_windows == 2 and rep2.mae_switch == pytest.approx(0.225)
    with pytest.raises(ValueError, match="forecasts for"):
        forecast_error(forecasts[1:], obs)


def test_drifted():
    f = profile([1.0, 0.6, 0.3])
    assert not drifted(f, profile([1.0, 0.5, 0.25]), threshold=0.2)
    assert drifted(f, profile([1.0, 0.3, 0.1]), threshold=0.2)
    with pytest.raises(ValueError, match="threshold"):
        drifted(f, f, threshold=20)
