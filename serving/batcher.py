"""Triton's dynamic batcher, modelled (pure): how many queued requests an idle instance takes. The one model of
it: the simulator's baselines (:class:`e3.simulator.des.Baseline`) and E²bird's emulated baselines (``e3 bench
admission --cuda``) both cut here, so they cannot disagree with each other about Triton's rule.
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["batch_cut", "dynamic_batch"]


def batch_cut(sizes: Sequence[int], preferred: int, max_batch: int, *, exceeded: bool) -> int:
    """Triton's dynamic batcher (``GetDynamicBatch``), the one model of it here: how many of the queued requests
    (``sizes``: inputs of each, oldest first) an idle instance puts into one batch once it stops waiting. At
    least one; more while their inputs stay within the preferred batch (``max_batch`` when ``preferred`` is 0),
    or within ``max_batch`` once the queue delay is ``exceeded``. The simulator's batcher
    (:class:`e3.simulator.des.Baseline`) and :func:`dynamic_batch` both cut here."""
    cap = max_batch if exceeded or preferred <= 0 else preferred
    take, rows = 0, 0
    while take < len(sizes) and (take == 0 or rows + sizes[take] <= cap):
        rows += sizes[take]
        take += 1
    return take


def dynamic_batch(staged: int, oldest_wait_us: float, max_batch: int, *, delay_us: float) -> int:
    """Triton's dynamic batcher (preferred batch = max batch, one input per request), the baselines' rule
    where they are emulated outside Triton (``e3 bench admission --cuda``): how many of ``staged`` queued
    inputs an idle instance takes now (0: it waits). A full batch goes at once; less goes once the oldest
    has waited ``delay_us`` (with no delay: at once, all up to the max batch)."""
    if max_batch < 1 or delay_us < 0:
        raise ValueError(f"max_batch must be >= 1 and delay_us >= 0, got {max_batch} and {delay_us}")
    if staged <= 0:
        return 0
    if staged >= max_batch or oldest_wait_us >= delay_us:
        return batch_cut([1] * min(staged, max_batch), max_batch, max_batch, exceeded=oldest_wait_us >= delay_us > 0)
    return 0
