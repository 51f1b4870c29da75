"""What the ExeGPT simulator is fed: a per-layer latency profile and sequence-length distributions.

Pure Python (no numpy, no torch): the scheduler loads and tests in milliseconds.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

__all__ = ["LayerProfile", "LengthDistribution"]


def _interp(xs: tuple[float, ...], ys: tuple[float, ...], x: float) -> float:
    """Piecewise-linear interpolation; linear extrapolation from the two end points outside the range.

    Extrapolation (rather than clamping) keeps the cost strictly growing past the last profiled size, so a
    schedule slightly beyond the profile is not predicted to be free.
    """
    if len(xs) == 1:
        return ys[0] * x / xs[0]
    i = bisect.bisect_left(xs, x)
    i = min(max(i, 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


def _points(d: dict, key: str, what: str) -> tuple[tuple[float, ...], tuple[float, ...]]:
    try:
        xs, ys = tuple(float(v) for v in d[key]), tuple(float(v) for v in d["ms"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"profile {what!r} needs lists {key!r} and 'ms' of numbers ({e})") from None
    if not xs or len(xs) != len(ys):
        raise ValueError(f"profile {what!r}: {key!r} and 'ms' must be non-empty and of equal length")
    if any(b <= a for a, b in zip(xs, xs[1:])) or xs[0] <= 0:
        raise ValueError(f"profile {what!r}: {key!r} must be positive and strictly increasing, got {xs}")
    if any(y < 0 or not math.isfinite(y) for y in ys):
        raise ValueError(f"profile {what!r}: 'ms' must be finite and >= 0, got {ys}")
    return xs, ys


@dataclass(frozen=True)
class LayerProfile:
    """Latency of ONE decoder layer, measured on the served runtime.

    ``prefill_ms(tokens)``: one layer over a prefill chunk holding ``tokens`` prompt tokens in total (all
    sequences of the chunk together). ``decode_ms(batch)``: one layer, one decode step for ``batch`` rows.
    Both are piecewise linear in the profiled points. Decision: decode cost does not depend on the context
    length (ExeGPT profiles one layer per batch size too); on SmolLM2 at the lengths served here the
    attention over the cache is a small share of a layer. ``overhead_ms`` is a fixed cost per model
    iteration (one per prefill or decode pass over all layers: the engine's bookkeeping and hops).
    ``head_call_ms(rows)``: the final head, paid once per pass for the rows that read it (optional).
    """

    num_layers: int                       # decoder layers L
    prefill_tokens: tuple[float, ...]     # profiled chunk sizes (tokens), increasing
    prefill_ms: tuple[float, ...]         # per-layer latency at each chunk size (ms)
    decode_batch: tuple[float, ...]       # profiled decode batch sizes (rows), increasing
    decode_ms: tuple[float, ...]          # per-layer latency of one decode step at each batch (ms)
    overhead_ms: float = 0.0              # per pass over all layers (ms)
    head_batch: tuple[float, ...] = ()    # profiled row counts of the final head (empty: the head is free)
    head_ms: tuple[float, ...] = ()       # the final head (norm + LM head + argmax) at each row count (ms)

    @classmethod
    def from_dict(cls, d: dict) -> "LayerProfile":
        """Build from ``{"num_layers": L, "prefill": {"tokens": [...], "ms": [...]}, "decode": {"batch":
        [...], "ms": [...]}, "overhead_ms": x, "head": {"batch": [...], "ms": [...]}}`` (the profiler's JSON;
        ``overhead_ms`` and ``head`` optional); errors name the bad field."""
        if not isinstance(d, dict):
            raise ValueError("profile must be a JSON object")
        try:
            num_layers = int(d["num_layers"])
        except (KeyError, TypeError, ValueError):
            raise ValueError("profile needs an integer 'num_layers'") from None
        if num_layers < 1:
            raise ValueError(f"profile 'num_layers' must be >= 1, got {num_layers}")
        pt, pm = _points(d.get("prefill", {}), "tokens", "prefill")
        db, dm = _points(d.get("decode", {}), "batch", "decode")
        overhead = float(d.get("overhead_ms", 0.0))
        if overhead < 0:
            raise ValueError(f"profile 'overhead_ms' must be >= 0, got {overhead}")
        hb, hm = _points(d["head"], "batch", "head") if d.get("head") else ((), ())
        return cls(num_layers, pt, pm, db, dm, overhead, hb, hm)

    def to_dict(self) -> dict:
        return {"num_layers": self.num_layers,
                "prefill": {"tokens": list(self.prefill_tokens), "ms": list(self.prefill_ms)},
                "decode": {"batch": list(self.decode_batch), "ms": list(self.decode_ms)},
                "overhead_ms": self.overhead_ms,
                **({"head": {"batch": list(self.head_batch), "ms": list(self.head_ms)}} if self.head_batch else {})}

    def fitted(self) -> "LayerProfile":
        """The same profile with every curve replaced by its least-squares line ``a + b x`` (a, b >= 0),
        read at the same points.

        Why: on the shared 2-core machine single points carry interference (the head measured 18 ms at 8 rows
        and 133 ms at 32 in one run), and a dent in a curve makes throughput non-monotonic in the batch size,
        which branch-and-bound relies on. The CPU's cost is a fixed cost per call plus a per-row slope
        (docs/exegpt.md), which the line keeps."""
        def line(xs, ys):
            if len(xs) < 2:
                return ys
            mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
            sxx = sum((x - mx) ** 2 for x in xs)
            b = max(sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx, 0.0) if sxx else 0.0
            a = max(my - b * mx, 0.0)
            return tuple(a + b * x for x in xs)
        return LayerProfile(self.num_layers, self.prefill_tokens, line(self.prefill_tokens, self.prefill_ms),
                            self.decode_batch, line(self.decode_batch, self.decode_ms), self.overhead_ms,
                            self.head_batch, line(self.head_batch, self.head_ms) if self.head_batch else ())

    def prefill_layer_ms(self, tokens: float) -> float:
        """One layer over a prefill chunk of ``tokens`` tokens (ms); 0 for an empty chunk."""
        return 0.0 if tokens <= 0 else _interp(self.prefill_tokens, self.prefill_ms, tokens)

    def head_call_ms(self, rows: float) -> float:
        """The final head over ``rows`` positions (one per decoded row, one per prompt in prefill) (ms).

        On SmolLM2 the tied 49,152 x 576 LM head costs about as much as 8 layers, so it is profiled."""
        return 0.0 if rows <= 0 or not self.head_batch else _interp(self.head_batch, self.head_ms, rows)

    def decode_layer_ms(self, batch: float) -> float:
        """One layer, one decode step of ``batch`` rows (fractional: an expected batch) (ms); 0 if empty."""
        return 0.0 if batch <= 0 else _interp(self.decode_batch, self.decode_ms, batch)


@dataclass(frozen=True)
class LengthDistribution:
    """A discrete distribution of sequence lengths (tokens): ``lengths[i]`` with probability ``probs[i]``."""

    lengths: tuple[int, ...]   # increasing, >= 1
    probs: tuple[float, ...]   # sum to 1

    def __post_init__(self):
        if not self.lengths or len(self.lengths) != len(self.probs):
            raise ValueError("length distribution needs equal, non-empty lengths and probs")
        if any(b <= a for a, b in zip(self.lengths, self.lengths[1:])) or self.lengths[0] < 1:
            raise ValueError(f"lengths must be >= 1 and strictly increasing, got {self.lengths}")
        if any(p < 0 for p in self.probs) or abs(sum(self.probs) - 1.0) > 1e-6:
            raise ValueError("probs must be >= 0 and sum to 1")

    @classmethod
    def from_samples(cls, samples: list[int]) -> "LengthDistribution":
        """The empirical distribution of observed lengths (e.g. tokens generated per finished request)."""
        if not samples:
            raise ValueError("no length samples")
        counts: dict[int, int] = {}
        for s in samples:
            s = int(s)
            if s < 1:
                raise ValueError(f"lengths must be >= 1, got {s}")
            counts[s] = counts.get(s, 0) + 1
        keys = sorted(counts)
        return cls(tuple(keys), tuple(counts[k] / len(samples) for k in keys))

    @classmethod
    def fixed(cls, length: int) -> "LengthDistribution":
        return cls((int(length),), (1.0,))

    def mean(self) -> float:
        return sum(s * p for s, p in zip(self.lengths, self.probs))

    def quantile(self, q: float) -> int:
        """The smallest length whose cumulative probability reaches ``q`` (``q`` = 0.99: the p99 length)."""
        acc = 0.0
        for s, p in zip(self.lengths, self.probs):
            acc += p
            if acc >= q - 1e-12:
                return s
        return self.lengths[-1]
