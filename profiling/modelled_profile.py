"""``e3 profile --modelled GPU``: per-layer GPU profiles MODELLED from public whole-model figures.

Nothing here is measured: every profile it makes has ``modelled=True`` on each
device, its ``source`` starts with "modelled from public figures", and
``e3 profile`` prints "MODELLED" beside it. It exists so that the planner and
the simulator can reason about GPUs this project's machines lack (docs/design.md §3, §5).

The model, step by step (data: ``docs/data/public/gpu_latency_public.csv``, see its README):

1. **Reference curve** ``W_g(b)``: whole-model latency (ms) of BERT-base (12 layers,
   hidden 768, FFN 3072) at sequence length 128, FP16, against batch ``b``:

   * v100, t4, a100 -- TensorRT 7.2 (S1); a30 -- TensorRT (S2);
   * a10 -- FasterTransformer FP16 (S3; only batch 1, 8, 32; on V100, where both
     exist, FasterTransformer is 14-38 % slower than S1's TensorRT);
   * k80 -- no BERT figure exists: the V100 curve times the K80/V100 latency
     ratio of ResNet-50 at the same batch, from the one source that has both
     (S8, MXNet, images/s; latency = batch / throughput). That ratio is 2.4 at
     batch 1 and 7.2 at 128; it compares FP32 on both, so it is likely an
     underestimate of the gap to an FP16 V100.

   Between listed batches ``W_g`` is linear; beyond the largest it is
   extrapolated linearly from the last two points; below batch 1 it is ``W_g(1)``.
2. **Per layer**: one reference layer costs ``W_g(b) / 12`` (the whole-model curve
   divided by its layer count; embeddings and pooler are spread over the layers).
3. **Scaled to the model's size by FLOPs**: ``f_k`` is block k's FLOPs per input
   (counted by ``torch.utils.flop_counter`` on the block exported alone, at the
   model's own sequence length; block 1 with the stem, block L with the head) and
   ``F_ref`` = 1.862 GFLOP, one BERT-base layer per input at seq 128
   (``2·S·(4H² + 2HF) + 4·S²·H``). A block of ``r_k = f_k / F_ref`` reference layers
   at batch ``B`` does the work of one reference layer at batch ``r_k·B``, so
   ``block_ms(B) = W_g(r_k·B) / 12``. This keeps the GPU's flat region: a block much
   smaller than a BERT-base layer costs the reference layer's batch-1 time (launch-
   and memory-bound), not a FLOP share of it.
4. **Ramps** cost their FLOP share of their block: ``ramp_ms(B) = block_ms(B) · f_ramp / f_k``
   (a ramp is a pooler and a classifier on one token: small on any device).
5. **Tx** between splits on different GPUs: ``tx_fixed_ms + bytes(B) / bandwidth``, with the
   cut's tensors' bytes (``card.state``) and, by default, 0.2 ms and 25 Gbit/s (an
   assumption, not a figure from the data file). ``tx_in_ms``, the hop of the model
   inputs into split 1, is the same formula with the inputs' bytes (``card.inputs``).
5b. **Exit check** (``check_ms``, what a compact split pays at each enabled ramp on a GPU):
   a device-to-host copy of the ramp's logits with its synchronisation, and a gather of
   the surviving rows on the device: ``check_fixed_ms + check_per_row_ms * B``, by
   default 0.05 ms + 0.0005 ms per row (an assumption, labelled modelled, not a figure
   from the data file).
5c. **Router** (``router_ms``): the router is CPU work whatever device runs the splits,
   so it is the curve measured on this host's CPU (:func:`e3.profiling.profiler.measure_router`,
   in-process, no Triton) when made by :func:`model_modelled_profile`; absent (0) when
   :func:`modelled_profile` is not given one.
6. **Prices** (README, AWS on-demand us-east-1, January 2026, USD per device-hour):
   k80 0.90 (p2.xlarge), v100 3.06 (p3.2xlarge), t4 0.526 (g4dn.xlarge), a10 1.006
   (g5.xlarge, an A10G), a100 2.745 (p4d.24xlarge / 8). The data has no A30 price:
   give one (``prices={"a30": ...}``, ``--price a30=...``).
"""

from __future__ import annotations

import csv
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Mapping, Sequence

import numpy as np

from e3.core.profile import DeviceConfig, LatencyProfile, ProfileError, interp_linear
from e3.core.spec import ModelCard, NUMPY_DTYPES
from e3.paths import project_root

if TYPE_CHECKING:
    from e3.models.api import EarlyExitModel

__all__ = ["GPUS", "PRICES_PER_HOUR", "REF_LAYERS", "REF_SEQ_LEN", "REF_LAYER_FLOPS", "CHECK_FIXED_MS",
           "CHECK_PER_ROW_MS", "default_data_file",
           "load_reference_curves", "Curve", "block_flops", "modelled_profile", "model_modelled_profile",
           "parse_prices"]

log = logging.getLogger(__name__)

GPUS = ("v100", "t4", "a100", "a30", "a10", "k80")
PRICES_PER_HOUR: dict[str, float | None] = {
    "k80": 0.90, "v100": 3.06, "t4": 0.526, "a10": 1.006, "a100": 21.96 / 8, "a30": None}
REF_LAYERS = 12
REF_SEQ_LEN = 128
REF_HIDDEN, REF_FFN = 768, 3072
REF_LAYER_FLOPS = 2 * REF_SEQ_LEN * (4 * REF_HIDDEN ** 2 + 2 * REF_HIDDEN * REF_FFN) + 4 * REF_SEQ_LEN ** 2 * REF_HIDDEN
TX_FIXED_MS = 0.2
TX_GBIT_S = 25.0
CHECK_FIXED_MS = 0.05       # modelled: device->host sync of a ramp's logits (assumption)
CHECK_PER_ROW_MS = 0.0005   # modelled: gathering one surviving row on the device (assumption)
SOURCE_PREFIX = "modelled from public figures"

# (model, gpu, precision, seq_len, source) of each GPU's reference rows in the CSV.
_REFERENCE_ROWS = {
    "v100": ("bert-base", "V100", "FP16", "128", "S1"),
    "t4": ("bert-base", "T4", "FP16", "128", "S1"),
    "a100": ("bert-base", "A100", "FP16", "128", "S1"),
    "a30": ("bert-base", "A30", "FP16", "128", "S2"),
    "a10": ("bert-base(12L)", "A10", "FP16-FasterTransformer", "128", "S3"),
}
_RESNET_K80 = ("resnet50(mxnet)", "K80", "S8")
_RESNET_V100 = ("resnet50(mxnet)", "V100", "S8")


def parse_prices(items: Iterable[str]) -> dict[str, float]:
    """``["a30=1.5", "T4=0.6"]`` (``--price GPU=USD_PER_HOUR``, repeatable) -> ``{"a30": 1.5, "t4": 0.6}``.

    Names are lower-cased; a price is a finite number >= 0 (USD per device-hour). Raises
    ProfileError naming the item and what to write instead.
    """
    prices: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition("=")
        try:
            price = float(value) if sep and name.strip() else float("nan")
        except ValueError:
            price = float("nan")
        if not (np.isfinite(price) and price >= 0):
            raise ProfileError(f"--price takes GPU=USD_PER_HOUR, e.g. a30=1.5; got {item!r}")
        prices[name.strip().lower()] = price
    return prices


def default_data_file() -> Path:
    """``docs/data/public/gpu_latency_public.csv`` in the repository (its sources in the README beside it;
    $E3_GPU_DATA overrides)."""
    return Path(os.environ.get("E3_GPU_DATA", project_root() / "docs" / "data" / "public" / "gpu_latency_public.csv"))


@dataclass(frozen=True)
class Curve:
    """Whole-model reference latency (ms) against batch, and how it was made."""
    batches: tuple[float, ...]
    latency_ms: tuple[float, ...]
    how: str

    def __call__(self, batch: float | np.ndarray) -> np.ndarray:
        """Linear between points, linear extrapolation past the last, the first point's value below it
        (:func:`e3.core.profile.interp_linear`, the one interpolation of a measured curve)."""
        return interp_linear(self.batches, self.latency_ms, np.maximum(np.asarray(batch, float), self.batches[0]))


def load_reference_curves(path: str | Path | None = None) -> dict[str, Curve]:
    """The reference curve of every GPU in :data:`GPUS` (see the module docstring, step 1)."""
    path = Path(path) if path else default_data_file()
    try:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
    except OSError as err:
        raise ProfileError(f"cannot read the public GPU figures {path}: {err.strerror or err}") from None

    def pick(model, gpu, precision, seq, source) -> dict[float, float]:
        got = {float(r["batch"]): float(r["latency_ms"]) for r in rows
               if (r["model"], r["gpu"], r["precision"], r["seq_len"], r["source"]) == (model, gpu, precision, seq, source)
               and r["latency_ms"]}
        if not got:
            raise ProfileError(f"{path} has no rows for {model} on {gpu} ({precision}, seq {seq}, {source})")
        return got

    def images_latency(model, gpu, source) -> dict[float, float]:
        got = {float(r["batch"]): 1e3 * float(r["batch"]) / float(r["throughput_per_s"]) for r in rows
               if (r["model"], r["gpu"], r["source"]) == (model, gpu, source) and r["throughput_per_s"]}
        if not got:
            raise ProfileError(f"{path} has no throughput rows for {model} on {gpu} ({source})")
        return got

    curves = {}
    for gpu, key in _REFERENCE_ROWS.items():
        pts = pick(*key)
        b = tuple(sorted(pts))
        curves[gpu] = Curve(b, tuple(pts[x] for x in b), f"{key[0]} {key[2]} seq {key[3]} on {key[1]} ({key[4]})")
    k80, v100 = images_latency(*_RESNET_K80), images_latency(*_RESNET_V100)
    rb = sorted(set(k80) & set(v100))
    ratio = Curve(tuple(rb), tuple(k80[b] / v100[b] for b in rb), "")
    v = curves["v100"]
    # The ratio beyond its last listed batch is held, not extrapolated.
    scale = np.interp(v.batches, ratio.batches, ratio.latency_ms)
    curves["k80"] = Curve(v.batches, tuple(float(x) for x in np.asarray(v.latency_ms) * scale),
                          f"V100 curve ({v.how}) x K80/V100 ResNet-50 latency ratio (S8, MXNet)")
    return curves


def block_flops(model: "EarlyExitModel") -> tuple[list[float], list[float]]:
    """FLOPs per input of every block alone (block 1 with the stem, L with the head) and of its ramp
    (0 where none), counted at batch 1 by ``torch.utils.flop_counter`` (matmuls, convolutions)."""
    # deferred: torch (FLOP counts of the model) and the measuring modules load only when a profile is modelled
    import torch
    from torch.utils.flop_counter import FlopCounterMode
    from e3.models.api import SplitModule
    from e3.export.onnx_export import split_inputs

    def flops(module) -> float:
        x = split_inputs(module, 1, 0)
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            module(*x)
        return float(counter.get_total_flops())

    card = model.card
    blocks, ramps = [], []
    for k in range(1, card.num_blocks + 1):
        base = flops(SplitModule(model, k, k, ()))
        blocks.append(base)
        ramps.append(max(0.0, flops(SplitModule(model, k, k, (k,))) - base) if k in card.ramp_blocks else 0.0)
    return blocks, ramps


def _bytes(specs) -> int:
    return int(sum(np.prod(t.shape, dtype=np.int64) * np.dtype(NUMPY_DTYPES[t.dtype]).itemsize for t in specs))


def _state_bytes(card: ModelCard) -> int:
    # deferred: torch (FLOP counts of the model) and the measuring modules load only when a profile is modelled
    from e3.profiling.profiler import cut_state
    return _bytes(cut_state(card))


def modelled_profile(model: str, batch_sizes: Sequence[int], flops: Sequence[float], *, ramp_flops: Sequence[float],
                     state_bytes: int, gpus: Sequence[str], curves: Mapping[str, Curve],
                     prices: Mapping[str, float | None] | None = None, tx_fixed_ms: float = TX_FIXED_MS,
                     tx_gbit_s: float = TX_GBIT_S, input_bytes: int | None = None,
                     router_ms: Sequence[float] | None = None, check_fixed_ms: float = CHECK_FIXED_MS,
                     check_per_row_ms: float = CHECK_PER_ROW_MS) -> LatencyProfile:
    """The modelled profile (module docstring, steps 2-6) of a model with per-input block FLOPs
    ``flops[k-1]`` and ramp FLOPs ``ramp_flops[k-1]``, on every GPU in ``gpus``. ``input_bytes``: bytes
    of one input's model inputs (None: no ``tx_in_ms``, split 1's hop is priced as a cut's);
    ``router_ms``: the router's work per batch at ``batch_sizes``, measured on a CPU (None: none). Pure."""
    prices = {**PRICES_PER_HOUR, **(prices or {})}
    gpus = [g.lower() for g in gpus]
    unknown = [g for g in gpus if g not in GPUS]
    if unknown or not gpus:
        raise ProfileError(f"cannot model {', '.join(unknown) or 'no GPU'}: modelled GPUs are {', '.join(GPUS)}")
    if len(set(gpus)) != len(gpus):
        raise ProfileError(f"a GPU is named twice in {gpus}")
    for g in gpus:
        if prices.get(g) is None:
            raise ProfileError(f"the public figures give no price for {g}; pass one (--price {g}=<USD per hour>)")
    if router_ms is not None and len(router_ms) != len(batch_sizes):
        raise ProfileError(f"router_ms must hold one latency per batch size ({len(batch_sizes)}), got {len(router_ms)}")
    B = np.asarray(batch_sizes, float)
    block_ms, ramp_ms, tx_ms, devices = {}, {}, {}, {}
    tx_in_ms, check_ms, router = {}, {}, {}

    def hop(nbytes: int) -> list[float]:
        return [tx_fixed_ms + nbytes * b * 8 / (tx_gbit_s * 1e9) * 1e3 for b in batch_sizes]

    tx = hop(state_bytes)
    check = [check_fixed_ms + check_per_row_ms * b for b in batch_sizes]
    for g in gpus:
        curve = curves[g]
        rows, ramp_rows = [], []
        for f, fr in zip(flops, ramp_flops):
            layer = curve(B * f / REF_LAYER_FLOPS) / REF_LAYERS
            rows.append([float(x) for x in layer])
            ramp_rows.append([float(x) for x in (layer * fr / f if f > 0 else np.zeros_like(layer))])
        block_ms[g], ramp_ms[g], tx_ms[g], check_ms[g] = rows, ramp_rows, list(tx), list(check)
        if input_bytes is not None:
            tx_in_ms[g] = hop(input_bytes)
        if router_ms is not None:
            router[g] = [float(x) for x in router_ms]
        devices[g] = DeviceConfig(g, float(prices[g]), modelled=True)
    how = "; ".join(f"{g}: {curves[g].how}" for g in gpus)
    source = (f"{SOURCE_PREFIX} (docs/data/public/gpu_latency_public.csv), NOT measured: whole-model BERT-base curves "
              f"divided by {REF_LAYERS} layers, scaled by block FLOPs / {REF_LAYER_FLOPS / 1e9:.3f} GFLOP "
              f"(one BERT-base layer at seq {REF_SEQ_LEN}) as an equivalent batch; ramps by their FLOP share; "
              f"Tx = {tx_fixed_ms:g} ms + cut bytes at {tx_gbit_s:g} Gbit/s (assumed)"
              f"{', Tx in the same with the model inputs bytes' if input_bytes is not None else ''}; "
              f"exit check MODELLED as {check_fixed_ms:g} ms + {check_per_row_ms:g} ms per row (device->host sync "
              f"and a gather, assumed); router work "
              f"{'measured on this host CPU (the router is CPU work)' if router_ms is not None else 'not included'}; "
              f"prices USD/device-hour (AWS on-demand, Jan 2026). Curves: {how}")
    profile = LatencyProfile(model=model, num_blocks=len(flops), batch_sizes=list(batch_sizes), devices=devices,
                             block_ms=block_ms, ramp_ms=ramp_ms, tx_ms=tx_ms, spread_ms={}, source=source,
                             tx_in_ms=tx_in_ms, check_ms=check_ms, router_ms=router)
    profile.validate()
    return profile


def model_modelled_profile(model_name: str, gpus: Sequence[str], batch_sizes: Sequence[int] | None = None,
                           *, prices: Mapping[str, float] | None = None, data_file: str | Path | None = None
                           ) -> LatencyProfile:
    """:func:`modelled_profile` for a zoo model (or ``package.module:factory``), with ``tx_in_ms`` from its
    inputs' bytes and ``router_ms`` measured on this host (:func:`e3.profiling.profiler.measure_router`)."""
    # deferred: torch (FLOP counts of the model) and the measuring modules load only when a profile is modelled
    from e3.core.names import served_name
    from e3.profiling.profiler import default_batch_sizes
    from e3.models.zoo import resolve_model
    from e3.profiling.profiler import measure_router, summarize

    model = resolve_model(model_name)
    card = model.card
    flops, ramp_flops = block_flops(model)
    log.info("block FLOPs per input of %s: %s", model_name, [f"{f:.3g}" for f in flops])
    batches = list(batch_sizes or default_batch_sizes(card.max_batch_size))
    router = [summarize(t).median_ms for t in measure_router(card, batches, repeats=50)]
    return modelled_profile(served_name(model_name), batches, flops, ramp_flops=ramp_flops, state_bytes=_state_bytes(card), gpus=gpus,
                            curves=load_reference_curves(data_file), prices=prices, input_bytes=_bytes(card.inputs),
                            router_ms=router)
