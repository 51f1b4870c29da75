"""Exit forecaster: E3's online batch-profile estimation (E3 §3.1, DESIGN §3).

Four steps, each a small piece the controller calls once per window:

1. **Read telemetry.** :func:`read_snapshot` fetches Triton's metrics page
   (``http://host:<metrics port>/metrics``) and :func:`parse_snapshots`
   turns its Prometheus text into one :class:`RouterSnapshot` per served
   model: the router's cumulative counters named in :mod:`e3.core.telemetry`.
   Nothing else is read, so it works the same when Triton runs elsewhere.
2. **Aggregate a window.** :func:`window_profile` takes two snapshots (the
   start and end of a window, 120 s by default) and returns a :class:`Window`
   whose ``profile`` is the window's :class:`~e3.core.profile.BatchProfile`.
   :class:`TelemetryReader` does steps 1-2 on a clock.
3. **Forecast.** A :class:`Forecaster` (``arima`` or ``last``, from
   :func:`make_forecaster`) is fed every window's measured profile and
   forecasts the next window's. Forecasts are clamped to feasible profiles
   (:func:`clamp_reach`), and ARIMA falls back to the last value while its
   history is short or when a fit fails or returns NaN.
4. **Check.** :func:`forecast_error` measures forecasts against what then
   happened (per ramp, on shares of B0, switch windows apart), and
   :func:`drifted` is E3 §3.1's "observed drifts far from forecast" trigger.

How counters map to reach (the window's batch profile)
------------------------------------------------------
For ramp k, ``reached_k`` is the window's increase of
``e3_ramp_reached_total{ramp=k}`` (inputs still running after block k, i.e.
not answered before ramp k) and ``exited_k`` that of
``e3_ramp_exited_total{ramp=k}`` (inputs answered at ramp k). An input enters
block k+1 iff it reached ramp k and did not exit there, so ramp k lets
through the share ``s_k = 1 - exited_k / reached_k`` of the inputs that reach
it, and::

    reach[0] = 1                       (block 1: every input)
    reach[k] = s_1 * s_2 * ... * s_k   (block k+1, k = 1 .. L-1)

With no drops, ``reached_{k+1} = reached_k - exited_k`` and this is exactly
``(reached_k - exited_k) / inputs``, the share of the window's inputs that
entered block k+1. The product form is used because it stays unbiased when
inputs are dropped between splits (E3 drops late inputs, Clockwork-style):
a dropped input is neither counted as having entered the later blocks nor
as having exited, so the profile describes the inputs that were served.
A ramp with no counters (disabled by the plan) or that no input reached in
the window lets everything through (``s_k = 1``: no evidence of exits), so a
measured profile is the profile of the plan in force. ``e3_inputs_total``
decides whether the window had traffic; the head (ramp L) only tells L.

Counter resets: when any counter of a model goes down between the two
snapshots, or a series present at the start is gone at the end, Triton or the
router restarted (a router reload with a new plan re-creates its metric
families), so every counter of that model is taken as counting from zero
and the window uses the end values (Prometheus ``increase()`` does the same
per series; doing it for all series at once keeps ``reached``/``exited``
consistent with each other).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import time
import urllib.request
import warnings
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from e3.core import telemetry
from e3.core.profile import BatchProfile

__all__ = [
    "RouterSnapshot", "Window", "TelemetryReader", "ForecastReport",
    "Forecaster", "ArimaForecaster", "LastValueForecaster", "FORECASTERS",
    "parse_snapshots", "read_snapshot", "fetch_metrics_text", "window_profile",
    "clamp_reach", "make_forecaster", "forecast_error", "drifted",
    "DEFAULT_WINDOW_S", "MIN_WINDOW_S", "ARIMA_ORDER",
]

log = logging.getLogger(__name__)

DEFAULT_WINDOW_S = 120.0   # E3 re-plans every 2 minutes
MIN_WINDOW_S = 1.0         # shorter windows hold too few inputs to estimate shares from
ARIMA_ORDER = (0, 1, 1)    # simple exponential smoothing; see ArimaForecaster for why


# --------------------------------------------------------------------------- step 1: telemetry

def _base(name: str) -> str:
    """Metric name without the counter suffix: the parser strips ``_total`` from counter families."""
    return name[: -len("_total")] if name.endswith("_total") else name


_INPUTS, _BATCHES, _REACHED, _EXITED, _DROPPED, _QUEUE, _PLAN = (
    _base(n) for n in (telemetry.INPUTS, telemetry.BATCHES, telemetry.RAMP_REACHED, telemetry.RAMP_EXITED,
                       telemetry.DROPPED, telemetry.ROUTER_OVERHEAD_US, telemetry.PLAN_INFO))


@dataclass(frozen=True)
class RouterSnapshot:
    """The router's cumulative counters for one model at one instant (since the router started)."""
    model: str                                              # served model name <m>
    at_s: float = 0.0                                       # wall-clock time of the scrape (s since the epoch)
    inputs: float = 0.0                                     # inputs that entered block 1
    batches: float = 0.0                                    # router execute calls
    dropped: float = 0.0                                    # inputs dropped with an error, all reasons
    router_overhead_us: float = 0.0                         # router's own Python work (us)
    reached: dict[int, float] = field(default_factory=dict)  # ramp k -> inputs still running after block k
    exited: dict[int, float] = field(default_factory=dict)   # ramp k -> inputs answered at ramp k
    plan_id: str | None = None                              # plan in force (e3_plan_info == 1), if exported

    def counters(self) -> dict[str, float]:
        """Every counter as a flat ``name -> value`` map (used to detect resets)."""
        flat = {"inputs": self.inputs, "batches": self.batches, "dropped": self.dropped,
                "router_overhead_us": self.router_overhead_us}
        flat.update({f"reached_{k}": v for k, v in self.reached.items()})
        flat.update({f"exited_{k}": v for k, v in self.exited.items()})
        return flat


def parse_snapshots(text: str, at_s: float | None = None) -> dict[str, RouterSnapshot]:
    """Parses Triton's Prometheus text into one :class:`RouterSnapshot` per ``model`` label.

    Metrics other than the router's (``nv_*``, ...) are ignored; a model whose
    router has exported nothing yet is absent from the result. Accepts counter
    samples with or without the ``_total`` suffix.
    """
    from prometheus_client.parser import text_string_to_metric_families

    at = time.time() if at_s is None else at_s
    fields: dict[str, dict] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            name, labels, value = _base(sample.name), sample.labels, float(sample.value)
            if name not in (_INPUTS, _BATCHES, _REACHED, _EXITED, _DROPPED, _QUEUE, _PLAN):
                continue
            model = labels.get("model")
            if model is None:
                log.debug("metric %s without a model label ignored", sample.name)
                continue
            f = fields.setdefault(model, {"reached": {}, "exited": {}, "dropped": 0.0})
            if name in (_REACHED, _EXITED):
                try:
                    ramp = int(labels["ramp"])
                except (KeyError, ValueError):
                    log.warning("metric %s with a missing or bad ramp label %r ignored", sample.name, labels)
                    continue
                bucket = f["reached" if name == _REACHED else "exited"]
                bucket[ramp] = bucket.get(ramp, 0.0) + value
            elif name == _DROPPED:
                f["dropped"] += value                   # summed over the ``reason`` label
            elif name == _PLAN:
                if value == 1.0:
                    f["plan_id"] = labels.get("plan_id")
            else:
                key = {_INPUTS: "inputs", _BATCHES: "batches", _QUEUE: "router_overhead_us"}[name]
                f[key] = f.get(key, 0.0) + value
    return {m: RouterSnapshot(model=m, at_s=at, **f) for m, f in fields.items()}


def fetch_metrics_text(url: str, timeout_s: float = 5.0) -> str:
    """GETs Triton's metrics page. ``url`` is ``host:port`` or a full URL (``/metrics`` is added if no path)."""
    if "://" not in url:
        url = "http://" + url
    scheme, _, rest = url.partition("://")
    if "/" not in rest:
        url = f"{scheme}://{rest}/metrics"
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:   # noqa: S310 (http only, our server)
        return resp.read().decode("utf-8")


def read_snapshot(url: str, model: str, timeout_s: float = 5.0) -> RouterSnapshot:
    """Scrapes ``url`` and returns ``model``'s snapshot (all zeros if its router exported nothing yet)."""
    at = time.time()
    snaps = parse_snapshots(fetch_metrics_text(url, timeout_s), at_s=at)
    return snaps.get(model, RouterSnapshot(model=model, at_s=at))


# --------------------------------------------------------------------------- step 2: windows

@dataclass(frozen=True)
class Window:
    """One window's traffic: counter increases between two snapshots, and its batch profile."""
    model: str                     # served model name <m>
    duration_s: float              # end.at_s - start.at_s
    inputs: float                  # inputs that entered block 1 in the window
    batches: float                 # router batches in the window
    dropped: float                 # inputs dropped in the window
    reached: dict[int, float]      # ramp k -> inputs that reached ramp k in the window
    exited: dict[int, float]       # ramp k -> inputs answered at ramp k in the window
    reset: bool                    # True when a counter reset (restart / router reload) fell in the window
    profile: BatchProfile | None   # the window's batch profile; None when the window had no traffic

    @property
    def mean_batch(self) -> float:
        """Mean router batch size in the window (inputs per batch; 0 without traffic)."""
        return self.inputs / self.batches if self.batches > 0 else 0.0


def _was_reset(start: RouterSnapshot, end: RouterSnapshot) -> bool:
    before, after = start.counters(), end.counters()
    return any(name not in after or after[name] < value for name, value in before.items())


def window_profile(start: RouterSnapshot, end: RouterSnapshot, *, num_blocks: int | None = None,
                   batch_size: int | None = None) -> Window:
    """The window between two snapshots of one model, and its batch profile.

    ``num_blocks`` is L (default: the largest ramp label seen, which is the
    head's once any input finished). ``batch_size`` is the profile's B0
    (default: the window's mean router batch, rounded, at least 1). The
    profile is None when no input entered in the window, or when L is unknown.
    See the module docstring for the mapping from counters to ``reach``.
    """
    if start.model != end.model:
        raise ValueError(f"snapshots of different models: {start.model!r} and {end.model!r}")
    reset = _was_reset(start, end)
    if reset:
        log.warning("router counters of %s went down: restart or router reload; the window counts from zero",
                    end.model)
        base = RouterSnapshot(model=end.model, at_s=start.at_s)
    else:
        base = start
    reached = {k: v - base.reached.get(k, 0.0) for k, v in end.reached.items()}
    exited = {k: v - base.exited.get(k, 0.0) for k, v in end.exited.items()}
    inputs = end.inputs - base.inputs
    batches = end.batches - base.batches
    win = dict(model=end.model, duration_s=end.at_s - start.at_s, inputs=inputs, batches=batches,
               dropped=end.dropped - base.dropped, reached=reached, exited=exited, reset=reset)

    ramps = set(reached) | set(exited)
    L = num_blocks if num_blocks is not None else max(ramps, default=0)
    if inputs <= 0:
        log.debug("window of %s had no traffic", end.model)
        return Window(**win, profile=None)
    if L < 1:
        log.warning("window of %s: number of blocks unknown (no ramp counters yet, num_blocks not given)",
                    end.model)
        return Window(**win, profile=None)
    reach = [1.0]
    for k in range(1, L):
        r, x = reached.get(k, 0.0), exited.get(k, 0.0)
        through = 1.0 if r <= 0 else min(1.0, max(0.0, 1.0 - x / r))
        reach.append(reach[-1] * through)
    b0 = batch_size if batch_size is not None else max(1, round(inputs / batches) if batches > 0 else 1)
    profile = BatchProfile(model=end.model, batch_size=int(b0), reach=reach,
                           source=f"measured: {inputs:.0f} inputs over {win['duration_s']:.1f} s")
    return Window(**win, profile=profile)


class TelemetryReader:
    """Closes one window per call: scrapes the router's counters and diffs them with the last scrape.

    ``window_s`` only documents the intended cadence and is validated here;
    the caller (the controller loop) calls :meth:`close_window` every
    ``window_s`` seconds, so tests and replays need no clock.
    """

    def __init__(self, url: str, model: str, *, window_s: float = DEFAULT_WINDOW_S,
                 num_blocks: int | None = None, batch_size: int | None = None, timeout_s: float = 5.0):
        if not (isinstance(window_s, (int, float)) and math.isfinite(window_s) and window_s >= MIN_WINDOW_S):
            raise ValueError(f"window_s must be a number of seconds >= {MIN_WINDOW_S:g}, got {window_s!r}; "
                             f"E3 uses {DEFAULT_WINDOW_S:g}")
        self.url, self.model, self.window_s = url, model, float(window_s)
        self.num_blocks, self.batch_size, self.timeout_s = num_blocks, batch_size, timeout_s
        self._last: RouterSnapshot | None = None

    def start(self) -> RouterSnapshot:
        """Takes the first snapshot (the start of the first window)."""
        self._last = read_snapshot(self.url, self.model, self.timeout_s)
        return self._last

    def close_window(self) -> Window:
        """Scrapes now and returns the window since the previous scrape (starting one first if needed)."""
        if self._last is None:
            self.start()
        end = read_snapshot(self.url, self.model, self.timeout_s)
        win = window_profile(self._last, end, num_blocks=self.num_blocks, batch_size=self.batch_size)
        self._last = end
        return win


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
        from statsmodels.tsa.arima.model import ARIMA

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
                   switch_windows: Sequence[int] = (), settle_windows: int = 2) -> ForecastReport:
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
