"""Build TensorRT engines (``model.plan``) from ONNX splits, for Triton's ``tensorrt_plan`` platform.

Used by ``e3 export --target ngc --format tensorrt``. The engine has one
optimisation profile over the batch dimension: min 1, opt = the plan's batch
size for the split, max = the model card's ``max_batch_size``; every other
dimension is fixed by the card. FP16 is optional.

TensorRT is the optional ``gpu`` extra and is imported only when an engine is
built. An engine is tied to the GPU model and the TensorRT version that built
it: build on the kind of GPU that will serve it, with the TensorRT version of
the Triton image that will load it (docs/ngc.md).

Precision: TensorRT <= 10 enables FP16 kernels with ``BuilderFlag.FP16``.
TensorRT 11 removed that flag (networks are strongly typed: an FP16 engine
needs an ONNX file already converted to mixed precision, e.g. by ModelOpt
AutoCast); with TensorRT 11, ``fp16=True`` is refused with that explanation
rather than silently building FP32.

Nothing in this module has been run on a GPU in this project (no machine
had one); everything up to ``build_serialized_network`` is unit-tested with a
recording stand-in for the ``tensorrt`` module.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Sequence

from e3.core.files import write_atomic
from e3.core.spec import TensorSpec

__all__ = ["TensorRTError", "ShapeProfile", "EngineSettings", "optimisation_profile", "import_tensorrt",
           "configure_builder", "build_engine"]

log = logging.getLogger(__name__)


class TensorRTError(RuntimeError):
    """An engine that cannot be built; the message says why and what to do."""


@dataclass(frozen=True)
class ShapeProfile:
    name: str                  # input tensor name
    min: tuple[int, ...]       # smallest shape the engine accepts (batch first)
    opt: tuple[int, ...]       # shape TensorRT tunes its kernels for
    max: tuple[int, ...]       # largest shape the engine accepts


@dataclass(frozen=True)
class EngineSettings:
    opt_batch: int             # the plan's batch size for this split (kernels are tuned for it)
    max_batch: int             # the model card's max_batch_size (config.pbtxt's max_batch_size)
    min_batch: int = 1
    fp16: bool = False         # FP16 kernels allowed (TensorRT <= 10; see the module docstring)
    workspace_mb: int = 1024   # builder workspace memory pool limit (MiB)

    def __post_init__(self) -> None:
        if not 1 <= self.min_batch <= self.opt_batch <= self.max_batch:
            raise TensorRTError(f"optimisation profile needs 1 <= min <= opt <= max batch, got "
                                f"{self.min_batch} / {self.opt_batch} / {self.max_batch}")
        if self.workspace_mb < 1:
            raise TensorRTError(f"workspace_mb must be >= 1, got {self.workspace_mb}")


def optimisation_profile(inputs: Sequence[TensorSpec], settings: EngineSettings) -> list[ShapeProfile]:
    """One :class:`ShapeProfile` per input: batch min/opt/max from ``settings``, the rest from the spec."""
    shapes = []
    for t in inputs:
        if any(d < 1 for d in t.shape):
            raise TensorRTError(f"input {t.name!r} has a variable dimension {t.shape}; only the batch may vary")
        shapes.append(ShapeProfile(t.name, (settings.min_batch, *t.shape), (settings.opt_batch, *t.shape),
                                   (settings.max_batch, *t.shape)))
    return shapes


def import_tensorrt() -> ModuleType:
    """The ``tensorrt`` module, or a :class:`TensorRTError` saying how to get it."""
    try:
        import tensorrt   # deferred: an optional dependency (the `gpu` extra), imported only to build an engine
    except ImportError as err:
        raise TensorRTError(
            "TensorRT is not installed (it is the optional `gpu` extra: pip install '.[gpu]' on a machine with an "
            "NVIDIA GPU, using the TensorRT version of the Triton image that will serve the engines); "
            f"import failed: {err}") from None
    return tensorrt


def configure_builder(trt: Any, builder: Any, shapes: Sequence[ShapeProfile], *, settings: EngineSettings) -> Any:
    """The builder config: workspace limit, precision, one optimisation profile over ``shapes``."""
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, settings.workspace_mb << 20)
    if settings.fp16:
        if not hasattr(trt.BuilderFlag, "FP16"):
            raise TensorRTError(
                f"TensorRT {getattr(trt, '__version__', '?')} has no BuilderFlag.FP16 (removed in TensorRT 11: "
                "networks are strongly typed); convert the ONNX split to mixed precision first (ModelOpt AutoCast) "
                "or build without fp16")
        config.set_flag(trt.BuilderFlag.FP16)
    profile = builder.create_optimization_profile()
    for s in shapes:
        profile.set_shape(s.name, s.min, s.opt, s.max)
    config.add_optimization_profile(profile)
    return config


def build_engine(onnx_path: str | os.PathLike, plan_path: str | os.PathLike, inputs: Sequence[TensorSpec],
                 *, settings: EngineSettings, trt: Any = None) -> Path:
    """Parse ``onnx_path``, build a serialized engine and write it to ``plan_path`` (atomically).

    ``inputs``: the split's input specs (batch dimension excluded), which must
    be the ONNX graph's inputs. ``trt``: the tensorrt module (imported if None).
    """
    trt = trt if trt is not None else import_tensorrt()
    shapes = optimisation_profile(inputs, settings)
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)  # explicit batch is the only mode since TensorRT 10
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise TensorRTError(f"TensorRT cannot parse {onnx_path}: {errors or 'no details'}")
    graph_inputs = [network.get_input(i).name for i in range(network.num_inputs)]
    if sorted(graph_inputs) != sorted(s.name for s in shapes):
        raise TensorRTError(f"{onnx_path} has inputs {graph_inputs}, the split's description has "
                            f"{[s.name for s in shapes]}")
    config = configure_builder(trt, builder, shapes, settings=settings)
    log.info("building TensorRT engine %s (batch %d/%d/%d, fp16=%s)", plan_path, settings.min_batch,
             settings.opt_batch, settings.max_batch, settings.fp16)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise TensorRTError(f"TensorRT could not build an engine from {onnx_path} (see the TensorRT log above)")
    return write_atomic(plan_path, bytes(serialized))
