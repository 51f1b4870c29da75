"""Names shared by every part (docs/design.md §2).

A zoo model ``bert-ee`` is served as ``bert_ee``; blocks are numbered 1..L; a
split is named by its block range, ``<m>_split_<first>-<last>``, so that a new
plan adds models beside the ones still serving instead of replacing them.
"""

from __future__ import annotations

import re

__all__ = [
    "ANSWERING",
    "INPUT_BOUNDS",
    "SIDE_BY_SIDE",
    "BASELINES",
    "DEVICE_SYSTEMS",
    "SHIPPED_MODELS_DIR",
    "WEIGHTS_FILE",
    "CutError",
    "served_name",
    "split_name",
    "router_name",
    "stock_name",
    "ee_name",
    "preprocess_name",
    "parse_cuts",
    "ranges_from_cuts",
    "ramps_in_range",
    "parse_split_name",
    "ramp_output",
    "state_output",
    "zoo_name_of",
    "block_file",
]

# What e3 export ships beside a router that runs the model itself (the device form, e3.serving.device.router):
SHIPPED_MODELS_DIR = "e3_models"        # a user's model module (Triton's stub ignores PYTHONPATH)
WEIGHTS_FILE = "weights.safetensors"   # the model's state dict

# How a model that answers after execute answers (parameter "answering" of the device router and E²bird's stage):
# "continuous" (execute admits, one engine thread computes and answers: e3.serving.device.continuous), the
# default, or "inline" (the labelled fallback: execute runs its own requests out).
ANSWERING = ("continuous", "inline")

# The config parameter carrying a model's inputs' value bounds (JSON: input name -> [low, high], inclusive), written
# by the exporter and read by every served model's input policy (e3.serving.triton_io.io_specs).
INPUT_BOUNDS = "input_bounds"

# The one registry of the systems a comparison serves (the device models' ``system``/``role`` parameter, the GPU
# side-by-side's rows): E3 and its two baselines, the stock model and the naive early-exit model; the device
# models add E²bird's admission stage (e3.serving.ebird).
BASELINES = ("stock", "ee")
SIDE_BY_SIDE = ("e3", *BASELINES)
DEVICE_SYSTEMS = (*SIDE_BY_SIDE, "admission")

_SERVED = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")
_SPLIT = re.compile(r"^(?P<m>.+)_split_(?P<first>\d+)-(?P<last>\d+)$")


class CutError(ValueError):
    """Cut points that do not describe a legal set of splits."""


def served_name(model: str) -> str:
    """Triton name of a zoo model: ``bert-ee`` -> ``bert_ee``.

    A ``package.module:factory`` reference is served under its factory's name.
    """
    base = model.rsplit(":", 1)[-1].replace("-", "_").replace(".", "_")
    if not _SERVED.match(base):
        raise ValueError(f"cannot derive a Triton model name from {model!r}: "
                         "use letters, digits, '-' and '_', starting with a letter")
    return base


def split_name(m: str, first: int, last: int) -> str:
    """``<m>_split_<first>-<last>`` for the split holding blocks first..last (1-based, inclusive)."""
    if not 1 <= first <= last:
        raise CutError(f"a split needs 1 <= first <= last, got {first}-{last}")
    return f"{m}_split_{first}-{last}"


def parse_split_name(name: str) -> tuple[str, int, int]:
    """Inverse of :func:`split_name`: ``bert_ee_split_1-2`` -> ``("bert_ee", 1, 2)``."""
    match = _SPLIT.match(name)
    if not match:
        raise ValueError(f"{name!r} is not a split name (<model>_split_<first>-<last>)")
    return match["m"], int(match["first"]), int(match["last"])


def router_name(m: str) -> str:
    return f"{m}_router"


def stock_name(m: str) -> str:
    return f"{m}_stock"


def ee_name(m: str) -> str:
    return f"{m}_ee"


def preprocess_name(m: str) -> str:
    return f"{m}_preprocess"


def parse_cuts(cuts: str | list[int] | tuple[int, ...] | None, num_blocks: int) -> list[int]:
    """Validate cut points: a cut ``c`` splits after block ``c``; legal cuts are 1..L-1.

    Accepts ``"2,4"``, ``[2, 4]``, ``""`` or ``None`` (no cut: one split).
    Raises :class:`CutError` naming the problem (out of range, unsorted, duplicated).
    """
    if cuts is None:
        return []
    if isinstance(cuts, str):
        text = cuts.strip()
        if not text:
            return []
        try:
            values = [int(part) for part in text.split(",")]
        except ValueError:
            raise CutError(f"cuts must be comma-separated block numbers like '2,4', got {cuts!r}") from None
    else:
        values = [int(v) for v in cuts]
    for c in values:
        if not 1 <= c <= num_blocks - 1:
            raise CutError(f"cut {c} is out of range: a model with {num_blocks} blocks "
                           f"can be cut after blocks 1..{num_blocks - 1}")
    if len(set(values)) != len(values):
        raise CutError(f"cuts {values} repeat a cut point (that would make an empty split)")
    if values != sorted(values):
        raise CutError(f"cuts {values} are not in increasing order; write {sorted(values)}")
    return values


def ranges_from_cuts(cuts: list[int], num_blocks: int) -> list[tuple[int, int]]:
    """Cuts after blocks ``cuts`` -> inclusive block ranges: ``[2,4], L=6 -> [(1,2),(3,4),(5,6)]``."""
    cuts = parse_cuts(cuts, num_blocks)
    edges = [0, *cuts, num_blocks]
    return [(edges[i] + 1, edges[i + 1]) for i in range(len(edges) - 1)]


def ramps_in_range(ramps, first: int, last: int, *, num_blocks: int | None = None) -> tuple[int, ...]:
    """The ramps of ``ramps`` that lie in blocks ``first..last`` (inclusive), ascending and distinct.

    With ``num_blocks`` (L) given, the final head (block L) is left out: it is
    not a ramp a plan can enable or disable.
    """
    return tuple(sorted({int(k) for k in ramps
                         if first <= int(k) <= last and (num_blocks is None or int(k) < num_blocks)}))


def ramp_output(k: int) -> str:
    """Name of the logits output of the ramp after block ``k`` (``ramp_<k>``; the head is ``ramp_<L>``)."""
    return f"ramp_{k}"


def state_output(name: str) -> str:
    """Split output carrying state tensor ``name`` across a cut (``hidden`` -> ``hidden_out``).

    Outputs need names distinct from inputs: a tensor that passes through a
    split unchanged (the attention mask) is both.
    """
    return f"{name}_out"


def zoo_name_of(served: str, zoo_names) -> str:
    """The zoo model behind a served name: ``tiny_ee_router`` -> ``tiny-ee``, ``bert_stock`` ->
    ``bert-stock``; the longest zoo name that is the served name or its prefix wins."""
    for name in sorted(zoo_names, key=len, reverse=True):
        base = served_name(name)
        if served == base or served.startswith(base + "_"):
            return name
    raise ValueError(f"cannot tell which zoo model {served!r} serves; pass --inputs-from MODEL or --workload FILE")


def block_file(k: int, ramp: bool = False) -> str:
    """Block k as an ONNX file (block 1 with the stem, block L with the head), in the router's version
    folder: what the router runs itself for a compact split; ``ramp``: with its ramp's logits too (one
    ONNX Runtime call for both, as ``<m>_ee`` runs them)."""
    return f"block_{k}{'_ramp' if ramp else ''}.onnx"
