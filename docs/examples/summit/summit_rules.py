"""The exit rule of the walk-through's model, in a module of its own (numpy and e3 only: `e3 export` copies
this file into the model repository, so Triton's processes import it without your working directory).

``MarginAgree(min_gap, num_classes)``: an input leaves at a ramp when the ramp's top probability beats the
runner-up by ``min_gap`` and the running sum of the probabilities of every ramp it passed (this one included)
picks the same class. The running sum is per-input state, carried across ramps and splits.
"""

from __future__ import annotations

import numpy as np

from e3.core.exits import ExitRule, softmax


class MarginAgree(ExitRule):
    def __init__(self, min_gap: float, num_classes: int):
        # public attributes are the rule's parameters (ExitRule.params), named as __init__ takes them; not
        # "margin": that is ExitRule's method for the tests' tie band
        self.min_gap = float(min_gap)
        self.num_classes = int(num_classes)

    def init_state(self, n):                 # overriding init_state makes the rule dependent
        return {"votes": np.zeros((n, self.num_classes))}

    def decide(self, block, logits, state, rows):
        p = softmax(logits).astype(np.float64)
        votes = state["votes"][rows] + p
        state["votes"][rows] = votes         # write back only the rows decided here
        top2 = np.sort(p, axis=1)[:, -2:]
        return (top2[:, 1] - top2[:, 0] >= self.min_gap) & (votes.argmax(1) == p.argmax(1))
