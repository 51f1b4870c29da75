"""The PyTorch reference: what the served system must answer, input by input.

Runs the early-exit model one input at a time (batch 1) with the given exit
rule and enabled ramps, exactly as the model would run unsplit. Tests compare
every served answer with this. The exit decisions use the same
:mod:`e3.core.exits` code as the router, on PyTorch's logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from e3.core.exits import ExitRule, exit_mask, softmax
from e3.models.api import EarlyExitModel

__all__ = ["ReferenceAnswers", "reference_answers"]


@dataclass
class ReferenceAnswers:
    label: np.ndarray       # [N] int64 predicted class
    exit_ramp: np.ndarray   # [N] int32 block whose ramp answered (L for the head)
    probs: np.ndarray       # [N, C] float32 softmax of the answering ramp
    min_margin: np.ndarray  # [N] float64 smallest distance to an exit boundary seen (tie band)


@torch.no_grad()
def reference_answers(model: EarlyExitModel, inputs: tuple[np.ndarray, ...] | tuple[torch.Tensor, ...],
                      rule: ExitRule, *, enabled_ramps: tuple[int, ...] | None = None) -> ReferenceAnswers:
    """Answer every input of ``inputs`` (batch-first arrays) alone, at batch 1.

    ``enabled_ramps`` defaults to every ramp of the model; ramps not listed are skipped.
    """
    card = model.card
    L = card.num_blocks
    ramps = set(card.ramp_blocks if enabled_ramps is None else enabled_ramps)
    tensors = [torch.as_tensor(np.asarray(x)) for x in inputs]
    n = tensors[0].shape[0]
    out = ReferenceAnswers(np.zeros(n, np.int64), np.zeros(n, np.int32),
                           np.zeros((n, card.num_classes), np.float32), np.full(n, np.inf))
    one = np.zeros(1, dtype=np.int64)
    for i in range(n):
        state = model.stem(*(t[i:i + 1] for t in tensors))
        rule_state = rule.init_state_for({spec.name: np.asarray(t[i:i + 1]) for spec, t in zip(card.inputs, tensors)}, 1)
        for k in range(1, L + 1):
            state = model.block(k, *state)
            if k != L and k not in ramps:
                continue
            logits = model.ramp(k, *state).numpy()
            if k != L:
                out.min_margin[i] = min(out.min_margin[i], rule.margin(k, logits, rule_state, one)[0])
                if not exit_mask(rule, k, logits, rule_state, one)[0]:
                    continue
            probs = softmax(logits)[0]
            out.label[i], out.exit_ramp[i], out.probs[i] = int(np.argmax(probs)), k, probs
            break
    return out
