"""Router telemetry on Triton's metrics port -> one window's batch profile (E3 §3.1, docs/design.md §2).

The first two of the exit forecaster's steps (:mod:`e3.controller.forecast` does the rest):

1. **Read telemetry.** :func:`read_snapshot` fetches Triton's metrics page
   (``http://host:<metrics port>/metrics``) and :func:`parse_snapshots`
   turns its Prometheus text (through :func:`e3.core.telemetry.metric_samples`,
   the project's one parser) into one :class:`RouterSnapshot` per served
   model: the router's cumulative counters named in :mod:`e3.core.telemetry`.
   Nothing else is read, so it works the same when Triton runs elsewhere.
2. **Aggregate a window.** :func:`window_profile` takes two snapshots (the
   start and end of a window, 120 s by default) and returns a :class:`Window`
   whose ``profile`` is the window's :class:`~e3.core.profile.BatchProfile`.
   :class:`TelemetryReader` does steps 1-2 on the controller's cadence.

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

import logging
import math
import time
import urllib.request
from dataclasses import dataclass, field

from e3.core import telemetry as metric_names
from e3.core.profile import BatchProfile
from e3.core.telemetry import metric_samples

__all__ = ["RouterSnapshot", "Window", "TelemetryReader", "parse_snapshots", "read_snapshot", "fetch_metrics_text",
           "window_profile", "DEFAULT_WINDOW_S", "MIN_WINDOW_S"]

log = logging.getLogger(__name__)

DEFAULT_WINDOW_S = 120.0   # E3 re-plans every 2 minutes
MIN_WINDOW_S = 1.0         # shorter windows hold too few inputs to estimate shares from

# The router's metric names as metric_samples yields them (counter suffix ``_total`` removed).
_INPUTS, _BATCHES, _REACHED, _EXITED, _DROPPED, _OVERHEAD, _PLAN = (
    n.removesuffix("_total") for n in (metric_names.INPUTS, metric_names.BATCHES, metric_names.RAMP_REACHED,
                                       metric_names.RAMP_EXITED, metric_names.DROPPED,
                                       metric_names.ROUTER_OVERHEAD_US, metric_names.PLAN_INFO))
_ROUTER_METRICS = (_INPUTS, _BATCHES, _REACHED, _EXITED, _DROPPED, _OVERHEAD, _PLAN)


# --------------------------------------------------------------------------- step 1: telemetry

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
    at = time.time() if at_s is None else at_s
    fields: dict[str, dict] = {}
    for name, labels, value in metric_samples(text):
        if name not in _ROUTER_METRICS:      # Triton's own nv_* metrics, and the parser's *_created samples
            continue
        model = labels.get("model")
        if model is None:
            log.debug("metric %s without a model label ignored", name)
            continue
        f = fields.setdefault(model, {"reached": {}, "exited": {}, "dropped": 0.0})
        if name in (_REACHED, _EXITED):
            try:
                ramp = int(labels["ramp"])
            except (KeyError, ValueError):
                log.warning("metric %s with a missing or bad ramp label %r ignored", name, labels)
                continue
            bucket = f["reached" if name == _REACHED else "exited"]
            bucket[ramp] = bucket.get(ramp, 0.0) + value
        elif name == _DROPPED:
            f["dropped"] += value                   # summed over the ``reason`` label
        elif name == _PLAN:
            if value == 1.0:
                f["plan_id"] = labels.get("plan_id")
        else:
            key = {_INPUTS: "inputs", _BATCHES: "batches", _OVERHEAD: "router_overhead_us"}[name]
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
