"""Exit rules: when does an input leave at a ramp? Pure numpy, no torch.

Two kinds (E3 §2, DESIGN §2):

* independent -- decided at one ramp from that ramp's output alone
  (DeeBERT/BranchyNet: entropy of the softmax, in nats, below ``tau_nats``);
* dependent -- carries per-input state across ramps
  (PABEE: exit once ``patience`` consecutive ramps agree on the prediction).

Both implement :class:`ExitRule`. The state of a dependent rule is a dict of
numpy arrays with one row per input, so that the router can carry it across
splits, and the PyTorch reference, the in-process baseline and the router all
call the same code: splitting changes where compute happens, never the answer.

The final head (block L) always answers; rules are only consulted at ramps.
"""

from __future__ import annotations

import abc
from typing import Any

import numpy as np

__all__ = ["ExitRule", "EntropyRule", "PatienceRule", "ForcedRule", "make_exit_rule", "softmax", "entropy_nats",
           "row_uniform"]


def softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise softmax of ``logits`` [N, C], computed in float64, returned as float32."""
    z = logits.astype(np.float64)
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return (e / e.sum(axis=1, keepdims=True)).astype(np.float32)


def entropy_nats(logits: np.ndarray) -> np.ndarray:
    """Entropy in nats of softmax(logits), per row: [N, C] -> [N] float64."""
    z = logits.astype(np.float64)
    z = z - z.max(axis=1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    return -(np.exp(logp) * logp).sum(axis=1)


class ExitRule(abc.ABC):
    """Decides, at a ramp, which of the inputs that reached it exit there."""

    kind: str

    def init_state(self, n: int) -> dict[str, np.ndarray]:
        """Per-input state for ``n`` inputs before block 1 (empty for independent rules)."""
        return {}

    def init_state_for(self, inputs: dict[str, np.ndarray], n: int) -> dict[str, np.ndarray]:
        """Per-input state for the ``n`` inputs ``inputs`` (name -> [n, ...]) before block 1. Only a rule
        whose decision depends on the input itself (:class:`ForcedRule`) reads them."""
        return self.init_state(n)

    @abc.abstractmethod
    def decide(self, block: int, logits: np.ndarray, state: dict[str, np.ndarray],
               rows: np.ndarray) -> np.ndarray:
        """Exit mask for ``rows`` at the ramp after ``block``.

        logits: [len(rows), C] outputs of the ramp for those inputs.
        state:  this batch's rule state (one entry per input of the batch); rows
                ``rows`` are updated in place.
        Returns a bool array [len(rows)]: True where the input exits here.
        """

    @abc.abstractmethod
    def margin(self, block: int, logits: np.ndarray, state: dict[str, np.ndarray],
               rows: np.ndarray) -> np.ndarray:
        """Distance of each row's exit score from the decision boundary ([len(rows)], >= 0).

        Used by tests to exclude ties: inputs within 1e-5 of the boundary may flip
        between runtimes and batch sizes (DESIGN §2). Call before :meth:`decide`.
        """

    @abc.abstractmethod
    def to_dict(self) -> dict[str, Any]:
        """The rule as it is written in model cards and plans."""


class EntropyRule(ExitRule):
    """Exit when the entropy (nats) of the ramp's softmax is below ``tau_nats``."""

    kind = "entropy"

    def __init__(self, tau_nats: float):
        if not np.isfinite(tau_nats) or tau_nats < 0:
            raise ValueError(f"tau_nats must be a finite number >= 0, got {tau_nats!r}")
        self.tau_nats = float(tau_nats)

    def decide(self, block, logits, state, rows):
        return entropy_nats(logits) < self.tau_nats

    def margin(self, block, logits, state, rows):
        return np.abs(entropy_nats(logits) - self.tau_nats)

    def to_dict(self):
        return {"kind": self.kind, "tau_nats": self.tau_nats}


class PatienceRule(ExitRule):
    """PABEE: exit once ``patience`` consecutive ramps agree with the one before.

    The counter starts at 0 at the first ramp; at each later ramp it becomes
    ``counter + 1`` if the prediction equals the previous ramp's, else 0; the
    input exits when the counter reaches ``patience``. Disabled ramps are
    skipped entirely (the counter compares consecutive *enabled* ramps).
    """

    kind = "patience"

    def __init__(self, patience: int):
        if int(patience) != patience or patience < 1:
            raise ValueError(f"patience must be an integer >= 1, got {patience!r}")
        self.patience = int(patience)

    def init_state(self, n):
        return {"prev": np.full(n, -1, dtype=np.int64), "count": np.zeros(n, dtype=np.int64)}

    def decide(self, block, logits, state, rows):
        pred = np.argmax(logits, axis=1)
        prev = state["prev"][rows]
        count = np.where((prev >= 0) & (pred == prev), state["count"][rows] + 1, 0)
        state["prev"][rows] = pred
        state["count"][rows] = count
        return count >= self.patience

    def margin(self, block, logits, state, rows):
        # The decision flips only if the arg-max flips: distance between the top two logits.
        top2 = np.sort(logits.astype(np.float64), axis=1)[:, -2:]
        return top2[:, 1] - top2[:, 0]

    def to_dict(self):
        return {"kind": self.kind, "patience": self.patience}


def row_uniform(inputs: dict[str, np.ndarray], n: int) -> np.ndarray:
    """A number in [0, 1) per input row, a fixed function of the row's bytes (every input tensor, in name
    order): the same input draws the same number in every process and every system."""
    h = np.zeros(n, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for name in sorted(inputs):
            x = np.ascontiguousarray(inputs[name]).reshape(n, -1)
            words = x.view(np.uint8).reshape(n, -1).astype(np.uint64)
            weights = (np.arange(1, words.shape[1] + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)) | np.uint64(1)
            h = h * np.uint64(0x100000001B3) + (words * weights).sum(axis=1, dtype=np.uint64)
        h ^= h >> np.uint64(33)                      # splitmix64's finaliser: spread every bit over the top ones
        h *= np.uint64(0xFF51AFD7ED558CCD)
        h ^= h >> np.uint64(33)
    return (h >> np.uint64(11)).astype(np.float64) / float(1 << 53)


class ForcedRule(ExitRule):
    """Exits drawn from a stated distribution, for speed runs of models with random weights.

    ``reach[k-1]`` is the share of inputs that reach block k (``reach[0] == 1``; non-increasing), as a
    workload's batch profile states it. Each input's exit block is fixed by :func:`row_uniform` of its own
    bytes: it leaves at the first block k whose ramp is computed with k >= its drawn block (a disabled
    ramp passes it on), the head answering the rest. So the same inputs exit at the same blocks in E3,
    in the naive early-exit model and in the reference, and the workload's exit distribution is the
    stated one in expectation. The answer (label, probabilities) is still the ramp's own output.

    Decision (the papers are silent): random weights make an entropy rule exit almost nothing or almost
    everything, so a speed run on an untrained architecture states its exits instead; results measured
    this way are labelled "forced exits" wherever they are reported, and never used to check accuracy.
    """

    kind = "forced"

    def __init__(self, reach):
        r = [float(x) for x in reach]
        if not r or abs(r[0] - 1.0) > 1e-9 or any(b > a + 1e-12 for a, b in zip(r, r[1:])) or min(r) < 0:
            raise ValueError(f"reach must start at 1 and never increase (share of inputs reaching each block), "
                             f"got {list(reach)!r}")
        self.reach = tuple(r)

    def exit_blocks(self, u: np.ndarray) -> np.ndarray:
        """The block each input with draw ``u`` exits after (1..len(reach); len(reach) = the head)."""
        past = np.asarray(self.reach[1:] + (0.0,))   # share going past block k, k = 1..L
        # an input exits after block k when its draw lies in [past[k], reach[k-1]): count the blocks it passes
        return (1 + (u[:, None] < past[None, :-1]).sum(axis=1)).astype(np.int64)

    def init_state(self, n):
        raise ValueError("forced exits are drawn from the inputs themselves: use init_state_for(inputs, n)")

    def init_state_for(self, inputs, n):
        return {"exit_at": self.exit_blocks(row_uniform(inputs, n))}

    def decide(self, block, logits, state, rows):
        return state["exit_at"][rows] <= block

    def margin(self, block, logits, state, rows):
        return np.full(len(rows), np.inf)   # a stated exit never ties

    def to_dict(self):
        return {"kind": self.kind, "reach": list(self.reach)}


_RULES = {"entropy": lambda d: EntropyRule(d["tau_nats"]), "patience": lambda d: PatienceRule(d["patience"]),
          "forced": lambda d: ForcedRule(d["reach"])}


def make_exit_rule(config: dict[str, Any]) -> ExitRule:
    """Build a rule from its dict form: ``{"kind": "entropy", "tau_nats": 0.3}`` or
    ``{"kind": "patience", "patience": 2}``. Unknown kinds and missing fields are errors."""
    kind = config.get("kind") if isinstance(config, dict) else None
    if kind not in _RULES:
        raise ValueError(f"unknown exit rule {kind!r}; use one of {sorted(_RULES)}")
    try:
        return _RULES[kind](config)
    except KeyError as missing:
        raise ValueError(f"exit rule {kind!r} needs the field {missing}") from None
