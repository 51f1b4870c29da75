"""``<m>_ee`` runs the code of E3's compact split (serving/compact.py) over the whole model: on tiny-ee's
exported ``<m>_ee`` folder, the composed one-graph form answers exactly as the block-by-block form and the
PyTorch reference, at every request size; a patience rule (PABEE) falls back to block by block and still
answers as the reference; blocks that do not compose fall back with the reason logged."""

from __future__ import annotations

import logging
import shutil

import numpy as np
import pytest

from e3.core.exits import PatienceRule, make_exit_rule
from e3.core.names import block_file
from e3.models.reference import reference_answers
from e3.serving.compact import BLOCK_BY_BLOCK, COMPOSED, CompactRunner

N_INPUTS, TIE_BAND = 120, 1e-5
ENABLED = (1, 2, 3)


@pytest.fixture(scope="module")
def ee_folder(tiny_repo):
    return tiny_repo / "tiny_ee_ee" / "1"


@pytest.fixture(scope="module")
def inputs(tiny_model):
    ids, mask = tiny_model.example_inputs(N_INPUTS, seed=42)
    return {"input_ids": ids.numpy(), "attention_mask": mask.numpy()}


def _answer(runner, inputs, size):
    """Every input through ``runner`` in requests of ``size`` rows: (label, exit_ramp, probs, ramp counts)."""
    label, ramp, probs, counts = [], [], [], []
    for a in range(0, N_INPUTS, size):
        route, rest = runner({k: v[a:a + size] for k, v in inputs.items()})
        assert rest is None and route.done
        label.append(route.label), ramp.append(route.exit_ramp), probs.append(route.probs), counts.append(route.counts)
    return np.concatenate(label), np.concatenate(ramp), np.concatenate(probs), counts


def _check_reference(label, ramp, ref):
    clear = ref.min_margin > TIE_BAND
    assert (~clear).sum() <= 2, "tie band must stay tiny"
    assert (ramp[clear] == ref.exit_ramp[clear]).all()
    assert (label[clear] == ref.label[clear]).all()


def test_the_ee_folder_holds_the_compact_splits_block_files(tiny_model, ee_folder):
    L = tiny_model.card.num_blocks
    assert sorted(p.name for p in ee_folder.glob("*.onnx")) == sorted(block_file(k, ramp=k in ENABLED)
                                                                     for k in range(1, L + 1))


@pytest.mark.parametrize("size", [N_INPUTS, 11, 1])
def test_composed_ee_answers_as_block_by_block_and_the_reference(tiny_model, ee_folder, inputs, size):
    card = tiny_model.card
    rule = make_exit_rule(card.exit_rule)
    composed = CompactRunner(ee_folder, card, rule, 1, card.num_blocks, ENABLED)
    blockwise = CompactRunner(ee_folder, card, rule, 1, card.num_blocks, ENABLED, compose=False)
    assert (composed.form, composed.why) == (COMPOSED, None)
    assert blockwise.form == BLOCK_BY_BLOCK
    got, want = _answer(composed, inputs, size), _answer(blockwise, inputs, size)
    assert got[0].tolist() == want[0].tolist()
    assert got[1].tolist() == want[1].tolist()
    np.testing.assert_allclose(got[2], want[2], rtol=1e-5, atol=1e-6)
    assert got[3] == want[3]                      # the batch profile, ramp by ramp
    assert set(got[1].tolist()) == {1, 2, 3, 4}   # every exit exercised
    _check_reference(got[0], got[1], reference_answers(tiny_model, (inputs["input_ids"], inputs["attention_mask"]),
                                                       rule, enabled_ramps=ENABLED))


def test_a_patience_rule_runs_block_by_block_and_answers_as_the_reference(tiny_model, ee_folder, inputs):
    card = tiny_model.card
    rule = PatienceRule(1)
    runner = CompactRunner(ee_folder, card, rule, 1, card.num_blocks, ENABLED)
    assert runner.form == BLOCK_BY_BLOCK and "patience" in runner.why
    label, ramp, _, _ = _answer(runner, inputs, 11)
    _check_reference(label, ramp, reference_answers(tiny_model, (inputs["input_ids"], inputs["attention_mask"]),
                                                    rule, enabled_ramps=ENABLED))


def test_blocks_that_do_not_compose_fall_back_and_say_why(tiny_model, ee_folder, tmp_path, caplog):
    card = tiny_model.card
    folder = tmp_path / "ee"
    shutil.copytree(ee_folder, folder)
    (folder / block_file(2, ramp=True)).unlink()   # block 2 without its ramp, under the ramp's name
    shutil.copy(folder / block_file(4), folder / block_file(2, ramp=True))
    with caplog.at_level(logging.WARNING, logger="e3.serving.compact"):
        runner = CompactRunner(folder, card, make_exit_rule(card.exit_rule), 1, card.num_blocks, ENABLED)
    assert runner.form == BLOCK_BY_BLOCK and "do not compose" in runner.why
    assert "blocks 1-4 run block by block" in caplog.text
