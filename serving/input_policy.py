"""What a served model accepts: the checks every Python-backend model runs on a request's tensors (pure).

Kept apart from :mod:`e3.serving.triton_io` (which needs Triton's stub) so that
the policy is tested without a server. Triton itself has already checked each
input's name, datatype and shape against the model config before ``execute``
runs; what it cannot know, and ONNX Runtime would answer wrongly or with an
unreadable message, is decided here:

* **Batch.** Every input of a request has the same batch size, at least 1.
* **NaN and Inf** in a floating-point input are refused (no model of the zoo
  gives them a meaning: an image with a NaN pixel, or a hidden state with one,
  answered label 0 at the first ramp before this check). The error names the
  input, the first bad row and the count.
* **Bounds.** An input whose :class:`~e3.core.spec.TensorSpec` carries
  ``bounds`` (inclusive; token ids: ``[0, vocab - 1]``, attention masks:
  ``[0, 1]``) is refused when any value lies outside them. Without the check a
  token id past the vocabulary came back as ONNX Runtime's "Gather node"
  message, and a negative one was silently read from the end of the
  embedding table (ONNX ``Gather`` accepts negative indices).

Text is decided in :mod:`e3.serving.tokenizer` (UTF-8 or refused; truncated to
``max_seq_len`` tokens).
"""

from __future__ import annotations

import numpy as np

from e3.core.spec import TensorSpec

__all__ = ["InputError", "check_request", "check_tensor"]


class InputError(ValueError):
    """A request this model cannot serve; the message goes back to the client (a 400-class error)."""


def check_tensor(spec: TensorSpec, array: np.ndarray) -> None:
    """Raise :class:`InputError` when ``array`` ([N, *spec.shape]) breaks ``spec``'s value policy."""
    if array.dtype.kind == "f":
        finite = np.isfinite(array)
        if not finite.all():
            bad = ~finite.reshape(len(array), -1).all(axis=1)
            raise InputError(f"input '{spec.name}': {int((~finite).sum())} NaN or Inf value(s), first in row "
                             f"{int(np.argmax(bad))}; {spec.dtype} inputs must be finite")
    if spec.bounds is not None and array.size and array.dtype.kind in "iuf":
        low, high = spec.bounds
        lo, hi = array.min(), array.max()
        if lo < low or hi > high:
            flat = array.reshape(len(array), -1)
            bad = ((flat < low) | (flat > high)).any(axis=1)
            worst = lo if lo < low else hi
            raise InputError(f"input '{spec.name}': value {_number(worst)} in row {int(np.argmax(bad))} is outside "
                             f"the allowed range [{_number(low)}, {_number(high)}]")


def check_request(specs: tuple[TensorSpec, ...], arrays: dict[str, np.ndarray]) -> int:
    """Check one request's inputs (``arrays`` by name, each [N, ...]); return its batch size N.

    Raises :class:`InputError` naming the first problem: a missing input, batch
    sizes that disagree, an empty batch, or a value :func:`check_tensor` refuses.
    """
    for t in specs:
        if arrays.get(t.name) is None:
            raise InputError(f"missing input '{t.name}'")
    batch = {arrays[t.name].shape[0] if arrays[t.name].ndim else -1 for t in specs}
    if len(batch) != 1:
        raise InputError(f"inputs disagree on the batch size: {sorted(batch)}")
    n = batch.pop()
    if n <= 0:
        raise InputError("empty batch: the request carries no inputs")
    for t in specs:
        check_tensor(t, arrays[t.name])
    return n


def _number(x) -> str:
    x = float(x)
    return str(int(x)) if x.is_integer() else repr(x)
