"""The router's decisions, pure numpy: which inputs exit where, what goes on.

:class:`BatchRoute` follows one batch of inputs through the splits of a
plan. After each split the caller hands it the logits of every ramp the
split computed (for the rows that entered the split); it applies the exit
rule ramp by ramp, records the answers of the rows that exit, and says which
rows survive into the next split.

Inside a split the batch cannot shrink: a row that exits at an inner ramp
takes that ramp's answer, the split still computes it to its end, and later
ramps of the same split do not see it (docs/design.md §2, "Ramps inside a split").

The same class drives the Triton router (splits are other Triton models,
reached by BLS) and the in-process ``<m>_ee`` baseline (one block per step,
the batch shrinking after every ramp), so both answer exactly alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable

import numpy as np

from e3.core.exits import ExitRule, exit_mask, softmax
from e3.core.names import ramp_output, state_output
from e3.core.plan import Plan

__all__ = ["BatchRoute", "RampCounts", "Drop", "DEADLINE", "ERROR", "drop_for"]

DEADLINE, ERROR = "deadline", "error"   # drop reasons: the label of e3_dropped_total


@dataclass
class RampCounts:
    """Batch profile of one batch: inputs reaching and leaving at each ramp (block -> count)."""

    reached: dict[int, int] = field(default_factory=dict)
    exited: dict[int, int] = field(default_factory=dict)

    def add(self, block: int, reached: int, exited: int) -> None:
        self.reached[block] = self.reached.get(block, 0) + reached
        self.exited[block] = self.exited.get(block, 0) + exited


class BatchRoute:
    """One batch of ``n`` inputs on its way through the splits.

    Attributes after :meth:`observe` calls:
      active     -- row indices (into the batch) still running, ascending
      label      -- [n] int64, -1 until answered
      exit_ramp  -- [n] int32, 0 until answered; the block whose ramp answered
      probs      -- [n, C] float32 softmax of the answering ramp
      counts     -- per-ramp reached/exited counts (the batch profile)
    """

    def __init__(self, n: int, num_classes: int, num_blocks: int, rule: ExitRule,
                 rule_state: dict[str, np.ndarray] | None = None):
        """``rule_state``: the rows' exit-rule state so far (a dependent rule's state carried across
        splits, one entry per row); default: the rule's state before block 1."""
        self.num_blocks = num_blocks
        self.rule = rule
        self.rule_state = rule.init_state(n) if rule_state is None else rule_state
        self.active = np.arange(n)
        self.label = np.full(n, -1, dtype=np.int64)
        self.exit_ramp = np.zeros(n, dtype=np.int32)
        self.probs = np.zeros((n, num_classes), dtype=np.float32)
        self.counts = RampCounts()

    @property
    def done(self) -> bool:
        return self.active.size == 0

    def observe(self, ramp_logits: dict[int, np.ndarray]) -> np.ndarray:
        """Apply the exit rule to the ramps one split computed.

        ramp_logits: block -> logits [len(self.active), C] for the rows that entered
        the split, for every ramp the split computed (the head is block L: every
        row still undecided there is answered).
        Returns a bool mask over the rows that entered: True for survivors, which
        the caller sends on (slicing the split's state outputs with it).
        """
        entered = self.active
        decided = np.zeros(entered.size, dtype=bool)
        for block in sorted(ramp_logits):
            logits = ramp_logits[block]
            if logits.shape[0] != entered.size:
                raise ValueError(f"ramp {block}: got {logits.shape[0]} rows, {entered.size} entered the split")
            pending = np.flatnonzero(~decided)
            if pending.size == 0:
                break
            if block == self.num_blocks:
                exits = np.ones(pending.size, dtype=bool)
            else:
                exits = exit_mask(self.rule, block, logits[pending], self.rule_state, entered[pending])
            leaving = pending[exits]
            self.counts.add(block, int(pending.size), int(leaving.size))
            if leaving.size:
                rows = entered[leaving]
                probs = softmax(logits[leaving])
                self.probs[rows] = probs
                self.label[rows] = probs.argmax(axis=1)
                self.exit_ramp[rows] = block
                decided[leaving] = True
        keep = ~decided
        self.active = entered[keep]
        return keep

    def advance(self, outputs: dict[str, np.ndarray], ramps: tuple[int, ...],
                state_names: list[str]) -> dict[str, np.ndarray] | None:
        """One split done: apply the exit rule to its ``ramps`` (logits in ``outputs`` under
        ``ramp_<k>``) and return the next split's inputs, the survivors' state (``outputs``
        under ``<name>_out``, sliced to the survivors); None when every input is answered."""
        keep = self.observe({k: outputs[ramp_output(k)] for k in ramps})
        if self.done:
            return None
        return {name: outputs[state_output(name)][keep] for name in state_names}

    def settle(self, label: np.ndarray, exit_ramp: np.ndarray, probs: np.ndarray, ramps: tuple[int, ...],
               survivors: np.ndarray | None) -> None:
        """Record what a split that applied the exit rule itself decided (a fused compact split,
        :mod:`e3.serving.fused_split`), for the rows that entered it.

        label [m] int64, exit_ramp [m] int32 (0: still running), probs [m, C]: one row per entered row;
        ``ramps``: the ramps the split applied, ascending (the batch profile counts rows reaching and leaving
        at each, as :meth:`observe` does ramp by ramp); ``survivors``: the entered rows still running, ascending
        (None after the head: every row is answered). Raises ``ValueError`` where the two disagree."""
        entered = self.active
        if not (label.shape[0] == exit_ramp.shape[0] == probs.shape[0] == entered.size):
            raise ValueError(f"a split answered {label.shape[0]} rows, {entered.size} entered it")
        running = exit_ramp == 0
        if not np.array_equal(np.flatnonzero(running), np.arange(0) if survivors is None else survivors):
            raise ValueError("the split's survivors are not the rows it left undecided")
        for block in ramps:
            reached = int(np.count_nonzero(running | (exit_ramp >= block)))
            if reached == 0:
                break
            self.counts.add(block, reached, int(np.count_nonzero(exit_ramp == block)))
        decided = entered[~running]
        self.label[decided] = label[~running]
        self.exit_ramp[decided] = exit_ramp[~running]
        self.probs[decided] = probs[~running]
        self.active = entered[running]

    def follow(self, feed: dict[str, np.ndarray],
               steps: Iterable[tuple[tuple[int, ...], Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]]],
               state_names: list[str]) -> dict[str, np.ndarray] | None:
        """Run the batch through ``steps`` in order, each ``(ramps, call)``: ``call(inputs)`` computes one
        split or block (the in-process baseline and the router's compact splits: one block) and
        :meth:`advance` applies the exit rule at its ``ramps``; stops as soon as every input is answered.
        Returns the survivors' inputs for what comes after the steps (None when every input is answered)."""
        for ramps, call in steps:
            feed = self.advance(call(feed), ramps, state_names)
            if feed is None:
                return None
        return feed


@dataclass(frozen=True)
class Drop:
    """How a batch the router cannot finish is answered."""
    reason: str    # DEADLINE (the SLO cannot be met) or ERROR (a split failed): the e3_dropped_total label
    message: str   # the error every request of the batch is answered with


def drop_for(plan: Plan, *, late: bool, detail: str) -> Drop:
    """The drop of a batch: ``late`` when its deadline passed (the budget ran out, or a split's queue
    rejected the call as expired), else a split's failure; ``detail`` says what happened. The SLO is
    written as configured (``%g``), never rounded to "0 ms"."""
    if late:
        return Drop(DEADLINE, f"dropped: {plan.model} cannot answer within its SLO of {plan.slo_ms:g} ms ({detail})")
    return Drop(ERROR, f"{plan.model} router: {detail}")
