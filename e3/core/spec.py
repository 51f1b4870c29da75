"""What crosses a boundary about a model: tensor specs and the model card.

The model card is everything the router, the exporter and the planner need to
know about an early-exit model without importing torch: how many blocks, which
blocks carry a ramp, the input and cut ("state") tensors, the number of
classes and the default exit rule.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from e3.core.exits import rule_config
from e3.core.names import ramp_output, ramps_in_range, state_output

__all__ = ["TensorSpec", "ModelCard", "NUMPY_DTYPES", "dtype_from_config", "config_dtype", "answer_specs",
           "cast_exact"]

# Triton datatype name (the protocol's, as tritonclient writes it) -> numpy dtype name.
NUMPY_DTYPES = {
    "FP32": "float32",
    "FP16": "float16",
    "INT64": "int64",
    "INT32": "int32",
    "INT8": "int8",
    "UINT8": "uint8",
    "BOOL": "bool",
    "BYTES": "object",
}


def dtype_from_config(data_type: str) -> str:
    """A model config's ``data_type`` (``TYPE_FP32``, ``TYPE_STRING``) -> the protocol's name (``FP32``, ``BYTES``).

    Raises ValueError for a type the project does not handle.
    """
    name = data_type.removeprefix("TYPE_")
    name = "BYTES" if name == "STRING" else name
    if name not in NUMPY_DTYPES:
        raise ValueError(f"unsupported Triton datatype {data_type!r}; supported: {sorted(NUMPY_DTYPES)}")
    return name


def config_dtype(dtype: str) -> str:
    """Inverse of :func:`dtype_from_config`: ``FP32`` -> ``TYPE_FP32``, ``BYTES`` -> ``TYPE_STRING``."""
    if dtype not in NUMPY_DTYPES:
        raise ValueError(f"unsupported Triton datatype {dtype!r}; supported: {sorted(NUMPY_DTYPES)}")
    return f"TYPE_{'STRING' if dtype == 'BYTES' else dtype}"


def cast_exact(name: str, array: np.ndarray, dtype: str) -> np.ndarray:
    """``array`` as the Triton datatype ``dtype`` (``FP32``, ``INT64``, ...): unchanged when it already is, converted
    when no value changes in the conversion (float64 holding float32 values, int32 token ids for INT64, ...),
    else ``ValueError`` naming the input ``name``, how many values would change and the first, and the fix.
    Text (``BYTES``) is left as it is. One piece of code for the client (:class:`e3.client.sdk.E3Client`) and
    data files (:mod:`e3.models.user_data`); Triton itself refuses any datatype but the config's.

    Decision: a value that would round (float64's 0.1 is not a float32) is refused, not rounded: the answer
    would be that of another input, and whether that is close enough is the caller's to say."""
    array = np.asarray(array)
    want = np.dtype(NUMPY_DTYPES[dtype])
    if array.dtype == want or want == np.dtype(object) or array.dtype.kind not in "biuf":
        return array
    with np.errstate(invalid="ignore", over="ignore"):
        out = array.astype(want)
        back = out.astype(array.dtype)
    same = (back == array) | (np.isnan(array) & np.isnan(back)) if array.dtype.kind == "f" else back == array
    if array.dtype.kind == "f" and want.kind in "iub":   # -0.0 -> 0 and NaN -> anything are not exact for ints
        same &= np.isfinite(array)
    if same.all():
        return out
    bad = np.flatnonzero(~same.reshape(-1))
    first = np.unravel_index(bad[0], array.shape)
    raise ValueError(f"input '{name}' is {array.dtype} and the model takes {dtype} ({want}): {len(bad)} of its "
                     f"{array.size} values would change in the conversion (row {first[0]}: "
                     f"{array[first]!r} -> {out[first]!r}); send {want} yourself (`{name}.astype(np.{want})`) "
                     "if that rounding is what you mean")


@dataclass(frozen=True)
class TensorSpec:
    name: str                 # tensor name, as in the ONNX graph and config.pbtxt
    dtype: str                # Triton datatype: "FP32", "INT64", ...
    shape: tuple[int, ...]    # shape WITHOUT the batch dimension
    # Inclusive range of values a served model accepts (token ids: [0, vocab - 1]); None: any finite
    # value. Checked by e3.serving.input_policy.
    bounds: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        if self.dtype not in NUMPY_DTYPES:
            raise ValueError(f"tensor {self.name!r}: unknown datatype {self.dtype!r}; "
                             f"use one of {sorted(NUMPY_DTYPES)}")
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        if self.bounds is not None:
            low, high = self.bounds
            if not low <= high:
                raise ValueError(f"tensor {self.name!r}: bounds {self.bounds} are empty (low > high)")
            object.__setattr__(self, "bounds", (low, high))

    @property
    def numpy_dtype(self) -> str:
        return NUMPY_DTYPES[self.dtype]

    def to_dict(self) -> dict[str, Any]:
        d = {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}
        return d if self.bounds is None else {**d, "bounds": list(self.bounds)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TensorSpec":
        bounds = d.get("bounds")
        return cls(name=d["name"], dtype=d["dtype"], shape=tuple(d["shape"]),
                   bounds=tuple(bounds) if bounds is not None else None)


@dataclass(frozen=True)
class ModelCard:
    name: str                        # zoo name or "package.module:factory"
    num_blocks: int                  # L: blocks are numbered 1..L
    ramp_blocks: tuple[int, ...]     # blocks followed by a ramp (excluding L, whose ramp is the final head)
    num_classes: int                 # C: size of every ramp's and the head's output
    inputs: tuple[TensorSpec, ...]   # the model's raw inputs (what split 1 takes)
    state: tuple[TensorSpec, ...]    # tensors carried across a cut (what split k>1 takes)
    # default exit rule, see e3.core.exits: its dict form, or an ExitRule (stored as its dict form)
    exit_rule: dict[str, Any] = field(default_factory=dict)
    max_batch_size: int = 64         # largest batch a split accepts
    max_seq_len: int | None = None   # text models: inputs are padded/truncated to this length
    preprocess: str | None = None    # front-door preprocessing: "minilm" (WordPiece text -> ids/mask) or None
    # Shapes of the state tensors after block k (0: after the stem) where they change
    # from block to block (CNNs); absent: ``state``'s shapes hold at every cut.
    state_shapes: dict[int, tuple[tuple[int, ...], ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        bad = [k for k in self.ramp_blocks if not 1 <= k < self.num_blocks]
        if bad:
            raise ValueError(f"model {self.name}: ramp blocks {bad} outside 1..{self.num_blocks - 1}")
        object.__setattr__(self, "ramp_blocks", tuple(sorted(set(self.ramp_blocks))))
        if not isinstance(self.exit_rule, dict):   # an ExitRule object: the card carries its dict form
            object.__setattr__(self, "exit_rule", rule_config(self.exit_rule))
        object.__setattr__(self, "inputs", tuple(self.inputs))
        object.__setattr__(self, "state", tuple(self.state))

    def state_after(self, k: int) -> tuple[TensorSpec, ...]:
        """Specs of the state a cut after block ``k`` carries (k = 0: the stem's output)."""
        shapes = self.state_shapes.get(k)
        if shapes is None:
            return self.state
        return tuple(TensorSpec(t.name, t.dtype, shape, t.bounds) for t, shape in zip(self.state, shapes))

    def split_ramps(self, first: int, last: int, enabled: tuple[int, ...] | set[int]) -> tuple[int, ...]:
        """Ramps a split over blocks first..last computes: the enabled ones inside it, and the
        final head (block L) when the split holds it; ascending."""
        inner = ramps_in_range(enabled, first, last, num_blocks=self.num_blocks)
        return (*inner, *((self.num_blocks,) if last == self.num_blocks else ()))

    def split_outputs(self, first: int, last: int, enabled: tuple[int, ...] | set[int]) -> list[str]:
        """Output names of that split: the state it hands on (unless it holds block L), then its ramps."""
        state = [state_output(t.name) for t in self.state] if last < self.num_blocks else []
        return state + [ramp_output(k) for k in self.split_ramps(first, last, enabled)]

    @property
    def exit_blocks(self) -> tuple[int, ...]:
        """Every block whose output can answer: the ramps, then the final head at L."""
        return (*self.ramp_blocks, self.num_blocks)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["inputs"] = [t.to_dict() for t in self.inputs]
        d["state"] = [t.to_dict() for t in self.state]
        d["ramp_blocks"] = list(self.ramp_blocks)
        d["state_shapes"] = {str(k): [list(s) for s in v] for k, v in self.state_shapes.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelCard":
        d = dict(d)
        d["inputs"] = tuple(TensorSpec.from_dict(t) for t in d["inputs"])
        d["state"] = tuple(TensorSpec.from_dict(t) for t in d["state"])
        d["ramp_blocks"] = tuple(d["ramp_blocks"])
        d["state_shapes"] = {int(k): tuple(tuple(s) for s in v) for k, v in d.get("state_shapes", {}).items()}
        return cls(**d)


def answer_specs(card: ModelCard) -> tuple[TensorSpec, ...]:
    """The front door's answer tensors (docs/design.md §2)."""
    return (TensorSpec("label", "INT64", (1,)), TensorSpec("exit_ramp", "INT32", (1,)),
            TensorSpec("probs", "FP32", (card.num_classes,)))
