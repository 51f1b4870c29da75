import numpy as np
import pytest

from e3.core.exits import EntropyRule, PatienceRule, entropy_nats, make_exit_rule, softmax


def test_entropy_in_nats_matches_hand_computation():
    # softmax([0, 0]) = [.5, .5] -> ln 2; a one-hot-like row has ~0 entropy.
    logits = np.array([[0.0, 0.0], [50.0, 0.0], [np.log(3.0), 0.0]])
    p = np.array([0.75, 0.25])
    expected = [np.log(2), 0.0, -(p * np.log(p)).sum()]
    np.testing.assert_allclose(entropy_nats(logits), expected, atol=1e-12)
    np.testing.assert_allclose(softmax(logits)[2], p, rtol=1e-6)


def test_entropy_rule_exits_strictly_below_tau():
    rule = EntropyRule(tau_nats=np.log(2) - 1e-9)
    logits = np.array([[0.0, 0.0], [3.0, 0.0]])
    assert rule.decide(1, logits, {}, np.arange(2)).tolist() == [False, True]
    np.testing.assert_allclose(rule.margin(1, logits, {}, np.arange(2))[0], 1e-9, atol=1e-12)


def test_patience_counter_by_hand():
    """PABEE, patience 2: predictions a,a,a exit at the 3rd ramp; a,b,b,b at the 4th."""
    rule = PatienceRule(patience=2)
    state = rule.init_state(2)
    rows = np.arange(2)
    one_hot = lambda preds: np.eye(3)[preds] * 5.0  # noqa: E731
    seq = [(0, 0), (0, 1), (0, 1), (1, 1)]  # (input 0's prediction, input 1's) at ramps 1..4
    decisions = [rule.decide(k + 1, one_hot(list(p)), state, rows).tolist() for k, p in enumerate(seq)]
    assert decisions[0] == [False, False]      # counters 0, 0
    assert decisions[1] == [False, False]      # counters 1, 0 (input 1 changed its mind)
    assert decisions[2] == [True, False]       # counters 2, 1
    assert decisions[3][1] is True             # input 1: counter 2 at ramp 4
    assert state["count"].tolist() == [0, 2]   # input 0 changed to class 1 at ramp 4 -> reset


def test_patience_state_is_per_row_subset():
    rule = PatienceRule(1)
    state = rule.init_state(4)
    rule.decide(1, np.eye(2)[[0, 1]] * 3, state, np.array([1, 3]))
    assert state["prev"].tolist() == [-1, 0, -1, 1]


@pytest.mark.parametrize("config, message", [
    ({"kind": "nope"}, "unknown exit rule"), ({"kind": "entropy"}, "tau_nats"),
    ({"kind": "entropy", "tau_nats": -1}, ">= 0"), ({"kind": "patience", "patience": 0}, ">= 1"),
])
def test_bad_rule_configs(config, message):
    with pytest.raises(ValueError, match=message):
        make_exit_rule(config)


def test_rule_round_trips_through_its_dict():
    for rule in (EntropyRule(0.25), PatienceRule(3)):
        assert make_exit_rule(rule.to_dict()).to_dict() == rule.to_dict()
