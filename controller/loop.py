"""The control loop: E3's controller on a running Triton (E3 §3, docs/design.md §3).

Every window (120 s by default) :meth:`Controller.step`

1. closes a telemetry window (router counters -> the window's batch profile,
   :mod:`e3.controller.telemetry`),
2. checks drift: did the observed profile leave the forecast made for it
   (:func:`~e3.controller.forecast.drifted`)?,
3. feeds the forecaster and forecasts the next window,
4. finds stragglers (:func:`~e3.controller.health.find_stragglers`) and
   takes them out of the devices,
5. plans for the forecast (E3's DP) and scores the running plan under the same
   forecast (:func:`~e3.controller.decisions.score_plan`),
6. decides with the pure function :func:`~e3.controller.decisions.decide`
   whether to apply,
7. applies (load missing splits, set their instances and batching, switch the
   router, later unload splits the plan in force no longer uses), with
   exponential backoff when Triton refuses,
8. checks the served models' health (a dead Python stub is reloaded).

Every part it talks to is injected, so decisions are unit-tested without
Triton: the telemetry source (anything with ``close_window()``, e.g.
:class:`~e3.controller.telemetry.TelemetryReader`), the forecaster, the
:class:`Planner`, the server it reads (:class:`~e3.controller.applier.ServerView`)
and the server it changes (:class:`~e3.controller.applier.ServerControl`;
:class:`~e3.controller.triton_applier.TritonApplier` is both) and the :class:`Clock`.

Decisions (where the paper and docs/design.md are silent)
-------------------------------------------------
* **Unloading waits for a drain**: a router reload returns when the new router
  is ready, but requests already inside an old router instance may still call
  the old splits. Every such request ends (answered or dropped) within the
  router's deadline, the SLO; so splits the plan in force does not use are
  unloaded only once ``drain_s`` (default: the SLO) has passed since the
  switch. Every loaded ``<m>_split_*`` outside the plan in force is unloaded
  then, including leftovers of a failed attempt; nothing serving the plan in
  force (or a plan waiting for a retry) is ever unloaded.
* **A refused apply** keeps the plan in force serving and is retried with
  exponential backoff (:func:`~e3.controller.decisions.backoff_delay_s`)
  between windows; a newer window that no longer asks for it drops it.
* **State for** ``e3 status``: every window's :class:`StepReport` is written to
  the state file, and every applied plan to the :class:`~e3.controller.history.PlanHistory`.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Iterable, Mapping, Protocol, Sequence

from e3.controller.applier import ControlError, PlanRefused, ServerControl, ServerView
from e3.controller.decisions import backoff_delay_s, decide, devices_used, layout, plan_diff, same_layout, score_plan
from e3.controller.forecast import Forecaster, drifted
from e3.controller.health import SplitStats, exclude_stragglers, find_stragglers
from e3.controller.history import PlanHistory
from e3.controller.planner import PlanOptions, best_plan
from e3.controller.report import format_reach
from e3.controller.settings import ControlSettings
from e3.controller.signals import drop_rate_rps, observed_rate_rps, planned_rate_rps
from e3.controller.telemetry import Window
from e3.core.files import write_json_atomic
from e3.core.plan import FORMS, Plan
from e3.core.profile import BatchProfile, LatencyProfile
from e3.deploy.stubs import reload_dead_stubs

__all__ = ["Controller", "StepReport", "Clock", "MonotonicClock", "TelemetrySource", "Planner", "ProfilePlanner"]

log = logging.getLogger(__name__)


class Clock(ABC):
    """Time for the control loop: ``now()`` in seconds (monotonic), ``sleep(s)``."""

    @abstractmethod
    def now(self) -> float:
        """Seconds on a monotonic clock."""

    @abstractmethod
    def sleep(self, seconds: float, stop: threading.Event | None = None) -> None:
        """Wait ``seconds`` (returning early when ``stop`` is set)."""


class MonotonicClock(Clock):
    """The real clock: ``time.monotonic`` and a sleep that a stop event cuts short."""

    def now(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float, stop: threading.Event | None = None) -> None:
        if seconds <= 0:
            return
        if stop is not None:
            stop.wait(seconds)
        else:
            time.sleep(seconds)


class TelemetrySource(Protocol):
    """Where windows come from (:class:`~e3.controller.telemetry.TelemetryReader`, or a script in tests)."""

    def close_window(self) -> Window:
        """The window since the previous call: its traffic and measured batch profile."""


class Planner(ABC):
    """Turns a forecast into a plan, and scores a fixed plan under a forecast."""

    @abstractmethod
    def plan(self, forecast: BatchProfile, devices: Mapping[str, int]) -> Plan:
        """The best plan for ``forecast`` on ``devices`` (configuration -> count); raises PlannerError
        (a ValueError) when none fits."""

    @abstractmethod
    def throughput(self, plan: Plan, forecast: BatchProfile) -> float | None:
        """Predicted throughput (inputs/s) of ``plan`` under ``forecast``; None when it cannot be scored."""

    def for_rate(self, rate_rps: float) -> None:
        """Plan from now on for ``rate_rps`` inputs/s (the controller following traffic); default: ignored."""


class ProfilePlanner(Planner):
    """E3's DP (:func:`~e3.controller.planner.best_plan`) on a latency profile; plans are scored with
    E3's cost model (:func:`~e3.controller.decisions.score_plan`)."""

    def __init__(self, latency: LatencyProfile, *, exit_rule: Mapping[str, Any], ramp_blocks: Iterable[int],
                 slo_ms: float, rate_rps: float, slack: float = 0.2, alpha: float | None = 1.0,
                 forms: Sequence[str] = FORMS, exit_wrapper: bool = True):
        self.latency, self.exit_rule, self.ramp_blocks = latency, dict(exit_rule), tuple(ramp_blocks)
        self.slo_ms, self.rate_rps, self.slack, self.alpha = slo_ms, rate_rps, slack, alpha
        self.forms, self.exit_wrapper = tuple(forms), exit_wrapper   # as best_plan's

    def plan(self, forecast: BatchProfile, devices: Mapping[str, int]) -> Plan:
        result = best_plan(self.latency, forecast, devices, PlanOptions(slo_ms=self.slo_ms, rate_rps=self.rate_rps,
                                                                        slack=self.slack, alpha=self.alpha,
                                                                        forms=self.forms,
                                                                        exit_wrapper=self.exit_wrapper,
                                                                        ramp_blocks=self.ramp_blocks))
        return result.to_plan(model=self.latency.model, num_blocks=self.latency.num_blocks,
                              exit_rule=self.exit_rule, ramp_blocks=self.ramp_blocks, slo_ms=self.slo_ms,
                              slack=self.slack)

    def throughput(self, plan: Plan, forecast: BatchProfile) -> float | None:
        return score_plan(self.latency, forecast, plan, rate_rps=self.rate_rps)

    def for_rate(self, rate_rps: float) -> None:
        self.rate_rps = float(rate_rps)


@dataclass
class StepReport:
    """What one window's step saw and did (logged; written to the state file for ``e3 status``)."""
    window: int                                   # step number, from 1
    closed_at_s: float = 0.0                      # the controller clock's time when the window closed (s)
    inputs: float = 0.0                           # inputs the router took in the window
    offered_rps: float | None = None              # inputs/s offered in the window (taken + dropped)
    dropped_rps: float | None = None              # inputs/s dropped in the window
    planned_rps: float | None = None              # the rate this window's plan was made for (inputs/s)
    observed: list[float] | None = None           # the window's measured reach (None: no traffic)
    forecast_for_window: list[float] | None = None  # what had been forecast for this window
    forecast: list[float] | None = None           # forecast for the next window (what was planned for)
    drift: bool = False                           # the observed profile left the forecast made for it
    stragglers: dict[str, float] = field(default_factory=dict)   # split -> measured / profiled latency
    devices: dict[str, int] = field(default_factory=dict)        # what the planner was given
    candidate: dict | None = None                 # the planner's plan (dict)
    candidate_rps: float | None = None            # its predicted throughput under the forecast (inputs/s)
    current_rps: float | None = None              # the running plan's, under the same forecast (inputs/s)
    decision: str = ""                            # what was decided, and why
    applied: bool = False                         # the candidate was applied in this step
    diff: list[str] = field(default_factory=list)  # plan_diff(running plan, candidate)
    reloaded: list[str] = field(default_factory=list)  # models reloaded because their Python stub died
    error: str | None = None                      # telemetry or planner failure (the running plan stays)


class Controller:
    """E3's control loop; see the module docstring. Call :meth:`step` once per window, or :meth:`run`.

    ``view`` is the server the loop reads, ``control`` the one it changes;
    ``control`` defaults to ``view`` (one object implementing both, such as
    :class:`~e3.controller.triton_applier.TritonApplier`), and a dry run needs
    no control at all.
    """

    def __init__(self, settings: ControlSettings, *, telemetry: TelemetrySource, forecaster: Forecaster,
                 planner: Planner, view: ServerView, control: ServerControl | None = None,
                 clock: Clock | None = None, pinned: Plan | None = None, latency: LatencyProfile | None = None,
                 on_report: Callable[[StepReport], None] | None = None):
        settings.validate()
        if control is None and isinstance(view, ServerControl):
            control = view
        if control is None and not settings.dry_run:
            raise ValueError("the controller needs control=<a ServerControl> (e.g. a TritonApplier) to apply "
                             "plans; only a dry run works with a view alone")
        self.settings, self.telemetry, self.forecaster = settings, telemetry, forecaster
        self.planner, self.view, self.control = planner, view, control
        self.clock = clock or MonotonicClock()
        self.pinned = pinned
        self.on_report = on_report            # called with every window's report (the CLI prints it)
        self.latency = latency if latency is not None else getattr(planner, "latency", None)
        self.history = PlanHistory(settings.history_path(), settings.model)
        self.state_path = settings.state_path()
        self.last_forecast: BatchProfile | None = None
        self.reports: list[StepReport] = []
        self.failures = 0                       # consecutive refused applies
        self.retry_at: float | None = None      # clock time of the next retry (None: nothing pending)
        self.pending: tuple[Plan, str, BatchProfile | None] | None = None
        self.plan_in_force: Plan | None = None  # the router's plan as last read (or applied)
        self.drain_until: float | None = None   # unload unused splits from this clock time on
        self._stats: dict[str, SplitStats] = {}
        self._failed: dict[str, float] | None = None
        self._windows = 0
        self.refused: dict[tuple, str] = {}     # layout -> why it was refused for good (reported once)
        self._no_plan: str | None = None        # the planner's last "no plan" reason (logged when it changes)

    # -- one window ----------------------------------------------------------------------------------
    def step(self) -> StepReport:
        """Close a window and do everything the module docstring lists for it."""
        self._windows += 1
        rep = StepReport(window=self._windows, closed_at_s=self.clock.now())
        s = self.settings
        try:
            win = self.telemetry.close_window()
        except Exception as err:  # noqa: BLE001 (telemetry down: serving goes on; say why and wait)
            rep.error = f"telemetry: {err}"
            log.warning("window %d: cannot read telemetry (%s); keeping the running plan", rep.window, err)
            return self._finish(rep)
        rep.inputs = win.inputs
        rep.offered_rps = observed_rate_rps(win.inputs, win.dropped, win.duration_s)
        rep.dropped_rps = drop_rate_rps(win.dropped, win.duration_s)
        rep.planned_rps = planned_rate_rps(s.rate_rps, rep.offered_rps) if s.follow_traffic else s.rate_rps
        if s.follow_traffic:
            self.planner.for_rate(rep.planned_rps)
        current = self._current_plan(rep)
        if not s.dry_run:
            rep.reloaded = self._check_health(current)
        if win.profile is None:
            rep.decision = "no traffic in the window: nothing to plan from"
            log.info("window %d: %s", rep.window, rep.decision)
            self._after_window()
            return self._finish(rep)
        observed = win.profile
        rep.observed = list(observed.reach)
        if self.last_forecast is not None and len(self.last_forecast.reach) == len(observed.reach):
            rep.forecast_for_window = list(self.last_forecast.reach)
            rep.drift = drifted(self.last_forecast, observed, s.drift_threshold)
        self.forecaster.observe(observed)
        forecast = self.forecaster.forecast()
        self.last_forecast = forecast
        rep.forecast = list(forecast.reach)

        rep.stragglers = self._stragglers(current)
        rep.devices = exclude_stragglers(s.devices, current, rep.stragglers) if current else dict(s.devices)
        if rep.stragglers:
            log.warning("window %d: straggling splits %s (measured/profiled latency); planning with %s",
                        rep.window, {k: round(v, 2) for k, v in rep.stragglers.items()}, rep.devices)
        try:
            candidate = self.planner.plan(forecast, rep.devices)
        except ValueError as err:   # PlannerError: no plan fits; keep serving
            rep.error = f"planner: {err}"
            if str(err) != self._no_plan:   # once per reason, not every window
                log.warning("window %d: no plan (%s); keeping the running plan", rep.window, err)
            self._no_plan = str(err)
            self._after_window()
            return self._finish(rep)
        self._no_plan = None
        rep.candidate = candidate.to_dict()
        rep.candidate_rps = self.planner.throughput(candidate, forecast)
        rep.current_rps = self.planner.throughput(current, forecast) if current is not None else None
        rep.diff = plan_diff(current, candidate)
        decision = decide(candidate=candidate, current=current, candidate_rps=rep.candidate_rps or 0.0,
                          current_rps=rep.current_rps, drift=rep.drift, pinned=self.pinned is not None,
                          margin=s.margin, current_fits=current is None or all(
                              n <= rep.devices.get(d, 0) for d, n in devices_used(current).items()
                              if d in s.devices))
        rep.decision = decision.reason
        log.info("window %d: observed %s forecast %s -> %s (%s)", rep.window, format_reach(rep.observed),
                 format_reach(rep.forecast), "apply" if decision.apply else "keep", decision.reason)
        if decision.apply and layout(candidate) in self.refused:
            rep.decision = f"keep: this layout was refused for good ({self.refused[layout(candidate)]})"
            decision = replace(decision, apply=False)
        if decision.apply and s.dry_run:
            rep.decision = f"dry run, would apply: {decision.reason}"
        elif decision.apply:
            self.pending = (candidate, decision.reason, forecast)
            if self.retry_at is None or self.clock.now() >= self.retry_at:
                rep.applied = self._try_apply()
            else:
                rep.decision += f" (Triton refused before: retry in {self.retry_at - self.clock.now():.1f} s)"
        elif self.pending is not None and not decision.apply:
            self.pending, self.retry_at = None, None    # the newer forecast no longer asks for the pending plan
        self._after_window()
        return self._finish(rep)

    def _current_plan(self, rep: StepReport) -> Plan | None:
        try:
            self.plan_in_force = self.view.current_plan(self.settings.router)
        except Exception as err:  # noqa: BLE001
            log.warning("cannot read the running plan (%s); using the last good one", err)
            self.plan_in_force = self.history.last_good
        return self.plan_in_force

    @property
    def wanted_plan(self) -> Plan | None:
        """The plan the controller wants in force: one waiting to be applied (e.g. for pods), else the running
        one (what the desired-replicas signal is computed from)."""
        return self.pending[0] if self.pending is not None else self.plan_in_force

    def _after_window(self) -> None:
        if not self.settings.dry_run:
            self.unload_unused()

    def _finish(self, rep: StepReport) -> StepReport:
        self.reports.append(rep)
        if self.on_report is not None:
            self.on_report(rep)
        try:
            write_json_atomic(self.state_path, {"model": self.settings.model, "updated_at": time.time(),
                                                "pinned": self.pinned.plan_id if self.pinned else None,
                                                "failures": self.failures, "report": asdict(rep)})
        except OSError as err:
            log.warning("cannot write %s: %s", self.state_path, err)
        return rep

    # -- applying ------------------------------------------------------------------------------------
    def _try_apply(self) -> bool:
        """Apply the pending plan; on refusal keep the last good plan and schedule a retry with backoff."""
        plan, reason, forecast = self.pending
        current = None
        try:
            current = self.view.current_plan(self.settings.router)
            missing = [sp for sp in plan.triton_splits if not self.view.exported(sp.model)]
            if missing:
                log.info("exporting missing split models %s", [sp.model for sp in missing])
                self.control.export(missing, current)
            self.control.prepare(plan)      # e.g. pods for the plan's instances, before any load
            for sp in plan.triton_splits:   # compact splits run inside the router: nothing to load
                self.control.configure_split(sp)
            self.control.switch_plan(self.settings.router, plan)
        except PlanRefused as err:      # no retry makes it fit: report once, serve on with the running plan
            self.refused[layout(plan)] = str(err)
            self.pending, self.retry_at = None, None
            log.warning("plan %s refused (%s); serving goes on with plan %s; not retried",
                        plan.plan_id, err, current.plan_id if current else "?")
            return False
        except (ControlError, OSError) as err:
            self.failures += 1
            delay = backoff_delay_s(self.failures, self.settings.backoff_base_s, self.settings.backoff_max_s)
            self.retry_at = self.clock.now() + delay
            log.warning("applying plan %s failed (%s); serving goes on with plan %s; retry %d in %.1f s",
                        plan.plan_id, err, current.plan_id if current else "?", self.failures, delay)
            return False
        self.failures, self.retry_at, self.pending = 0, None, None
        self.plan_in_force = plan
        self.drain_until = self.clock.now() + self.settings.drain_wait_s
        self.history.append(plan, reason, forecast)
        log.info("applied plan %s (%s): %s", plan.plan_id, reason, "; ".join(plan_diff(current, plan)))
        return True

    def retry(self) -> bool:
        """Retry the pending plan if its backoff has passed; True when it was applied now."""
        if self.pending is None or self.retry_at is None or self.clock.now() < self.retry_at:
            return False
        return self._try_apply()

    def apply_pinned(self) -> bool:
        """Apply the pinned plan once if the router runs another layout (a pin holds that plan)."""
        if self.pinned is None or self.settings.dry_run:
            return False
        if same_layout(self.view.current_plan(self.settings.router), self.pinned):
            return False
        self.pending = (self.pinned, "pinned plan", None)
        return self._try_apply()

    def unload_unused(self) -> list[str]:
        """Unload loaded splits of this model that the plan in force does not use, once the drain has passed."""
        if self.drain_until is not None and self.clock.now() < self.drain_until:
            return []
        try:
            current = self.view.current_plan(self.settings.router)
            if current is None:
                return []
            used = {sp.model for sp in current.triton_splits}
            if self.pending is not None:
                used |= {sp.model for sp in self.pending[0].triton_splits}   # keep what a retry will need
            unused = sorted(set(self.view.loaded_splits(self.settings.model)) - used)
        except ControlError as err:
            log.warning("cannot list loaded splits (%s)", err)
            return []
        done = []
        for name in unused:
            try:
                self.control.unload(name)
                done.append(name)
            except ControlError as err:
                log.warning("unload of %s refused (%s); will try again next window", name, err)
        if done:
            log.info("unloaded %s (not used by plan %s)", done, current.plan_id)
        try:
            self.control.settle(current)   # e.g. pods no plan needs any more
        except ControlError as err:
            log.warning("cannot give back what plan %s no longer needs (%s); will try again", current.plan_id, err)
        self.drain_until = None
        return done

    # -- watching ------------------------------------------------------------------------------------
    def _stragglers(self, current: Plan | None) -> dict[str, float]:
        s = self.settings
        if current is None or s.straggler_factor is None or self.latency is None:
            return {}
        try:
            now = self.view.split_stats([sp.model for sp in current.triton_splits])
        except Exception as err:  # noqa: BLE001
            log.warning("no split statistics (%s); straggler check skipped", err)
            return {}
        before, self._stats = self._stats, now
        return find_stragglers(before, now, current, latency=self.latency, factor=s.straggler_factor, min_executions=s.min_executions)

    def _check_health(self, current: Plan | None) -> list[str]:
        """Reload models of the plan in force (and the router) whose Python stub died."""
        try:
            failed = self.view.failed_requests()
        except Exception as err:  # noqa: BLE001
            log.warning("cannot read failed-request counters (%s); health check skipped", err)
            return []
        before, self._failed = self._failed, failed
        if before is None:
            return []
        watched = [self.settings.router] + ([sp.model for sp in current.triton_splits] if current else [])
        rose = [m for m in watched if failed.get(m, 0.0) > before.get(m, 0.0)]
        reloaded, refused = reload_dead_stubs(rose, self.view.probe, self.control.reload, refused=(ControlError,))
        for name in refused:
            self._failed[name] = before.get(name, 0.0)   # so the next window looks again
        return reloaded

    # -- the loop ------------------------------------------------------------------------------------
    def run(self, stop: threading.Event | None = None, max_windows: int | None = None) -> list[StepReport]:
        """Step every ``window_s`` until ``stop`` is set or ``max_windows`` steps ran; retries and
        deferred unloads happen between windows."""
        stop = stop or threading.Event()
        start = getattr(self.telemetry, "start", None)
        if callable(start):
            start()
        self.apply_pinned()
        next_window = self.clock.now() + self.settings.window_s
        while not stop.is_set() and (max_windows is None or self._windows < max_windows):
            wake = min(t for t in (next_window, self.retry_at, self.drain_until) if t is not None)
            self.clock.sleep(wake - self.clock.now(), stop)
            if stop.is_set():
                break
            now = self.clock.now()
            if self.retry_at is not None and now >= self.retry_at and now < next_window:
                self.retry()
            if self.drain_until is not None and now >= self.drain_until and now < next_window \
                    and not self.settings.dry_run:
                self.unload_unused()
            if now >= next_window:
                self.step()
                next_window += self.settings.window_s
                if next_window <= self.clock.now():       # a slow step: do not fire a burst of windows
                    next_window = self.clock.now() + self.settings.window_s
        if not stop.is_set() and self.drain_until is not None and not self.settings.dry_run:
            self.clock.sleep(self.drain_until - self.clock.now(), stop)   # --once: finish the unload too
            self.unload_unused()
        return self.reports
