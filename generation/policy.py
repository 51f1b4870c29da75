"""Never slower: when early exits and speculation pay, from measured costs and measured acceptance.

Pure arithmetic over a cost table that profiling produced (:func:`e3.generation.calibration.profile_costs`,
reloadable from the engine spec); nothing here touches a model.

**Cost model** (seconds): a split call on ``n`` row-positions (rows x chunk) costs ``fixed_s + per_position_s
* n``; reading a head (49,152 x 576 on SmolLM2) costs ``head_s`` per position read; the exit model (kv fill,
and the head for a token that left on a cheap measure) ``fill_fixed_s + fill_per_row_s`` per row. On a CPU
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

from dataclasses import dataclass, field

__all__ = ["SplitCost", "Costs", "plain_step_s", "speculation_round_s", "expected_tokens", "choose_draft",
           "SpeculationPolicy", "resolve_target"]


@dataclass(frozen=True)
class SplitCost:
    fixed_s: float           # per call, whatever its size (dispatch, BLS hop, kernel launches)
    per_position_s: float    # per row-position computed (rows x chunk), head not included


@dataclass(frozen=True)
class Costs:
    splits: tuple[SplitCost, ...]   # per split, in order
    head_s: float                   # one head read at one position (vocabulary x hidden matmul, argmax, margin)
    fill_fixed_s: float = 0.0       # one exit-model (kv fill) call
    fill_per_row_s: float = 0.0     # per row of it, without the head
    device: str = "cpu"             # where they were measured (words)

    def to_dict(self) -> dict:
        return {"splits": [[s.fixed_s, s.per_position_s] for s in self.splits], "head_s": self.head_s,
                "fill_fixed_s": self.fill_fixed_s, "fill_per_row_s": self.fill_per_row_s, "device": self.device}

    @classmethod
    def from_dict(cls, d: dict) -> "Costs":
        return cls(splits=tuple(SplitCost(*s) for s in d["splits"]), head_s=d["head_s"],
                   fill_fixed_s=d.get("fill_fixed_s", 0.0), fill_per_row_s=d.get("fill_per_row_s", 0.0),
                   device=d.get("device", "cpu"))


def _call_s(c: Costs, j: int, positions: float) -> float:
    return c.splits[j].fixed_s + c.splits[j].per_position_s * positions


def plain_step_s(costs: Costs, rows: int) -> float:
    """Seconds of one plain decode step for ``rows`` sequences (every split, the final head at one position)."""
    return sum(_call_s(costs, j, rows) for j in range(len(costs.splits))) + costs.head_s * rows


def speculation_round_s(costs: Costs, rows: int, depth: int, k: int) -> float:
    """Seconds of one speculation round: ``k`` draft steps through splits 0..``depth`` with the draft head,
    then one verification call of each later split over ``k`` positions, the final head at each."""
    draft = k * (sum(_call_s(costs, j, rows) for j in range(depth + 1)) + costs.head_s * rows)
    verify = sum(_call_s(costs, j, rows * k) for j in range(depth + 1, len(costs.splits))) + costs.head_s * rows * k
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


def resolve_target(calibration: dict | None, min_agreement: float) -> tuple[str, list[float]]:
    """(measure, thresholds per exit) calibrated for a quality target of at least ``min_agreement``: the entry
    of ``calibration["targets"]`` with the smallest calibrated target >= it (a stricter one serves a looser
    request). An entry whose exits did not pay (``fallback``) has thresholds above 1: no exits, plain decoding.
    ValueError naming the calibrated targets when none fits."""
    if not calibration or not calibration.get("targets"):
        raise ValueError("this model was not calibrated: send tau (and measure) instead of min_agreement")
    if not 0.0 <= min_agreement <= 1.0:
        raise ValueError(f"min_agreement must lie in [0, 1], got {min_agreement}")
    fits = [t for t in calibration["targets"] if t["min_agreement"] >= min_agreement - 1e-9]
    if not fits:
        have = ", ".join(f"{t['min_agreement']:g}" for t in calibration["targets"])
        raise ValueError(f"no calibration for min_agreement {min_agreement:g}; calibrated targets: {have}")
    best = min(fits, key=lambda t: t["min_agreement"])
    return best["measure"], [float(x) for x in best["thresholds"]]
