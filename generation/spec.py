"""What the generation engine is given and gives back: the served model (:class:`EngineSpec`), a request
(:class:`GenRequest`, checked against the spec), a finished sequence (:class:`Finished`), and the names of the
models it calls. Pure data, no numpy beyond the request check; :mod:`e3.generation.engine` runs them."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from e3.core.names import split_name

__all__ = ["EngineSpec", "GenRequest", "Finished", "MODES", "MEASURES", "ON_SLOWER", "kvfill_name"]

MODES = ("calm", "full", "speculative")
MEASURES = ("softmax", "saturation", "classifier")   # CALM's confidence measures; the last two skip the head
ON_SLOWER = ("fallback", "refuse", "serve")   # a CALM request predicted slower than plain decoding: what to do
REFRESH_STEPS = 32                            # steps between refits of the served costs


def kvfill_name(model: str, first: int, last: int) -> str:
    """Triton name of the kv-fill model of layers first..last."""
    return f"{model}_kvfill_{first}-{last}"


@dataclass(frozen=True)
class EngineSpec:
    model: str                          # served name prefix, e.g. "smollm2_ee"
    ranges: tuple[tuple[int, int], ...]  # split layer ranges, 1..L, a ramp after each but the last
    kv_heads: int
    head_dim: int
    max_active: int = 16                # sequences decoded together (1: the naive form)
    eos_id: int | None = None
    max_context: int = 2048             # prompt + new tokens, per sequence
    vocab_size: int | None = None       # token ids must lie in [0, vocab_size)
    kv_in_splits: bool = False          # the splits keep the cache (e3.generation.kv_store), not the engine
    split_model: str | None = None      # name prefix of the split models (default: model)
    full_layers: int | None = None      # the model's L when ``ranges`` stop early (a partially loaded model)
    costs: dict | None = None           # measured costs (policy.Costs.to_dict): speculation adapts when set
    calibration: dict | None = None     # min_agreement targets -> measure, thresholds (calibration.calibrate)

    @property
    def num_layers(self) -> int:
        """The last layer served: the final head sits after it (an exit head when the model is partial)."""
        return self.ranges[-1][1]

    def truncated(self, depth: int) -> "EngineSpec":
        """This model **partially loaded** up to exit layer ``depth`` (HELIOS): the splits up to it, whose last
        head answers every token that reaches it (the same as
        :func:`e3.generation.reference.generate_early_exit` with ``depth``)."""
        full = self.full_layers or self.num_layers
        if depth == full:
            return self
        keep = tuple(r for r in self.ranges if r[1] <= depth)
        if not keep or keep[-1][1] != depth:
            raise ValueError(f"depth {depth} is not the end of a split of {self.model} {list(self.ranges)}")
        return replace(self, ranges=keep, full_layers=full)

    def split(self, j: int) -> str:
        """Served name of split j (0-based)."""
        return split_name(self.split_model or self.model, *self.ranges[j])

    def to_dict(self) -> dict:
        return {"model": self.model, "ranges": [list(r) for r in self.ranges], "kv_heads": self.kv_heads,
                "head_dim": self.head_dim, "max_active": self.max_active, "eos_id": self.eos_id,
                "max_context": self.max_context, "vocab_size": self.vocab_size, "kv_in_splits": self.kv_in_splits,
                "split_model": self.split_model, "full_layers": self.full_layers, "costs": self.costs,
                "calibration": self.calibration}

    @classmethod
    def from_dict(cls, d: dict) -> "EngineSpec":
        return cls(**{**d, "ranges": tuple(tuple(r) for r in d["ranges"])})


@dataclass
class GenRequest:
    request_id: object                  # the caller's handle, returned in Finished
    prompt: list[int]                   # token ids, at least one
    max_new_tokens: int
    mode: str = "calm"                  # one of MODES
    tau: float = 0.9                    # CALM threshold at every exit (calm mode, unless ``thresholds``)
    draft_tokens: int = 4               # most tokens drafted per verification (speculative mode)
    measure: str = "softmax"            # CALM confidence measure, one of MEASURES
    thresholds: tuple[float, ...] | None = None   # per ramp (split order), instead of ``tau``
    min_agreement: float | None = None  # quality target: measure and thresholds from the spec's calibration
    on_slower: str = "fallback"         # predicted slower than plain: decode plainly, refuse, or serve as asked
    note: dict = field(default_factory=dict)   # how it is served (mode, fallback and why, predicted speed-up)

    def check(self, spec: EngineSpec) -> None:
        """Raise ValueError naming what is wrong with this request."""
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, not {self.mode!r}")
        if not self.prompt:
            raise ValueError("empty prompt: at least one token is needed")
        bad = [t for t in self.prompt if t < 0 or (spec.vocab_size is not None and t >= spec.vocab_size)]
        if bad:
            raise ValueError(f"token ids out of the vocabulary [0, {spec.vocab_size}): {bad[:5]}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if len(self.prompt) + self.max_new_tokens > spec.max_context:
            raise ValueError(f"prompt ({len(self.prompt)} tokens) + max_new_tokens ({self.max_new_tokens}) exceeds "
                             f"the context of {spec.max_context}")
        if self.mode == "speculative" and self.draft_tokens < 1:
            raise ValueError(f"draft_tokens must be >= 1, got {self.draft_tokens}")
        if np.isnan(self.tau):
            raise ValueError(f"tau must be a number, got {self.tau}")
        if self.measure not in MEASURES:
            raise ValueError(f"measure must be one of {', '.join(MEASURES)}, not {self.measure!r}")
        if self.on_slower not in ON_SLOWER:
            raise ValueError(f"on_slower must be one of {', '.join(ON_SLOWER)}, not {self.on_slower!r}")
        if self.thresholds is not None and len(self.thresholds) != len(spec.ranges) - 1:
            raise ValueError(f"thresholds needs one value per exit ({len(spec.ranges) - 1}), got {len(self.thresholds)}")

    def threshold(self, j: int) -> float:
        """CALM threshold at ramp j (after split j); above 1 never exits."""
        return float(self.tau if self.thresholds is None else self.thresholds[j])


@dataclass
class Finished:
    request_id: object
    tokens: list[int]                   # new tokens
    exit_layers: list[int]              # per token: the layer whose head chose it (L: final head)
    ttft_s: float                       # admission to first token
    total_s: float                      # admission to last token
    error: str | None = None            # set when the sequence failed (then tokens may be partial)
    confidences: list[float] = field(default_factory=list)   # per token: its head's softmax margin
    note: dict = field(default_factory=dict)   # how it was served (GenRequest.note)
