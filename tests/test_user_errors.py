"""Errors a user serving their own model can act on (issue 41, "Serve your own model"): each names the cause
and the fix. Unit tests, no server: the rule's checked call, the exact cast of inputs, the warning about a rule
module that imports torch, a failed export that leaves the repository as it found it, the load report's exit
comparison, the evaluation plot of a rule without a sweep, and --out on the commands that write results."""

from __future__ import annotations

import numpy as np
import pytest

from e3.core.exits import ExitRule, exit_mask
from e3.serving.policy import BatchRoute


class _IntRule(ExitRule):
    """Returns 0/1 integers: the walk-through user's first rule."""

    def decide(self, block, logits, state, rows):
        return (logits[:, 0] > 0).astype(np.int64)


class _ShapeRule(ExitRule):
    """Returns one decision for the whole batch."""

    def decide(self, block, logits, state, rows):
        return bool(logits[:, 0].mean() > 0)


class _ColumnRule(ExitRule):
    """Returns a column [len(rows), 1]."""

    def decide(self, block, logits, state, rows):
        return (logits[:, :1] > 0)


def _route(rule, n=3):
    return BatchRoute(n, 2, 3, rule)


def test_a_rule_returning_integers_is_told_to_return_booleans():
    logits = np.array([[1.0, 0.0], [-1.0, 0.0], [2.0, 0.0]], np.float32)
    with pytest.raises(ValueError, match=r"decide\(\) at ramp 1 returned a int64 array of shape \[3\]; expected a "
                                         r"boolean array of shape \[len\(rows\)\] = \[3\]: integers are read as row "
                                         r"numbers, not decisions"):
        _route(_IntRule()).observe({1: logits})


@pytest.mark.parametrize("rule, what", [(_ShapeRule(), "bool True"), (_ColumnRule(), r"bool array of shape \[3, 1\]")])
def test_a_wrong_shaped_decision_names_the_expected_shape_and_what_came_back(rule, what):
    logits = np.array([[1.0, 0.0], [-1.0, 0.0], [2.0, 0.0]], np.float32)
    with pytest.raises(ValueError, match=rf"returned a {what}; expected a boolean array of shape \[len\(rows\)\] "
                                         r"= \[3\]: return one bool per row"):
        _route(rule).observe({1: logits})


def test_a_boolean_decision_passes_unchanged():
    class Good(ExitRule):
        def decide(self, block, logits, state, rows):
            return logits[:, 0] > 0
    mask = exit_mask(Good(), 1, np.array([[1.0, 0], [-1.0, 0]]), {}, np.arange(2))
    assert mask.dtype == np.bool_ and mask.tolist() == [True, False]
