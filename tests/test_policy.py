"""The router's pure policy: exits, inner ramps, survivors, counts; and the
property that splitting never changes an answer."""

import numpy as np
import pytest

from e3.core.exits import EntropyRule, PatienceRule, softmax
from e3.serving.policy import BatchRoute

CONFIDENT, UNSURE = np.array([6.0, 0.0, 0.0]), np.array([0.1, 0.0, 0.0])


def test_inner_ramp_exits_take_their_answer_and_later_ramps_skip_them():
    route = BatchRoute(3, num_classes=3, num_blocks=4, rule=EntropyRule(0.5))
    ramp1 = np.stack([CONFIDENT, UNSURE, UNSURE])
    ramp2 = np.stack([UNSURE[[1, 0, 2]], CONFIDENT[[1, 0, 2]], UNSURE])  # input 0 would now say class 1
    keep = route.observe({1: ramp1, 2: ramp2})
    assert keep.tolist() == [False, False, True]
    assert route.exit_ramp.tolist() == [1, 2, 0]
    assert route.label.tolist() == [0, 1, -1]  # input 0 keeps ramp 1's answer
    assert route.counts.reached == {1: 3, 2: 2} and route.counts.exited == {1: 1, 2: 1}
    np.testing.assert_allclose(route.probs[0], softmax(CONFIDENT[None])[0])
    # Last split: the head (block 4) answers everything left.
    keep = route.observe({3: UNSURE[None], 4: UNSURE[None]})
    assert keep.tolist() == [False] and route.done
    assert route.exit_ramp.tolist() == [1, 2, 4]


def test_row_count_mismatch_is_an_error():
    route = BatchRoute(2, 3, 2, EntropyRule(0.1))
    with pytest.raises(ValueError, match="2 entered"):
        route.observe({1: np.zeros((3, 3))})


def _reference(logits, enabled, rule):
    """One input at a time, block by block: the unsplit model."""
    n, L = logits.shape[:2]
    out = np.zeros(n, int), np.zeros(n, int)
    for i in range(n):
        state = rule.init_state(1)
        for k in range(1, L + 1):
            if k < L and k not in enabled:
                continue
            if k == L or rule.decide(k, logits[i, k - 1][None], state, np.zeros(1, int))[0]:
                out[0][i], out[1][i] = logits[i, k - 1].argmax(), k
                break
    return out


@pytest.mark.parametrize("rule_factory", [lambda: EntropyRule(0.6), lambda: PatienceRule(2)])
@pytest.mark.parametrize("seed", range(6))
def test_any_split_layout_gives_the_unsplit_answers(rule_factory, seed):
    rng = np.random.default_rng(seed)
    n, L, C = 50, 6, 3
    logits = rng.normal(scale=2.0, size=(n, L, C))
    enabled = {k for k in range(1, L) if rng.random() < 0.7}
    cuts = sorted(rng.choice(np.arange(1, L), size=rng.integers(0, L - 1), replace=False).tolist())
    edges = [0, *cuts, L]
    route = BatchRoute(n, C, L, rule_factory())
    for a, b in zip(edges[:-1], edges[1:]):
        ramps = [k for k in range(a + 1, b + 1) if k in enabled or k == L]
        if ramps:
            route.observe({k: logits[route.active, k - 1] for k in ramps})
    label, ramp = _reference(logits, enabled, rule_factory())
    assert route.done
    assert route.label.tolist() == label.tolist()
    assert route.exit_ramp.tolist() == ramp.tolist()


def test_advance_hands_on_only_the_survivors_state():
    route = BatchRoute(3, num_classes=3, num_blocks=4, rule=EntropyRule(0.5))
    hidden = np.arange(3 * 2, dtype=np.float32).reshape(3, 2)
    out = {"ramp_1": np.stack([UNSURE, CONFIDENT, UNSURE]), "hidden_out": hidden, "mask_out": np.ones((3, 5))}
    feed = route.advance(out, (1,), ["hidden", "mask"])
    assert set(feed) == {"hidden", "mask"}
    np.testing.assert_array_equal(feed["hidden"], hidden[[0, 2]])  # input 1 exited at ramp 1
    assert route.active.tolist() == [0, 2]
    # A split without ramps hands everything on unchanged; the head answers the rest.
    feed = route.advance({"hidden_out": feed["hidden"], "mask_out": feed["mask"]}, (), ["hidden", "mask"])
    assert feed["hidden"].shape == (2, 2)
    assert route.advance({"ramp_4": np.stack([UNSURE, UNSURE])}, (4,), ["hidden", "mask"]) is None
    assert route.exit_ramp.tolist() == [4, 1, 4]


def test_split_outputs_and_ramps_from_the_card():
    from e3.core.spec import ModelCard, TensorSpec
    card = ModelCard(name="m", num_blocks=4, ramp_blocks=(1, 2, 3), num_classes=2,
                     inputs=(TensorSpec("x", "FP32", (2,)),), state=(TensorSpec("h", "FP32", (2,)),))
    assert card.split_ramps(1, 2, (1, 2, 3)) == (1, 2)
    assert card.split_ramps(3, 4, (1, 2)) == (4,)            # disabled ramp 3 is not computed; the head is
    assert card.split_outputs(1, 2, (2,)) == ["h_out", "ramp_2"]
    assert card.split_outputs(3, 4, (3,)) == ["ramp_3", "ramp_4"]


def test_follow_stops_once_every_input_is_answered():
    """BatchRoute.follow (the router's and the in-process baseline's loop): survivors' state is sliced to
    the rows still running, and no step runs after every input is answered."""
    from e3.core.names import ramp_output, state_output
    route = BatchRoute(3, num_classes=3, num_blocks=3, rule=EntropyRule(0.5))
    calls = []

    def step(logits_by_ramp):
        def call(feed):
            calls.append(feed["hidden"].tolist())
            return {state_output("hidden"): feed["hidden"] + 1, **{ramp_output(k): v for k, v in logits_by_ramp.items()}}
        return call

    steps = [((1,), step({1: np.stack([CONFIDENT, UNSURE, CONFIDENT])})),
             ((2,), step({2: np.stack([CONFIDENT])})),
             ((3,), step({3: np.stack([UNSURE])}))]          # never runs: nothing is left
    route.follow({"hidden": np.array([10, 20, 30])}, steps, ["hidden"])
    assert calls == [[10, 20, 30], [21]]                   # split 2 saw only input 1's state, moved on by split 1
    assert route.done and route.exit_ramp.tolist() == [1, 2, 1]


def test_drops_say_why_with_the_slo_as_configured():
    from e3.core.plan import default_plan
    from e3.serving.policy import DEADLINE, ERROR, drop_for
    plan = default_plan("m", 4, [(1, 2), (3, 4)], exit_rule={"kind": "entropy", "tau_nats": 0.3}, ramp_blocks=(1, 2, 3), slo_ms=0.5)
    late = drop_for(plan, late=True, detail="m_split_3-4: Request timeout expired")
    assert late.reason == DEADLINE
    assert late.message == ("dropped: m cannot answer within its SLO of 0.5 ms "
                            "(m_split_3-4: Request timeout expired)")
    failed = drop_for(plan, late=False, detail="m_split_1-2: Stub process is not healthy")
    assert failed.reason == ERROR and failed.message == "m router: m_split_1-2: Stub process is not healthy"


def test_follow_hands_back_the_survivors_inputs_or_none_when_all_are_answered():
    route = BatchRoute(3, num_classes=3, num_blocks=4, rule=EntropyRule(0.5))
    block1 = lambda x: {"ramp_1": np.stack([CONFIDENT, UNSURE, UNSURE]), "h_out": x["h"] * 2}  # noqa: E731
    left = route.follow({"h": np.arange(3.0)}, [((1,), block1)], ["h"])
    assert left["h"].tolist() == [2.0, 4.0]          # rows 1 and 2 go on, with block 1's output
    head = lambda x: {"ramp_4": np.stack([UNSURE, UNSURE])}  # noqa: E731
    assert route.follow(left, [((4,), head)], ["h"]) is None and route.done
