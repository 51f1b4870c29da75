"""Which answers a served model may send: the check every front-door answer and split output passes (pure).

Finite inputs can still overflow inside a model: huge but finite floats (``FLT_MAX``, ``1e30``) given to a
split came back as HTTP 200 with NaN ramp logits, and a NaN logit makes every exit test false and every
argmax 0. So an answer holding NaN or Inf in any floating-point output is refused for that request, with a
client error (INVALID_ARG, HTTP 400) like a non-finite input (:mod:`e3.serving.input_policy`): the values the
client sent lie outside the range the model computes in. The other requests of the batch are answered.
Decision: integer outputs (labels, exit ramps) are not checked; the whole request is refused, not only the
rows that overflowed (one response per request, docs/design.md §2).
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

__all__ = ["nonfinite_output"]


def nonfinite_output(outputs: Mapping[str, np.ndarray]) -> str | None:
    """None when every floating-point array of ``outputs`` (name -> [rows, ...]) is finite, else a message
    naming the output, the first row and the count of non-finite values."""
    for name, array in outputs.items():
        a = np.asarray(array)
        if a.dtype.kind != "f" or a.size == 0:
            continue
        bad = ~np.isfinite(a)
        if bad.any():
            rows = np.flatnonzero(bad.reshape(len(a), -1).any(axis=1)) if a.ndim else np.array([0])
            return (f"output {name!r} holds {int(bad.sum())} non-finite value(s) (NaN or Inf; first in row "
                    f"{int(rows[0])} of this request): its input lies outside the range the model computes in "
                    "(e.g. huge floats); refused")
    return None
