"""The controller: E3's control loop on a running Triton (E3 §3, DESIGN §3, issue 6).

Every window (120 s by default) :meth:`Controller.step`

1. closes a telemetry window (router counters -> the window's batch profile),
2. checks drift: did the observed profile leave the forecast made for it
   (:func:`~e3.controller.forecast.drifted`)?,
3. feeds the forecaster and forecasts the next window,
4. finds stragglers (splits whose measured per-batch latency is far above the
   latency profile) and takes them out of the resources,
5. plans for the forecast (E3's DP) and scores the running plan under the same
   forecast,
6. decides with the pure function :func:`decide` whether to apply,
7. applies (load missing splits, set their instances and batching, switch the
   router, later unload splits the plan in force no longer uses), with
   exponential backoff when Triton refuses,
8. checks the served models' health (a dead Python stub is reloaded).

Every part it talks to is injected, so decisions are unit-tested without
Triton: the telemetry source (anything with ``close_window()``, e.g.
:class:`~e3.controller.forecast.TelemetryReader`), the forecaster, the
:class:`Planner`, the :class:`Applier` (:class:`TritonApplier` talks to
Triton, :class:`RecordingApplier` records calls) and the :class:`Clock`.

Decisions (where the paper and DESIGN are silent)
-------------------------------------------------
* **"Better by a margin" compares like with like**: the new plan's predicted
  throughput against the *running* plan re-scored under the same forecast
  (:func:`score_plan`, the planner's formulas applied to a fixed plan), not
  against the running plan's prediction for an older mix. A running plan that
  cannot be scored (device not in the profile) or that breaks the latency
  budget under the forecast scores 0.
* **Drift** applies the new plan whatever the margin (E3 §3.1), unless the new
  plan has the same layout (:func:`layout`: splits, instances, batch sizes,
  devices, ramps) as the running one. Nothing is applied while a plan is pinned.
* **Unloading waits for a drain**: a router reload returns when the new router
  is ready, but requests already inside an old router instance may still call
  the old splits. Every such request ends (answered or dropped) within the
  router's deadline, the SLO; so splits the plan in force does not use are
  unloaded only once ``drain_s`` (default: the SLO) has passed since the
  switch. Every loaded ``<m>_split_*`` outside the plan in force is unloaded
  then, including leftovers of a failed attempt; nothing serving the plan in
  force is ever unloaded.
* **Split configuration**: a split's instances, preferred batch size and queue
  delay are set with one load carrying a config override (skipped when the
  live config already matches); DESIGN §3 asks for instance counts through
  ``POST v2/repository/models/<name>/load`` with a config override.
* **Missing split models** (not pre-exported with ``--all-ranges``) are
  exported with :func:`~e3.export.repository.export_repository` before any
  load, keeping the plan in force as the repository's plan.
* **Stragglers** (E3 §3.3): Triton's per-model statistics are per model, not
  per instance, and on one CPU machine the replicas of a split share the same
  cores. So a split whose measured per-batch latency over the window
  (``compute_infer`` ns / executions, at the window's mean executed batch) is
  above ``straggler_factor`` x its profiled latency at that batch counts as
  one slow replica, and the next plan is made with one device fewer of that
  split's configuration (never below one). Detection needs at least
  ``min_executions`` executions in the window.
* **Dead Python stubs** (DESIGN §6): detected from Triton's failed-request
  counter ``nv_inference_request_failure`` (per model, on the metrics port):
  when it rose in the window for the router or a split of the plan in force,
  that model is probed with one tiny request; if the probe fails with "Stub
  process ... is not healthy", the model is reloaded (a load with its live
  config as override, which Triton treats as a new version). The counter is
  the cheap trigger (no request per window); the probe keeps deadline drops
  and bad client input, which also count as failures, from causing reloads.
* **Files** (plan history, state for ``e3 status``) are validated JSON written
  to a temporary file and moved into place with ``os.replace``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import tempfile
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Protocol

from e3.controller.forecast import Forecaster, Window, drifted
from e3.core.names import parse_split_name, router_name
from e3.core.plan import Plan, PlanError, SplitPlan
from e3.core.profile import BatchProfile, LatencyProfile

__all__ = [
    "ControlSettings", "Decision", "SplitStats", "StepReport", "decide", "layout", "same_layout", "plan_diff",
    "score_plan", "find_stragglers", "exclude_stragglers", "devices_used", "backoff_delay_s", "failed_requests",
    "is_dead_stub", "PlanHistory", "HistoryError", "write_json_atomic", "Clock", "MonotonicClock",
    "Planner", "ProfilePlanner", "Applier", "RecordingApplier", "TritonApplier", "Controller",
    "HISTORY_VERSION", "describe_report", "status_lines",
]

log = logging.getLogger(__name__)

HISTORY_VERSION = 1
_DEAD_STUB = re.compile(r"stub process.*not healthy", re.IGNORECASE | re.DOTALL)


# --------------------------------------------------------------------------------------------- settings

@dataclass(frozen=True)
class ControlSettings:
    """What the controller is asked to do; validated once at start (:meth:`validate`)."""
    model: str                              # served model name <m> (e.g. "tiny_ee")
    resources: dict[str, int]               # device configuration -> devices (Triton instances here)
    slo_ms: float                           # latency objective per request (ms)
    rate_rps: float                         # offered request rate R the plans are made for (inputs/s)
    slack: float = 0.2                      # share of the SLO kept in reserve
    window_s: float = 120.0                 # seconds between two steps (E3: 2 minutes)
    margin: float = 0.10                    # apply when new throughput > running x (1 + margin)
    drift_threshold: float = 0.2            # max |forecast - observed| reach share that is not drift
    straggler_factor: float | None = 2.0    # measured / profiled latency past which a split straggles; None: off
    min_executions: int = 5                 # executions a split needs in a window before it can straggle
    backoff_base_s: float = 1.0             # first retry delay after Triton refuses (s)
    backoff_max_s: float = 60.0             # retry delay cap (s)
    drain_s: float | None = None            # wait after a switch before unloading (s); None: the SLO
    dry_run: bool = False                   # plan and report, never touch Triton
    state_dir: Path | None = None           # history and state files (default artifacts/controller)

    @property
    def router(self) -> str:
        return router_name(self.model)

    @property
    def drain_wait_s(self) -> float:
        return self.slo_ms / 1e3 if self.drain_s is None else self.drain_s

    def validate(self) -> None:
        """Raises ValueError naming the bad setting and what to write instead."""
        if not self.resources or any(int(n) < 1 for n in self.resources.values()):
            raise ValueError(f"resources need at least one device per configuration, e.g. {{'cpu': 2}}; "
                             f"got {self.resources}")
        if not self.slo_ms > 0 or not self.rate_rps > 0:
            raise ValueError(f"slo_ms and rate_rps must be > 0 (e.g. 200 and 50); got {self.slo_ms}, {self.rate_rps}")
        if not 0 <= self.slack < 1:
            raise ValueError(f"slack is a share of the SLO in [0, 1), e.g. 0.2; got {self.slack}")
        if not (math.isfinite(self.window_s) and self.window_s >= 1.0):
            raise ValueError(f"window_s must be >= 1 s (E3 uses 120); got {self.window_s}")
        if not self.margin >= 0:
            raise ValueError(f"margin is a share >= 0, e.g. 0.1 for 10%; got {self.margin}")
        if not 0 < self.drift_threshold <= 1:
            raise ValueError(f"drift_threshold is a share of B0 in (0, 1], e.g. 0.2; got {self.drift_threshold}")
        if self.straggler_factor is not None and not self.straggler_factor > 1:
            raise ValueError(f"straggler_factor must be > 1 (e.g. 2.0), or None to turn detection off; "
                             f"got {self.straggler_factor}")
        if not 0 < self.backoff_base_s <= self.backoff_max_s:
            raise ValueError(f"need 0 < backoff_base_s <= backoff_max_s; got {self.backoff_base_s}, "
                             f"{self.backoff_max_s}")
        if self.drain_s is not None and self.drain_s < 0:
            raise ValueError(f"drain_s must be >= 0 seconds; got {self.drain_s}")

    def files_dir(self) -> Path:
        if self.state_dir is not None:
            return Path(self.state_dir)
        from e3.paths import artifacts_dir
        return artifacts_dir() / "controller"


# --------------------------------------------------------------------------------------------- pure parts

@dataclass(frozen=True)
class Decision:
    apply: bool       # True: apply the candidate plan
    reason: str       # why, in words (logged, written to the history and the state file)


def layout(plan: Plan) -> tuple:
    """What a plan changes on the server: per split its model, instances, batch size, device and ramps.

    Plan ids, predictions and queue delays are left out: two plans with the same
    layout serve the same way.
    """
    return tuple((s.model, s.instances, s.batch_size, s.device, tuple(s.enabled_ramps)) for s in plan.splits)


def same_layout(a: Plan | None, b: Plan | None) -> bool:
    return a is not None and b is not None and layout(a) == layout(b)


def decide(*, candidate: Plan, current: Plan | None, candidate_rps: float, current_rps: float | None,
           drift: bool, pinned: bool, margin: float = 0.10, current_fits: bool = True) -> Decision:
    """Apply ``candidate``? ``*_rps``: predicted throughput (inputs/s) of both plans under the same forecast.

    Never while pinned; never when the layout would not change; always when
    nothing runs yet or the running plan cannot be scored (``current_rps`` None);
    always when the running plan uses more devices than the planner was given
    (``current_fits`` False: a straggler was left out); otherwise when the
    candidate beats the running plan by more than ``margin`` (a share, 0.1 =
    10%), or when the observed profile drifted from the forecast.
    """
    if pinned:
        return Decision(False, "pinned: the controller only watches")
    if same_layout(candidate, current):
        return Decision(False, "the planner's plan has the running layout")
    if current is None:
        return Decision(True, "no plan is running")
    if not current_fits:
        return Decision(True, "the running plan uses devices that are left out (stragglers)")
    if current_rps is None or current_rps <= 0:
        return Decision(True, "the running plan cannot be scored under the forecast (or breaks its SLO)")
    gain = candidate_rps / current_rps - 1.0
    if candidate_rps > current_rps * (1.0 + margin) * (1.0 + 1e-9):   # strictly better, float noise aside
        return Decision(True, f"predicted throughput {candidate_rps:.1f} vs {current_rps:.1f} inputs/s "
                              f"(+{100 * gain:.0f}% > {100 * margin:.0f}% margin)")
    if drift:
        return Decision(True, f"observed batch profile drifted from the forecast (gain {100 * gain:+.0f}%)")
    return Decision(False, f"gain {100 * gain:+.0f}% within the {100 * margin:.0f}% margin and no drift")


def plan_diff(current: Plan | None, new: Plan) -> list[str]:
    """Human-readable changes from ``current`` to ``new``: splits added, removed and reconfigured."""
    if current is None:
        return [f"+ {s.model} x{s.instances} batch {s.batch_size} on {s.device}" for s in new.splits]
    old = {s.model: s for s in current.splits}
    lines = []
    for s in new.splits:
        o = old.pop(s.model, None)
        if o is None:
            lines.append(f"+ {s.model} x{s.instances} batch {s.batch_size} on {s.device}")
            continue
        changes = [f"{what} {a} -> {b}" for what, a, b in (
            ("instances", o.instances, s.instances), ("batch", o.batch_size, s.batch_size),
            ("device", o.device, s.device), ("queue delay us", o.queue_delay_us, s.queue_delay_us),
            ("ramps", list(o.enabled_ramps), list(s.enabled_ramps))) if a != b]
        lines.append(f"~ {s.model}: " + ", ".join(changes) if changes else f"= {s.model}")
    lines += [f"- {name}" for name in old]
    return lines


def score_plan(latency: LatencyProfile, batch: BatchProfile, plan: Plan, rate_rps: float) -> float | None:
    """Predicted throughput (inputs/s) of a fixed ``plan`` under ``batch``, with the planner's formulas.

    B0 is the plan's predicted ``input_batch_size`` (else its first split's
    batch x instances); split i takes B0 x reach[a_i - 1] inputs per cycle,
    B_a / m per replica; stage = sum of its blocks with their ramps; the hop
    into every split but the first is Tx at that batch; cycle = the slowest
    stage or hop (pipelined). Returns 0 when the worst-case latency (fill
    time + every stage and hop) breaks SLO x (1 - slack), None when a split's
    device is not in the profile or the plan is for another number of blocks.
    """
    if plan.num_blocks != latency.num_blocks or len(batch.reach) != latency.num_blocks:
        return None
    if any(s.device not in latency.devices for s in plan.splits):
        return None
    b0 = float(plan.predicted.get("input_batch_size") or plan.splits[0].batch_size * plan.splits[0].instances)
    cycle = pipe = 0.0
    for i, s in enumerate(plan.splits):
        per = b0 * batch.reach[s.first_block - 1] / s.instances
        stage = sum(latency.block(k, s.device, per, with_ramp=True) for k in range(s.first_block, s.last_block + 1))
        hop = latency.tx(s.device, per) if i > 0 else 0.0
        cycle, pipe = max(cycle, stage, hop), pipe + stage + hop
    if 1e3 * (b0 - 1) / rate_rps + pipe > plan.slo_ms * (1 - plan.slack) * (1 + 1e-9):
        return 0.0
    return 1e3 * b0 / cycle if cycle > 0 else math.inf


@dataclass(frozen=True)
class SplitStats:
    """Cumulative Triton statistics of one model (``/v2/models/<name>/stats``)."""
    executions: int          # execution_count: batches executed
    inferences: int          # inference_count: inputs executed
    compute_infer_ns: int    # inference_stats.compute_infer.ns: time inside execute (ns)


def find_stragglers(before: Mapping[str, SplitStats], after: Mapping[str, SplitStats], plan: Plan,
                    latency: LatencyProfile, factor: float, min_executions: int = 5) -> dict[str, float]:
    """Splits of ``plan`` whose measured per-batch latency over the window is > ``factor`` x the profile's.

    Measured: delta compute_infer / delta executions (ms per batch), at the
    window's mean executed batch (delta inferences / delta executions);
    profiled: the sum of the split's blocks with ramps at that batch. Returns
    split name -> measured / profiled. Splits with fewer than
    ``min_executions`` executions, without stats, whose counters went down (a
    reload) or whose device is not in the profile are skipped.
    """
    out = {}
    for s in plan.splits:
        a, b = before.get(s.model), after.get(s.model)
        if a is None or b is None or s.device not in latency.devices:
            continue
        runs = b.executions - a.executions
        if runs < min_executions or b.inferences < a.inferences or b.compute_infer_ns < a.compute_infer_ns:
            continue
        measured_ms = (b.compute_infer_ns - a.compute_infer_ns) / runs / 1e6
        batch = (b.inferences - a.inferences) / runs
        profiled_ms = sum(latency.block(k, s.device, batch, with_ramp=True)
                          for k in range(s.first_block, s.last_block + 1))
        if profiled_ms > 0 and measured_ms > factor * profiled_ms:
            out[s.model] = measured_ms / profiled_ms
    return out


def exclude_stragglers(resources: Mapping[str, int], plan: Plan, stragglers: Iterable[str]) -> dict[str, int]:
    """The resources for the next plan: one device fewer of a straggling split's configuration (never < 1)."""
    res = dict(resources)
    device_of = {s.model: s.device for s in plan.splits}
    for name in stragglers:
        dev = device_of.get(name)
        if dev is None or dev not in res:
            continue
        if res[dev] > 1:
            res[dev] -= 1
        else:
            log.warning("straggler %s: only one %s device left; it cannot be left out", name, dev)
    return res


def devices_used(plan: Plan) -> dict[str, int]:
    """Device configuration -> instances the plan's splits use."""
    out: dict[str, int] = {}
    for s in plan.splits:
        out[s.device] = out.get(s.device, 0) + s.instances
    return out


def backoff_delay_s(failures: int, base_s: float = 1.0, max_s: float = 60.0) -> float:
    """Exponential backoff: ``base_s`` after the first failure, doubling, capped at ``max_s`` (s)."""
    if failures < 1:
        return 0.0
    return min(max_s, base_s * 2.0 ** (failures - 1))


def failed_requests(metrics_text: str) -> dict[str, float]:
    """Model -> Triton's cumulative ``nv_inference_request_failure`` (summed over its other labels)."""
    from prometheus_client.parser import text_string_to_metric_families
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name.removesuffix("_total") == "nv_inference_request_failure" and "model" in sample.labels:
                m = sample.labels["model"]
                out[m] = out.get(m, 0.0) + float(sample.value)
    return out


def is_dead_stub(message: str | None) -> bool:
    """True for the Python backend's "Stub process ... is not healthy" error."""
    return bool(message) and _DEAD_STUB.search(message) is not None


# --------------------------------------------------------------------------------------------- files

class HistoryError(ValueError):
    """A plan history file that cannot be used; the message names the problem."""


def write_json_atomic(path: Path, data: Any) -> None:
    """Write ``data`` as JSON to a temporary file beside ``path``, fsync, and ``os.replace`` it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(data, indent=1, sort_keys=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


class PlanHistory:
    """Every applied plan, oldest first, in one JSON file; the last entry is the last good plan.

    Entries: ``{"applied_at": <epoch s>, "reason": str, "forecast": [reach] | None, "plan": {...}}``.
    Each plan is validated (:meth:`Plan.from_dict`) on write and on read; a
    file that does not validate raises :class:`HistoryError` (it is never
    silently replaced). Only the last ``keep`` entries are kept.
    """

    def __init__(self, path: Path, model: str, keep: int = 200):
        self.path, self.model, self.keep = Path(path), model, keep
        self.entries: list[dict] = self._read() if self.path.exists() else []

    def _read(self) -> list[dict]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise HistoryError(f"plan history {self.path} is unreadable ({err}); move it away to start afresh") from None
        if not isinstance(data, dict) or data.get("version") != HISTORY_VERSION or not isinstance(
                data.get("entries"), list):
            raise HistoryError(f"plan history {self.path} is not a version-{HISTORY_VERSION} history")
        for i, e in enumerate(data["entries"]):
            try:
                Plan.from_dict(e["plan"])
            except (PlanError, KeyError, TypeError) as err:
                raise HistoryError(f"plan history {self.path}: entry {i} holds no valid plan ({err})") from None
        return data["entries"]

    @property
    def last_good(self) -> Plan | None:
        return Plan.from_dict(self.entries[-1]["plan"]) if self.entries else None

    def append(self, plan: Plan, reason: str, forecast: BatchProfile | None = None,
               at_s: float | None = None) -> None:
        """Validates ``plan`` and rewrites the file atomically with it appended."""
        checked = Plan.from_dict(json.loads(plan.to_json()))   # raises PlanError before anything is written
        entry = {"applied_at": time.time() if at_s is None else at_s, "reason": reason,
                 "forecast": list(forecast.reach) if forecast is not None else None, "plan": checked.to_dict()}
        entries = (self.entries + [entry])[-self.keep:]
        write_json_atomic(self.path, {"version": HISTORY_VERSION, "model": self.model, "entries": entries})
        self.entries = entries


# --------------------------------------------------------------------------------------------- injected parts

class Clock(ABC):
    """Time for the control loop: ``now()`` in seconds (monotonic), ``sleep(s)``."""

    @abstractmethod
    def now(self) -> float:
        """Seconds on a monotonic clock."""

    @abstractmethod
    def sleep(self, seconds: float, stop: threading.Event | None = None) -> None:
        """Wait ``seconds`` (returning early when ``stop`` is set)."""


class MonotonicClock(Clock):
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
    def close_window(self) -> Window: ...


class Planner(ABC):
    """Turns a forecast into a plan, and scores a fixed plan under a forecast."""

    @abstractmethod
    def plan(self, forecast: BatchProfile, resources: Mapping[str, int]) -> Plan:
        """The best plan for ``forecast`` on ``resources`` (raises PlannerError when none fits)."""

    @abstractmethod
    def throughput(self, plan: Plan, forecast: BatchProfile) -> float | None:
        """Predicted throughput (inputs/s) of ``plan`` under ``forecast``; None when it cannot be scored."""


class ProfilePlanner(Planner):
    """E3's DP (:func:`~e3.controller.planner.best_plan`) on a latency profile."""

    def __init__(self, latency: LatencyProfile, *, exit_rule: Mapping[str, Any], ramp_blocks: Iterable[int],
                 slo_ms: float, rate_rps: float, slack: float = 0.2, alpha: float | None = 1.0):
        self.latency, self.exit_rule, self.ramp_blocks = latency, dict(exit_rule), tuple(ramp_blocks)
        self.slo_ms, self.rate_rps, self.slack, self.alpha = slo_ms, rate_rps, slack, alpha

    def plan(self, forecast: BatchProfile, resources: Mapping[str, int]) -> Plan:
        from e3.controller.planner import best_plan
        result = best_plan(self.latency, forecast, resources, slo_ms=self.slo_ms, rate_rps=self.rate_rps,
                           slack=self.slack, alpha=self.alpha)
        return result.to_plan(self.latency.model, self.latency.num_blocks, self.exit_rule, self.ramp_blocks,
                              self.slo_ms, self.slack)

    def throughput(self, plan: Plan, forecast: BatchProfile) -> float | None:
        return score_plan(self.latency, forecast, plan, self.rate_rps)


class Applier(ABC):
    """The controller's view of and hands on the server. Every method raises ControlError when refused."""

    @abstractmethod
    def current_plan(self, router: str) -> Plan | None:
        """The plan in the router's live config (None when the router is not loaded)."""

    @abstractmethod
    def loaded_splits(self, model: str) -> dict[str, int]:
        """Loaded (READY) split models of served model ``model`` -> their instance count."""

    @abstractmethod
    def exported(self, split: str) -> bool:
        """Is the split model in the repository (loadable)?"""

    @abstractmethod
    def export(self, splits: list[SplitPlan], plan_in_force: Plan | None) -> None:
        """Export missing split models into the repository (off the request path)."""

    @abstractmethod
    def configure_split(self, split: SplitPlan) -> None:
        """Load ``split.model`` (or reload it) with the split's instances, preferred batch and queue delay."""

    @abstractmethod
    def switch_plan(self, router: str, plan: Plan) -> None:
        """Hand ``plan`` to the router (its splits are loaded)."""

    @abstractmethod
    def unload(self, name: str) -> None:
        """Unload a model."""

    @abstractmethod
    def split_stats(self, names: Iterable[str]) -> dict[str, SplitStats]:
        """Cumulative per-model statistics of the named (loaded) models."""

    @abstractmethod
    def failed_requests(self) -> dict[str, float]:
        """Model -> cumulative failed requests (Triton's nv_inference_request_failure)."""

    @abstractmethod
    def probe(self, name: str) -> str | None:
        """Send one tiny request to ``name``; None when it answered, else the error message."""

    @abstractmethod
    def reload(self, name: str) -> None:
        """Reload ``name`` with its live config (new stub processes)."""


class RecordingApplier(Applier):
    """An in-memory server that records every call (tests, and what a dry run would do).

    ``fail`` maps an operation name (``configure``, ``switch``, ``unload``,
    ``export``, ``reload``) to how many of its next calls raise ControlError.
    """

    def __init__(self, plan: Plan | None = None, exported: Iterable[str] | None = None):
        self.plan = plan
        self.splits: dict[str, dict] = {s.model: {"instances": s.instances, "batch": s.batch_size}
                                        for s in (plan.splits if plan else ())}
        self.repository: set[str] | None = set(exported) if exported is not None else None
        self.calls: list[tuple] = []
        self.fail: dict[str, int] = {}
        self.stats: dict[str, SplitStats] = {}
        self.failures: dict[str, float] = {}
        self.probe_errors: dict[str, str] = {}

    def _maybe_fail(self, op: str, what: str) -> None:
        from e3.controller.triton_api import ControlError
        if self.fail.get(op, 0) > 0:
            self.fail[op] -= 1
            self.calls.append(("refused", op, what))
            raise ControlError(f"{op} {what}: refused (recorded failure)")

    def current_plan(self, router: str) -> Plan | None:
        return self.plan

    def loaded_splits(self, model: str) -> dict[str, int]:
        return {n: v["instances"] for n, v in self.splits.items() if n.startswith(f"{model}_split_")}

    def exported(self, split: str) -> bool:
        return self.repository is None or split in self.repository

    def export(self, splits: list[SplitPlan], plan_in_force: Plan | None) -> None:
        self._maybe_fail("export", ",".join(s.model for s in splits))
        self.calls.append(("export", tuple(s.model for s in splits)))
        if self.repository is not None:
            self.repository.update(s.model for s in splits)

    def configure_split(self, split: SplitPlan) -> None:
        want = {"instances": split.instances, "batch": split.batch_size}
        if self.splits.get(split.model) == want:
            return
        self._maybe_fail("configure", split.model)
        self.calls.append(("load", split.model, split.instances, split.batch_size))
        self.splits[split.model] = want

    def switch_plan(self, router: str, plan: Plan) -> None:
        from e3.controller.triton_api import ControlError
        self._maybe_fail("switch", plan.plan_id)
        missing = [s.model for s in plan.splits if s.model not in self.splits]
        if missing:
            raise ControlError(f"load the plan's splits before switching {router}: {missing} not ready")
        self.calls.append(("switch", plan.plan_id))
        self.plan = plan

    def unload(self, name: str) -> None:
        self._maybe_fail("unload", name)
        self.calls.append(("unload", name))
        self.splits.pop(name, None)

    def split_stats(self, names: Iterable[str]) -> dict[str, SplitStats]:
        return {n: self.stats[n] for n in names if n in self.stats}

    def failed_requests(self) -> dict[str, float]:
        return dict(self.failures)

    def probe(self, name: str) -> str | None:
        self.calls.append(("probe", name))
        return self.probe_errors.get(name)

    def reload(self, name: str) -> None:
        self._maybe_fail("reload", name)
        self.calls.append(("reload", name))
        self.probe_errors.pop(name, None)


_NP_TYPES = {"TYPE_FP32": "float32", "TYPE_FP16": "float16", "TYPE_INT64": "int64", "TYPE_INT32": "int32",
             "TYPE_BOOL": "bool", "TYPE_INT8": "int8", "TYPE_UINT8": "uint8"}
_CLIENT_TYPES = {"TYPE_FP32": "FP32", "TYPE_FP16": "FP16", "TYPE_INT64": "INT64", "TYPE_INT32": "INT32",
                 "TYPE_BOOL": "BOOL", "TYPE_INT8": "INT8", "TYPE_UINT8": "UINT8"}


class TritonApplier(Applier):
    """Applies plans to a running Triton through its HTTP API (:class:`~e3.controller.triton_api.TritonControl`).

    ``repo`` and ``zoo_model`` are needed only to export split models that are
    missing from the repository; ``metrics_url`` only for the failed-request
    counters.
    """

    def __init__(self, url: str, *, metrics_url: str | None = None, repo: Path | None = None,
                 zoo_model: str | None = None, probe_timeout_s: float = 10.0):
        self.url, self.metrics_url, self.repo, self.zoo_model = url, metrics_url, repo, zoo_model
        self.probe_timeout_s = probe_timeout_s
        self._local = threading.local()

    @property
    def control(self):
        """This thread's :class:`TritonControl`: tritonclient's HTTP client (gevent) hangs when shared
        across threads, and the control loop usually runs in its own thread."""
        control = getattr(self._local, "control", None)
        if control is None:
            from e3.controller.triton_api import TritonControl
            control = self._local.control = TritonControl(self.url)
        return control

    def close(self) -> None:
        """Closes this thread's client; clients of other threads are dropped with their threads."""
        control = getattr(self._local, "control", None)
        if control is not None:
            control.close()
            self._local.control = None

    def current_plan(self, router: str) -> Plan | None:
        from e3.controller.triton_api import ControlError
        try:
            if not self.control.is_ready(router):
                return None
        except ControlError:
            return None
        return self.control.current_plan(router)

    def loaded_splits(self, model: str) -> dict[str, int]:
        out = {}
        for name, state in self.control.loaded().items():
            if state != "READY":
                continue
            try:
                served, _, _ = parse_split_name(name)
            except ValueError:
                continue
            if served == model:
                groups = self.control.model_config(name).get("instance_group", [])
                out[name] = sum(int(g.get("count", 1)) for g in groups) or 1
        return out

    def exported(self, split: str) -> bool:
        if self.repo is None:
            return True   # no repository to check: let Triton's load say
        return (Path(self.repo) / split / "config.pbtxt").is_file()

    def export(self, splits: list[SplitPlan], plan_in_force: Plan | None) -> None:
        from e3.controller.triton_api import ControlError
        from e3.export.repository import ExportError, ExportSettings, export_repository
        if self.repo is None or self.zoo_model is None:
            raise ControlError(f"split models {[s.model for s in splits]} are not in the repository and no "
                               "repository/model was given to export them; export with --all-ranges")
        try:
            export_repository(self.zoo_model, None, Path(self.repo), ExportSettings(), plan=plan_in_force,
                              progress=False, extra_ranges=[(s.first_block, s.last_block) for s in splits])
        except (ExportError, PlanError, ValueError) as err:
            raise ControlError(f"export of {[s.model for s in splits]} failed: {err}") from None

    def configure_split(self, split: SplitPlan) -> None:
        from e3.controller.triton_api import ControlError
        state = self.control.loaded().get(split.model)
        config = self.control.model_config(split.model) if state == "READY" else None
        if config is None:
            self.control.load(split.model)            # first load: the repository's config
            config = self.control.model_config(split.model)
        want = _with_split_settings(config, split)
        if want != config:
            self.control.load(split.model, want)
        if not self.control.is_ready(split.model):
            raise ControlError(f"{split.model} is not ready after its load")

    def switch_plan(self, router: str, plan: Plan) -> None:
        self.control.switch_plan(router, plan)

    def unload(self, name: str) -> None:
        self.control.unload(name)

    def split_stats(self, names: Iterable[str]) -> dict[str, SplitStats]:
        out = {}
        for name in names:
            try:
                stats = self.control._call(f"statistics of {name}", self.control._client.get_inference_statistics,
                                           name)
            except Exception as err:  # noqa: BLE001 (a missing model has no stats; never fatal)
                log.debug("no statistics for %s: %s", name, err)
                continue
            for s in stats.get("model_stats", []):
                out[name] = SplitStats(int(s.get("execution_count", 0)), int(s.get("inference_count", 0)),
                                       int(s.get("inference_stats", {}).get("compute_infer", {}).get("ns", 0)))
        return out

    def failed_requests(self) -> dict[str, float]:
        if self.metrics_url is None:
            return {}
        from e3.controller.forecast import fetch_metrics_text
        return failed_requests(fetch_metrics_text(self.metrics_url))

    def probe(self, name: str) -> str | None:
        import numpy as np
        import tritonclient.http as http
        from tritonclient.utils import InferenceServerException
        config = self.control.model_config(name)
        inputs = []
        for spec in config.get("input", []):
            dims = [1, *(max(1, int(d)) for d in spec.get("dims", []))]
            np_type = _NP_TYPES.get(spec.get("data_type", ""), None)
            if np_type is None:
                return None   # cannot build a probe for this input type: no evidence either way
            # ones, not zeros: an all-zero attention mask would give NaN softmaxes (still an answer)
            data = np.ones(dims, dtype=np_type) if "INT" in spec["data_type"] or "BOOL" in spec["data_type"] \
                else np.zeros(dims, dtype=np_type)
            tensor = http.InferInput(spec["name"], dims, _CLIENT_TYPES[spec["data_type"]])
            tensor.set_data_from_numpy(data)
            inputs.append(tensor)
        try:
            with http.InferenceServerClient(self.url, network_timeout=self.probe_timeout_s) as client:
                client.infer(name, inputs)
        except InferenceServerException as err:
            return err.message()
        except Exception as err:  # noqa: BLE001 (connection trouble is a probe failure, with its message)
            return str(err)
        return None

    def reload(self, name: str) -> None:
        """Reload ``name`` with fresh instances. Triton skips a load whose config and files are
        unchanged (measured: a dead stub stayed dead), so the override carries a new
        ``e3_reload`` parameter; the old version serves until the new one is ready."""
        import time
        config = self.control.model_config(name)
        config.setdefault("parameters", {})["e3_reload"] = {"string_value": f"{time.time():.6f}"}
        self.control.load(name, config)


def _with_split_settings(config: dict, split: SplitPlan) -> dict:
    """``config`` (a Triton model config as JSON) with the split's instances, preferred batch and queue delay."""
    import copy
    out = copy.deepcopy(config)
    for group in out.get("instance_group", []) or [{}]:
        group["count"] = split.instances
    if not out.get("instance_group"):
        out["instance_group"] = [{"count": split.instances, "kind": "KIND_CPU"}]
    batching = out.setdefault("dynamic_batching", {})
    batching["preferred_batch_size"] = [min(split.batch_size, int(out.get("max_batch_size") or split.batch_size))]
    batching["max_queue_delay_microseconds"] = split.queue_delay_us
    return out


# --------------------------------------------------------------------------------------------- the loop

@dataclass
class StepReport:
    """What one window's step saw and did (logged; written to the state file for ``e3 status``)."""
    window: int                                   # step number, from 1
    closed_at_s: float = 0.0                      # the controller clock's time when the window closed (s)
    inputs: float = 0.0                           # inputs the router took in the window
    observed: list[float] | None = None           # the window's measured reach (None: no traffic)
    forecast_for_window: list[float] | None = None  # what had been forecast for this window
    forecast: list[float] | None = None           # forecast for the next window (what was planned for)
    drift: bool = False
    stragglers: dict[str, float] = field(default_factory=dict)   # split -> measured / profiled latency
    resources: dict[str, int] = field(default_factory=dict)      # what the planner was given
    candidate: dict | None = None                 # the planner's plan (dict)
    candidate_rps: float | None = None
    current_rps: float | None = None
    decision: str = ""
    applied: bool = False
    diff: list[str] = field(default_factory=list)
    reloaded: list[str] = field(default_factory=list)
    error: str | None = None


class Controller:
    """E3's control loop; see the module docstring. Call :meth:`step` once per window, or :meth:`run`."""

    def __init__(self, settings: ControlSettings, *, telemetry: TelemetrySource, forecaster: Forecaster,
                 planner: Planner, applier: Applier, clock: Clock | None = None, pinned: Plan | None = None,
                 latency: LatencyProfile | None = None, on_report: Callable[[StepReport], None] | None = None):
        settings.validate()
        self.settings, self.telemetry, self.forecaster = settings, telemetry, forecaster
        self.planner, self.applier = planner, applier
        self.clock = clock or MonotonicClock()
        self.pinned = pinned
        self.on_report = on_report            # called with every window's report (the CLI prints it)
        self.latency = latency if latency is not None else getattr(planner, "latency", None)
        files = settings.files_dir()
        self.history = PlanHistory(files / f"{settings.model}.history.json", settings.model)
        self.state_path = files / f"{settings.model}.state.json"
        self.last_forecast: BatchProfile | None = None
        self.reports: list[StepReport] = []
        self.failures = 0                       # consecutive refused applies
        self.retry_at: float | None = None      # clock time of the next retry (None: nothing pending)
        self.pending: tuple[Plan, str, BatchProfile | None] | None = None
        self.drain_until: float | None = None   # unload unused splits from this clock time on
        self._stats: dict[str, SplitStats] = {}
        self._failed: dict[str, float] | None = None
        self._windows = 0

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
        rep.resources = exclude_stragglers(s.resources, current, rep.stragglers) if current else dict(s.resources)
        if rep.stragglers:
            log.warning("window %d: straggling splits %s (measured/profiled latency); planning with %s",
                        rep.window, {k: round(v, 2) for k, v in rep.stragglers.items()}, rep.resources)
        try:
            candidate = self.planner.plan(forecast, rep.resources)
        except ValueError as err:   # PlannerError: no plan fits; keep serving
            rep.error = f"planner: {err}"
            log.warning("window %d: no plan (%s); keeping the running plan", rep.window, err)
            self._after_window()
            return self._finish(rep)
        rep.candidate = candidate.to_dict()
        rep.candidate_rps = self.planner.throughput(candidate, forecast)
        rep.current_rps = self.planner.throughput(current, forecast) if current is not None else None
        rep.diff = plan_diff(current, candidate)
        decision = decide(candidate=candidate, current=current, candidate_rps=rep.candidate_rps or 0.0,
                          current_rps=rep.current_rps, drift=rep.drift, pinned=self.pinned is not None,
                          margin=s.margin, current_fits=current is None or all(
                              n <= rep.resources.get(d, 0) for d, n in devices_used(current).items()
                              if d in s.resources))
        rep.decision = decision.reason
        log.info("window %d: observed %s forecast %s -> %s (%s)", rep.window, _fmt(rep.observed), _fmt(rep.forecast),
                 "apply" if decision.apply else "keep", decision.reason)
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
            return self.applier.current_plan(self.settings.router)
        except Exception as err:  # noqa: BLE001
            log.warning("cannot read the running plan (%s); using the last good one", err)
            return self.history.last_good

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
        from e3.controller.triton_api import ControlError
        plan, reason, forecast = self.pending
        current = None
        try:
            current = self.applier.current_plan(self.settings.router)
            missing = [sp for sp in plan.splits if not self.applier.exported(sp.model)]
            if missing:
                log.info("exporting missing split models %s", [sp.model for sp in missing])
                self.applier.export(missing, current)
            for sp in plan.splits:
                self.applier.configure_split(sp)
            self.applier.switch_plan(self.settings.router, plan)
        except (ControlError, OSError) as err:
            self.failures += 1
            delay = backoff_delay_s(self.failures, self.settings.backoff_base_s, self.settings.backoff_max_s)
            self.retry_at = self.clock.now() + delay
            log.warning("applying plan %s failed (%s); serving goes on with plan %s; retry %d in %.1f s",
                        plan.plan_id, err, current.plan_id if current else "?", self.failures, delay)
            return False
        self.failures, self.retry_at, self.pending = 0, None, None
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
        if same_layout(self.applier.current_plan(self.settings.router), self.pinned):
            return False
        self.pending = (self.pinned, "pinned plan", None)
        return self._try_apply()

    def unload_unused(self) -> list[str]:
        """Unload loaded splits of this model that the plan in force does not use, once the drain has passed."""
        from e3.controller.triton_api import ControlError
        if self.drain_until is not None and self.clock.now() < self.drain_until:
            return []
        try:
            current = self.applier.current_plan(self.settings.router)
            if current is None:
                return []
            used = {sp.model for sp in current.splits}
            if self.pending is not None:
                used |= {sp.model for sp in self.pending[0].splits}   # keep what a retry will need
            unused = sorted(set(self.applier.loaded_splits(self.settings.model)) - used)
        except ControlError as err:
            log.warning("cannot list loaded splits (%s)", err)
            return []
        done = []
        for name in unused:
            try:
                self.applier.unload(name)
                done.append(name)
            except ControlError as err:
                log.warning("unload of %s refused (%s); will try again next window", name, err)
        if done:
            log.info("unloaded %s (not used by plan %s)", done, current.plan_id)
        self.drain_until = None
        return done

    # -- watching ------------------------------------------------------------------------------------
    def _stragglers(self, current: Plan | None) -> dict[str, float]:
        s = self.settings
        if current is None or s.straggler_factor is None or self.latency is None:
            return {}
        try:
            now = self.applier.split_stats([sp.model for sp in current.splits])
        except Exception as err:  # noqa: BLE001
            log.warning("no split statistics (%s); straggler check skipped", err)
            return {}
        before, self._stats = self._stats, now
        return find_stragglers(before, now, current, self.latency, s.straggler_factor, s.min_executions)

    def _check_health(self, current: Plan | None) -> list[str]:
        """Reload models of the plan in force (and the router) whose Python stub died."""
        from e3.controller.triton_api import ControlError
        try:
            failed = self.applier.failed_requests()
        except Exception as err:  # noqa: BLE001
            log.warning("cannot read failed-request counters (%s); health check skipped", err)
            return []
        before, self._failed = self._failed, failed
        if before is None:
            return []
        watched = [self.settings.router] + ([sp.model for sp in current.splits] if current else [])
        rose = [m for m in watched if failed.get(m, 0.0) > before.get(m, 0.0)]
        reloaded = []
        for name in rose:
            message = self.applier.probe(name)
            if not is_dead_stub(message):
                if message:
                    log.warning("%s had failed requests; its probe failed with: %s", name, message)
                continue
            log.error("%s: Python stub died (%s); reloading it", name, message)
            try:
                self.applier.reload(name)
                reloaded.append(name)
            except ControlError as err:
                log.error("reload of %s refused (%s); will try again next window", name, err)
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


def _fmt(reach: list[float] | None) -> str:
    return "-" if reach is None else "[" + ", ".join(f"{r:.2f}" for r in reach) + "]"



# --------------------------------------------------------------------------------------------- reporting

def _plan_lines(plan: Plan, indent: str = "  ") -> list[str]:
    lines = [f"{indent}{s.model:24s} blocks {s.first_block}-{s.last_block}  {s.device} x{s.instances}  "
             f"batch {s.batch_size}  queue delay {s.queue_delay_us} us  ramps {list(s.enabled_ramps) or '-'}"
             for s in plan.splits]
    if plan.predicted:
        p = plan.predicted
        lines.append(f"{indent}predicted throughput {p.get('throughput_rps', float('nan')):.1f} inputs/s, "
                     f"worst-case latency {p.get('latency_ms', float('nan')):.1f} ms, B0 "
                     f"{p.get('input_batch_size', float('nan')):.0f}")
    return lines


def describe_report(rep: StepReport) -> str:
    """A window's report as text (what ``e3 control`` prints)."""
    lines = [f"window {rep.window}: {rep.inputs:.0f} inputs, observed reach {_fmt(rep.observed)}, "
             f"forecast for it {_fmt(rep.forecast_for_window)}{' (DRIFT)' if rep.drift else ''}"]
    if rep.error:
        lines.append(f"  error: {rep.error}")
    if rep.stragglers:
        lines.append(f"  stragglers (measured/profiled): {rep.stragglers}; planned with {rep.resources}")
    if rep.candidate is not None:
        rps = lambda x: "-" if x is None else f"{x:.1f}"  # noqa: E731
        lines.append(f"  next window forecast {_fmt(rep.forecast)}; planner's plan ({rps(rep.candidate_rps)} "
                     f"inputs/s; running plan {rps(rep.current_rps)} under the same forecast):")
        lines += _plan_lines(Plan.from_dict(rep.candidate), "    ")
        lines.append("  diff vs running plan: " + ("; ".join(rep.diff) or "none"))
    lines.append(f"  {'APPLIED' if rep.applied else 'kept'}: {rep.decision}")
    if rep.reloaded:
        lines.append(f"  reloaded (dead Python stub): {rep.reloaded}")
    return "\n".join(lines)


def status_lines(applier: Applier, model: str, state_dir: Path | None = None, history_entries: int = 10) -> list[str]:
    """What ``e3 status`` prints: the live plan, loaded splits, last forecast vs observed, plan history."""
    from e3.controller.triton_api import ControlError
    settings = ControlSettings(model=model, resources={"cpu": 1}, slo_ms=1, rate_rps=1, state_dir=state_dir)
    lines = []
    try:
        plan = applier.current_plan(settings.router)
        if plan is None:
            lines.append(f"{settings.router} is not loaded")
        else:
            lines.append(f"plan in force on {settings.router}: {plan.plan_id} (SLO {plan.slo_ms:g} ms, "
                         f"slack {plan.slack:g}, exit rule {plan.exit_rule})")
            lines += _plan_lines(plan)
        loaded = applier.loaded_splits(model)
        lines.append("loaded splits: " + (", ".join(f"{n} x{c}" for n, c in sorted(loaded.items())) or "none"))
    except ControlError as err:
        lines.append(f"server: {err}")
    files = settings.files_dir()
    state_path = files / f"{model}.state.json"
    if state_path.exists():
        try:
            state = json.loads(state_path.read_text())
            rep = state["report"]
            lines.append(f"controller's last window ({rep['window']}, {time.ctime(state['updated_at'])}): "
                         f"observed {_fmt(rep['observed'])} vs forecast {_fmt(rep['forecast_for_window'])}"
                         f"{' DRIFT' if rep['drift'] else ''}; next forecast {_fmt(rep['forecast'])}")
            lines.append(f"  decision: {'applied' if rep['applied'] else 'kept'} ({rep['decision']})"
                         + (f"; pinned {state['pinned']}" if state.get("pinned") else "")
                         + (f"; {state['failures']} refused applies" if state.get("failures") else ""))
        except (OSError, ValueError, KeyError) as err:
            lines.append(f"controller state {state_path} unreadable: {err}")
    else:
        lines.append(f"no controller state yet ({state_path})")
    try:
        history = PlanHistory(files / f"{model}.history.json", model)
    except HistoryError as err:
        lines.append(str(err))
        return lines
    lines.append(f"plan history ({len(history.entries)} applied, last {history_entries}):")
    for e in history.entries[-history_entries:]:
        plan = Plan.from_dict(e["plan"])
        cuts = " | ".join(f"{s.first_block}-{s.last_block} x{s.instances}" for s in plan.splits)
        lines.append(f"  {time.ctime(e['applied_at'])}  {plan.plan_id}  {cuts}  ({e['reason']})")
    return lines
