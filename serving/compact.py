"""Blocks ``first..last`` run in this process with the batch shrinking at every enabled ramp: what the router
runs for a compact split and what ``<m>_ee`` runs for the whole model (blocks 1..L). One piece of code, so
the naive early-exit baseline gets every optimisation E3's compact split gets (docs/design.md §2: equal budgets,
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
tests/test_compact.py). Each file, and the composed graph, is given exactly the tensors it reads: what export
recorded (``reads``: file -> input names, the model config's ``part_io``), checked at load against the file
itself (torch.onnx drops an input a graph never reads, and ONNX Runtime refuses a feed it does not declare).
Imports without Triton.
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

__all__ = ["CompactRunner", "COMPOSED", "BLOCK_BY_BLOCK", "session_reads", "feed_for"]

log = logging.getLogger(__name__)

COMPOSED = "composed"
BLOCK_BY_BLOCK = "block by block"


def session_reads(session, name: str, recorded=None) -> tuple[str, ...]:
    """The inputs ONNX Runtime ``session`` (of file ``name``) declares; where export recorded them
    (``recorded``: a list of names), they must agree, else ``ValueError`` naming the file and the tensors."""
    declared = tuple(i.name for i in session.get_inputs())
    if recorded is not None and set(recorded) != set(declared):
        raise ValueError(f"{name} reads {sorted(declared)}, but its export recorded {sorted(recorded)}: the "
                         "repository is inconsistent; export the model again")
    return declared


def feed_for(reads, feed: dict[str, np.ndarray], part: str) -> dict[str, np.ndarray]:
    """The tensors of ``feed`` that a part reads (``reads``: its input names); ``ValueError`` naming the part
    and the tensor where one is missing."""
    try:
        return {k: feed[k] for k in reads}
    except KeyError as missing:
        raise ValueError(f"{part} reads {missing}, which the rows it was given do not carry "
                         f"(they carry {sorted(feed)})") from None


class CompactRunner:
    """``runner(feed, rule_state=None) -> (route, survivors' state or None)`` for blocks ``first..last`` of the
    model ``card`` describes, from the block files in ``folder``, with the ramps in ``enabled_ramps`` and
    ``rule``. ``copies``: sessions (or session sets) that calls may use at once (one per instance: instances
    mean cores); ``threads``: each session's ONNX Runtime intra-op threads; ``compose=False``: block by block
    whatever the rule (to compare the forms); ``reads``: block file -> the inputs export recorded for it (None:
    what each file declares). ``form`` says which form runs, ``why`` (None when composed) why it is block by
    block."""

    def __init__(self, folder: str | os.PathLike, card, rule: ExitRule, first: int, last: int,
                 enabled_ramps, copies: int = 1, threads: int = 1, compose: bool = True,
                 reads: dict[str, list[str]] | None = None):
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
        self.files = {k: block_file(k, ramp=k in enabled) for k in self.blocks}
        self.free: queue.Queue = queue.Queue()
        for _ in range(max(1, copies)):
            self.free.put(make_session(self.composed.graph, threads) if self.composed is not None else
                          {k: make_session(os.path.join(folder, self.files[k]), threads) for k in self.blocks})
        sessions = self.free.queue[0]
        if self.composed is not None:
            self.reads = {"composed": session_reads(sessions, f"blocks {first}-{last} composed",
                                                    (reads or {}).get(self.files[first]))}
        else:
            self.reads = {k: session_reads(sessions[k], self.files[k], (reads or {}).get(self.files[k]))
                          for k in self.blocks}

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
            out = dict(zip(self.names, sessions.run(self.names, feed_for(self.reads["composed"], feed,
                                                                         "the composed graph"))))
        finally:
            self.free.put(sessions)
        return route, self.composed.advance(route, out)

    def _block(self, session, k: int, feed: dict) -> dict:
        """Block k (with its ramp if enabled) on the rows still running."""
        return dict(zip(self.outputs[k], session.run(self.outputs[k], feed_for(self.reads[k], feed, self.files[k]))))
