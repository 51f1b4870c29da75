"""A user's own exit rule, for the tests: stateful across ramps, with its own parameters, in a module of its
own that imports nothing but numpy and e3's public rule interface (what ``e3 export`` ships to Triton).

``MeanAgreeRule(margin, num_classes)``: an input exits at a ramp when that ramp's top probability beats its
runner-up by at least ``margin`` *and* the running sum of the probabilities of every ramp it has passed (this
one included) picks the same class. The running sum is the rule's state ([n, num_classes] per input), carried
across ramps and across splits.
"""

from __future__ import annotations

import numpy as np

from e3.core.exits import ExitRule, softmax


class MeanAgreeRule(ExitRule):
    """Exit when the ramp is confident by ``margin`` and agrees with the mean of the ramps so far."""

    def __init__(self, margin: float, num_classes: int):
        if not 0 <= margin <= 1:
            raise ValueError(f"margin is a probability gap in [0, 1], got {margin!r}")
        self.margin_p = float(margin)
        self.num_classes = int(num_classes)

    @classmethod
    def from_dict(cls, config):
        return cls(config["margin"], config["num_classes"])

    def params(self):
        return {"margin": self.margin_p, "num_classes": self.num_classes}

    def init_state(self, n):
        return {"votes": np.zeros((n, self.num_classes), dtype=np.float64)}

    def _look(self, logits, state, rows):
        p = softmax(logits).astype(np.float64)
        votes = state["votes"][rows] + p
        top2 = np.sort(p, axis=1)[:, -2:]
        return p, votes, top2[:, 1] - top2[:, 0]

    def decide(self, block, logits, state, rows):
        p, votes, gap = self._look(logits, state, rows)
        state["votes"][rows] = votes
        return (gap >= self.margin_p) & (votes.argmax(axis=1) == p.argmax(axis=1))

    def margin(self, block, logits, state, rows):
        p, votes, gap = self._look(logits, state, rows)
        v2 = np.sort(votes, axis=1)[:, -2:]
        p2 = np.sort(p, axis=1)[:, -2:]
        # a decision flips if the gap crosses the margin, or either arg-max flips
        return np.minimum(np.abs(gap - self.margin_p), np.minimum(v2[:, 1] - v2[:, 0], p2[:, 1] - p2[:, 0]))


class ForgetfulRule(ExitRule):
    """A wrong rule, for the tests: it keeps state on the rule object instead of in the per-row state, so a
    batch is decided differently from the same inputs one at a time (export must refuse it)."""

    def __init__(self):
        self._seen = 0

    def params(self):
        return {}

    def decide(self, block, logits, state, rows):
        self._seen += len(rows)
        return np.full(len(rows), self._seen > 40)
