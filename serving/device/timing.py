"""How long the serving executors take: every block and every split, at each batch bucket, run as they serve.

``e3 profile MODEL --cuda`` times a model here and hands the timings to :mod:`e3.profiling.cuda_profile`, which
writes the latency profile. So the planner's prices come from the very code that serves a split on a device:
:func:`~e3.serving.device.executor.prepare_model` (the weights on the device, ``model.half()`` for FP16) and
:func:`~e3.serving.device.executor.make_executor` (one CUDA graph per batch bucket, or eager PyTorch), a call being
:meth:`SplitExecutor.run <e3.serving.device.executor.SplitExecutor.run>` with the rows' copy into the graph's
static inputs included, as the pipeline calls it. The timings cross into ``e3.export`` as plain data
(:class:`ExecutorTimings`): ``e3.export`` may not import this room (docs/architecture.md), which imports
``e3.export``'s model interface.

**Timing**: wall clock around one call and a device synchronize (what one call takes, host launch included);
``warmup`` untimed calls of each variant first, then ``repeats`` timed calls alternating the variants of a block
(with and without its ramp), so a drift of the host's clock or load falls on both alike.

Also here: :func:`compare_with_torch_layer`, the check that the zoo encoder (its attention through
``scaled_dot_product_attention``) keeps up with a model of the same size built from ``nn.TransformerEncoderLayer``
(PyTorch's fused fast path), both run by the same executor.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch
from torch import nn

from e3.models.api import EarlyExitModel, SplitModule
from e3.models.zoo import BERT_BASE
from e3.models.zoo.encoder import EncoderConfig, EncoderEE
from e3.serving.device import executor

__all__ = ["ExecutorTimings", "SplitTimes", "timed", "time_blocks", "time_split", "LayerComparison", "torch_layer_twin",
           "compare_with_torch_layer"]

log = logging.getLogger(__name__)


@dataclass
class ExecutorTimings:
    """Timed repeats (ms) of a model's serving executors, per block and for the stock split, at each bucket."""

    batch_sizes: tuple[int, ...]                   # the buckets timed (rows per call), ascending
    block_ms: list[list[np.ndarray]]               # [k-1][i]: repeats of split k..k without ramp k (block 1 holds
                                                   # the stem, block L the head) at batch_sizes[i], ms
    block_ramp_ms: list[list[np.ndarray] | None]   # [k-1][i]: the same split with ramp k; None: block k has no ramp
    stock_ms: list[np.ndarray]                     # [i]: repeats of split 1..L with the head only, ms
    execution: str                                 # how they ran: executor, device, precision, buckets (for a
                                                   # profile's source)


def _sync(settings: executor.DeviceSettings) -> Callable[[], None]:
    if settings.cuda:
        return lambda: torch.cuda.synchronize(settings.device)
    return lambda: None


def timed(calls: dict[str, Callable[[], object]], *, repeats: int, warmup: int,
          sync: Callable[[], None]) -> dict[str, np.ndarray]:
    """Wall-clock ms of each call and a ``sync`` (module docstring): ``warmup`` untimed calls of each first, then
    ``repeats`` rounds of one call each. Returns ``{name: [repeats] ms}``."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got {repeats} and {warmup}")
    for call in calls.values():
        for _ in range(warmup):
            call()
    sync()
    out = {key: np.empty(repeats) for key in calls}
    for r in range(repeats):
        for key, call in calls.items():
            start = time.perf_counter()
            call()
            sync()
            out[key][r] = (time.perf_counter() - start) * 1e3
    return out


def _device_inputs(model: EarlyExitModel, n: int, seed: int, device: str) -> tuple[torch.Tensor, ...]:
    """``n`` of the model's example inputs (token ids with random lengths, images, ...) on ``device``."""
    return tuple(t.to(device) for t in model.example_inputs(n, seed=seed))


@dataclass
class SplitTimes:
    """What :func:`time_split` measured."""

    samples: dict[str, list[np.ndarray]]   # variant name -> [bucket index] repeats (ms)
    executor: str                          # the class of executor that ran them (CudaGraphExecutor, EagerExecutor)


def time_split(model: EarlyExitModel, variants: dict[str, tuple[int, int, tuple[int, ...]]],
               inputs: Sequence[torch.Tensor], settings: executor.DeviceSettings, *, repeats: int, warmup: int,
               bar=None) -> SplitTimes:
    """Time splits that share their inputs, each as the serving executor runs it (:func:`make_executor`), at every
    bucket of ``settings``.

    ``model``: already prepared (:func:`prepare_model` with the same settings). ``variants``: name -> (first,
    last, enabled ramps) of the split, all with the same ``first``. ``inputs``: that split's inputs on the
    device, rows first, at least the largest bucket's rows. The variants alternate within a bucket. ``bar`` (a
    tqdm) moves once per bucket."""
    execs = {name: executor.make_executor(model, first, last, ramps=ramps, settings=settings)
             for name, (first, last, ramps) in variants.items()}
    sync = _sync(settings)
    out: dict[str, list[np.ndarray]] = {name: [] for name in variants}
    for b in settings.batch_buckets:
        chunk = [tuple(x[:b] for x in inputs)]
        calls = {name: (lambda ex=ex, b=b, chunk=chunk: ex.run(chunk, b)) for name, ex in execs.items()}
        for name, samples in timed(calls, repeats=repeats, warmup=warmup, sync=sync).items():
            out[name].append(samples)
        if bar is not None:
            bar.update(1)
    return SplitTimes(out, type(next(iter(execs.values()))).__name__)


def _execution(settings: executor.DeviceSettings, kind: str) -> str:
    how = "one CUDA graph per bucket" if kind == "CudaGraphExecutor" else "eager kernel launches"
    weights = "model.half()" if settings.precision == "fp16" else "FP32 weights"
    return (f"the serving executor ({kind}: prepare_model + make_executor, {how}, {weights}, device "
            f"{settings.device}, buckets {list(settings.batch_buckets)}), rows copied into its inputs per call")


def time_blocks(model: EarlyExitModel, settings: executor.DeviceSettings, *, repeats: int = 50, warmup: int = 5,
                seed: int = 0, bar=None) -> ExecutorTimings:
    """Every block of ``model`` (with and without its ramp) and the stock split, run by the serving executor
    at each of ``settings.batch_buckets``.

    The model is prepared here (:func:`prepare_model`: moved to ``settings.device`` and, for FP16, halved in
    place). Block k's inputs are the state blocks 1..k-1 compute from the model's example inputs (``seed``), at
    the largest bucket. ``bar`` moves once per (block, bucket) and once per stock bucket:
    ``(L + 1) x len(buckets)`` steps in all."""
    model = executor.prepare_model(model, settings)
    card = model.card
    L, top = card.num_blocks, max(settings.batch_buckets)
    first_inputs = _device_inputs(model, top, seed, settings.device)
    without: list[list[np.ndarray]] = []
    with_ramp: list[list[np.ndarray] | None] = []
    state = first_inputs
    for k in range(1, L + 1):
        variants = {"without": (k, k, ())}
        if k in card.ramp_blocks:
            variants["with"] = (k, k, (k,))
        rows = time_split(model, variants, state, settings, repeats=repeats, warmup=warmup, bar=bar).samples
        without.append(rows["without"])
        with_ramp.append(rows.get("with"))
        if k < L:   # the next block's inputs: this block's state, computed once, eagerly
            with torch.inference_mode():
                state = tuple(t.contiguous() for t in SplitModule(model, k, k, ())(*state))
    stock = time_split(model, {"stock": (1, L, ())}, first_inputs, settings, repeats=repeats, warmup=warmup, bar=bar)
    if settings.cuda:
        torch.cuda.empty_cache()   # the graphs' pools went with their executors
    return ExecutorTimings(tuple(settings.batch_buckets), without, with_ramp, stock.samples["stock"],
                           _execution(settings, stock.executor))


# -- the encoder against PyTorch's fused layer -------------------------------------------------------------------

class _TorchLayer(nn.Module):
    """``nn.TransformerEncoderLayer`` behind the zoo encoder's layer call ``(states [B, S, H], mask [B, S]) ->
    states``; ``padding``: pass the padded keys as ``src_key_padding_mask`` (False: no mask at all, PyTorch's
    flash path, as the H200 run made when the design was written measured it: docs/design.md §5)."""

    def __init__(self, layer: nn.TransformerEncoderLayer, padding: bool):
        super().__init__()
        self.layer, self.padding = layer, padding

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.layer(x, src_key_padding_mask=(mask == 0) if self.padding else None)


def torch_layer_twin(model, *, padding: bool = True):
    """A copy of the zoo encoder ``model`` (:class:`~e3.models.zoo.encoder.EncoderEE`) whose layers are
    ``nn.TransformerEncoderLayer`` of the same size (hidden, heads, FFN, post-LayerNorm, erf GELU, its eps),
    holding the same weights (q, k, v stacked into ``in_proj``): the same function, up to float rounding, where
    every row has a token (a row of padding only gets uniform weights in ours and NaN in the twin). Stem, ramps
    and head are copies of ``model``'s."""
    c = model.config
    twin = copy.deepcopy(model)
    layers = []
    for ours in model.layers:
        layer = nn.TransformerEncoderLayer(c.hidden, c.heads, c.ffn, dropout=c.dropout, activation="gelu",
                                           layer_norm_eps=c.layer_norm_eps, batch_first=True, norm_first=False)
        with torch.no_grad():
            layer.self_attn.in_proj_weight.copy_(torch.cat([ours.query.weight, ours.key.weight, ours.value.weight]))
            layer.self_attn.in_proj_bias.copy_(torch.cat([ours.query.bias, ours.key.bias, ours.value.bias]))
            for theirs, mine in ((layer.self_attn.out_proj, ours.attn_out), (layer.norm1, ours.attn_norm),
                                 (layer.linear1, ours.intermediate), (layer.linear2, ours.output),
                                 (layer.norm2, ours.out_norm)):
                theirs.weight.copy_(mine.weight)
                theirs.bias.copy_(mine.bias)
        layers.append(_TorchLayer(layer, padding))
    twin.layers = nn.ModuleList(layers)
    return twin.eval()


@dataclass(frozen=True)
class LayerComparison:
    """The zoo encoder's stock model against its ``nn.TransformerEncoderLayer`` twin, one executor call each."""

    ours_ms: float          # median ms of one call of the zoo encoder's stock split (blocks 1..L, head) at `batch`
    torch_layer_ms: float   # the same for the twin (:func:`torch_layer_twin`), same executor, same inputs
    batch: int              # rows per call
    seq_len: int            # tokens per row
    execution: str          # how both ran (executor, device, precision)

    @property
    def ratio(self) -> float:
        """ours / twin: 1.10 is 10% slower than PyTorch's fused layer."""
        return self.ours_ms / self.torch_layer_ms


def compare_with_torch_layer(config=None, *, batch: int = 32, settings: executor.DeviceSettings | None = None,
                             padding: bool = True, repeats: int = 50, warmup: int = 5,
                             seed: int = 0) -> LayerComparison:
    """Time the stock model of the zoo encoder (``config``: an :class:`~e3.models.zoo.encoder.EncoderConfig`;
    default BERT-base's shape, 12 x 768, 12 heads, FFN 3072, 128 tokens) against its
    :func:`torch_layer_twin`, both prepared and run by the serving executor (:func:`time_split`, alternating) at
    one bucket of ``batch`` rows. ``settings`` default: CUDA, FP16, CUDA graphs. Inputs: the model's example
    token ids with random lengths (padding masked in both unless ``padding=False``, which drops the twin's mask:
    PyTorch's flash path, the fastest it has). Returns both medians and their ratio."""
    config = config or EncoderConfig(**BERT_BASE, ramp_blocks=())
    settings = settings or executor.DeviceSettings(device="cuda", precision="fp16", graphs=True, max_batch=batch)
    settings = dataclasses.replace(settings, max_batch=batch, buckets=(batch,))
    torch.manual_seed(seed)
    ours = EncoderEE("encoder-stock", config, exit_rule={"kind": "entropy", "tau_nats": 0.0},
                     max_batch_size=batch).eval()
    twin = torch_layer_twin(ours, padding=padding)
    ours, twin = (executor.prepare_model(m, settings) for m in (ours, twin))
    inputs = _device_inputs(ours, batch, seed, settings.device)
    L = config.layers
    execs = {"ours": executor.make_executor(ours, 1, L, ramps=(L,), settings=settings),
             "twin": executor.make_executor(twin, 1, L, ramps=(L,), settings=settings)}
    chunk = [tuple(inputs)]
    samples = timed({name: (lambda ex=ex: ex.run(chunk, batch)) for name, ex in execs.items()},
                    repeats=repeats, warmup=warmup, sync=_sync(settings))
    kind = type(execs["ours"]).__name__
    result = LayerComparison(float(np.median(samples["ours"])), float(np.median(samples["twin"])), batch,
                             config.max_seq_len, _execution(settings, kind))
    log.info("encoder %.3f ms, nn.TransformerEncoderLayer twin %.3f ms at B=%d x %d tokens: %.2fx (%s)",
             result.ours_ms, result.torch_layer_ms, batch, config.max_seq_len, result.ratio, result.execution)
    return result
