"""One split on one device: blocks ``first..last`` and their computed ramps, run at a batch of ``n`` rows.

One interface (:class:`SplitExecutor`), chosen by what the host has (:func:`make_executor`):

* **CUDA graphs through PyTorch** (a GPU host with PyTorch; the hosts this project was lent have neither
  TensorRT nor ONNX Runtime's CUDA provider): one graph per batch bucket (powers of two up to the max batch,
  and the max batch itself), captured once at start; a call copies the rows into the bucket's static input
  buffers, replays the graph (one launch for the whole split) and returns views of its static outputs.
  A partial batch runs at the next bucket up; its padding rows hold whatever the buffer held (rows are
  independent in these models) and are never read.
* **Eager PyTorch** elsewhere (the CPU): the same module called on the rows, under ``inference_mode``, with
  the intra-op threads pinned by the caller. This is what ``make test`` runs, so the device path's answers
  are checked against the reference on every change.

Where TensorRT or ONNX Runtime's CUDA provider is installed an executor over them would implement the same
two methods; none is written yet because no host at hand has either (docs/gpu.md).

Outputs of one call stay valid until the next call of the same executor (graph outputs are static buffers):
callers copy what they keep (the survivors' gather does).

The GPU latency profile (``e3 profile --cuda``) times these executors as they are
(:mod:`~e3.serving.device.timing`), so the planner prices the execution that serves.
"""

from __future__ import annotations

import abc
import logging
from dataclasses import dataclass
from typing import Sequence

import torch

from e3.models.api import EarlyExitModel, SplitModule
from e3.models.zoo import resolve_architecture, resolve_model

__all__ = ["DeviceSettings", "SplitExecutor", "EagerExecutor", "CudaGraphExecutor", "make_executor", "buckets_for",
           "bucket_for", "prepare_model", "build_model"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeviceSettings:
    device: str = "cpu"        # torch device: "cpu", "cuda", "cuda:1"
    precision: str = "fp32"    # "fp32" | "fp16" (weights and activations in half precision; CUDA only)
    graphs: bool = True        # CUDA graphs per bucket on a GPU (False: eager launches); ignored on the CPU
    max_batch: int = 32        # largest batch a call may carry (rows)
    buckets: tuple[int, ...] | None = None   # batches captured (None: buckets_for(max_batch))

    def __post_init__(self):
        if self.precision not in ("fp32", "fp16"):
            raise ValueError(f"precision must be 'fp32' or 'fp16', got {self.precision!r}")
        if self.precision == "fp16" and not self.device.startswith("cuda"):
            raise ValueError("fp16 runs only on a CUDA device; use precision 'fp32' on the CPU")
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {self.max_batch}")

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def batch_buckets(self) -> tuple[int, ...]:
        return tuple(sorted(self.buckets)) if self.buckets else buckets_for(self.max_batch)


def buckets_for(max_batch: int) -> tuple[int, ...]:
    """Batch buckets a split is captured at: 1, 2, 4, ... below ``max_batch``, and ``max_batch``."""
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return (*out, max_batch)


def bucket_for(buckets: Sequence[int], n: int) -> int:
    """The smallest bucket that holds ``n`` rows."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"a batch of {n} rows is larger than the largest bucket, {buckets[-1]}")


def build_model(name: str, *, seed: int, trained: bool) -> EarlyExitModel:
    """The model a config names: its checkpoint (``trained``), or its architecture with weights drawn from
    ``seed``, so that every process of a comparison holds the same weights."""
    torch.manual_seed(seed)
    return resolve_model(name) if trained else resolve_architecture(name)


def prepare_model(model: EarlyExitModel, settings: DeviceSettings) -> EarlyExitModel:
    """The model on the settings' device and precision (FP16: ``model.half()``, every float weight and the
    float state between blocks in half precision), in eval mode; in place, returned."""
    model = model.to(settings.device).eval()
    return model.half() if settings.precision == "fp16" else model


class SplitExecutor(abc.ABC):
    """Blocks ``first..last`` with their computed ramps (:class:`~e3.models.api.SplitModule`) on a device."""

    buckets: tuple[int, ...]

    @abc.abstractmethod
    def run(self, chunks: Sequence[Sequence[torch.Tensor]], n: int) -> tuple[torch.Tensor, ...]:
        """Run ``n`` rows given as ``chunks`` (each a tuple of tensors aligned with the split's inputs, rows
        first; their rows add up to ``n``). Returns the split's outputs for those rows in order: the state
        after ``last`` (omitted after the head), then the logits of every computed ramp, ascending. Views,
        valid until the next call."""


class EagerExecutor(SplitExecutor):
    def __init__(self, module: SplitModule, settings: DeviceSettings):
        self.module, self.settings = module, settings
        self.buckets = settings.batch_buckets

    def run(self, chunks, n):
        with torch.inference_mode():
            inputs = [c[0].to(self.settings.device) if len(chunks) == 1 else
                      torch.cat([chunk[i] for chunk in chunks]).to(self.settings.device)
                      for i, c in enumerate(zip(*chunks))]
            return tuple(self.module(*inputs))


class CudaGraphExecutor(SplitExecutor):
    """One CUDA graph per bucket (module docstring)."""

    def __init__(self, module: SplitModule, settings: DeviceSettings, warmup: int = 2):
        self.module, self.settings = module, settings
        self.buckets = settings.batch_buckets
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, list[torch.Tensor], tuple[torch.Tensor, ...]]] = {}
        specs = module.input_specs
        dtype = torch.float16 if settings.precision == "fp16" else torch.float32
        self.pool = torch.cuda.graph_pool_handle()   # buckets share one memory pool: only one runs at a time
        with torch.inference_mode():
            for b in reversed(self.buckets):   # largest first: the pool is sized once
                static = [torch.zeros((b, *spec.shape), device=settings.device,
                                      dtype=torch_dtype(spec.dtype, dtype)) for spec in specs]
                side = torch.cuda.Stream(device=settings.device)
                side.wait_stream(torch.cuda.current_stream(settings.device))
                with torch.cuda.stream(side):
                    for _ in range(warmup):
                        module(*static)
                torch.cuda.current_stream(settings.device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    outs = tuple(module(*static))
                self.graphs[b] = (graph, static, outs)

    def run(self, chunks, n):
        graph, static, outs = self.graphs[bucket_for(self.buckets, n)]
        at = 0
        with torch.inference_mode():   # the static buffers are inference tensors
            for chunk in chunks:
                m = chunk[0].shape[0]
                for buf, x in zip(static, chunk):
                    buf[at:at + m].copy_(x, non_blocking=True)
                at += m
            if at != n:
                raise ValueError(f"chunks hold {at} rows, the call says {n}")
            graph.replay()
            return tuple(o[:n] for o in outs)


def torch_dtype(triton_dtype: str, float_dtype: torch.dtype) -> torch.dtype:
    """A state or input tensor's dtype on the device: floats at the run's precision, integers as declared."""
    if triton_dtype.startswith("FP"):
        return float_dtype
    return {"INT64": torch.int64, "INT32": torch.int32, "BOOL": torch.bool, "UINT8": torch.uint8}[triton_dtype]


def make_executor(model: EarlyExitModel, first: int, last: int, *, ramps: tuple[int, ...],
                  settings: DeviceSettings) -> SplitExecutor:
    """The executor for one split of ``model`` (already on the device, :func:`prepare_model`): CUDA graphs
    on a GPU with ``settings.graphs``, eager PyTorch otherwise."""
    module = SplitModule(model, first, last, ramps)
    if settings.cuda and settings.graphs:
        return CudaGraphExecutor(module, settings)
    return EagerExecutor(module, settings)
