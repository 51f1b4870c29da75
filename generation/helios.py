"""HELIOS (Algorithm 1): choosing among early-exit LLM candidates, loading only the layers most used, and the
confidence breach counter (CBC) deciding between "load the rest" and "switch model". Pure decisions; the
Triton side (engines, loading and unloading split models, the memory budget's admission) is
``generation/helios_router.py``.

A **configuration** is ``(model, depth)``: a candidate served up to an exit layer (``depth`` < L: partially
loaded, the head after ``depth`` answers every token that reaches it) or whole (``depth`` = L).

Algorithm 1, as built here:

* **Step 1, candidates**: given (:class:`HeliosSettings`); each must fit the memory budget whole with room for
  one sequence (:func:`check_candidates`). Re-selecting candidates from a model repository is not built (the
  paper's default does not re-select either).
* **Step 2, evaluation**: the next ``eval_prompts`` requests of the live stream go to each candidate in turn,
  served whole, and their tokens fill the candidate's row of the **Performance History Table** (PHT): the
  exit profile (where each decoded token left, with every layer loaded), mean confidence, measured tokens/s. Their answers are real answers (not discarded), as in the paper. When every evaluation request has
  finished, :meth:`HeliosController.best` picks the configuration to serve.
* **Step 3, serving with greedy partial loading**: a candidate's M' is its shallowest depth whose
  *predicted* breach rate is within the CBC's tolerance (``cbc_max / window``); the predicted breach rate at
  depth d is the share of its profiled tokens that left deeper than d (or met no confidence at all), the
  predicted cost per token counts layers run plus heads read (``head_cost`` layer-equivalents each), and the
  predicted tokens/s come from the cost per token (see :meth:`HeliosController.predicted`). Decision: the
  "most likely used layers" of the paper are made concrete this way so that loading depth and the breach
  tolerance agree: a depth that would breach more often than the CBC tolerates is never chosen. The best
  configuration is the feasible one with the highest predicted tokens/s (ties: the lower breach rate, then
  the candidates' order).
* **The CBC**: a token is a **breach** when a partially loaded model forced it out at its last loaded head
  with a confidence below ``tau`` (the layers that could have met the threshold are not loaded). A whole
  model's final head always answers, as in CALM, and never breaches. Decision: an earlier version also
  counted a whole model's unsure final-head tokens; on SmolLM2 at tau 0.3 about half of every model's final
  tokens are below the threshold, so the counter switched between whole models back and forth (measured: 10
  tokens/s against 36-39 for either candidate alone); Algorithm 1's two options (load the rest of M', or
  another candidate's M') are both about partial models anyway. The counter is a window of the last
  ``window`` tokens of the chosen configuration; when more than ``cbc_max`` of them breached, the options are
  (1) load the rest of the chosen candidate and (2) switch to the best other candidate's M', both judged from
  the PHT. (1) wins unless (2) is predicted faster by ``switch_gain`` (a switch reloads another model; the
  paper compares "overheads"). The counter restarts after any decision.
* **Step 4, periodic re-assessment**: after ``ri`` served prompts, Step 2 again. Decision: the pseudo-code's
  ``until ServicedPrompts < RI`` is read as "repeat until RI prompts were served" (taken literally it would
  stop after the first prompt).

A sequence finishes on the configuration it started with (its KV cache exists only for those layers); a
decision applies to sequences admitted after it.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from dataclasses import dataclass, field

__all__ = ["Candidate", "HeliosSettings", "Row", "Decision", "HeliosController", "check_candidates", "Config"]

Config = tuple[str, int]          # (candidate name, depth)


@dataclass(frozen=True)
class Candidate:
    """One early-exit LLM: its exits, and the sizes the memory budget counts."""
    name: str                       # served name prefix, e.g. "smollm2_ee"
    exits: tuple[int, ...]          # ramp layers, ascending
    num_layers: int
    layer_bytes: int                # weights of one decoder layer
    base_bytes: int                 # embeddings and final norm (loaded with the first split)
    head_bytes: int                 # one exit head's own weights (its adapter)
    kv_bytes: int                   # k and v of one position in one layer
    head_cost: float = 1.0          # reading one head, in layer-equivalents of compute
    fill_cost: float = 0.0          # CALM's k/v copy into one skipped (loaded) layer, in layer-equivalents

    @property
    def depths(self) -> tuple[int, ...]:
        return (*self.exits, self.num_layers)

    def check_depth(self, depth: int) -> None:
        if depth not in self.depths:
            raise ValueError(f"{self.name}: depth {depth} is not an exit layer or L ({list(self.depths)})")

    def weight_bytes(self, depth: int) -> int:
        """Weights loaded to serve up to ``depth``."""
        self.check_depth(depth)
        return self.base_bytes + depth * self.layer_bytes + self.head_bytes * sum(e <= depth for e in self.exits)

    def sequence_bytes(self, positions: int, depth: int) -> int:
        """KV cache of one sequence of ``positions`` positions served up to ``depth``."""
        return positions * depth * self.kv_bytes

    def token_cost(self, exit_layer: int, depth: int | None = None) -> float:
        """Layer-equivalents one token costs when it leaves after ``exit_layer`` (capped at ``depth``): the
        layers it ran, the heads it read, and the k/v copies into the loaded layers it skipped."""
        d = self.num_layers if depth is None else depth
        e = min(exit_layer, d)
        heads = sum(x <= e for x in self.exits if x < d) + 1 if e == d else sum(x <= e for x in self.exits)
        return e + self.head_cost * heads + self.fill_cost * (d - e)


@dataclass(frozen=True)
class HeliosSettings:
    candidates: tuple[Candidate, ...]
    tau: float = 0.9                # confidence threshold (CALM's softmax margin)
    memory_bytes: int = 1 << 30     # the budget for loaded weights and reserved KV
    eval_prompts: int = 5           # Step 2: requests per candidate
    ri: int = 150                   # Step 4: re-assessment interval, in served prompts
    cbc_max: int = 50               # breaches tolerated ...
    window: int = 100               # ... in this many consecutive tokens
    switch_gain: float = 1.25       # a switch must be predicted this much faster than loading the rest
    min_tokens: int = 20            # a row's own measurement is trusted from this many tokens on

    def validate(self) -> None:
        if not self.candidates:
            raise ValueError("HELIOS needs at least one candidate model")
        names = [c.name for c in self.candidates]
        if len(set(names)) != len(names):
            raise ValueError(f"candidate names repeat: {names}")
        if not 0 <= self.tau <= 1:
            raise ValueError(f"tau must lie in [0, 1] (a softmax margin), got {self.tau}")
        if not 0 <= self.cbc_max < self.window:
            raise ValueError(f"cbc_max must lie in [0, window={self.window}), got {self.cbc_max}")
        for name, v in (("eval_prompts", self.eval_prompts), ("ri", self.ri), ("min_tokens", self.min_tokens)):
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        if self.switch_gain < 1:
            raise ValueError(f"switch_gain must be >= 1, got {self.switch_gain}")

    @property
    def tolerance(self) -> float:
        """The breach rate the CBC tolerates."""
        return self.cbc_max / self.window


def check_candidates(settings: HeliosSettings, positions: int) -> None:
    """Raise ValueError unless every candidate fits the budget whole with one sequence of ``positions``."""
    for c in settings.candidates:
        need = c.weight_bytes(c.num_layers) + c.sequence_bytes(positions, c.num_layers)
        if need > settings.memory_bytes:
            raise ValueError(f"candidate {c.name} needs {need / 2**20:.1f} MiB whole with one {positions}-position "
                             f"sequence, more than the memory budget of {settings.memory_bytes / 2**20:.1f} MiB")


@dataclass
class Row:
    """One PHT row: what serving ``(model, depth)`` was measured to do since the last evaluation."""
    tokens: int = 0
    seconds: float = 0.0
    breaches: int = 0
    conf_sum: float = 0.0
    exits: Counter = field(default_factory=Counter)     # exit layer -> decoded tokens (prefill tokens excluded)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def breach_rate(self) -> float:
        return self.breaches / self.tokens if self.tokens else 0.0

    @property
    def mean_confidence(self) -> float:
        return self.conf_sum / self.tokens if self.tokens else math.nan

    def to_dict(self) -> dict:
        return {"tokens": self.tokens, "tokens_per_s": round(self.tokens_per_s, 3),
                "breach_rate": round(self.breach_rate, 4), "mean_confidence": round(self.mean_confidence, 4)
                if self.tokens else None, "exits": {str(k): v for k, v in sorted(self.exits.items())}}


@dataclass(frozen=True)
class Decision:
    kind: str                       # "evaluate", "choose", "load_rest", "switch", "reassess"
    before: Config | None
    after: Config | None
    reason: str

    def to_dict(self) -> dict:
        return {"kind": self.kind, "before": list(self.before) if self.before else None,
                "after": list(self.after) if self.after else None, "reason": self.reason}


class HeliosController:
    """See the module docstring. Not thread-safe (the router calls it from its one engine thread)."""

    def __init__(self, settings: HeliosSettings):
        settings.validate()
        self.s = settings
        self.by_name = {c.name: c for c in settings.candidates}
        self.pht: dict[Config, Row] = {}
        self.chosen: Config | None = None
        self.decisions: list[Decision] = []
        self.breach_window: deque[bool] = deque(maxlen=settings.window)
        self.served_since_eval = 0
        self._eval_queue: list[str] = []          # candidates still to route evaluation requests to
        self._eval_left = 0                       # evaluation requests still to route to _eval_queue[0]
        self._eval_pending = 0                    # evaluation requests routed but not yet finished
        self._start_evaluation("start")

    # -- the router's calls ----------------------------------------------------------------------------
    @property
    def evaluating(self) -> bool:
        return bool(self._eval_queue) or self._eval_pending > 0

    def peek(self) -> tuple[Config, bool]:
        """What :meth:`route` would answer now, without routing."""
        if self._eval_queue:
            return (self._eval_queue[0], self.by_name[self._eval_queue[0]].num_layers), True
        if self.chosen is None:
            c = self.s.candidates[-1]
            return (c.name, c.num_layers), False
        return self.chosen, False

    def route(self) -> tuple[Config, bool]:
        """The configuration the next admitted request runs on, and whether it is an evaluation request."""
        if self._eval_queue:
            c = self.by_name[self._eval_queue[0]]
            self._eval_left -= 1
            self._eval_pending += 1
            if self._eval_left == 0:
                self._eval_queue.pop(0)
                self._eval_left = self.s.eval_prompts
            return (c.name, c.num_layers), True
        return self.peek()

    def observe_time(self, config: Config, tokens: int, seconds: float) -> None:
        """Engine time ``seconds`` spent making ``tokens`` tokens of ``config`` (one engine step)."""
        row = self.pht.setdefault(config, Row())
        row.tokens += tokens
        row.seconds += seconds

    def observe(self, config: Config, exits: list[int], confidences: list[float], evaluation: bool = False
                ) -> Decision | None:
        """A finished sequence of ``config``: its tokens' exit layers and confidences (the first token comes from
        the prefill). Returns the decision it triggered, if any."""
        name, depth = config
        c = self.by_name[name]
        row = self.pht.setdefault(config, Row())
        for i, (e, conf) in enumerate(zip(exits, confidences)):
            breach = depth < c.num_layers and e == depth and not conf >= self.s.tau
            row.breaches += breach
            row.conf_sum += conf if conf == conf else 0.0
            if i > 0:
                row.exits[e] += 1
            if config == self.chosen and not evaluation:
                self.breach_window.append(breach)
        if evaluation:
            self._eval_pending -= 1
            if not self.evaluating:
                return self._record(self._choose("evaluation done"))
            return None
        self.served_since_eval += 1
        if config == self.chosen and depth < c.num_layers and sum(self.breach_window) > self.s.cbc_max:
            return self._record(self._on_breaches(c, depth))
        if self.chosen is not None and self.served_since_eval >= self.s.ri:
            return self._record(self._start_evaluation(f"{self.served_since_eval} prompts served (RI {self.s.ri})"))
        return None

    @property
    def cbc(self) -> int:
        return sum(self.breach_window)

    # -- predictions from the PHT ----------------------------------------------------------------------
    def profile(self, name: str) -> Row | None:
        """The candidate's whole-model row (its exit profile), if it has tokens."""
        row = self.pht.get((name, self.by_name[name].num_layers))
        return row if row is not None and sum(row.exits.values()) else None

    def seconds_per_unit(self) -> float | None:
        """Engine seconds per layer-equivalent, pooled over every measured row (one device serves them all)."""
        units = seconds = 0.0
        for (name, depth), row in self.pht.items():
            c = self.by_name[name]
            n = sum(row.exits.values())
            if row.seconds > 0 and n:
                units += row.tokens * sum(k * c.token_cost(e, depth) for e, k in row.exits.items()) / n
                seconds += row.seconds
        return seconds / units if units > 0 else None

    def predicted(self, config: Config) -> tuple[float, float]:
        """(breach rate, tokens/s) predicted for ``config``: the breach rate from the candidate's exit profile,
        tokens/s from its cost per token and the pooled seconds per layer-equivalent. A row measured on
        ``min_tokens`` tokens or more speaks for itself. (inf, 0) when nothing is known.

        Decision: the pooled calibration, not each candidate's own tokens/s, ranks configurations that were not
        served long enough: a short evaluation's tokens/s carries the cold start of freshly loaded models
        (measured here: the first candidate evaluated ran at 40% of its warm speed), which would decide the
        choice by evaluation order."""
        name, depth = config
        c = self.by_name[name]
        own = self.pht.get(config)
        prof = self.profile(name)
        if own is not None and own.tokens >= self.s.min_tokens and own.seconds > 0:
            return own.breach_rate, own.tokens_per_s
        unit = self.seconds_per_unit()
        if prof is None or unit is None:
            return math.inf, 0.0
        total = sum(prof.exits.values())
        beyond = sum(n for e, n in prof.exits.items() if e > depth)
        breach = beyond / total
        cost = sum(n * c.token_cost(e, depth) for e, n in prof.exits.items()) / total
        return breach, 1.0 / (unit * cost)

    def partial_depth(self, name: str) -> int | None:
        """M': the shallowest depth predicted within the CBC's tolerance (None: not even the whole model)."""
        for d in self.by_name[name].depths:
            if self.predicted((name, d))[0] <= self.s.tolerance:
                return d
        return None

    def best(self, exclude: str | None = None) -> Config | None:
        """BestModel(PHT): the feasible M' with the highest predicted tokens/s, or None."""
        options = []
        for i, c in enumerate(self.s.candidates):
            d = None if c.name == exclude else self.partial_depth(c.name)
            if d is not None:
                breach, tps = self.predicted((c.name, d))
                options.append((-tps, breach, i, (c.name, d)))
        return min(options)[3] if options else None

    # -- decisions -------------------------------------------------------------------------------------
    def _record(self, d: Decision | None) -> Decision | None:
        if d is not None:
            self.decisions.append(d)
            self.breach_window.clear()
        return d

    def _start_evaluation(self, reason: str) -> Decision:
        self._eval_queue = [c.name for c in self.s.candidates]
        self._eval_left = self.s.eval_prompts
        self.pht = {}
        self.served_since_eval = 0
        return Decision("evaluate", self.chosen, None, f"{reason}: {self.s.eval_prompts} prompts on each of "
                                                       f"{', '.join(self._eval_queue)}, whole")

    def _choose(self, reason: str) -> Decision:
        before, best = self.chosen, self.best()
        if best is None:                         # nobody within tolerance: the least breaching whole model
            best = min(((self.predicted((c.name, c.num_layers))[0], i, (c.name, c.num_layers))
                        for i, c in enumerate(self.s.candidates)))[2]
            reason += f"; no candidate within the tolerated breach rate {self.s.tolerance:.2f}"
        self.chosen = best
        b, tps = self.predicted(best)
        return Decision("choose", before, best, f"{reason}: predicted breach rate {b:.2f}, {tps:.1f} tokens/s")

    def _on_breaches(self, c: Candidate, depth: int) -> Decision:
        """Algorithm 1's ``if PHT[M(Chosen)] < PHT[M'(Others)]``: the rest of this candidate, or another's M'."""
        here = (c.name, depth)
        why = f"{self.cbc} breaches in the last {len(self.breach_window)} tokens (CBCmax {self.s.cbc_max})"
        rest = (c.name, c.num_layers)
        other = self.best(exclude=c.name)
        rest_tps = self.predicted(rest)[1]
        other_p = self.predicted(other) if other else (math.inf, 0.0)
        if other is not None and other_p[1] >= self.s.switch_gain * rest_tps:
            self.chosen = other
            return Decision("switch", here, other, f"{why}; {other[0]} up to layer {other[1]} is predicted at "
                            f"{other_p[1]:.1f} tokens/s (breach rate {other_p[0]:.2f}), the rest of {c.name} at "
                            f"{rest_tps:.1f}")
        self.chosen = rest
        return Decision("load_rest", here, rest, f"{why}; the rest of {c.name} is predicted at {rest_tps:.1f} "
                        f"tokens/s" + (f", {other[0]} up to layer {other[1]} at {other_p[1]:.1f}" if other else ""))

    # -- reporting -------------------------------------------------------------------------------------
    def table(self) -> dict:
        """The PHT and the state, for telemetry and ``e3 helios status``."""
        return {"chosen": list(self.chosen) if self.chosen else None, "cbc": self.cbc,
                "evaluating": self.evaluating, "served_since_eval": self.served_since_eval,
                "rows": [{"model": m, "depth": d, **r.to_dict()} for (m, d), r in sorted(self.pht.items())],
                "decisions": [d.to_dict() for d in self.decisions[-20:]]}
