"""Real assets and training: data loaders on the shipped files, MiniLM weights, tiny training that learns."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from e3.core.exits import EntropyRule, PatienceRule
from e3.models.training import (all_exit_logits, choose_patience, choose_tau, encoder_pooled_features, finetune_head,
                                simulate_exits, summarize_exits, train_ramps_on_pooled)
from e3.models.zoo.encoder import EncoderConfig, EncoderEE
from reference_bert import bert_hidden_states, load_checkpoint, sentence_embedding, wordpiece_ids

# Real sentences of different lengths, with punctuation, an accent and words split into pieces.
SENTENCES = ["A man is eating food.",
             "The unaffable critic hated this overlong, self-indulgent film!",
             "Café society isn't what it was -- or is it?",
             "Embeddings"]


@pytest.fixture(scope="module")
def minilm_reference():
    """The raw all-MiniLM-L6-v2 checkpoint, located the way the project locates it."""
    from e3.models.data.text import minilm_zip
    return load_checkpoint(minilm_zip())


def test_rotten_tomatoes_loader_reads_the_shipped_file():
    from e3.models.data.text import rotten_tomatoes
    data = rotten_tomatoes()
    sizes = {k: len(v.texts) for k, v in data.items()}
    assert sum(sizes.values()) == 12808  # fresh + rotten; 'plot' rows and empty texts excluded
    assert sizes == {"train": 10246, "dev": 1280, "test": 1282}
    labels = np.concatenate([v.labels for v in data.values()])
    assert labels.sum() == 7403  # fresh
    assert all(t.strip() for v in data.values() for t in v.texts)


def test_tokenizer_pads_and_truncates_to_max_seq_len():
    from e3.models.data.text import Tokenizer
    tok = Tokenizer(12)
    ids, mask = tok(["A man is eating food.", "word " * 40])
    assert ids.shape == mask.shape == (2, 12) and ids.dtype == np.int64
    assert ids[0, :8].tolist() == [101, 1037, 2158, 2003, 5983, 2833, 1012, 102]  # [CLS] ... [SEP]
    assert mask[0].tolist() == [1] * 8 + [0] * 4 and ids[0, 8:].tolist() == [0] * 4
    assert mask[1].all() and ids[1, -1] == 102  # truncated, still closed with [SEP]


def test_tokenizer_matches_an_independent_wordpiece(minilm_reference):
    """The project's tokenizer against a plain greedy WordPiece over the checkpoint's own vocabulary."""
    from e3.models.data.text import Tokenizer
    vocab = minilm_reference.vocab
    assert (vocab["[PAD]"], vocab["[UNK]"], vocab["[CLS]"], vocab["[SEP]"]) == (0, 100, 101, 102)
    ids, mask = Tokenizer()(SENTENCES)
    for text, row, row_mask in zip(SENTENCES, ids, mask):
        expected = wordpiece_ids(text, vocab)
        n = int(row_mask.sum())
        assert row[:n].tolist() == expected and not row[n:].any() and row_mask[:n].all()
    # Word pieces known from the BERT uncased vocabulary: a wrong vocabulary or a whole-word
    # tokenizer would not give these.
    inverse = {i: t for t, i in vocab.items()}
    pieces = lambda text: [inverse[i] for i in Tokenizer()([text])[0][0] if i]  # noqa: E731
    assert pieces("embeddings") == ["[CLS]", "em", "##bed", "##ding", "##s", "[SEP]"]
    assert pieces("Café, unaffable!") == ["[CLS]", "cafe", ",", "una", "##ffa", "##ble", "!", "[SEP]"]


def test_fashion_mnist_loader_reads_the_debian_files():
    from e3.models.data.images import fashion_mnist
    data = fashion_mnist()
    assert {k: v.images.shape for k, v in data.items()} == {
        "train": (55000, 1, 28, 28), "dev": (5000, 1, 28, 28), "test": (10000, 1, 28, 28)}
    assert sorted(np.unique(data["test"].labels)) == list(range(10))
    assert abs(float(data["train"].images.mean())) < 0.05  # normalised with the training mean


def test_minilm_backbone_matches_an_independent_bert_forward_pass(minilm_reference):
    """The project's MiniLM (weights mapped by name, its own layer code) against a numpy BERT in
    float64 on the raw checkpoint: every layer's states at the real tokens, and the sentence
    embedding as sentence-transformers defines it for this model (masked mean, L2-normalised).
    The sentences differ in length, so all but the longest carry padding."""
    from e3.models.zoo.minilm import build_minilm_ee
    assert minilm_reference.modules == ["Transformer", "Pooling", "Normalize"]
    pooling = minilm_reference.pooling
    assert pooling["pooling_mode_mean_tokens"] and not pooling["pooling_mode_cls_token"]
    rows = [wordpiece_ids(t, minilm_reference.vocab) for t in SENTENCES]
    width = max(map(len, rows)) + 3  # even the longest sentence has padding
    ids = np.zeros((len(rows), width), dtype=np.int64)
    mask = np.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, :len(row)], mask[i, :len(row)] = row, 1
    expected = bert_hidden_states(minilm_reference, ids, mask)

    model = build_minilm_ee("x", {"kind": "entropy", "tau_nats": 0.3}).eval()
    real = mask.astype(bool)
    with torch.no_grad():
        state = model.stem(torch.as_tensor(ids), torch.as_tensor(mask))
        np.testing.assert_allclose(state[0].numpy()[real], expected[0][real], atol=1e-4, rtol=0)
        for k in range(1, 7):
            state = model.block(k, *state)
            np.testing.assert_allclose(state[0].numpy()[real], expected[k][real], atol=1e-4, rtol=0,
                                       err_msg=f"hidden states after block {k}")
    ours = sentence_embedding(state[0].numpy().astype(np.float64), mask)
    np.testing.assert_allclose(ours, sentence_embedding(expected[-1], mask), atol=1e-5, rtol=0)
    # The ramps read this same masked mean (pooling="mean"), so check their pooling too.
    pooled = model.head.pool(state[0], torch.as_tensor(mask)).numpy()
    np.testing.assert_allclose(pooled / np.linalg.norm(pooled, axis=-1, keepdims=True), ours, atol=1e-5, rtol=0)


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
    finetune_head(model, ids, mask, labels=labels, epochs=6, lr=2e-3, batch_size=32, freeze_embeddings=False,
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


def _entropy_nats(row):
    """Entropy of softmax(row) in nats, written out here rather than taken from e3.core.exits."""
    p = np.exp(row - row.max())
    p /= p.sum()
    return float(-(p * np.log(p)).sum())


def test_simulated_exits_match_the_rule_input_by_input():
    rng = np.random.default_rng(3)
    logits = {k: rng.normal(size=(30, 3)) * 3 for k in (1, 2, 3, 4)}
    labels = rng.integers(0, 3, 30)
    # Entropy rule: each input leaves at the first ramp whose entropy is under τ, else at the head.
    first = [next((k for k in (1, 2, 3) if _entropy_nats(logits[k][i]) < 0.4), 4) for i in range(30)]
    assert len(set(first)) >= 3  # the draw exercises early exits and the head alike
    route = simulate_exits(logits, EntropyRule(0.4), 4)
    assert route.exit_ramp.tolist() == first
    assert route.label.tolist() == [int(logits[k][i].argmax()) for i, k in enumerate(first)]
    # PABEE with patience 1: leave at the first ramp that agrees with the ramp before it.
    preds = {k: v.argmax(1) for k, v in logits.items()}
    first = [next((k for k in (2, 3) if preds[k][i] == preds[k - 1][i]), 4) for i in range(30)]
    assert len(set(first)) >= 2
    route = simulate_exits(logits, PatienceRule(1), 4)
    assert route.exit_ramp.tolist() == first
    s = summarize_exits(route, labels, 4)
    assert s["exit_share"] == pytest.approx({k: first.count(k) / 30 for k in set(first)})
    assert s["accuracy"] == pytest.approx(np.mean([preds[k][i] == labels[i] for i, k in enumerate(first)]))
    assert s["blocks_fraction"] == pytest.approx(np.mean(first) / 4)


def test_batch_profile_of_an_exit_stream():
    from e3.models.workload import batch_profile_of
    prof = batch_profile_of(np.array([1, 1, 2, 3]), 3, "m", batch_size=8)
    assert prof.reach == [1.0, 0.5, 0.25]
    assert prof.batch_at(2) == 4.0
