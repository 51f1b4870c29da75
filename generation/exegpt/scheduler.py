"""The decisions of ExeGPT's front door on Triton (``<m>_generate_exegpt``, ``generation/exegpt/router.py``).
Pure Python: the door only feeds it observations and applies its answers.

:class:`ExegptScheduler` (``RraScheduler``, its first name) holds, for one served generation model:

* **the schedule in force**: RRA's (``batch_size`` B_E, ``decode_iters`` N_D), which it enforces around the
  generation engine: :meth:`ExegptScheduler.admissions` says how many waiting requests join before the next
  engine step (B_E at a phase start, none inside a phase), as ``generation/exegpt/validate.py`` does in process;
  or WAA's (``batch_size`` B_E handed from the encode worker per decode iteration, ``micro_batches`` B_m), which
  the door runs over two workers (:mod:`e3.generation.exegpt.waa`);
* **the served profile**: the door's own engine steps, timed (pure prefill steps by prompt tokens, pure decode
  steps by rows), fitted to lines (:class:`StepTimes`). The simulator then reasons about the model as served,
  BLS hops and Python included, not only about the ONNX layers the offline profiler measures;
* **the output lengths seen** (a window, :class:`LengthWatch`) and the **re-plan**: when their mean or p99
  moves from those the schedule was planned for by more than ``threshold`` (relative), the same
  branch-and-bound (:func:`e3.generation.exegpt.search.branch_and_bound`) plans again for what was seen.

Decisions (where the paper is silent):

* **Slack.** Plans are made under ``bound x (1 - slack)`` (E3's 20% default): the simulator is an
  expected-value model, and the bound is on the 99th percentile of measured latency.
* **Phases.** A phase starts when the last one has run its N_D steps, or at once when no sequence is active
  (all finished early): the engine never idles while requests wait. A phase admits min(B_E, waiting): it does
  not hold a batch back to fill it (in a closed system that only adds latency). A new schedule takes effect at
  the next phase start.
* **Latency** is, as in the simulator, from a sequence's admission (its phase start) to its last token; time
  waiting before admission is not bounded (it depends on the offered load). The door reports both.
* **Space.** N_D ranges over 1..the longest output length planned for (past it RRA is the static batch, the
  same point), B_E over ``batch_sizes``.
* **No feasible schedule**: the lowest-latency one (a static batch of B_E = the smallest batch size) is put
  in force and the status says ``feasible: false``.
* **Which profile.** The served profile once both of its curves have two distinct sizes observed
  (``min_points`` steps each), else the profile given at export (the offline profiler's, which leaves out BLS
  and the engine's Python: it under-predicts the served step).
* **RRA or WAA.** Each re-plan runs the branch-and-bound over both spaces and keeps the faster feasible answer
  (ExeGPT §5.1). RRA is run by one engine thread calling the splits one after another: one worker. WAA runs on
  two (an encode worker and a decode worker, each with its own split models; this machine's two cores), so
  ``simulate_waa`` gets ``workers`` = 2 (one encoder, one decoder, B_m = 1). WAA is predicted from its own
  served profile (encode passes by prompt tokens, decode iterations by rows, timed while WAA ran: the two
  workers' contention for the cores and the door's Python is in it) once both curves have two sizes, and
  until then from RRA's profile (the single-worker steps: a pure prefill step for an encode pass, a pure
  decode step for an iteration), which leaves that contention out. A switch between RRA and WAA takes effect
  at once: the decode worker is RRA's engine, so live sequences stay where they are.
* **A p99 bound from an expected-value model.** The simulator adds up expected step times, while the bound is
  on the 99th percentile of measured latency, and on this shared 2-core machine step times have a long tail.
  With the served profile, throughput is predicted from the step times' medians and latency from their
  ``latency_quantile`` (90th percentile by default) per size: fitted to medians alone, the chosen schedule's
  measured p99 ran 35-65% above its predicted latency on tiny-gen.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import asdict, dataclass, replace

from e3.generation.exegpt.search import branch_and_bound, grid_search, rra_space, waa_space
from e3.generation.exegpt.simulator import Prediction, Workload, simulate_rra, simulate_waa
from e3.generation.exegpt.workload import LayerProfile, LengthDistribution

__all__ = ["RraSchedule", "WaaSchedule", "ReplanPolicy", "StepTimes", "LengthWatch", "ExegptScheduler",
           "RraScheduler", "choose_rra", "choose_waa", "best_static", "predict", "predict_waa", "schedule_from_json",
           "WAA_WORKERS", "SCHEDULE_KINDS"]

WAA_WORKERS = 2            # WAA on Triton: one encode worker and one decode worker (the machine's two cores)
SCHEDULE_KINDS = ("rra", "waa")


class _Schedule:
    """What both schedules share: their kind and their list form (``[kind, B_E, second variable]``, what a
    ``schedule`` control document holds); each checks its two control variables once."""

    KIND = ""
    SECOND = ""   # the second control variable's field name
    NAME = ""     # how errors name the schedule ("an RRA schedule")

    @property
    def kind(self) -> str:
        return self.KIND

    def as_list(self) -> list:
        return [self.KIND, self.batch_size, getattr(self, self.SECOND)]

    def _check_positive(self) -> None:
        second = getattr(self, self.SECOND)
        if self.batch_size < 1 or second < 1:
            raise ValueError(f"{self.NAME} needs batch_size >= 1 and {self.SECOND} >= 1, got "
                             f"{self.batch_size}, {second}")


@dataclass(frozen=True)
class RraSchedule(_Schedule):
    """RRA's control variables on one worker: ``as_list()`` is ``["rra", B_E, N_D]``."""

    KIND, SECOND, NAME = "rra", "decode_iters", "an RRA schedule"
    batch_size: int       # B_E: prompts admitted (and prefilled together) per phase
    decode_iters: int     # N_D: engine steps per phase (the encoding frequency is 1 / N_D)

    def __post_init__(self):
        self._check_positive()


@dataclass(frozen=True)
class WaaSchedule(_Schedule):
    """WAA's control variables (WAA-C) on one encode worker and one decode worker: ``["waa", B_E, B_m]``."""

    KIND, SECOND, NAME = "waa", "micro_batches", "a WAA schedule"
    batch_size: int           # B_E: prompts the encode worker prefills and hands over per decode iteration
    micro_batches: int = 1    # B_m: decode micro-batches (at most the decode workers: 1 here)

    def __post_init__(self):
        self._check_positive()
        if self.micro_batches > WAA_WORKERS - 1:
            raise ValueError(f"a WAA schedule here has {WAA_WORKERS - 1} decode worker, so micro_batches must be "
                             f"<= {WAA_WORKERS - 1} (more only lose in the simulator), got {self.micro_batches}")


def schedule_from_json(value) -> RraSchedule | WaaSchedule:
    """A schedule from a control document: ``[B_E, N_D]`` (RRA), ``["rra", B_E, N_D]`` or ``["waa", B_E, B_m]``;
    ValueError naming what is wrong."""
    if isinstance(value, list) and len(value) == 2:
        value = ["rra", *value]
    if not (isinstance(value, list) and len(value) == 3 and value[0] in SCHEDULE_KINDS
            and all(isinstance(v, int) and not isinstance(v, bool) for v in value[1:])):
        raise ValueError(f"schedule must be [batch_size, decode_iters], [\"rra\", batch_size, decode_iters] or "
                         f"[\"waa\", batch_size, micro_batches], got {value!r}")
    return RraSchedule(*value[1:]) if value[0] == "rra" else WaaSchedule(*value[1:])


@dataclass(frozen=True)
class ReplanPolicy:
    """When the door re-plans on what it observes."""

    window: int = 200            # output lengths kept (the most recent finished sequences)
    min_samples: int = 50        # lengths needed before a shift is judged
    threshold: float = 0.25      # relative change of mean or p99 length that triggers a re-plan
    slack: float = 0.2           # plans are made under bound x (1 - slack)
    min_points: int = 3          # steps per size before the served profile is used
    latency_quantile: float = 0.9   # latency is predicted from this quantile of the served step times

    def __post_init__(self):
        if self.window < 1 or not 1 <= self.min_samples <= self.window:
            raise ValueError(f"need window >= 1 and 1 <= min_samples <= window, got {self.window}, "
                             f"{self.min_samples}")
        if not 0.5 <= self.latency_quantile < 1:
            raise ValueError(f"latency_quantile must be in [0.5, 1), got {self.latency_quantile}")
        if self.threshold <= 0 or not 0 <= self.slack < 1:
            raise ValueError(f"need threshold > 0 and 0 <= slack < 1, got {self.threshold}, {self.slack}")


def _quantile(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, max(0, round(q * (len(v) - 1))))]


def _bucket(x: int) -> int:
    """Sizes above 16 share a bucket a quarter-octave wide (17-20, 21-24, ..., 64-79, ...), so that the live
    batches of refilling schedules, which rarely repeat exactly, still reach ``min_points`` steps per size."""
    if x <= 16:
        return x
    width = 1 << (x.bit_length() - 3)
    return (x // width) * width


def _median_points(samples, min_points: int, q: float = 0.5) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
    """Per size, the ``q`` quantile of the times (the median by default), for sizes with ``min_points`` steps;
    None unless two sizes qualify."""
    by: dict[int, list[float]] = {}
    for x, ms in samples:
        by.setdefault(_bucket(x), []).append(ms)
    xs = sorted(x for x, v in by.items() if len(v) >= min_points and x > 0)
    if len(xs) < 2:
        return None
    return tuple(float(x) for x in xs), tuple(_quantile(by[x], q) for x in xs)


class StepTimes:
    """Timed engine steps of the served model, as a :class:`LayerProfile` of one "layer" (the whole model).

    Decisions: the served model is profiled whole (``num_layers`` = 1, no separate head curve): the door runs it
    as one worker (the engine calls the splits one after another), so the simulator needs the cost of a step,
    not of a layer. A step's time runs from its start to the next step's start, so it includes what the door
    does between steps (answering finished requests, taking new ones), which the latency of a sequence pays
    too (timing ``engine.step()`` alone under-predicted refilling schedules by 30-50% on tiny-gen). The decode
    line is fitted to pure decode steps by rows; the prefill line to pure prefill steps by prompt tokens and to
    steps that do both, less the decode line at their rows: the simulator's encode phase is exactly such a step
    (a phase's first step prefills the new prompts and decodes the live ones)."""

    def __init__(self, keep: int = 4000, min_points: int = 3):
        self.prefill: deque[tuple[int, float]] = deque(maxlen=keep)
        self.decode: deque[tuple[int, float]] = deque(maxlen=keep)
        self.mixed: deque[tuple[int, int, float]] = deque(maxlen=keep)   # (tokens, rows, ms): both in one step
        self.min_points = min_points

    def record(self, prefill_tokens: int, decode_rows: int, ms: float) -> None:
        """One engine step: ``prefill_tokens`` tokens in its prefill chunk (rows x padded length; 0: none),
        ``decode_rows`` rows decoded, ``ms`` its wall time."""
        if prefill_tokens > 0 and decode_rows == 0:
            self.prefill.append((int(prefill_tokens), float(ms)))
        elif decode_rows > 0 and prefill_tokens == 0:
            self.decode.append((int(decode_rows), float(ms)))
        elif decode_rows > 0:
            self.mixed.append((int(prefill_tokens), int(decode_rows), float(ms)))

    def _lines(self, min_points: int, q: float = 0.5):
        dec = _median_points(self.decode, min_points, q)
        if dec is None:
            return None, None
        decode = LayerProfile(1, (1.0, 2.0), (1.0, 1.0), dec[0], dec[1]).fitted()
        samples = list(self.prefill) + [(t, ms - decode.decode_layer_ms(r)) for t, r, ms in self.mixed]
        return _median_points(samples, min_points, q), decode

    def points(self) -> dict:
        """The medians per size (before fitting): ``{"prefill": [[tokens, ms], ...], "decode": [[rows, ms],
        ...]}`` (prefill: with steps that also decoded, less the decode line)."""
        pre, _ = self._lines(1)
        dec = _median_points(self.decode, 1)
        return {"prefill": [] if pre is None else [[x, round(y, 3)] for x, y in zip(*pre)],
                "decode": [] if dec is None else [[x, round(y, 3)] for x, y in zip(*dec)]}

    def profile(self, q: float = 0.5) -> LayerProfile | None:
        """The profile fitted to the ``q`` quantile of the step times per size (the median by default), or None
        until each curve has two sizes with ``min_points`` steps each."""
        pre, decode = self._lines(self.min_points, q)
        if pre is None:
            return None
        return LayerProfile(1, pre[0], pre[1], decode.decode_batch, decode.decode_ms).fitted()


class LengthWatch:
    """The output lengths of the last ``window`` finished sequences against those a schedule was planned for."""

    def __init__(self, policy: ReplanPolicy, planned: LengthDistribution):
        self.policy, self.planned = policy, planned
        self.seen: deque[int] = deque(maxlen=policy.window)

    def observe(self, length: int) -> None:
        if length >= 1:
            self.seen.append(int(length))

    def observed(self) -> LengthDistribution | None:
        return LengthDistribution.from_samples(list(self.seen)) if self.seen else None

    def shift(self) -> dict | None:
        """``{"mean": relative change, "p99": relative change}`` when either exceeds the threshold (with at
        least ``min_samples`` seen since the last re-base), else None."""
        if len(self.seen) < self.policy.min_samples:
            return None
        obs = self.observed()
        change = {"mean": obs.mean() / self.planned.mean() - 1.0,
                  "p99": obs.quantile(0.99) / self.planned.quantile(0.99) - 1.0}
        return change if any(abs(v) > self.policy.threshold for v in change.values()) else None

    def rebase(self, planned: LengthDistribution) -> None:
        """A new plan was made for ``planned``: judge shifts against it, from fresh samples."""
        self.planned = planned
        self.seen.clear()


def _workload(profile: LayerProfile, prompt_tokens: float, lengths: LengthDistribution) -> Workload:
    prompt = LengthDistribution.fixed(max(1, round(prompt_tokens)))
    return Workload(profile, prompt, lengths, workers=1)


def predict(profile: LayerProfile, prompt_tokens: float, lengths: LengthDistribution, *, schedule: tuple[int, int],
            latency_profile: LayerProfile | None = None) -> Prediction:
    """RRA's prediction on one worker; with ``latency_profile``, its latency is read from that profile (the
    door's: step times at a high quantile) and its throughput from ``profile`` (their medians)."""
    p = simulate_rra(_workload(profile, prompt_tokens, lengths), *schedule)
    if latency_profile is None:
        return p
    tail = simulate_rra(_workload(latency_profile, prompt_tokens, lengths), *schedule)
    return replace(p, latency_ms=tail.latency_ms)


def predict_waa(profile: LayerProfile, prompt_tokens: float, lengths: LengthDistribution, *, schedule: tuple[int, int],
                latency_profile: LayerProfile | None = None) -> Prediction:
    """WAA's prediction on :data:`WAA_WORKERS` workers (``schedule`` = (B_E, B_m)); ``latency_profile`` as in
    :func:`predict`."""
    w = replace(_workload(profile, prompt_tokens, lengths), workers=WAA_WORKERS)
    p = simulate_waa(w, *schedule)
    if latency_profile is None:
        return p
    tail = simulate_waa(replace(w, profile=latency_profile), *schedule)
    return replace(p, latency_ms=tail.latency_ms)


def choose_waa(profile: LayerProfile, prompt_tokens: float, lengths: LengthDistribution, *, bound_ms: float,
               batch_sizes: tuple[int, ...], tolerance: float = 0.05,
               latency_profile: LayerProfile | None = None) -> Prediction | None:
    """WAA's best schedule under ``bound_ms`` (already net of slack) by branch-and-bound over B_E and B_m
    (1..decode workers). None if nothing meets the bound."""
    space = waa_space(batch_sizes, WAA_WORKERS - 1)
    return branch_and_bound(_workload(profile, prompt_tokens, lengths), space, bound_ms, throughput_tol=tolerance, latency_tol=tolerance,
                            evaluate=lambda c: predict_waa(profile, prompt_tokens, lengths, schedule=c, latency_profile=latency_profile)).best


def choose_rra(profile: LayerProfile, prompt_tokens: float, lengths: LengthDistribution, *, bound_ms: float,
               batch_sizes: tuple[int, ...], tolerance: float = 0.05,
               latency_profile: LayerProfile | None = None) -> Prediction | None:
    """RRA's best schedule on one worker under ``bound_ms`` (already net of slack) by branch-and-bound; N_D over
    1..the longest length (``latency_profile``: see :func:`predict`). None if nothing meets the bound."""
    space = rra_space(batch_sizes, tuple(range(1, lengths.lengths[-1] + 1)))
    return branch_and_bound(_workload(profile, prompt_tokens, lengths), space, bound_ms, throughput_tol=tolerance, latency_tol=tolerance,
                            evaluate=lambda c: predict(profile, prompt_tokens, lengths, schedule=c, latency_profile=latency_profile)).best


def best_static(profile: LayerProfile, prompt_tokens: float, lengths: LengthDistribution, *, bound_ms: float,
                batch_sizes: tuple[int, ...], latency_profile: LayerProfile | None = None) -> Prediction | None:
    """The best static batch under ``bound_ms``: admit B, decode until all have finished (RRA with N_D = the
    longest length), the baseline ``e3 plan-generate --validate`` measures. None if none meets it."""
    space = rra_space(batch_sizes, (lengths.lengths[-1],))
    return grid_search(_workload(profile, prompt_tokens, lengths), space, bound_ms,
                       evaluate=lambda c: predict(profile, prompt_tokens, lengths, schedule=c, latency_profile=latency_profile)).best


class ExegptScheduler:
    """See the module docstring. Not thread-safe: the door's engine thread alone calls it.

    ``schedules``: the kinds the planner may choose ("rra", "waa"); a pinned schedule may be of either."""

    def __init__(self, profile: LayerProfile, lengths: LengthDistribution, prompt_tokens: float,
                 batch_sizes: tuple[int, ...], bound_ms: float = math.inf,
                 policy: ReplanPolicy = ReplanPolicy(), schedule: RraSchedule | WaaSchedule | None = None,
                 clock=time.time, schedules: tuple[str, ...] = ("rra",)):
        if not batch_sizes or min(batch_sizes) < 1:
            raise ValueError("batch_sizes must hold sizes >= 1")
        if not bound_ms > 0:
            raise ValueError(f"bound_ms must be > 0 (inf: no bound), got {bound_ms}")
        if not schedules or set(schedules) - set(SCHEDULE_KINDS):
            raise ValueError(f"schedules must name some of {SCHEDULE_KINDS}, got {schedules!r}")
        self.offline, self.prompt_tokens = profile, float(prompt_tokens)
        self.batch_sizes, self.bound_ms, self.policy = tuple(sorted(set(batch_sizes))), float(bound_ms), policy
        self.schedules = tuple(k for k in SCHEDULE_KINDS if k in schedules)
        self.steps = StepTimes(min_points=policy.min_points)       # RRA: the single worker's engine steps
        self.waa_steps = StepTimes(min_points=policy.min_points)   # WAA: encode passes and decode iterations
        self.watch = LengthWatch(policy, lengths)
        self.clock = clock
        self.history: list[dict] = []
        self.pinned = schedule is not None
        self.prediction: Prediction | None = None
        self.feasible = True
        self.step_in_phase = 0
        self.schedule: RraSchedule | WaaSchedule = schedule or RraSchedule(self.batch_sizes[0], lengths.lengths[-1])
        if not self.pinned:
            self.replan("start")

    # -- the schedule --------------------------------------------------------------------------------
    def profile(self) -> tuple[LayerProfile, str]:
        """The profile RRA's plans are made from, and which one it is ("served" or "offline")."""
        served = self.steps.profile()
        return (served, "served") if served is not None else (self.offline, "offline")

    def latency_profile(self) -> LayerProfile | None:
        """The served step times at the policy's latency quantile (None before the served profile exists)."""
        return self.steps.profile(self.policy.latency_quantile)

    def waa_profiles(self) -> tuple[LayerProfile, LayerProfile | None, str]:
        """WAA's profile, its latency-quantile profile and which ("served-waa": WAA's own timed encode passes and
        decode iterations; else RRA's, see the module docstring)."""
        served = self.waa_steps.profile()
        if served is not None:
            return served, self.waa_steps.profile(self.policy.latency_quantile), "served-waa"
        profile, source = self.profile()
        return profile, (self.latency_profile() if source == "served" else None), source

    def predict(self, schedule: RraSchedule | WaaSchedule, lengths: LengthDistribution | None = None) -> Prediction:
        """The simulator's prediction for ``schedule`` with the profiles plans use now."""
        lengths = lengths or self.watch.planned
        if schedule.kind == "waa":
            profile, tail, _ = self.waa_profiles()
            return predict_waa(profile, self.prompt_tokens, lengths, schedule=(schedule.batch_size, schedule.micro_batches),
                               latency_profile=tail)
        profile, source = self.profile()
        return predict(profile, self.prompt_tokens, lengths, schedule=(schedule.batch_size, schedule.decode_iters),
                       latency_profile=self.latency_profile() if source == "served" else None)

    def replan(self, reason: str, lengths: LengthDistribution | None = None) -> RraSchedule | WaaSchedule:
        """Plan again (for ``lengths``, default those planned for last) under the bound net of slack, over every
        kind in ``schedules``; the faster feasible answer is put in force. Unpins."""
        lengths = lengths or self.watch.planned
        profile, source = self.profile()
        net = self.bound_ms * (1.0 - self.policy.slack)
        tail = self.latency_profile() if source == "served" else None
        found, w_source = {}, source
        if "rra" in self.schedules:
            found["rra"] = choose_rra(profile, self.prompt_tokens, lengths, bound_ms=net, batch_sizes=self.batch_sizes,
                                      latency_profile=tail)
        if "waa" in self.schedules:
            w_profile, w_tail, w_source = self.waa_profiles()
            found["waa"] = choose_waa(w_profile, self.prompt_tokens, lengths, bound_ms=net, batch_sizes=self.batch_sizes,
                                      latency_profile=w_tail)
        feasible = [p for p in found.values() if p is not None]
        best = max(feasible, key=lambda p: p.throughput_seq_s) if feasible else None
        self.feasible = best is not None
        if best is None:    # the lowest-latency schedule: a static batch of the smallest size
            best = predict(profile, self.prompt_tokens, lengths, schedule=(self.batch_sizes[0], lengths.lengths[-1]), latency_profile=tail)
        self.pinned = False
        self.prediction = best
        self.schedule = RraSchedule(*best.config) if best.schedule == "rra" else WaaSchedule(*best.config)
        self.watch.rebase(lengths)
        self.history.append({"at_s": self.clock(), "reason": reason, "kind": self.schedule.kind,
                             "schedule": asdict(self.schedule),
                             "profile": source if best.schedule == "rra" else w_source, "feasible": self.feasible,
                             "predicted_seq_s": best.throughput_seq_s, "predicted_latency_ms": best.latency_ms,
                             "candidates": {k: None if p is None else {"schedule": list(p.config),
                                                                       "predicted_seq_s": p.throughput_seq_s,
                                                                       "predicted_latency_ms": p.latency_ms}
                                            for k, p in found.items()},
                             "mean_length": lengths.mean(), "p99_length": lengths.quantile(0.99)})
        return self.schedule

    def set_bound(self, bound_ms: float) -> RraSchedule | WaaSchedule:
        """A new latency bound (ms; inf: none): re-plan under it."""
        if not bound_ms > 0:
            raise ValueError(f"bound_ms must be > 0 (inf: no bound), got {bound_ms}")
        self.bound_ms = float(bound_ms)
        return self.replan("bound")

    def pin(self, schedule: RraSchedule | WaaSchedule) -> None:
        """Hold ``schedule`` (RRA: from the next phase start; WAA, or a change of kind: at once): no re-planning
        until :meth:`replan` or :meth:`set_bound`."""
        self.schedule, self.pinned, self.prediction = schedule, True, None
        self.history.append({"at_s": self.clock(), "reason": "pinned", "kind": schedule.kind,
                             "schedule": asdict(schedule)})

    # -- what the door reports -----------------------------------------------------------------------
    def admissions(self, waiting: int, active: int) -> int:
        """RRA: how many waiting requests to admit before the next engine step (call once per step, then
        :meth:`stepped`). Under WAA the encode worker takes them (:meth:`handover`), so none."""
        if self.schedule.kind != "rra":
            return 0
        if active == 0 or self.step_in_phase >= self.schedule.decode_iters:
            if active == 0 and waiting == 0:
                return 0
            self.step_in_phase = 0
            return min(self.schedule.batch_size, waiting)
        return 0

    def handover(self, waiting: int) -> int:
        """WAA: how many waiting requests to hand the (free) encode worker now: min(B_E, waiting); 0 under RRA."""
        return min(self.schedule.batch_size, waiting) if self.schedule.kind == "waa" else 0

    def stepped(self, prefill_tokens: int, decode_rows: int, ms: float) -> None:
        """An RRA engine step ran (see :meth:`StepTimes.record`)."""
        self.step_in_phase += 1
        self.steps.record(prefill_tokens, decode_rows, ms)

    def encoded(self, prefill_tokens: int, ms: float) -> None:
        """WAA: an encode pass of ``prefill_tokens`` (rows x padded length) took ``ms``, hand-over to hand-over."""
        self.waa_steps.record(prefill_tokens, 0, ms)

    def decoded(self, rows: int, ms: float) -> None:
        """WAA: a decode iteration over ``rows`` took ``ms`` (start to next start)."""
        self.waa_steps.record(0, rows, ms)

    def finished(self, length: int) -> bool:
        """A sequence finished with ``length`` tokens; True if that made the scheduler re-plan."""
        self.watch.observe(length)
        if self.pinned:
            return False
        change = self.watch.shift()
        if change is None:
            return False
        self.replan("lengths shifted: mean {mean:+.0%}, p99 {p99:+.0%}".format(**change), self.watch.observed())
        return True

    def status(self) -> dict:
        """The schedule in force and why (JSON-ready). ``schedule`` holds the kind's fields (RRA: batch_size,
        decode_iters; WAA: batch_size, micro_batches), ``kind`` which it is."""
        obs = self.watch.observed()
        p = self.prediction
        waa = self.waa_steps.profile()
        waa_tail = self.waa_steps.profile(self.policy.latency_quantile)
        return {"kind": self.schedule.kind, "schedule": asdict(self.schedule), "pinned": self.pinned,
                "schedules": list(self.schedules),
                "bound_ms": None if math.isinf(self.bound_ms) else self.bound_ms, "slack": self.policy.slack,
                "feasible": self.feasible, "profile": self.profile()[1], "waa_profile": self.waa_profiles()[2],
                "served_profile": None if self.steps.profile() is None else self.steps.profile().to_dict(),
                "served_latency_profile": (None if self.latency_profile() is None
                                           else self.latency_profile().to_dict()),
                "served_points": self.steps.points(),
                "waa_served_profile": None if waa is None else waa.to_dict(),
                "waa_served_latency_profile": None if waa_tail is None else waa_tail.to_dict(),
                "waa_served_points": self.waa_steps.points(),
                "predicted": None if p is None else {"seq_s": p.throughput_seq_s, "latency_ms": p.latency_ms},
                "planned_lengths": {"mean": self.watch.planned.mean(), "p99": self.watch.planned.quantile(0.99)},
                "observed_lengths": None if obs is None else {"n": len(self.watch.seen), "mean": obs.mean(),
                                                              "p99": obs.quantile(0.99)},
                "replans": sum(h["reason"] not in ("start", "pinned") for h in self.history),
                "history": self.history[-10:]}


RraScheduler = ExegptScheduler   # its name while it planned RRA alone
