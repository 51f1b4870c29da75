"""Rows of a concatenated batch, per request.

A Triton model that serves several requests in one execution concatenates
their inputs along the batch axis, runs once, and hands each request back its
own rows. These two helpers are the one place that bookkeeping lives.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

__all__ = ["request_slices", "split_rows"]


def request_slices(sizes: Sequence[int]) -> list[slice]:
    """Row ranges of consecutive requests of ``sizes`` rows: ``[2, 3] -> [slice(0, 2), slice(2, 5)]``."""
    edges = np.cumsum([0, *(int(n) for n in sizes)])
    return [slice(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:])]


def split_rows(arrays: Mapping[str, np.ndarray], sizes: Sequence[int]) -> list[dict[str, np.ndarray]]:
    """Per request, its rows of every array in ``arrays`` (each [sum(sizes), ...]); views, not copies."""
    total = int(sum(sizes))
    for name, a in arrays.items():
        if a.shape[0] != total:
            raise ValueError(f"{name}: {a.shape[0]} rows, the requests hold {total}")
    return [{name: a[rows] for name, a in arrays.items()} for rows in request_slices(sizes)]
