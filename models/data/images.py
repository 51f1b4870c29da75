"""Fashion-MNIST from Debian's ``dataset-fashion-mnist`` (the original idx files).

70,000 28x28 grey images in 10 classes. Splits: the official 60,000 training
images are split, seeded, into 55,000 train and 5,000 dev; the official
10,000 test images are the test split. Pixels are scaled to [0, 1] and
normalised with the training set's mean and std (fixed constants below).
"""

from __future__ import annotations

import gzip
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from e3.models.data.assets import debian_dir, file_sha256

__all__ = ["ImageSplit", "fashion_mnist", "fashion_sha256", "MEAN", "STD"]

MEAN, STD = 0.2860, 0.3530
SPLIT_SEED = 2024
_DIR = "usr/share/datasets/fashion-mnist"


@dataclass
class ImageSplit:
    images: np.ndarray  # [N, 1, 28, 28] float32, normalised
    labels: np.ndarray  # [N] int64


def _idx(name: str) -> np.ndarray:
    path = debian_dir(_DIR, "dataset-fashion-mnist") / name
    with gzip.open(path, "rb") as f:
        data = f.read()
    magic = int.from_bytes(data[:4], "big")
    dims = [int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(magic & 0xFF)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * len(dims)).reshape(dims)


def _normalise(images: np.ndarray) -> np.ndarray:
    return ((images.astype(np.float32) / 255.0 - MEAN) / STD)[:, None, :, :]


@lru_cache(maxsize=1)
def fashion_mnist() -> dict[str, ImageSplit]:
    train_x, train_y = _idx("train-images-idx3-ubyte.gz"), _idx("train-labels-idx1-ubyte.gz").astype(np.int64)
    test_x, test_y = _idx("t10k-images-idx3-ubyte.gz"), _idx("t10k-labels-idx1-ubyte.gz").astype(np.int64)
    order = np.random.default_rng(SPLIT_SEED).permutation(len(train_x))
    dev, train = order[:5000], order[5000:]
    return {"train": ImageSplit(_normalise(train_x[train]), train_y[train]),
            "dev": ImageSplit(_normalise(train_x[dev]), train_y[dev]),
            "test": ImageSplit(_normalise(test_x), test_y)}


def fashion_sha256() -> str:
    folder = debian_dir(_DIR, "dataset-fashion-mnist")
    return file_sha256(folder / "train-images-idx3-ubyte.gz")[:32] + file_sha256(folder / "t10k-images-idx3-ubyte.gz")[:32]
