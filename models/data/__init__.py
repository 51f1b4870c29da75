"""Data that installs from the package registries (no downloads at run time).

:func:`split_inputs` gives a dataset's split as model inputs (in the order of
the model card's inputs) and labels, whatever the family.
"""

from __future__ import annotations

import numpy as np

from e3.models.data.images import fashion_mnist
from e3.models.data.text import Tokenizer, rotten_tomatoes

__all__ = ["DATASETS", "split_inputs"]

DATASETS = ("rotten-tomatoes", "fashion-mnist")


def split_inputs(dataset: str, split: str, max_seq_len: int | None = None) -> tuple[tuple[np.ndarray, ...], np.ndarray]:
    """(inputs, labels) of ``split`` ("train", "dev", "test") of ``dataset``."""
    if dataset == "rotten-tomatoes":
        part = rotten_tomatoes()[split]
        ids, mask = Tokenizer(max_seq_len)(part.texts) if max_seq_len else Tokenizer()(part.texts)
        return (ids, mask), part.labels
    if dataset == "fashion-mnist":
        part = fashion_mnist()[split]
        return (part.images,), part.labels
    raise ValueError(f"unknown dataset {dataset!r}; known: {', '.join(DATASETS)}")
