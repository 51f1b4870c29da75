"""Never slower: when early exits and speculation pay, from measured costs and measured acceptance.

Pure arithmetic over a cost table that profiling produced (:func:`e3.generation.calibration.profile_costs`,
reloadable from the engine spec); nothing here touches a model.

**Cost model** (seconds): a split call on ``n`` row-positions (rows x chunk) costs ``fixed_s + per_position_s
* n``; a call that reads a head (49,152 x 576 on SmolLM2) pays ``head_fixed_s`` once (its weights are read
on every call) and ``head_s`` per position read; each exit's kv-fill call (with the head inside it for a
token that left on a cheap measure) its own fixed and per-row cost. A call is paid once per step when any
row makes it, so a few leaving rows pay a whole call (:func:`calm_s_per_token`). The table starts from the
export's in-process profile and, while serving, each kind of call is refitted from the engine's own timings
of its BLS calls (:class:`CostMeter`): the never-slower decisions read the costs as served. On a CPU
``per_position_s`` dominates (verifying k drafted positions costs about k decode steps); on a GPU ``fixed_s``
does, which is where speculation pays. The same formulas serve both: only the measured numbers differ.

**Speculation** (lossless; the draft from the exit head after split ``depth``): a round drafts ``k`` tokens
(k calls of splits 0..depth and of the draft head) and verifies them in one call of each later split over k
positions with the final head at each. With per-position acceptance ``alpha`` (the chance a drafted token
equals the full model's, given the prefix was accepted) a round yields ``(1 - alpha^k) / (1 - alpha)`` tokens
per row (the accepted prefix plus the full model's correction; k when all are accepted). The policy picks
the (depth, k) with the most tokens per second, or plain decoding when none beats it (``fallback``):
:meth:`SpeculationPolicy.choose`. ``alpha`` starts from the acceptance measured on calibration prompts and
follows the acceptance observed while serving (:meth:`SpeculationPolicy.observe`, decayed counts); while
fallen back, one round in ``probe_every`` plain steps is still speculated so a changed workload is noticed.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

__all__ = ["SplitCost", "Costs", "call_key", "plain_step_s", "calm_s_per_token", "speculation_round_s",
           "expected_tokens", "choose_draft", "SpeculationPolicy", "resolve_target", "resolve_entry", "CostMeter", "predict_raw", "speedup",
           "MIN_GAIN", "NEVER"]

MIN_GAIN = 1.01   # exits must be predicted this much faster than plain decoding (the cost table's resolution)
NEVER = 2.0       # a threshold no confidence reaches: no exits


@dataclass(frozen=True)
class SplitCost:
    fixed_s: float           # per call, whatever its size (dispatch, BLS hop, kernel launches)
    per_position_s: float    # per row-position computed (rows x chunk), head not included


@dataclass(frozen=True)
class Costs:
    splits: tuple[SplitCost, ...]   # per split, in order: a call that reads no head
    head_s: float                   # one head read at one position (vocabulary x hidden matmul, argmax, margin)
    fill_fixed_s: float = 0.0       # one exit-model (kv fill) call (profiles without ``fills``: every exit)
    fill_per_row_s: float = 0.0     # per row of it, without the head
    device: str = "cpu"             # where they were measured (words)
    head_fixed_s: float = 0.0       # per call that reads a head at all (its weights are read once per call)
    fills: tuple[SplitCost, ...] = ()    # per exit: its kv-fill call (per call, per row), head not included
    served: dict = field(default_factory=dict)   # call kind -> SplitCost timed on the serving path (CostMeter)

    def call(self, kind: str, j: int, head: bool = False) -> SplitCost:
        """Cost of one call of ``kind`` ("split" j or "fill" after exit j), reading a head or not: as served
        when the serving path timed it, else composed from the profile (the call plus the head's share)."""
        key = call_key(kind, j, head)
        if key in self.served:
            return self.served[key]
        base = self.splits[j] if kind == "split" else (
            self.fills[j] if j < len(self.fills) else SplitCost(self.fill_fixed_s, self.fill_per_row_s))
        return SplitCost(base.fixed_s + self.head_fixed_s, base.per_position_s + self.head_s) if head else base

    def to_dict(self) -> dict:
        return {"splits": [[s.fixed_s, s.per_position_s] for s in self.splits], "head_s": self.head_s,
                "fill_fixed_s": self.fill_fixed_s, "fill_per_row_s": self.fill_per_row_s, "device": self.device,
                "head_fixed_s": self.head_fixed_s, "fills": [[f.fixed_s, f.per_position_s] for f in self.fills],
                "served": {k: [c.fixed_s, c.per_position_s] for k, c in self.served.items()}}

    @classmethod
    def from_dict(cls, d: dict) -> "Costs":
        return cls(splits=tuple(SplitCost(*s) for s in d["splits"]), head_s=d["head_s"],
                   fill_fixed_s=d.get("fill_fixed_s", 0.0), fill_per_row_s=d.get("fill_per_row_s", 0.0),
                   device=d.get("device", "cpu"), head_fixed_s=d.get("head_fixed_s", 0.0),
                   fills=tuple(SplitCost(*f) for f in d.get("fills", ())),
                   served={k: SplitCost(*c) for k, c in d.get("served", {}).items()})


def call_key(kind: str, j: int, head: bool) -> str:
    """The name of a kind of call in :attr:`Costs.served`: "split0", "split0+head", "fill1+head", ..."""
    return f"{kind}{j}{'+head' if head else ''}"


def _call_s(c: Costs, j: int, positions: float, head: bool = False) -> float:
    cost = c.call("split", j, head)
    return cost.fixed_s + cost.per_position_s * positions


def plain_step_s(costs: Costs, rows: int) -> float:
    """Seconds of one plain decode step for ``rows`` sequences (every split, the final head at one position)."""
    n = len(costs.splits)
    return sum(_call_s(costs, j, rows, head=j == n - 1) for j in range(n))


def calm_s_per_token(costs: Costs, rates, *, measure: str, batch: int) -> float:
    """Expected seconds per decoded token when a share ``rates[j]`` of tokens leaves after split j (the last
    entry: the final head), ``batch`` rows per step. A call is paid when at least one row makes it (chance
    ``1 - (1 - share)^batch``), its per-row part by each row that does: the splits a row reaches; with
    ``softmax`` each ramp's head read for every row that reaches it; per exit with a leaving row one kv-fill
    call, with the exit head inside it for the cheap measures."""
    n, B = len(costs.splits), max(1, batch)
    rates = [float(r) for r in rates]
    total = 0.0
    for j in range(n):
        reached = min(1.0, sum(rates[j:]))
        c = costs.call("split", j, head=j == n - 1 or measure == "softmax")
        total += (1.0 - (1.0 - reached) ** B) * c.fixed_s + B * reached * c.per_position_s
        if j < n - 1 and rates[j] > 0:
            f = costs.call("fill", j, head=measure != "softmax")
            total += (1.0 - (1.0 - rates[j]) ** B) * f.fixed_s + B * rates[j] * f.per_position_s
    return total / B


def speculation_round_s(costs: Costs, rows: int, depth: int, k: int) -> float:
    """Seconds of one speculation round: ``k`` draft steps through splits 0..``depth`` with the draft head,
    then one verification call of each later split over ``k`` positions, the final head at each."""
    n = len(costs.splits)
    draft = k * sum(_call_s(costs, j, rows, head=j == depth) for j in range(depth + 1))
    verify = sum(_call_s(costs, j, rows * k, head=j == n - 1) for j in range(depth + 1, n))
    return draft + verify


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens one round yields per row: the accepted prefix plus the correction, k when all are accepted."""
    if alpha >= 1.0:
        return float(k)
    return (1.0 - alpha ** k) / (1.0 - alpha)


def choose_draft(costs: Costs, rows: int, alphas: dict[int, float], *, max_k: int) -> tuple[int, int, float]:
    """(depth, k, predicted speed-up over plain decoding) of the best speculation for ``rows`` sequences, with
    acceptance ``alphas[depth]`` per draft depth (split index whose exit head drafts); (-1, 0, 1.0) when no
    choice beats plain decoding."""
    plain = plain_step_s(costs, rows) / rows            # seconds per token, plain
    best = (-1, 0, 1.0)
    for depth, alpha in sorted(alphas.items()):
        if not 0 <= depth < len(costs.splits) - 1:
            continue
        for k in range(1, max_k + 1):
            per_token = speculation_round_s(costs, rows, depth, k) / (rows * expected_tokens(alpha, k))
            gain = plain / per_token
            if gain > best[2]:
                best = (depth, k, gain)
    return best


@dataclass
class SpeculationPolicy:
    """Chooses each step's draft depth and length for the speculative rows, or plain decoding; see the module
    docstring. ``prior`` (trials) weighs the calibrated acceptance against what serving observes."""
    costs: Costs
    acceptance: dict[int, float]          # calibrated per-position acceptance per draft depth (split index)
    prior: float = 20.0                   # weight of the calibrated acceptance, in drafted positions
    decay: float = 0.98                   # per observed round: older rounds count less
    probe_every: int = 16                 # while plain wins, speculate one step in this many anyway
    seen: dict[int, list[float]] = field(default_factory=dict)   # depth -> [accepted, rejected] (decayed)
    plain_steps: int = 0
    fallbacks: int = 0                    # steps decoded plainly because speculation did not pay
    rounds: int = 0                       # speculation rounds run

    def alpha(self, depth: int) -> float:
        a0 = self.acceptance[depth]
        acc, rej = self.seen.get(depth, (0.0, 0.0))
        return (acc + self.prior * a0) / (acc + rej + self.prior)

    def choose(self, rows: int, max_k: int) -> tuple[int, int]:
        """(depth, k) for this step's ``rows`` speculative sequences, k = 0 for plain decoding."""
        alphas = {d: self.alpha(d) for d in self.acceptance}
        depth, k, _ = choose_draft(self.costs, rows, alphas, max_k=max_k)
        if k:
            self.rounds += 1
            return depth, k
        self.plain_steps += 1
        if self.probe_every and self.plain_steps % self.probe_every == 0 and alphas:
            self.rounds += 1
            return max(alphas, key=alphas.get), 1   # a cheap probe: one drafted token from the likeliest head
        self.fallbacks += 1
        return -1, 0

    def observe(self, depth: int, accepted: int, drafted: int) -> None:
        """One row's round: ``accepted`` of ``drafted`` positions kept (a rejection ends the round)."""
        acc, rej = self.seen.get(depth, (0.0, 0.0))
        self.seen[depth] = [self.decay * acc + accepted, self.decay * rej + (1.0 if accepted < drafted else 0.0)]


def resolve_entry(calibration: dict | None, min_agreement: float) -> dict:
    """The entry of ``calibration["targets"]`` that serves a quality target of at least ``min_agreement``: the
    one with the smallest calibrated target >= it (a stricter one serves a looser request). An entry whose exits
    did not pay (``fallback``) has thresholds above 1: no exits, plain decoding. ValueError naming the
    calibrated targets when none fits."""
    if not calibration or not calibration.get("targets"):
        raise ValueError("this model was not calibrated: send tau (and measure) instead of min_agreement")
    if not 0.0 <= min_agreement <= 1.0:
        raise ValueError(f"min_agreement must lie in [0, 1], got {min_agreement}")
    fits = [t for t in calibration["targets"] if t["min_agreement"] >= min_agreement - 1e-9]
    if not fits:
        have = ", ".join(f"{t['min_agreement']:g}" for t in calibration["targets"])
        raise ValueError(f"no calibration for min_agreement {min_agreement:g}; calibrated targets: {have}")
    return min(fits, key=lambda t: t["min_agreement"])


def resolve_target(calibration: dict | None, min_agreement: float) -> tuple[str, list[float]]:
    """(measure, thresholds per exit) of :func:`resolve_entry`."""
    best = resolve_entry(calibration, min_agreement)
    return best["measure"], [float(x) for x in best["thresholds"]]


def speedup(costs: Costs, exit_rate, *, measure: str, batch: int) -> float:
    """Predicted plain-decoding time over CALM's, per token, when a share ``exit_rate[j]`` of tokens leaves at
    exit j (the rest reach the final head), ``batch`` rows per step."""
    rates = [float(r) for r in exit_rate]
    calm = calm_s_per_token(costs, [*rates, max(0.0, 1.0 - sum(rates))], measure=measure, batch=batch)
    plain = plain_step_s(costs, max(1, batch)) / max(1, batch)
    return plain / calm if calm > 0 else 1.0


def predict_raw(calibration: dict | None, costs: Costs, *, measure: str, tau: float,
                batch: int) -> dict | None:
    """What a raw threshold ``tau`` (the same at every exit) is predicted to do, from the calibration's replay
    of uniform thresholds (``calibration["raw"][measure]``: exit rates and agreement on a grid of tau,
    interpolated): {"speedup", "agreement", "exit_rate"}; None when the calibration has no such table."""
    table = ((calibration or {}).get("raw") or {}).get(measure)
    if not table or not table.get("taus"):
        return None
    taus = table["taus"]
    rates = [float(_interp(tau, taus, [r[j] for r in table["exit_rate"]])) for j in range(len(table["exit_rate"][0]))]
    return {"speedup": speedup(costs, rates, measure=measure, batch=batch),
            "agreement": float(_interp(tau, taus, table["agreement"])), "exit_rate": rates}


def _interp(x: float, xs: list[float], ys: list[float]) -> float:
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    for i in range(1, len(xs)):
        if x <= xs[i]:
            w = (x - xs[i - 1]) / (xs[i] - xs[i - 1]) if xs[i] > xs[i - 1] else 1.0
            return ys[i - 1] + w * (ys[i] - ys[i - 1])
    return ys[-1]


class CostMeter:
    """Costs as served: the engine times each decode call it makes (one position per row) and reports it here
    as (call kind, rows, seconds); each kind (:func:`call_key`) is fitted to fixed + per-row cost from the
    median time of each row count over its last ``window`` calls. :meth:`costs` is the prior profile with
    every kind seen at least ``min_calls`` times replaced by its fit (the table the never-slower decisions
    read while serving)."""

    def __init__(self, prior: Costs, *, window: int = 512, min_calls: int = 8):
        self.prior, self.window, self.min_calls = prior, window, min_calls
        self.samples: dict[tuple[str, int, bool], list[tuple[int, float]]] = {}

    def observe(self, kind: str, j: int, head: bool, rows: int, seconds: float) -> None:
        """One timed call of split j (``kind`` "split") or of exit j's kv fill ("fill") on ``rows`` rows."""
        got = self.samples.setdefault((kind, j, head), [])
        got.append((rows, seconds))
        if len(got) > self.window:
            del got[0]

    def fit(self, kind: str, j: int, head: bool) -> SplitCost | None:
        """Fixed and per-row seconds of that kind of call, None below ``min_calls`` calls. One row count seen:
        the prior's per-row cost, the rest fixed."""
        got = self.samples.get((kind, j, head), [])
        if len(got) < self.min_calls:
            return None
        by_rows: dict[int, list[float]] = {}
        for rows, s in got:
            by_rows.setdefault(rows, []).append(s)
        xs = sorted(by_rows)
        med = [sorted(by_rows[x])[len(by_rows[x]) // 2] for x in xs]
        if len(xs) == 1:
            per = self.prior.call(kind, j, head).per_position_s
            return SplitCost(max(0.0, med[0] - per * xs[0]), per)
        w = [len(by_rows[x]) for x in xs]
        sw = sum(w)
        mx = sum(wi * x for wi, x in zip(w, xs)) / sw
        my = sum(wi * y for wi, y in zip(w, med)) / sw
        var = sum(wi * (x - mx) ** 2 for wi, x in zip(w, xs))
        per = max(0.0, sum(wi * (x - mx) * (y - my) for wi, x, y in zip(w, xs, med)) / var)
        return SplitCost(max(0.0, my - per * mx), per)

    def costs(self) -> Costs:
        served = {call_key(*k): c for k in self.samples if (c := self.fit(*k)) is not None}
        return replace(self.prior, served={**self.prior.served, **served})
