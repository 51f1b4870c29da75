"""A user's own early-exit model, written for the tests (not a zoo model): four blocks, ramps after 1-3, an
input of 8 features, 3 classes, random seeded weights, and a state layout the zoo never uses:

* ``h``       the hidden state: every block reads and writes it;
* ``summ``    a summary of the input the stem writes and only the ramps read (every block passes it on
              untouched; the final head does not read it, so the last block's graph has no such input);
* ``scratch`` a state block 2 overwrites without reading (block 2's graph has no ``scratch`` input); the
              ramps read it.

Its exit rule is :class:`custom_rule.MeanAgreeRule` (a module of its own), stateful across ramps. The margin is
calibrated once, deterministically, so that inputs leave at every ramp and at the head.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from torch import nn

from e3.core.exits import softmax
from e3.core.spec import ModelCard, TensorSpec
from e3.models.api import EarlyExitModel

F, D, C, L = 8, 16, 3, 4
SEED = 7


class SummitEE(EarlyExitModel):
    def __init__(self, rule: dict | None = None):
        super().__init__()
        torch.manual_seed(SEED)
        self.inp = nn.Linear(F, D)
        self.summary = nn.Linear(F, D)
        self.blocks = nn.ModuleList(nn.Linear(D, D) for _ in range(L))
        self.scratch = nn.Linear(D, D)
        self.ramps = nn.ModuleList(nn.Linear(3 * D, C) for _ in range(L - 1))
        self.head = nn.Linear(D, C)
        for r in [*self.ramps, self.head]:
            nn.init.normal_(r.weight, std=0.5)
        self.card = ModelCard(
            name="custom_ee:summit", num_blocks=L, ramp_blocks=(1, 2, 3), num_classes=C,
            inputs=(TensorSpec("x", "FP32", (F,)),),
            state=(TensorSpec("h", "FP32", (D,)), TensorSpec("summ", "FP32", (D,)), TensorSpec("scratch", "FP32", (D,))),
            exit_rule=rule or {"kind": "custom_rule:MeanAgreeRule", "margin": 0.5, "num_classes": C}, max_batch_size=32)

    def stem(self, x):
        h = torch.tanh(self.inp(x))
        return h, torch.tanh(self.summary(x)), torch.zeros_like(h)

    def block(self, k, h, summ, scratch):
        h = h + torch.tanh(self.blocks[k - 1](h))
        if k == 2:   # overwritten, never read
            scratch = torch.relu(self.scratch(h))
        return h, summ, scratch

    def ramp(self, k, h, summ, scratch):
        if k == L:
            return self.head(h)
        return self.ramps[k - 1](torch.cat([h, summ, scratch], dim=1))

    def example_inputs(self, n, seed=0):
        g = torch.Generator().manual_seed(seed)
        return (torch.randn(n, F, generator=g) * 1.5,)


def summit() -> SummitEE:
    """The model with its margin calibrated: about 40% of random inputs are confident enough at ramp 1."""
    model = SummitEE().eval()
    with torch.no_grad():
        state = model.block(1, *model.stem(*model.example_inputs(256, seed=SEED)))
        p = softmax(model.ramp(1, *state).numpy()).astype(np.float64)
    top2 = np.sort(p, axis=1)[:, -2:]
    margin = float(np.round(np.quantile(top2[:, 1] - top2[:, 0], 0.6), 4))
    model.card = dataclasses.replace(model.card, exit_rule={"kind": "custom_rule:MeanAgreeRule", "margin": margin,
                                                            "num_classes": C})
    return model


def summit_patience() -> SummitEE:
    """The same network under the built-in patience rule (patience 1)."""
    model = SummitEE(rule={"kind": "patience", "patience": 1}).eval()
    model.card = dataclasses.replace(model.card, name="custom_ee:summit_patience")
    return model


def summit_entropy() -> SummitEE:
    """The same network under the built-in entropy rule, which composes into one graph (τ: the 40% quantile of
    ramp 1's entropies on random inputs)."""
    from e3.core.exits import entropy_nats
    model = SummitEE().eval()
    with torch.no_grad():
        state = model.block(1, *model.stem(*model.example_inputs(256, seed=SEED)))
        tau = float(np.round(np.quantile(entropy_nats(model.ramp(1, *state).numpy()), 0.4), 4))
    model.card = dataclasses.replace(model.card, name="custom_ee:summit_entropy",
                                     exit_rule={"kind": "entropy", "tau_nats": tau})
    return model
