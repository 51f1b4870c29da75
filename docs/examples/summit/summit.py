"""The walk-through's early-exit model (README, "Serve your own model"): five blocks of a small MLP over 32
features, ramps after blocks 1-4, four classes. Its state carries two tensors: the hidden state ``h`` and a
summary of the input ``summ`` that only the ramps read (the final head does not).

``summit``: with the stateful rule of summit_rules.py; ``summit_patience``: the same weights under PABEE's
patience rule (patience 1). Weights come from ``summit.pt`` (``python train_summit.py`` writes it).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import nn

from e3.core.spec import ModelCard, TensorSpec
from e3.models.api import EarlyExitModel

F, D, C, L = 32, 1024, 4, 5
WEIGHTS = Path(__file__).with_name("summit.pt")


class Summit(EarlyExitModel):
    def __init__(self, exit_rule: dict):
        super().__init__()
        self.inp, self.summary = nn.Linear(F, D), nn.Linear(F, 64)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(D, D), nn.GELU(), nn.Linear(D, D)) for _ in range(L))
        self.ramps = nn.ModuleList(nn.Linear(D + 64, C) for _ in range(L - 1))
        self.head = nn.Linear(D, C)
        self.card = ModelCard(name="summit:summit", num_blocks=L, ramp_blocks=(1, 2, 3, 4), num_classes=C,
                              inputs=(TensorSpec("x", "FP32", (F,)),),
                              state=(TensorSpec("h", "FP32", (D,)), TensorSpec("summ", "FP32", (64,))),
                              exit_rule=exit_rule, max_batch_size=64)

    def stem(self, x):
        return torch.tanh(self.inp(x)), torch.tanh(self.summary(x))

    def block(self, k, h, summ):
        return h + self.blocks[k - 1](h), summ          # summ passes on untouched

    def ramp(self, k, h, summ):
        return self.head(h) if k == L else self.ramps[k - 1](torch.cat([h, summ], dim=1))

    def example_inputs(self, n, seed=0):
        return (torch.randn(n, F, generator=torch.Generator().manual_seed(seed)),)


def _load(model: Summit, name: str) -> Summit:
    if not WEIGHTS.exists():
        raise FileNotFoundError(f"{WEIGHTS} is missing: run `python train_summit.py` first")
    model.load_state_dict(torch.load(WEIGHTS))
    model.card = dataclasses.replace(model.card, name=name)
    return model.eval()


def summit() -> Summit:
    return _load(Summit({"kind": "summit_rules:MarginAgree", "min_gap": 0.6, "num_classes": C}), "summit:summit")


def summit_patience() -> Summit:
    return _load(Summit({"kind": "patience", "patience": 1}), "summit:summit_patience")
