"""The decoder cut into splits for serving, exported to ONNX: one set of split models for prefill and decode.

A **split** runs layers ``first..last`` on a chunk of S new positions per sequence, attending to the
sequence's cache of those layers, and ends with a head: the exit head after ``last`` (a ramp), or the model's
final head for the split that holds layer L. The same graph serves

* prefill: S = prompt length (right-padded), no exits, the final head read at each prompt's last position;
* decode: S = 1, the head read at that position (token and CALM confidence);
* self-speculative verification: S = drafted tokens, the final head read at every position.

The graph takes the cache as an input (``past_kv``) and returns only the chunk's new k/v (``new_kv``); where
the cache lives is the caller's choice: passed in by the router (``<m>_split_*``), or kept by the split's
Python model and fed to the graph from there (``<m>_kv_split_*``, :mod:`e3.generation.kv_store`; measured
faster, the default: ``docs/generation.md``).

Tensors (B sequences, S new positions, T cached positions, n = last-first+1 layers, K heads to read):

==================  ===========================  ===============================================
input               shape / type                 meaning
==================  ===========================  ===============================================
``input_ids``       [B, S] INT64                 split holding layer 1 only (else ``hidden``)
``hidden``          [B, S, H] FP32               the previous split's ``hidden_out``
``positions``       [B, S] INT64                 absolute positions (rotary)
``past_kv``         [B, n, 2, kvh, T, d] FP32    cached k (0) and v (1) of layers first..last
``key_valid``       [B, T+S] BOOL                False for padding (cache or chunk)
``head_index``      [B, K] INT64                 chunk positions whose head output is wanted
==================  ===========================  ===============================================

Outputs: ``hidden_out`` [B, S, H], ``new_kv`` [B, n, 2, kvh, S, d], ``token`` [B, K] INT64 (argmax of the
head), ``confidence`` [B, K] FP32 (softmax margin, the final head's too: CALM never exits on it, but HELIOS's
breach counter reads it), ``exit_scores`` [B, S, 2] FP32: CALM's cheap confidence measures at every chunk
position, (state saturation cos(h_last, h_last-1), the learned classifier's probability), computed without
the head (577 multiply-adds a position; :meth:`e3.generation.decoder.Decoder.exit_scores`).

A **kv-fill** model (CALM's state copy, and the exit head for cheap decisions) takes the exit layer's
``hidden`` [B, 1, H], ``positions`` [B, 1] and ``head_index`` [B, K] (K = 1: read the exit head after
first-1, K = 0: not) and returns ``new_kv`` [B, n, 2, kvh, 1, d] for layers first..L the token skipped,
``token`` and ``confidence`` [B, K]: so a token that leaves on a cheap measure pays for the head once, in
the call that fills its cache anyway.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

from e3.core.session import make_session
from e3.generation.decoder import Decoder, attention_mask, softmax_margin

__all__ = ["DecodeSplit", "KvFill", "split_ranges", "export_split", "export_kvfill", "OPSET"]

log = logging.getLogger(__name__)
OPSET = 17
RTOL = 1e-4


def split_ranges(num_layers: int, exit_layers: tuple[int, ...]) -> list[tuple[int, int]]:
    """Block ranges of the splits: a cut after every exit layer, e.g. 30, (10, 20) -> [(1,10), (11,20), (21,30)]."""
    cuts = sorted(exit_layers)
    if any(not 1 <= e < num_layers for e in cuts):
        raise ValueError(f"exit layers {cuts} must lie in 1..{num_layers - 1}")
    starts = [1, *[e + 1 for e in cuts]]
    ends = [*cuts, num_layers]
    return list(zip(starts, ends))


class DecodeSplit(nn.Module):
    """Layers first..last plus the head after ``last``; see the module docstring for the tensors."""

    def __init__(self, model: Decoder, first: int, last: int):
        super().__init__()
        self.model, self.first, self.last = model, first, last

    @property
    def input_names(self) -> list[str]:
        return ["input_ids" if self.first == 1 else "hidden", "positions", "past_kv", "key_valid", "head_index"]

    output_names = ["hidden_out", "new_kv", "token", "confidence", "exit_scores"]

    def forward(self, x, positions, past_kv, key_valid, head_index):
        m = self.model
        h = m.embed(x) if self.first == 1 else x
        s = h.shape[1]
        cos, sin = m.rope(positions)
        mask = attention_mask(key_valid, s)
        new = []
        before = h
        for i, layer in enumerate(range(self.first, self.last + 1)):
            before = h
            h, k, v = m.layer_forward(layer, h, cos, sin, past_kv[:, i, 0], past_kv[:, i, 1], mask)
            new.append(torch.stack((k, v), dim=1))
        token, confidence = _head(m, h, head_index, self.last)
        return h, torch.stack(new, dim=1), token, confidence, m.exit_scores(h, before, self.last)


def _head(m: Decoder, h: torch.Tensor, head_index: torch.Tensor, after_layer: int):
    """(argmax, softmax margin) [B, K] of the head after ``after_layer`` at chunk positions ``head_index`` [B, K]
    of ``h`` [B, S, H]; K = 0 computes nothing."""
    picked = torch.gather(h, 1, head_index[..., None].expand(-1, -1, h.shape[-1]))
    logits = m.head_logits(picked, after_layer)
    return logits.argmax(-1), softmax_margin(logits)


class KvFill(nn.Module):
    """k/v of layers first..last computed from a skipped token's exit-layer state (CALM), and optionally the exit
    head after first-1 (see the module docstring)."""

    input_names = ["hidden", "positions", "head_index"]
    output_names = ["new_kv", "token", "confidence"]

    def __init__(self, model: Decoder, first: int, last: int):
        super().__init__()
        self.model, self.first, self.last = model, first, last

    def forward(self, hidden, positions, head_index):
        out = [torch.stack(self.model.layer_kv(layer, hidden, positions), dim=1)
               for layer in range(self.first, self.last + 1)]
        return (torch.stack(out, dim=1), *_head(self.model, hidden, head_index, self.first - 1))


def _example_split(split: DecodeSplit, batch: int, past: int, chunk: int, seed: int):
    c = split.model.config
    g = torch.Generator().manual_seed(seed)
    n = split.last - split.first + 1
    x = (torch.randint(0, c.vocab_size, (batch, chunk), generator=g) if split.first == 1
         else torch.randn(batch, chunk, c.hidden_size, generator=g))
    positions = past + torch.arange(chunk)[None].expand(batch, -1)
    past_kv = torch.randn(batch, n, 2, c.num_kv_heads, past, c.head_dim, generator=g)
    key_valid = torch.ones(batch, past + chunk, dtype=torch.bool)
    if past > 1:
        key_valid[0, past - 1] = False   # a padded cache slot
    head_index = torch.full((batch, 1), chunk - 1, dtype=torch.int64)
    return x, positions, past_kv, key_valid, head_index


def _export(module: nn.Module, example: tuple, path: Path, dynamic: dict[str, dict[int, str]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # the TorchScript exporter announces its deprecation
        torch.onnx.export(module, example, str(path), input_names=module.input_names,
                          output_names=module.output_names, dynamic_axes=dynamic, opset_version=OPSET, dynamo=False)


def _check(module: nn.Module, path: Path, examples: list[tuple]) -> float:
    session = make_session(str(path), 1)
    wanted = {i.name for i in session.get_inputs()}
    worst = 0.0
    for ex in examples:
        with torch.no_grad():
            out = module(*ex)
            expected = [t.numpy() for t in (out if isinstance(out, tuple) else (out,))]
        got = session.run(module.output_names, {n: t.numpy() for n, t in zip(module.input_names, ex) if n in wanted})
        for name, e, g in zip(module.output_names, expected, got):
            if e.shape != g.shape:
                raise RuntimeError(f"{path.name}: {name} has shape {g.shape}, PyTorch gives {e.shape}")
            if e.dtype == np.int64:
                continue   # argmax: equal unless logits tie; compared end to end by the tests
            scale = float(np.abs(e).max()) if e.size else 0.0
            err = float(np.abs(e - g).max()) if e.size else 0.0
            if err > RTOL * scale + 1e-5:
                raise RuntimeError(f"{path.name}: {name} differs from PyTorch by {err:.3g} (scale {scale:.3g})")
            worst = max(worst, err / (scale or 1.0))
    return worst


def export_split(model: Decoder, first: int, last: int, *, path: Path) -> float:
    """Write split first..last to ``path`` and check it against PyTorch (decode and prefill shapes); returns
    the worst relative error."""
    split = DecodeSplit(model, first, last).eval()
    dynamic = {"input_ids" if first == 1 else "hidden": {0: "batch", 1: "chunk"}, "positions": {0: "batch", 1: "chunk"},
               "past_kv": {0: "batch", 4: "past"}, "key_valid": {0: "batch", 1: "keys"},
               "head_index": {0: "batch", 1: "heads"}, "hidden_out": {0: "batch", 1: "chunk"},
               "new_kv": {0: "batch", 4: "chunk"}, "token": {0: "batch", 1: "heads"},
               "confidence": {0: "batch", 1: "heads"}, "exit_scores": {0: "batch", 1: "chunk"}}
    _export(split, _example_split(split, 2, 3, 2, 0), path, dynamic)
    return _check(split, path, [_example_split(split, 1, 0, 5, 1), _example_split(split, 3, 7, 1, 2)])


def export_kvfill(model: Decoder, first: int, last: int, *, path: Path) -> float:
    """Write the kv-fill model of layers first..last to ``path`` and check it; returns the worst relative error."""
    fill = KvFill(model, first, last).eval()
    c = model.config
    ex = lambda b, seed, k=1: (torch.randn(b, 1, c.hidden_size, generator=torch.Generator().manual_seed(seed)),
                               torch.full((b, 1), 5 + seed, dtype=torch.int64), torch.zeros(b, k, dtype=torch.int64))
    _export(fill, ex(2, 0), path, {"hidden": {0: "batch"}, "positions": {0: "batch"}, "new_kv": {0: "batch"},
                                   "head_index": {0: "batch", 1: "heads"}, "token": {0: "batch", 1: "heads"},
                                   "confidence": {0: "batch", 1: "heads"}})
    # K = 0 is not checked: ONNX Runtime's ArgMax over an empty axis returns a wrongly shaped empty tensor
    # (as in the splits); the engine reads token/confidence only when it asked for the head
    return _check(fill, path, [ex(1, 1), ex(4, 2)])
