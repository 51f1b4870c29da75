"""Exit rules: when does an input leave at a ramp? Pure numpy, no torch.

Two kinds (E3 §2, docs/design.md §2):

* independent -- decided at one ramp from that ramp's output alone
  (DeeBERT/BranchyNet: entropy of the softmax, in nats, below ``tau_nats``);
* dependent -- carries per-input state across ramps
  (PABEE: exit once ``patience`` consecutive ramps agree on the prediction).

Both implement :class:`ExitRule`. The state of a dependent rule is a dict of
numpy arrays with one row per input, so that the router can carry it across
splits, and the PyTorch reference, the in-process baseline and the router all
call the same code: splitting changes where compute happens, never the answer.

The final head (block L) always answers; rules are only consulted at ramps.

**Your own rule** (the public extension point): subclass :class:`ExitRule` in a module of your own, give it
the parameters it needs in ``__init__`` (keyword arguments with JSON values) and implement :meth:`decide`
(and :meth:`init_state` for state carried across ramps; :meth:`margin` to tell tests its ties). Name it in
a model card or plan as ``{"kind": "package.module:ClassName", <its parameters>}``, or put the rule object
itself in ``card.exit_rule``. :func:`make_exit_rule` imports the class and builds it with
:meth:`ExitRule.from_dict`; the built-in ``entropy``, ``patience`` and ``forced`` rules are made by the same
code (their short names are aliases of ``e3.core.exits:EntropyRule`` and so on). ``e3 export`` checks the
rule against PyTorch and ships its module with the model repository (``e3.export.rules``), so Triton's
processes import it without the user's working directory.
"""

from __future__ import annotations

import abc
import importlib
import os
import sys
from typing import Any, Iterable

import numpy as np

__all__ = ["ExitRule", "EntropyRule", "PatienceRule", "ForcedRule", "make_exit_rule", "rule_class", "rule_config",
           "check_rule_config", "exit_mask", "BUILTIN_RULES", "SHIPPED_RULES_DIR", "softmax", "entropy_nats",
           "row_uniform"]

# The folder, inside a Triton model's version folder, where `e3 export` ships a user's rule module.
SHIPPED_RULES_DIR = "e3_rules"


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
    """Decides, at a ramp, which of the inputs that reached it exit there.

    ``kind`` names the rule in model cards and plans: a built-in's short name, else ``module:ClassName``
    (set for every subclass that does not set its own). ``dependent``: True when a decision reads state that
    earlier ramps left (the default: True exactly when :meth:`init_state` is overridden); the exit-wrapper
    then keeps the ramps a decision relies on (:meth:`relies_on`) unless it can re-price them from data.
    """

    kind: str = ""
    dependent: bool = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "kind" not in cls.__dict__:
            cls.kind = f"{cls.__module__}:{cls.__qualname__}"
        if "dependent" not in cls.__dict__ and ("init_state" in cls.__dict__ or "init_state_for" in cls.__dict__):
            cls.dependent = True

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> "ExitRule":
        """The rule from its dict form: every key but ``kind`` is a keyword argument of ``__init__``."""
        return cls(**{k: v for k, v in config.items() if k != "kind"})

    def params(self) -> dict[str, Any]:
        """The rule's parameters as :meth:`from_dict` takes them (default: its public attributes)."""
        return {k: (v.tolist() if isinstance(v, np.ndarray) else list(v) if isinstance(v, tuple) else v)
                for k, v in vars(self).items() if not k.startswith("_")}

    def to_dict(self) -> dict[str, Any]:
        """The rule as it is written in model cards and plans: ``kind`` and its parameters."""
        return {"kind": self.kind, **self.params()}

    def relies_on(self, block: int, enabled: tuple[int, ...]) -> tuple[int, ...]:
        """The enabled ramps (blocks, before ``block``) whose outcome the decision at ``block`` reads, with the
        ramps ``enabled``: none for an independent rule; every earlier one for a dependent rule unless it
        says better (:class:`PatienceRule`: the ``patience`` before it)."""
        return tuple(k for k in enabled if k < block) if self.dependent else ()

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

    def margin(self, block: int, logits: np.ndarray, state: dict[str, np.ndarray],
               rows: np.ndarray) -> np.ndarray:
        """Distance of each row's exit score from the decision boundary ([len(rows)], >= 0).

        Used by tests to exclude ties: inputs within 1e-5 of the boundary may flip
        between runtimes and batch sizes (docs/design.md §2). Call before :meth:`decide`.
        Default: infinite (a rule that does not say is trusted never to tie).
        """
        return np.full(len(rows), np.inf)


def exit_mask(rule: ExitRule, block: int, logits: np.ndarray, state: dict[str, np.ndarray],
              rows: np.ndarray) -> np.ndarray:
    """``rule.decide(block, logits, state, rows)``, checked: a bool array [len(rows)]; ``ValueError`` naming the
    rule, the ramp, what came back and what to return otherwise. Every caller of a rule (the router, ``<m>_ee``,
    the PyTorch reference, the exit replays) goes through here.

    Decision: 0/1 integers are refused, not cast. An integer array is also what ``np.flatnonzero(mask)`` gives,
    and a caller indexing rows with it reads row numbers, not decisions: ``[0, 1]`` for two rows that both exit
    is a mask ``[False, True]`` when cast. Which one a rule meant cannot be told from the values, so the rule
    says it with a bool dtype (``mask.astype(bool)``, or a comparison)."""
    got = rule.decide(block, logits, state, rows)
    n = len(rows)
    array = np.asarray(got) if isinstance(got, (np.ndarray, list, tuple)) else None
    if array is not None and array.dtype == np.bool_ and array.shape == (n,):
        return array
    what = (f"{type(got).__name__} {got!r}" if array is None else
            f"{array.dtype} array of shape {list(array.shape)}")
    if array is not None and array.dtype.kind in "iu" and array.shape == (n,):
        cause = ("integers are read as row numbers, not decisions; return a boolean array, e.g. "
                 "`(exits != 0)` or `mask.astype(bool)`")
    else:
        cause = "return one bool per row, True where that input exits here (e.g. a comparison of [len(rows)] arrays)"
    raise ValueError(f"exit rule {rule.kind}: decide() at ramp {block} returned a {what}; expected a boolean "
                     f"array of shape [len(rows)] = [{n}]: {cause}")


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

    def relies_on(self, block, enabled):
        # an exit at block needs the `patience` enabled ramps before it to have agreed
        return tuple(k for k in enabled if k < block)[-self.patience:]


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
    dependent = False   # its state is drawn from the inputs, not left by earlier ramps

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


BUILTIN_RULES: dict[str, type[ExitRule]] = {c.kind: c for c in (EntropyRule, PatienceRule, ForcedRule)}


def check_rule_config(config: Any) -> str:
    """The ``kind`` of a rule's dict form after checking its shape (a dict whose ``kind`` is a built-in name or
    ``module:ClassName``), without importing anything; raises ``ValueError``."""
    if isinstance(config, ExitRule):
        config = config.to_dict()
    kind = config.get("kind") if isinstance(config, dict) else None
    if not isinstance(kind, str) or not kind:
        raise ValueError(f"an exit rule is a dict with a 'kind' ({', '.join(sorted(BUILTIN_RULES))}, or "
                         f"'package.module:ClassName' for your own), got {config!r}")
    if kind not in BUILTIN_RULES:
        module, _, name = kind.partition(":")
        if not module or not name or not all(p.isidentifier() for p in [*module.split("."), *name.split(".")]):
            raise ValueError(f"unknown exit rule {kind!r}; use one of {sorted(BUILTIN_RULES)}, or name your own "
                             "ExitRule subclass as 'package.module:ClassName'")
        if module == "__main__":
            raise ValueError(f"exit rule {kind!r} is defined in a script (__main__): define it in a module of "
                             "its own, so that the server can import it")
    return kind


def rule_class(kind: str, *, paths: Iterable[str | os.PathLike] = ()) -> type[ExitRule]:
    """The :class:`ExitRule` subclass ``kind`` names (a built-in name, or ``module:ClassName``, imported;
    ``paths``: folders searched first, e.g. where export shipped the module)."""
    check_rule_config({"kind": kind})
    if kind in BUILTIN_RULES:
        return BUILTIN_RULES[kind]
    module_name, _, qualname = kind.partition(":")
    for folder in reversed([os.fspath(p) for p in paths if os.path.isdir(p)]):
        if folder not in sys.path:
            sys.path.insert(0, folder)
    try:
        found: Any = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"exit rule {kind!r}: cannot import {module_name!r} ({err}); make it importable (run "
                         "from its folder, install it, or add its folder to PYTHONPATH)") from None
    except Exception as err:  # noqa: BLE001 - a user's module may fail any way while it runs
        raise ValueError(f"exit rule {kind!r}: importing {module_name!r} failed: {type(err).__name__}: {err}") from None
    for part in qualname.split("."):
        found = getattr(found, part, None)
    if not (isinstance(found, type) and issubclass(found, ExitRule)):
        raise ValueError(f"exit rule {kind!r}: {module_name} has no ExitRule subclass {qualname!r}")
    return found


def rule_config(rule: "ExitRule | dict[str, Any]") -> dict[str, Any]:
    """The dict form of ``rule`` (an :class:`ExitRule`, or already a dict)."""
    return rule.to_dict() if isinstance(rule, ExitRule) else dict(rule)


def make_exit_rule(config: "dict[str, Any] | ExitRule", *, paths: Iterable[str | os.PathLike] = ()) -> ExitRule:
    """Build a rule from its dict form: ``{"kind": "entropy", "tau_nats": 0.3}``,
    ``{"kind": "patience", "patience": 2}`` or ``{"kind": "package.module:ClassName", ...its parameters}``
    (``paths``: folders searched first for its module). An :class:`ExitRule` is returned as it is. Unknown
    kinds, missing or unknown fields are ``ValueError``."""
    if isinstance(config, ExitRule):
        return config
    kind = check_rule_config(config)
    cls = rule_class(kind, paths=paths)
    try:
        return cls.from_dict(config)
    except (TypeError, KeyError) as err:
        raise ValueError(f"exit rule {kind!r}: its fields {sorted(k for k in config if k != 'kind')} do not "
                         f"build it ({err})") from None
