"""Your own data for the toolchain (``--data FILE`` of ``e3 evaluate``, ``e3 workload``, ``e3 profile`` and
``e3 plan``), for any model, zoo or ``package.module:factory``.

The format (one ``.npz`` file, ``numpy.savez(FILE, **arrays)``):

* one array per model input, named as the model card names it (``card.inputs``), batch first, with the
  card's shape after the batch axis and its dtype (``x``: float32 [N, 8]; ``input_ids``/``attention_mask``:
  int64 [N, 48]);
* ``labels``: int64 [N], the true class of every input (``label`` is accepted too). Without labels,
  ``e3 evaluate`` cannot give accuracy (it says so); the other verbs do not need them.

Decisions: the whole file is used, in its order (``--limit`` takes the first N); arrays of another numeric
dtype are converted to the card's dtype only when no value changes (else an error naming the array:
:func:`e3.core.spec.cast_exact`, which the client uses too).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from e3.core.spec import cast_exact

__all__ = ["DataError", "load_data", "use_data_inputs", "LABELS"]

LABELS = ("labels", "label")


class DataError(ValueError):
    """A data file the model cannot use; the message names the array and what is expected."""


def load_data(path: str | Path, card, *, limit: int | None = None,
              need_labels: bool = False) -> tuple[tuple[np.ndarray, ...], np.ndarray | None]:
    """The model inputs (in ``card.inputs`` order) and labels (None when the file has none) of ``path``."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file {path} does not exist")
    try:
        data = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as err:
        raise DataError(f"{path} is not a .npz file of arrays ({err}); write it with numpy.savez") from None
    with data:
        names = set(data.files)
        missing = [t.name for t in card.inputs if t.name not in names]
        if missing:
            raise DataError(f"{path} has no array {missing[0]!r}: the model's inputs are "
                            f"{[t.name for t in card.inputs]} (and 'labels'); it has {sorted(names)}")
        inputs = []
        for spec in card.inputs:
            x = data[spec.name]
            if tuple(x.shape[1:]) != tuple(spec.shape):
                raise DataError(f"{path}: array {spec.name!r} has shape {list(x.shape)}, the model takes "
                                f"[N, {', '.join(map(str, spec.shape))}]")
            try:
                inputs.append(cast_exact(spec.name, x, spec.dtype))
            except ValueError as err:
                raise DataError(f"{path}: {err}") from None
        label_name = next((n for n in LABELS if n in names), None)
        labels = None if label_name is None else data[label_name].astype(np.int64).reshape(-1)
    n = len(inputs[0])
    if any(len(x) != n for x in inputs) or (labels is not None and len(labels) != n):
        raise DataError(f"{path}: arrays of different lengths "
                        f"({', '.join(f'{t.name}: {len(x)}' for t, x in zip(card.inputs, inputs))}"
                        f"{'' if labels is None else f', labels: {len(labels)}'})")
    if n == 0:
        raise DataError(f"{path} holds no inputs")
    if labels is not None and ((labels < 0) | (labels >= card.num_classes)).any():
        raise DataError(f"{path}: labels must be classes 0..{card.num_classes - 1}")
    if need_labels and labels is None:
        raise DataError(f"{path} has no 'labels' array (int64 [N]): it is needed here")
    if limit:
        inputs, labels = [x[:limit] for x in inputs], None if labels is None else labels[:limit]
    return tuple(inputs), labels


def use_data_inputs(model, inputs: tuple[np.ndarray, ...]) -> None:
    """Make ``model.example_inputs(n, seed)`` draw its ``n`` rows from ``inputs`` (seeded, with replacement
    when the data holds fewer), so that whatever times or checks the model on example inputs (the profiler)
    runs it on the user's data."""
    import torch   # deferred: loading a data file needs no torch; only the profiler's example inputs do
    count = len(inputs[0])

    def example_inputs(n: int, seed: int = 0):
        idx = np.random.default_rng(seed).choice(count, size=n, replace=n > count)
        return tuple(torch.as_tensor(x[idx]) for x in inputs)

    model.example_inputs = example_inputs
