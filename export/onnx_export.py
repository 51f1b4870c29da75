"""Export splits of an early-exit model to ONNX and check them against PyTorch.

Every exported file is checked on fresh random inputs at batch 1 and at the
maximum batch: max |onnx - torch| <= 1e-4 * max |torch| + 1e-6 per output
(fp32). Export fails loudly (:class:`ParityError`) otherwise.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch

from e3.core.spec import NUMPY_DTYPES
from e3.models.api import EarlyExitModel, SplitModule

__all__ = ["ParityError", "StateLayoutError", "export_onnx", "check_parity", "split_inputs", "part_io",
           "check_state_layout", "RTOL", "ATOL"]

log = logging.getLogger(__name__)
OPSET = 17
RTOL, ATOL = 1e-4, 1e-6


class ParityError(RuntimeError):
    """An exported file whose outputs differ from PyTorch beyond the tolerance."""


class StateLayoutError(ValueError):
    """A stem or block that does not hand on the state the model card names; the message names the tensor."""


def part_io(path: Path) -> dict[str, list[str]]:
    """What an exported part reads and writes: ``{"reads": input names, "writes": output names}`` of the ONNX
    file at ``path`` (torch.onnx drops an input the graph never reads, so ``reads`` may be fewer than the
    tensors the part is given: serving passes each part exactly these)."""
    graph = onnx.load(str(path), load_external_data=False).graph
    return {"reads": [i.name for i in graph.input], "writes": [o.name for o in graph.output]}


@torch.no_grad()
def check_state_layout(model: EarlyExitModel, *, n: int = 2, seed: int = 0) -> None:
    """The stem and every block below L return exactly the state ``model.card.state`` names, each with the
    shape (``card.state_after``) and dtype the card gives; :class:`StateLayoutError` naming the tensor a part
    drops or mangles. A part may overwrite a state without reading it, or pass one on untouched."""
    card = model.card
    names = [t.name for t in card.state]
    state = model.stem(*model.example_inputs(n, seed=seed))
    for k in range(0, card.num_blocks):
        if k > 0:
            state = model.block(k, *state)
        where = "the stem" if k == 0 else f"block {k}"
        if not isinstance(state, (tuple, list)) or len(state) != len(names):
            got = len(state) if isinstance(state, (tuple, list)) else 1
            lost = names[got:] if got < len(names) else []
            raise StateLayoutError(
                f"{where} returns {got} state tensor(s), the model card names {len(names)} ({', '.join(names)})"
                + (f": it drops {', '.join(repr(x) for x in lost)}, which later blocks and ramps are given" if lost
                   else "") + "; return every state tensor (pass on the ones the block does not change)")
        for spec, t in zip(card.state_after(k), state):
            if tuple(t.shape[1:]) != tuple(spec.shape) or str(t.numpy().dtype) != NUMPY_DTYPES[spec.dtype]:
                raise StateLayoutError(f"{where} returns state {spec.name!r} as {t.numpy().dtype}{list(t.shape[1:])}, "
                                       f"the model card says {spec.dtype}{list(spec.shape)}")


def split_inputs(split: SplitModule, n: int, seed: int, *, device: str | torch.device | None = None
                 ) -> tuple[torch.Tensor, ...]:
    """Valid random inputs for ``split``: model inputs for split 1, else the state that
    the blocks before it produce from random model inputs; on ``device`` (the model's own, e.g. a
    GPU, where given)."""
    model = split.model
    x = model.example_inputs(n, seed=seed)
    if device is not None:
        x = tuple(t.to(device) for t in x)
    if split.first == 1:
        return x
    with torch.no_grad():
        state = model.stem(*x)
        for k in range(1, split.first):
            state = model.block(k, *state)
    return tuple(t.contiguous() for t in state)


def export_onnx(split: SplitModule, path: Path, output_names: list[str] | None = None,
                *, max_batch_size: int = 64, seed: int = 0) -> None:
    """Write ``split`` to ``path`` as ONNX (dynamic batch axis) and check parity."""
    input_names = [t.name for t in split.input_specs]
    output_names = output_names or split.output_names
    example = split_inputs(split, 2, seed)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter announces its deprecation
        torch.onnx.export(
            split, example, str(path), input_names=input_names, output_names=output_names,
            dynamic_axes={name: {0: "batch"} for name in [*input_names, *output_names]},
            opset_version=OPSET, dynamo=False)
    check_parity(split, path, output_names, batch_sizes=(1, max_batch_size), seed=seed + 1)


def check_parity(split: SplitModule, path: Path, output_names: list[str],
                 *, batch_sizes: tuple[int, ...] = (1, 64), seed: int = 1) -> float:
    """Compare ONNX Runtime with PyTorch; returns the worst relative error seen."""

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    input_names = [t.name for t in split.input_specs]
    worst = 0.0
    for i, batch in enumerate(batch_sizes):
        x = split_inputs(split, batch, seed + i)
        with torch.no_grad():
            expected = [t.numpy() for t in split(*x)]
        wanted = {i.name for i in session.get_inputs()}  # ONNX drops inputs a graph never reads (a ramp's mask)
        got = session.run(output_names, {n: t.numpy() for n, t in zip(input_names, x) if n in wanted})
        for name, e, g in zip(output_names, expected, got):
            if e.shape != g.shape:
                raise ParityError(f"{path.name}: output {name} has shape {g.shape}, PyTorch gives {e.shape}")
            scale = float(np.abs(e).max()) if e.size else 0.0
            err = float(np.abs(e.astype(np.float64) - g).max()) if e.size else 0.0
            if err > RTOL * scale + ATOL:
                raise ParityError(f"{path.name}: output {name} at batch {batch} differs from PyTorch by "
                                  f"{err:.3g} (allowed {RTOL * scale + ATOL:.3g})")
            worst = max(worst, err / (scale + 1e-30))
    log.debug("parity ok for %s (worst relative error %.2g)", path, worst)
    return worst
