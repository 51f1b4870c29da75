"""Real assets and training: data loaders on the shipped files, MiniLM weights, tiny training that learns."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from e3.core.exits import EntropyRule, PatienceRule
from e3.export.training import (all_exit_logits, choose_patience, choose_tau, encoder_pooled_features, finetune_head,
                                simulate_exits, summarize_exits, train_ramps_on_pooled)
from e3.export.zoo.encoder import EncoderConfig, EncoderEE


def test_rotten_tomatoes_loader_reads_the_shipped_file():
    from e3.export.data.text import rotten_tomatoes
    data = rotten_tomatoes()
    sizes = {k: len(v.texts) for k, v in data.items()}
    assert sum(sizes.values()) == 12808  # fresh + rotten; 'plot' rows and empty texts excluded
    assert sizes == {"train": 10246, "dev": 1280, "test": 1282}
    labels = np.concatenate([v.labels for v in data.values()])
    assert labels.sum() == 7403  # fresh
    assert all(t.strip() for v in data.values() for t in v.texts)


def test_tokenizer_pads_and_truncates_to_max_seq_len():
    from e3.export.data.text import Tokenizer
    tok = Tokenizer(12)
    ids, mask = tok(["A man is eating food.", "word " * 40])
    assert ids.shape == mask.shape == (2, 12) and ids.dtype == np.int64
    assert ids[0, :8].tolist() == [101, 1037, 2158, 2003, 5983, 2833, 1012, 102]  # [CLS] ... [SEP]
    assert mask[0].tolist() == [1] * 8 + [0] * 4 and ids[0, 8:].tolist() == [0] * 4
    assert mask[1].all() and ids[1, -1] == 102  # truncated, still closed with [SEP]


def test_fashion_mnist_loader_reads_the_debian_files():
    from e3.export.data.images import fashion_mnist
    data = fashion_mnist()
    assert {k: v.images.shape for k, v in data.items()} == {
        "train": (55000, 1, 28, 28), "dev": (5000, 1, 28, 28), "test": (10000, 1, 28, 28)}
    assert sorted(np.unique(data["test"].labels)) == list(range(10))
    assert abs(float(data["train"].images.mean())) < 0.05  # normalised with the training mean


def test_minilm_weights_give_the_reference_sentence_embedding():
    """Mean-pooled, normalised all-MiniLM-L6-v2 embedding of one sentence, computed once with these weights."""
    from e3.export.data.text import Tokenizer
    from e3.export.zoo.minilm import build_minilm_ee
    model = build_minilm_ee("x", {"kind": "entropy", "tau_nats": 0.3}).eval()
    ids, mask = (torch.as_tensor(a) for a in Tokenizer()(["A man is eating food."]))
    with torch.no_grad():
        state = model.stem(ids, mask)
        for k in range(1, 7):
            state = model.block(k, *state)
    emb = torch.nn.functional.normalize((state[0] * mask[..., None]).sum(1) / mask.sum(), dim=-1)[0]
    reference = [0.03324, 0.00441, -0.00628, 0.04838, -0.1387, -0.03362, 0.10113, -0.05438]
    np.testing.assert_allclose(emb[:8].numpy(), reference, atol=2e-5)


def _separable(n, seed, vocab=40, seq=10):
    """Token sequences whose class is which of tokens 5 / 6 they contain (plus noise tokens)."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 2, n)
    ids = rng.integers(10, vocab, (n, seq))
    ids[:, 0] = 1
    ids[np.arange(n), rng.integers(1, seq, n)] = 5 + labels
    return ids.astype(np.int64), np.ones_like(ids), labels.astype(np.int64)


def test_tiny_two_stage_training_learns():
    torch.manual_seed(0)
    config = EncoderConfig(vocab_size=40, hidden=32, layers=3, heads=2, ffn=64, max_seq_len=10, num_classes=2,
                           ramp_blocks=(1, 2), dropout=0.0)
    model = EncoderEE("tiny", config, exit_rule={"kind": "entropy", "tau_nats": 0.3})
    ids, mask, labels = _separable(512, 0)
    finetune_head(model, ids, mask, labels, epochs=6, lr=2e-3, batch_size=32, freeze_embeddings=False,
                  progress=False)
    feats = encoder_pooled_features(model, ids, mask, progress=False)
    train_ramps_on_pooled(model, feats, labels, blocks=(1, 2), epochs=30, lr=3e-3, progress=False)
    tids, tmask, tlabels = _separable(256, 1)
    logits = all_exit_logits(model, (tids, tmask))
    assert (logits[3].argmax(1) == tlabels).mean() > 0.9      # the head learned
    assert (logits[2].argmax(1) == tlabels).mean() > 0.8      # stage 2: a ramp on frozen features learned
    tau, summary = choose_tau(logits, tlabels, 3, max_drop=0.02)
    assert summary["accuracy"] >= (logits[3].argmax(1) == tlabels).mean() - 0.02
    assert summary["blocks_fraction"] < 1.0                    # some inputs exit early


def test_threshold_choice_on_hand_built_logits():
    # 4 inputs, L = 2: ramp 1 is confident and right on inputs 0, 1, confident and wrong on input 2.
    labels = np.array([0, 1, 0, 1])
    conf = lambda c: np.eye(2)[c] * 8.0  # noqa: E731
    logits = {1: np.stack([conf(0), conf(1), conf(1), np.zeros(2)]), 2: np.stack([conf(0), conf(1), conf(0), conf(1)])}
    tau, s = choose_tau(logits, labels, 2, max_drop=0.0)
    assert s["accuracy"] == 1.0 and tau < 0.01  # any τ letting input 2 exit early costs accuracy
    tau, s = choose_tau(logits, labels, 2, max_drop=0.25)
    assert s["exit_share"][1] == 0.75 and s["accuracy"] == 0.75
    patience, s = choose_patience(logits, labels, 2, max_drop=0.0)
    assert patience == 1 and s["exit_share"] == {2: 1.0}  # with 2 blocks, patience 1 exits at ramp 2 at the earliest


def test_simulated_exits_match_the_rule_block_by_block():
    rng = np.random.default_rng(3)
    logits = {k: rng.normal(size=(30, 3)) * 3 for k in (1, 2, 3, 4)}
    route = simulate_exits(logits, EntropyRule(0.4), 4)
    for i in range(30):
        first = next((k for k in (1, 2, 3) if EntropyRule(0.4).decide(k, logits[k][i:i + 1], {}, np.zeros(1, int))[0]), 4)
        assert route.exit_ramp[i] == first and route.label[i] == logits[first][i].argmax()
    s = summarize_exits(simulate_exits(logits, PatienceRule(1), 4), np.zeros(30, int), 4)
    assert abs(sum(s["exit_share"].values()) - 1) < 1e-9


def test_batch_profile_of_an_exit_stream():
    from e3.export.workload import batch_profile_of
    prof = batch_profile_of(np.array([1, 1, 2, 3]), 3, "m", batch_size=8)
    assert prof.reach == [1.0, 0.5, 0.25]
    assert prof.batch_at(2) == 4.0
