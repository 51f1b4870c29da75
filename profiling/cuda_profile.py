"""``e3 profile MODEL --cuda``: a latency profile MEASURED on this host's NVIDIA GPU, with PyTorch.

The same units as the CPU profile (:mod:`e3.profiling.profiler`): every block k alone
(:class:`~e3.models.api.SplitModule`, block 1 with the stem, block L with the head)
with and without its ramp, the stock graph (blocks 1..L, no ramp), a cut's hop, the
exit check of a compact split and the router's work, at batch 1, 2, 4, ... up to the
model's maximum batch. The device configuration is named after the GPU (``h100``,
``h200``, ``a100``, ...; :func:`device_label`) with ``modelled=False``, so the planner
and ``e3 bench gpu --measured`` take it beside the modelled ones.

How each is run and timed, and why:

* **Runtime: PyTorch on CUDA, not ONNX Runtime's CUDA provider or TensorRT.** Those are
  what an NGC Triton image serves the splits with (``docs/ngc.md``; ``pip install
  .[gpu]``), and where they are installed they are what to profile. The GPU hosts this
  project was lent carry PyTorch with CUDA but neither of them, and their wheels (hundreds
  of MB) could not be brought there. PyTorch runs the very modules the ONNX files are
  exported from, so the FLOPs and shapes are the served ones; kernel choice differs.
* **Blocks and the stock graph: the serving executor, timed in the serving room.** Every block (with and
  without its ramp) and the stock graph run exactly as E3's device splits serve them
  (:mod:`e3.serving.device.executor`): ``prepare_model`` (the weights on the GPU, ``model.half()`` for FP16)
  and ``make_executor`` (one CUDA graph per batch bucket, the batch sizes here being the buckets, or eager
  launches with ``--eager``), a call copying the rows into the graph's inputs and replaying it. The timing
  lives beside the executor (:func:`e3.serving.device.timing.time_blocks`); :func:`profile_model_cuda` receives
  it as ``time_blocks`` (:func:`profile_cuda` passes it; a test passes a plain one) and writes what it measured. FP16 and CUDA graphs are the default: the
  public figures the modelled profiles come from are TensorRT FP16 engines, which launch a whole engine per
  call, as a graph replay does. ``--eager`` / ``--fp32`` measure the other ways (the device is then named e.g.
  ``h100-eager-fp32``), to show what launch overhead and precision do.
* **Timing**: wall clock around one call and a device synchronize: what one call takes, host launch included.
  ``warmup`` untimed calls, then ``repeats`` timed calls alternating the variants of a block; median, spread =
  IQR.
* **Tx**, a cut's hop: the router moves a cut's state through host memory (a BLS call
  returns the split's outputs to the router, the survivors go to the next split), so a hop
  is the state's copy device -> host and host -> device, measured here for B rows, plus
  ``hop_fixed_ms`` (default the modelled profile's 0.2 ms) for the BLS exchange between
  host threads, which is not measured on a GPU host (the CPU profile measures a whole BLS
  hop: ``e3 profile``). ``tx_in_ms``: the model inputs' copy host -> device plus the same
  fixed part.
* **check** (a compact split at an enabled ramp): the ramp's logits copied to the host,
  the model's exit rule (:class:`~e3.serving.policy.BatchRoute`'s ``observe``, as the
  router runs it), the survivors' indices copied back and their state rows gathered on the
  device. Measured, where the modelled profile assumes 0.05 ms + 0.0005 ms per row.
* **router**: the router's own work per batch (stacking rows, the exit rule, answers) is
  host CPU work whatever runs the splits: :func:`e3.profiling.profiler.measure_router`, on
  this host's CPU.

The weights' values do not change a latency: ``--untrained`` times the architecture with
random weights (:func:`e3.models.zoo.resolve_architecture`) on a host without the trained
checkpoints. Measuring needs CUDA, or ``torch_device="cpu"`` (``e3 profile --cuda --torch-device
cpu``): the same path with eager executors in FP32 on the CPU, a check of the code where no GPU is;
:func:`device_label` and the assembly are pure.
"""

from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Protocol, Sequence

import numpy as np
import torch
from tqdm import tqdm

from e3.core.names import served_name
from e3.core.profile import LatencyProfile, ProfileError
from e3.core.spec import NUMPY_DTYPES
from e3.models.zoo import resolve_architecture, resolve_model
from e3.profiling.profiler import (_check_inputs, _first_ramp, _route, assemble_profile, cut_state,
                                   default_batch_sizes, measure_router, summarize)
from e3.profiling.modelled_profile import TX_FIXED_MS
from e3.serving.device.executor import DeviceSettings
from e3.serving.device.timing import time_blocks

if TYPE_CHECKING:
    from e3.models.api import EarlyExitModel

__all__ = ["CudaSettings", "BlockTimer", "BlockTimings", "device_label", "profile_model_cuda", "profile_cuda", "cuda_available",
           "bls_from_run", "measured_hop_ms", "compile_call"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CudaSettings:
    batch_sizes: tuple[int, ...] | None = None   # None: 1, 2, 4, ... up to the model's max batch
    repeats: int = 50                            # timed calls per (block, variant, batch)
    warmup: int = 5                              # untimed calls before them (after the graph's capture)
    precision: str = "fp16"                      # "fp16" (the executor's model.half()) | "fp32"
    graphs: bool = True                          # one CUDA graph per batch bucket (False: eager launches)
    hop_fixed_ms: float = TX_FIXED_MS            # a hop's BLS exchange on the host, when no measured one is given
    bls_ms: tuple[tuple[int, float], ...] = ()   # measured BLS hops with device tensors: (batch, ms) (bls_from_run)
    device: str | None = None                    # device configuration name (None: device_label of the GPU)
    price: float = 1.0                           # its price per hour (relative units unless given)
    seed: int = 0
    torch_device: str = "cuda"                   # "cpu": the same executors eagerly on the CPU (no GPU needed)

    def __post_init__(self) -> None:
        if self.torch_device == "cpu" and (self.graphs or self.precision != "fp32"):
            raise ValueError("torch_device='cpu' (a test of this code without a GPU) needs graphs=False and fp32")
        if self.repeats < 1 or self.warmup < 0:
            raise ValueError(f"repeats must be >= 1 and warmup >= 0, got {self.repeats} and {self.warmup}")
        if self.precision not in ("fp16", "fp32"):
            raise ValueError(f"precision must be fp16 or fp32, got {self.precision!r}")
        if self.hop_fixed_ms < 0:
            raise ValueError(f"hop_fixed_ms must be >= 0, got {self.hop_fixed_ms}")


class BlockTimings(Protocol):
    """Timed repeats of every block and of the stock graph, as the serving executor ran them
    (:class:`e3.serving.device.timing.ExecutorTimings` is the one implementation)."""

    batch_sizes: tuple[int, ...]                   # rows per call, ascending (the executor's buckets)
    block_ms: list[list[np.ndarray]]               # [k-1][i]: repeats (ms) of block k alone, no ramp
    block_ramp_ms: list[list[np.ndarray] | None]   # [k-1][i]: block k with ramp k; None where it has none
    stock_ms: list[np.ndarray]                     # [i]: repeats (ms) of blocks 1..L with the head only
    execution: str                                 # how they ran, for the profile's source


# (model, settings, batch sizes, progress bar or None) -> the timings; model on the CPU as built
BlockTimer = Callable[["EarlyExitModel", "CudaSettings", tuple[int, ...], object], BlockTimings]


def bls_from_run(path, model_name: str) -> tuple[tuple[int, float], ...]:
    """The BLS hop prices a GPU side-by-side run measured for ``model_name`` (its ``side_by_side.json`` or
    folder: ``hops`` rows, :mod:`e3.serving.device.hops`), as (batch, ms) pairs; a clear error when it has none."""
    p = Path(path)
    p = p / "side_by_side.json" if p.is_dir() else p
    doc = json.loads(p.read_text())
    rows = sorted((int(h["max_batch"]), float(h["bls_ms"])) for h in doc.get("hops", [])
                  if h.get("zoo", h.get("model")) == model_name)
    if not rows:
        raise ProfileError(f"{p} holds no measured hop for {model_name} (run benchmarks/gpu_side_by_side.py on the "
                           "GPU host first, or leave --hops out to add the assumed exchange)")
    return tuple(rows)


def measured_hop_ms(measured: tuple[tuple[int, float], ...], batches) -> list[float]:
    """The measured hop at each of ``batches``: interpolated in log2(batch) between the measured batches, the
    nearest measured figure outside them (a BLS call's cost is nearly flat in the batch: 1.64-1.75 ms at
    1-128 rows on the H200, measured when the design was written: docs/design.md §5)."""
    xs = np.log2([b for b, _ in measured])
    ys = [ms for _, ms in measured]
    return [float(np.interp(np.log2(b), xs, ys)) for b in batches]


def device_label(gpu_name: str, precision: str = "fp16", graphs: bool = True) -> str:
    """A device configuration name from the GPU's name: ``"NVIDIA H100 80GB HBM3"`` -> ``"h100"``,
    ``"NVIDIA A100-SXM4-40GB"`` -> ``"a100"``, ``"Tesla V100-SXM2-16GB"`` -> ``"v100"``; a run other
    than the default (FP16, CUDA graphs) says so: ``"h100-eager-fp32"``. Pure."""
    words = [w for w in re.split(r"[\s\-_]+", gpu_name.lower()) if w and w not in ("nvidia", "tesla", "geforce")]
    words = [w + words[i + 1] if w.isalpha() and i + 1 < len(words) and words[i + 1].isdigit() else w
             for i, w in enumerate(words)]     # "RTX 4090" -> "rtx4090"
    model = next((w for w in words if re.fullmatch(r"[a-z]+\d+[a-z]*", w)), words[0] if words else "gpu")
    suffix = ("" if graphs else "-eager") + ("" if precision == "fp16" else f"-{precision}")
    return re.sub(r"[^a-z0-9]", "", model) + suffix


def cuda_available() -> bool:
    try:
        return bool(torch.cuda.is_available())
    except ImportError:     # pragma: no cover - torch is a dependency
        return False


def _sync(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize()


def _timed(calls: dict[str, Callable[[], object]], repeats: int, warmup: int, device: str = "cuda"
           ) -> dict[str, np.ndarray]:
    """Wall-clock ms of each call and a synchronize, ``warmup`` untimed calls of each first, then the
    calls alternating one each."""
    for call in calls.values():
        for _ in range(warmup):
            call()
    _sync(device)
    out = {key: np.empty(repeats) for key in calls}
    for r in range(repeats):
        for key, call in calls.items():
            start = time.perf_counter()
            call()
            _sync(device)
            out[key][r] = (time.perf_counter() - start) * 1e3
    return out


def compile_call(module, inputs: Sequence, settings: CudaSettings) -> Callable[[], object]:
    """One call of ``module`` on ``inputs`` (CUDA tensors) under FP16 autocast or not, captured as one CUDA
    graph (replayed; the inputs stay the graph's static inputs) or eager. Only the GPU admission analogue
    (``benchmarks/admission_gpu.py``) runs this; the profile times the serving executor instead (module
    docstring)."""
    def run():
        with torch.no_grad(), torch.autocast(settings.torch_device, dtype=torch.float16,
                                             enabled=settings.precision == "fp16", cache_enabled=False):
            return module(*inputs)

    if not settings.graphs:
        return run
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):     # warm-up off the default stream, as graph capture requires
        for _ in range(3):
            run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()

    def replay(graph=graph, out=out):     # the static outputs live as long as the call
        graph.replay()
        return out
    return replay


def _state_dtype(triton_dtype: str, settings: CudaSettings):
    """A state tensor's dtype as the executor holds it: floats in half precision under FP16 (its
    ``model.half()``), everything else as the model card declares it."""
    if triton_dtype.startswith("FP") and settings.precision == "fp16":
        return torch.float16
    return getattr(torch, np.dtype(NUMPY_DTYPES[triton_dtype]).name)


def measure_hops_cuda(model: "EarlyExitModel", batches: Sequence[int], settings: CudaSettings):
    """Timings (ms) of a cut's copies (the heaviest cut's state, device -> host -> device, at the
    executor's precision) and of the model inputs' copy host -> device, at each batch size; the fixed
    part is not in them."""
    card = model.card
    dev = settings.torch_device
    tx, tx_in = [], []
    for b in batches:
        state = [torch.zeros((b, *t.shape), dtype=_state_dtype(t.dtype, settings), device=dev)
                 for t in cut_state(card)]
        inputs = [t.cpu() for t in model.example_inputs(b, seed=settings.seed)]
        samples = _timed({"tx": lambda s=state: [x.to("cpu").to(dev) for x in s],
                          "tx_in": lambda i=inputs: [x.to(dev) for x in i]}, settings.repeats, settings.warmup, dev)
        tx.append(samples["tx"])
        tx_in.append(samples["tx_in"])
    return tx, tx_in


def measure_check_cuda(model: "EarlyExitModel", batches: Sequence[int], settings: CudaSettings):
    """Timings (ms) of one exit check of a compact split on the GPU: the ramp's logits to the host, the
    exit rule (``BatchRoute.observe``), the survivors' indices to the device and a gather of their rows
    of the heaviest cut's state."""
    card = model.card
    dev = settings.torch_device
    rng = np.random.default_rng(settings.seed)
    ramp = _first_ramp(card)
    out = []
    for b in batches:
        logits_np, state_np = _check_inputs(card, b, rng)
        logits = torch.from_numpy(logits_np).to(dev)
        state = [torch.from_numpy(x).to(dev, _state_dtype(spec.dtype, settings))
                 for spec, x in zip(cut_state(card), state_np.values())]

        def check(b=b, logits=logits, state=state):
            route = _route(card, b)
            keep = route.observe({ramp: logits.cpu().numpy()})
            idx = torch.from_numpy(np.flatnonzero(keep)).to(dev)
            return [x.index_select(0, idx) for x in state]

        out.append(_timed({"check": check}, max(settings.repeats, 50), settings.warmup, dev)["check"])
    return out


def profile_model_cuda(model_name: str, settings: CudaSettings = CudaSettings(), progress: bool = True,
                       *, untrained: bool = False, time_blocks: BlockTimer) -> LatencyProfile:
    """Measure ``model_name`` on this host's GPU (module docstring); returns the profile.

    ``time_blocks(model, settings, batches, bar)`` times the blocks and the stock graph with the serving
    executor (:func:`profile_cuda` passes the one that does); the rest (hops, the exit check,
    the router) is measured here. Latencies in ms per call of B rows, B in ``settings.batch_sizes``."""
    if settings.torch_device != "cpu" and not cuda_available():
        raise ProfileError("--cuda needs an NVIDIA GPU that PyTorch can use (torch.cuda.is_available() is False "
                           "here); profile the CPU without --cuda, or model GPUs with --modelled")
    model = (resolve_architecture if untrained else resolve_model)(model_name)
    card = model.card
    batches = list(settings.batch_sizes or default_batch_sizes(card.max_batch_size))
    if batches != sorted(set(batches)) or batches[0] < 1 or batches[-1] > card.max_batch_size:
        raise ValueError(f"batch sizes must be ascending within 1..{card.max_batch_size}, got {batches}")
    gpu = torch.cuda.get_device_name() if settings.torch_device != "cpu" else "CPU (a test of this code)"
    device = settings.device or device_label(gpu, settings.precision, settings.graphs)
    torch.manual_seed(settings.seed)
    total = (card.num_blocks + 1) * len(batches)
    with tqdm(total=total, desc=f"profile {served_name(model_name)} on {device}", unit="step",
              disable=not progress) as bar:
        timings = time_blocks(model, settings, tuple(batches), bar)
    if list(timings.batch_sizes) != batches or len(timings.block_ms) != card.num_blocks:
        raise ProfileError(f"the block timer measured batches {list(timings.batch_sizes)} and "
                           f"{len(timings.block_ms)} blocks; asked for {batches} and {card.num_blocks}")
    tx, tx_in = measure_hops_cuda(model, batches, settings)
    check = measure_check_cuda(model, batches, settings)
    router = measure_router(card, batches, max(settings.repeats, 50), warmup=settings.warmup, seed=settings.seed)
    if settings.bls_ms:   # a BLS call with device tensors, measured inside Triton on this GPU: the whole hop
        hop = measured_hop_ms(settings.bls_ms, batches)
        tx_samples = [np.asarray([h]) for h in hop]
        tx_in_samples = [np.asarray(s) + h for s, h in zip(tx_in, hop)]
        tx_text = (f"Tx = a BLS call between two Triton models passing the cut state as a device tensor, MEASURED "
                   f"in Triton on this GPU at batches {[b for b, _ in settings.bls_ms]} (interpolated between them); "
                   f"Tx in = the inputs' copy host->device + that call")
    else:
        fixed = settings.hop_fixed_ms
        tx_samples = [np.asarray(s) + fixed for s in tx]
        tx_in_samples = [np.asarray(s) + fixed for s in tx_in]
        tx_text = (f"Tx = the cut state's copies device->host->device, measured, + {fixed:g} ms for the BLS exchange "
                   f"(assumed, as the modelled profiles); Tx in = the inputs' copy host->device + the same")
    cuda = f" CUDA {torch.version.cuda}" if settings.torch_device != "cpu" else ""
    source = (f"measured on {gpu} ({device}): PyTorch {torch.__version__}{cuda}; blocks and stock graph run by "
              f"{timings.execution}; wall clock with a synchronize per call; {settings.repeats} repeats after "
              f"{settings.warmup} warmup calls, medians, spread = IQR"
              f"{'; random weights (--untrained: latency does not depend on them)' if untrained else ''}; "
              f"{tx_text}; check: "
              f"logits to the host, BatchRoute.observe, survivors' rows gathered on the device; router: this host's "
              f"CPU (numpy, in-process). NOT ONNX Runtime's CUDA provider or TensorRT (not installed on this host)")
    profile = assemble_profile(served_name(model_name), batches, timings.block_ms, with_ramp=timings.block_ramp_ms,
                               tx=tx_samples, device=device, price=settings.price, source=source,
                               check=check, router=router, stock=timings.stock_ms)
    profile.tx_in_ms[device] = [summarize(s).median_ms for s in tx_in_samples]
    profile.validate()
    return profile


def profile_cuda(model_name: str, settings, *, untrained: bool = False, progress: bool = True):
    """``e3 profile MODEL --cuda``: a latency profile of ``model_name`` whose blocks and stock graph are timed
    with the serving executor (:func:`e3.serving.device.timing.time_blocks`: ``prepare_model`` +
    ``make_executor`` at each batch size as a bucket) and written by :func:`profile_model_cuda` (hops, exit
    check, router, the file). ``settings``: a :class:`CudaSettings`. ``e3 profile --cuda`` and
    ``benchmarks/gpu_host.py`` both call it, so every GPU profile times the code that serves."""
    def executor_timer(model, s, batches, bar):
        device = DeviceSettings(device=s.torch_device, precision=s.precision, graphs=s.graphs,
                                max_batch=max(batches), buckets=tuple(batches))
        return time_blocks(model, device, repeats=s.repeats, warmup=s.warmup, seed=s.seed, bar=bar)

    return profile_model_cuda(model_name, settings, progress, untrained=untrained, time_blocks=executor_timer)
