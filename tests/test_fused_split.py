"""A compact split composed into one ONNX graph (serving/fused_split.py) answers exactly as the same block files
run block by block with the exit rule in numpy (what ``<m>_ee`` and the router's block-by-block form do):
every range of tiny-ee, with a ramp disabled, with no row exiting, with every row exiting at the first ramp
(the ``If`` that keeps later blocks off an empty batch), and the batch profile the router reports."""

from __future__ import annotations

from functools import partial

import numpy as np
import onnx
import pytest

from e3.core.exits import EntropyRule, PatienceRule
from e3.core.names import block_file
from e3.serving.fused_split import can_fuse, compose_split, fuse_blocks
from e3.serving.policy import BatchRoute
from e3.core.session import make_session

ROWS = 24


@pytest.fixture(scope="module")
def blocks(tiny_repo):
    return tiny_repo / "tiny_ee_router" / "1"


def _inputs(model, card, first):
    """The split's inputs for ROWS random model inputs: the model's for split 1, else the state before it."""
    import torch
    x = model.example_inputs(ROWS, seed=3)
    if first == 1:
        return {spec.name: t.numpy() for spec, t in zip(card.inputs, x)}
    with torch.no_grad():
        state = model.stem(*x)
        for k in range(1, first):
            state = model.block(k, *state)
    return {spec.name: t.numpy() for spec, t in zip(card.state, state)}


def _block_by_block(folder, card, rule, first, last, enabled, feed):
    route = BatchRoute(ROWS, card.num_classes, card.num_blocks, rule)
    sessions = {k: make_session(str(folder / block_file(k, ramp=k in enabled))) for k in range(first, last + 1)}

    def run(k, x):
        names = card.split_outputs(k, k, enabled)
        return dict(zip(names, sessions[k].run(names, x)))
    rest = route.follow(feed, ((card.split_ramps(k, k, enabled), partial(run, k)) for k in range(first, last + 1)),
                        [t.name for t in card.state])
    return route, rest


def _fused(folder, card, rule, first, last, enabled, feed):
    """The router's composed form: compose_split and ComposedSplit.advance, as serving/router.py calls them."""
    composed = compose_split(folder, card, first, last=last, enabled_ramps=tuple(sorted(enabled)), tau_nats=rule.tau_nats)
    names = list(composed.outputs)
    out = dict(zip(names, make_session(composed.graph).run(names, feed)))
    route = BatchRoute(ROWS, card.num_classes, card.num_blocks, rule)
    return route, composed.advance(route, out)


@pytest.mark.parametrize("first,last", [(1, 4), (1, 2), (3, 4), (2, 3), (4, 4)])
@pytest.mark.parametrize("tau", ["card", "none_exit", "all_exit"])
@pytest.mark.parametrize("enabled", [(1, 2, 3), (1, 3)])
def test_the_composed_graph_answers_as_block_by_block(tiny_model, blocks, first, last, tau, enabled):
    card = tiny_model.card
    rule = EntropyRule({"card": card.exit_rule["tau_nats"], "none_exit": 0.0, "all_exit": 1e9}[tau])
    feed = _inputs(tiny_model, card, first)
    want, want_rest = _block_by_block(blocks, card, rule, first, last, set(enabled), feed)
    got, got_rest = _fused(blocks, card, rule, first, last, set(enabled), feed)
    assert got.label.tolist() == want.label.tolist()
    assert got.exit_ramp.tolist() == want.exit_ramp.tolist()
    np.testing.assert_allclose(got.probs, want.probs, rtol=1e-5, atol=1e-6)
    assert got.active.tolist() == want.active.tolist()
    assert got.counts == want.counts
    assert (got_rest is None) == (want_rest is None)
    if want_rest is not None:
        for name in want_rest:
            np.testing.assert_allclose(got_rest[name], want_rest[name], rtol=1e-4, atol=1e-5)
    if tau == "all_exit" and first < 4 and any(k in enabled for k in range(first, last)):
        assert got.done or got.active.size == 0     # every row left at the split's first ramp
        assert set(got.exit_ramp.tolist()) == {min(k for k in enabled if k >= first)}


def test_only_independent_rules_are_compiled():
    assert can_fuse(EntropyRule(0.3))
    assert not can_fuse(PatienceRule(2))


def test_settle_refuses_survivors_that_disagree_with_the_answers():
    route = BatchRoute(3, 2, 4, EntropyRule(0.3))
    with pytest.raises(ValueError, match="survivors"):
        route.settle(np.array([1, -1, -1]), np.array([2, 0, 0], np.int32), np.zeros((3, 2), np.float32), (1, 2),
                     np.array([2]))
    with pytest.raises(ValueError, match="2 rows, 3 entered"):
        route.settle(np.array([1, 1]), np.array([2, 2], np.int32), np.zeros((2, 2), np.float32), (1, 2), None)


def test_blocks_must_be_consecutive(tiny_model, blocks):
    card = tiny_model.card
    models = [(k, onnx.load(str(blocks / block_file(k, ramp=True)))) for k in (1, 3)]
    with pytest.raises(ValueError, match="consecutive"):
        fuse_blocks(models, 4, card.num_classes, ramps=(1, 3), tau_nats=0.5, input_names=["input_ids", "attention_mask"],
                    state_names=["hidden", "attention_mask"])
