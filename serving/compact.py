"""Blocks ``first..last`` run in this process with the batch shrinking at every enabled ramp: what the router
runs for a compact split and what ``<m>_ee`` runs for the whole model (blocks 1..L). One piece of code, so
the naive early-exit baseline gets every optimisation E3's compact split gets (DESIGN §2: equal budgets,
same engine).

Two forms, chosen at load:

* **composed** (:mod:`e3.serving.fused_split`): the blocks, their exit tests and the compaction between
  them as one ONNX graph, one ONNX Runtime call per batch. Where the exit rule decides at a ramp from that
  ramp's logits alone (:func:`~e3.serving.fused_split.can_fuse`: entropy rules).
* **block by block**: one ONNX Runtime call per block file, the exit rule in numpy between them
  (:meth:`~e3.serving.policy.BatchRoute.follow`). For the other rules (PABEE's patience carries state
  across ramps; a forced rule draws its exits), and for blocks that do not compose (logged, with why).

Both read the per-block files of ``folder`` (``block_<k>[_ramp].onnx``, :func:`~e3.core.names.block_file`,
with its ramp where the ramp is enabled) and answer identically (tests/test_fused_split.py,
tests/test_compact.py). Imports without Triton.
"""

from __future__ import annotations

import logging
import os
import queue
from functools import partial

import numpy as np

from e3.core.exits import ExitRule
from e3.core.names import block_file
from e3.serving.fused_split import can_fuse, compose_split
from e3.serving.policy import BatchRoute
from e3.core.session import make_session

__all__ = ["CompactRunner", "COMPOSED", "BLOCK_BY_BLOCK"]

log = logging.getLogger(__name__)

COMPOSED = "composed"
BLOCK_BY_BLOCK = "block by block"


class CompactRunner:
    """``runner(feed, rule_state=None) -> (route, survivors' state or None)`` for blocks ``first..last`` of the
    model ``card`` describes, from the block files in ``folder``, with the ramps in ``enabled_ramps`` and
    ``rule``. ``copies``: sessions (or session sets) that calls may use at once (one per instance: instances
    mean cores); ``threads``: each session's ONNX Runtime intra-op threads; ``compose=False``: block by block
    whatever the rule (to compare the forms). ``form`` says which form runs, ``why`` (None when composed) why
    it is block by block."""

    def __init__(self, folder: str | os.PathLike, card, rule: ExitRule, first: int, last: int,
                 enabled_ramps, copies: int = 1, threads: int = 1, compose: bool = True):
        self.card, self.rule = card, rule
        self.state_names = [t.name for t in card.state]
        enabled = tuple(sorted(set(enabled_ramps)))
        self.blocks = range(first, last + 1)
        self.composed, self.why = None, None
        if not compose:
            self.why = "asked for"
        elif can_fuse(rule):
            try:
                self.composed = compose_split(folder, card, first, last=last, enabled_ramps=enabled, tau_nats=rule.tau_nats)
            except ValueError as e:   # a model whose block graphs do not compose
                self.why = f"its blocks do not compose into one graph ({e})"
                log.warning("blocks %d-%d run block by block: %s", first, last, self.why)
        else:
            self.why = f"its exit rule ({rule.kind}) is not compiled into a graph (only entropy rules are)"
            log.info("blocks %d-%d run block by block: %s", first, last, self.why)
        self.names = list(self.composed.outputs) if self.composed is not None else None
        self.outputs = {k: card.split_outputs(k, k, enabled) for k in self.blocks}   # state out, then its ramp
        self.ramps = {k: card.split_ramps(k, k, enabled) for k in self.blocks}
        self.free: queue.Queue = queue.Queue()
        for _ in range(max(1, copies)):
            self.free.put(make_session(self.composed.graph, threads) if self.composed is not None else
                          {k: make_session(os.path.join(folder, block_file(k, ramp=k in enabled)), threads)
                           for k in self.blocks})

    @property
    def form(self) -> str:
        return COMPOSED if self.composed is not None else BLOCK_BY_BLOCK

    def __call__(self, feed: dict[str, np.ndarray],
                 rule_state: dict[str, np.ndarray] | None = None) -> tuple[BatchRoute, dict | None]:
        route = BatchRoute(len(next(iter(feed.values()))), self.card.num_classes, self.card.num_blocks, self.rule,
                           rule_state)
        sessions = self.free.get()
        try:
            if self.composed is None:
                steps = ((self.ramps[k], partial(self._block, sessions[k], k)) for k in self.blocks)
                return route, route.follow(feed, steps, self.state_names)
            out = dict(zip(self.names, sessions.run(self.names, feed)))
        finally:
            self.free.put(sessions)
        return route, self.composed.advance(route, out)

    def _block(self, session, k: int, feed: dict) -> dict:
        """Block k (with its ramp if enabled) on the rows still running."""
        return dict(zip(self.outputs[k], session.run(self.outputs[k], feed)))
