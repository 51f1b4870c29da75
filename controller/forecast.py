"""Exit forecaster: forecasts of the next window's batch profile, and their checks (E3 §3.1, docs/design.md §3).

The last two of the exit forecaster's steps; the window's measured profile
comes from :mod:`e3.controller.telemetry`.

3. **Forecast.** A :class:`Forecaster` (``arima`` or ``last``, from
   :func:`make_forecaster`) is fed every window's measured profile and
   forecasts the next window's. Forecasts are clamped to feasible profiles
   (:func:`clamp_reach`), and ARIMA falls back to the last value while its
   history is short or when a fit fails or returns NaN.
4. **Check.** :func:`forecast_error` measures forecasts against what then
   happened (per ramp, on shares of B0, switch windows apart), and
   :func:`drifted` is E3 §3.1's "observed drifts far from forecast" trigger.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import warnings
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from e3.core.profile import BatchProfile

__all__ = ["ForecastReport", "Forecaster", "ArimaForecaster", "LastValueForecaster", "FORECASTERS", "clamp_reach",
           "make_forecaster", "forecast_error", "drifted", "ARIMA_ORDER"]

log = logging.getLogger(__name__)

ARIMA_ORDER = (0, 1, 1)    # simple exponential smoothing; see ArimaForecaster for why


# --------------------------------------------------------------------------- step 3: forecasting

def clamp_reach(values: Sequence[float]) -> list[float]:
    """E3 §3.1's safety check: the nearest feasible profile.

    ``reach[0] = 1``; every share in [0, 1] (NaN becomes the previous share);
    non-increasing in k (a later block cannot see more inputs than an earlier
    one), enforced by a running minimum.
    """
    out = [1.0]
    for v in list(values)[1:]:
        v = float(v)
        if not math.isfinite(v):
            v = out[-1]
        out.append(min(out[-1], max(0.0, v)))
    return out


@contextlib.contextmanager
def _one_blas_thread():
    """Runs the block with every loaded OpenBLAS (numpy's, scipy's) on one thread, then restores them.

    statsmodels' fits are tiny; with OpenBLAS' default threads they ran 10-50x
    slower on a busy 2-core machine (spinning threads). Does what
    threadpoolctl does, for OpenBLAS only; a no-op where /proc is absent.
    """
    restore = []
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "openblas" in line.lower() and "/" in line}
    except OSError:
        paths = set()
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for prefix in ("openblas", "scipy_openblas"):
            for suffix in ("64_", "", "_"):
                get = getattr(lib, f"{prefix}_get_num_threads{suffix}", None)
                put = getattr(lib, f"{prefix}_set_num_threads{suffix}", None)
                if get is not None and put is not None:
                    break
            else:
                continue
            put.argtypes = [ctypes.c_int]
            before = int(get())
            if before != 1:
                put(1)
                restore.append((put, before))
            break
    try:
        yield
    finally:
        for put, before in restore:
            put(before)


class Forecaster(ABC):
    """Forecasts the next window's batch profile from the measured profiles of past windows.

    Feed it one measured profile per window with :meth:`observe` (skip
    windows without traffic), then ask :meth:`forecast` for the next one.
    Every forecast is feasible (:func:`clamp_reach`).
    """

    name = ""

    def __init__(self) -> None:
        self._history: list[BatchProfile] = []

    @property
    def history(self) -> list[BatchProfile]:
        """Profiles observed so far, oldest first (a copy)."""
        return list(self._history)

    def observe(self, observed: BatchProfile) -> None:
        """Appends one window's measured profile; all must have the same model and L."""
        if self._history:
            last = self._history[-1]
            if (observed.model, len(observed.reach)) != (last.model, len(last.reach)):
                raise ValueError(f"profile of {observed.model!r} with {len(observed.reach)} blocks does not "
                                 f"continue the history of {last.model!r} with {len(last.reach)} blocks")
        self._history.append(observed)

    def forecast(self) -> BatchProfile | None:
        """The next window's profile, clamped to feasible values; None before the first observation."""
        if not self._history:
            return None
        last = self._history[-1]
        reach = clamp_reach(self._predict())
        return BatchProfile(model=last.model, batch_size=last.batch_size, reach=reach,
                            source=f"forecast ({self.name}) from {len(self._history)} windows")

    @abstractmethod
    def _predict(self) -> list[float]:
        """Raw next-window reach (length L, may be infeasible); history is non-empty."""


class LastValueForecaster(Forecaster):
    """Naive forecast: the next window looks like the last one."""

    name = "last"

    def _predict(self) -> list[float]:
        return list(self._history[-1].reach)


class ArimaForecaster(Forecaster):
    """One statsmodels ARIMA per ramp, on the series of reach shares (E3 §3.1).

    Order (0, 1, 1) without a constant, i.e. simple exponential smoothing
    with its smoothing weight fitted on the history. Checked on synthetic
    series of window shares (binomial noise, 512 inputs per window; see
    ``benchmarks/forecast_error.py``): on a stationary series it matched
    (1, 0, 0) with a constant (which forecasts the mean) and beat last value
    by about 25%; on the 80:20 -> 20:80 stream its steady MAE was 0.019 of
    B0 against 0.021-0.025 for last value, 0.021-0.027 for (1, 0, 0) and
    0.021-0.023 for (1, 1, 0). After the step it re-converged in two windows,
    where (1, 0, 0) kept pulling forecasts back to the old mean for four or
    more (0.075 MAE in windows 2-5 after the switch on one seed, against
    0.020).

    The fit uses the last ``max_history`` windows (15 = half an hour of
    2-minute windows: bounded cost, and an old mix ages out sooner than with
    30, which was worse after a switch); with fewer than ``min_history`` windows, when a series is
    constant, or when a fit fails or returns NaN, that ramp's forecast is its
    last value. statsmodels' convergence and start-parameter warnings are
    expected on short noisy series and are logged at debug level only.
    A fit takes about 50 ms per ramp; fits run with OpenBLAS on one thread
    (:func:`_one_blas_thread`), since on a busy 2-core machine its spinning
    threads made them 10-50x slower.
    """

    name = "arima"

    def __init__(self, order: tuple[int, int, int] = ARIMA_ORDER, min_history: int = 8, max_history: int = 15):
        super().__init__()
        if len(order) != 3 or any(not isinstance(o, int) or o < 0 for o in order):
            raise ValueError(f"order must be three non-negative integers (p, d, q), got {order!r}")
        if min_history < 3:
            raise ValueError(f"min_history must be >= 3 windows, got {min_history}")
        if max_history < min_history:
            raise ValueError(f"max_history ({max_history}) must be >= min_history ({min_history})")
        self.order, self.min_history, self.max_history = tuple(order), min_history, max_history
        self.fallbacks = 0          # ramps forecast by last value because a fit failed or returned NaN

    def _predict(self) -> list[float]:
        series = np.array([p.reach for p in self._history[-self.max_history:]], dtype=float)  # [T, L]
        last = series[-1]
        if len(series) < self.min_history:
            return list(last)
        with _one_blas_thread():
            return [1.0] + [self._forecast_one(series[:, k], k) for k in range(1, series.shape[1])]

    def _forecast_one(self, y: np.ndarray, k: int) -> float:
        """ARIMA's next value of ramp ``k``'s series ``y``, or ``y[-1]`` if it cannot be had."""
        if np.ptp(y) < 1e-9:            # constant series: nothing to fit (and statsmodels would complain)
            return float(y[-1])
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                value = self._fit_forecast(y)
            for w in caught:
                log.debug("ARIMA ramp %d: %s", k, w.message)
        except Exception as err:  # noqa: BLE001 (any numerical failure means: use the last value)
            log.info("ARIMA fit for ramp %d failed (%s); using the last value", k, err)
            self.fallbacks += 1
            return float(y[-1])
        if not math.isfinite(value):
            log.info("ARIMA forecast for ramp %d is not finite; using the last value", k)
            self.fallbacks += 1
            return float(y[-1])
        return value

    def _fit_forecast(self, y: np.ndarray) -> float:
        """One statsmodels ARIMA fit on ``y`` and its one-step forecast (may raise or be NaN)."""
        from statsmodels.tsa.arima.model import ARIMA   # deferred: statsmodels takes seconds to load

        trend = "c" if self.order[1] == 0 else "n"
        # cov_type="none": parameter standard errors are not used, and their numerical Hessian is most of a fit
        fitted = ARIMA(y, order=self.order, trend=trend).fit(cov_type="none")
        return float(np.asarray(fitted.forecast(1))[0])


FORECASTERS: dict[str, type[Forecaster]] = {"arima": ArimaForecaster, "last": LastValueForecaster}


def make_forecaster(name: str, **options) -> Forecaster:
    """The forecaster called ``name`` (``arima`` or ``last``), built with ``options``."""
    try:
        cls = FORECASTERS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown forecaster {name!r}; choose one of: {', '.join(sorted(FORECASTERS))} "
                         f"(e.g. make_forecaster('arima'))") from None
    try:
        return cls(**options)
    except TypeError as err:
        raise ValueError(f"bad options for forecaster {name!r}: {err}") from None


# --------------------------------------------------------------------------- step 4: checking

@dataclass(frozen=True)
class ForecastReport:
    """Forecast error on reach shares (|forecast - observed| batch / B0), per ramp k = 1 .. L-1.

    Ramp k's error is on ``reach[k]``, the share of B0 that continues past
    ramp k into block k+1 (``reach[0]`` is always 1 and carries no error).
    """
    per_ramp_mae: dict[int, float]          # steady windows: ramp k -> mean |error|
    mae: float                              # steady windows: mean over ramps and windows
    per_ramp_mae_switch: dict[int, float]   # windows right after a mix switch
    mae_switch: float                       # NaN when there are no switch windows
    windows: int                            # steady windows scored
    switch_windows: int                     # switch windows scored
    per_window: list[float]                 # mean |error| over ramps per window (NaN where no forecast)

    def to_dict(self) -> dict:
        nan = lambda x: None if isinstance(x, float) and math.isnan(x) else x  # noqa: E731 (JSON has no NaN)
        return {"per_ramp_mae": {str(k): v for k, v in self.per_ramp_mae.items()}, "mae": nan(self.mae),
                "per_ramp_mae_switch": {str(k): v for k, v in self.per_ramp_mae_switch.items()},
                "mae_switch": nan(self.mae_switch), "windows": self.windows,
                "switch_windows": self.switch_windows, "per_window": [nan(x) for x in self.per_window]}


def forecast_error(forecasts: Sequence[BatchProfile | None], observed: Sequence[BatchProfile | None],
                   switch_windows: Sequence[int] = (), *, settle_windows: int = 2) -> ForecastReport:
    """Scores ``forecasts[i]`` (made before window i) against ``observed[i]``.

    Windows where either side is None (no forecast yet, no traffic) are
    skipped. Window i is a switch window when ``s <= i < s + settle_windows``
    for some ``s`` in ``switch_windows`` (the first window holding inputs of
    the new mix); those are reported apart, since no forecaster can see a
    switch coming and E3 reacts to it with :func:`drifted` instead.
    """
    if len(forecasts) != len(observed):
        raise ValueError(f"{len(forecasts)} forecasts for {len(observed)} observed windows")
    if settle_windows < 1:
        raise ValueError(f"settle_windows must be >= 1, got {settle_windows}")
    switch = {s + j for s in switch_windows for j in range(settle_windows)}
    steady_err: list[np.ndarray] = []
    switch_err: list[np.ndarray] = []
    per_window: list[float] = []
    L = None
    for i, (f, o) in enumerate(zip(forecasts, observed)):
        if f is None or o is None:
            per_window.append(float("nan"))
            continue
        if len(f.reach) != len(o.reach):
            raise ValueError(f"window {i}: forecast has {len(f.reach)} blocks, observed {len(o.reach)}")
        L = len(o.reach)
        err = np.abs(np.asarray(f.reach[1:], dtype=float) - np.asarray(o.reach[1:], dtype=float))
        (switch_err if i in switch else steady_err).append(err)
        per_window.append(float(err.mean()) if err.size else 0.0)

    def summarise(errs: list[np.ndarray]) -> tuple[dict[int, float], float]:
        if not errs or L is None or L < 2:
            return {}, float("nan")
        table = np.vstack(errs)                     # [windows, L-1]
        return {k: float(table[:, k - 1].mean()) for k in range(1, L)}, float(table.mean())

    per_ramp, mae = summarise(steady_err)
    per_ramp_sw, mae_sw = summarise(switch_err)
    return ForecastReport(per_ramp, mae, per_ramp_sw, mae_sw, len(steady_err), len(switch_err), per_window)


def drifted(forecast: BatchProfile, observed: BatchProfile, threshold: float = 0.2) -> bool:
    """True when the observed profile drifts far from the forecast (E3 §3.1: re-run the planner).

    Drift is the largest |forecast - observed| over blocks, as a share of B0;
    ``threshold`` 0.2 is E3 §5.8.3's 20% error, past which goodput loss grows.
    """
    if not 0 < threshold <= 1:
        raise ValueError(f"threshold is a share of B0 in (0, 1], got {threshold!r}")
    if len(forecast.reach) != len(observed.reach):
        raise ValueError(f"forecast has {len(forecast.reach)} blocks, observed {len(observed.reach)}")
    gap = max(abs(a - b) for a, b in zip(forecast.reach, observed.reach))
    return gap > threshold
