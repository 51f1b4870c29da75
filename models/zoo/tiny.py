"""``tiny-ee``: a 4-layer encoder with random (seeded) weights, for the demo and tests.

Random weights give random exits; to make exits happen at all, the ramps'
classifiers get a wider initialisation and the default τ is calibrated once,
deterministically, so that about a third of random inputs leave at ramp 1.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from e3.core.exits import entropy_nats
from e3.models.zoo.encoder import EncoderConfig, EncoderEE

SEED = 1234
EXIT_SHARE_AT_RAMP_1 = 0.35


def build_tiny_ee() -> EncoderEE:
    torch.manual_seed(SEED)
    config = EncoderConfig()
    model = EncoderEE("tiny-ee", config, exit_rule={"kind": "entropy", "tau_nats": 1.0})
    for ramp in [*model.ramps.values(), model.head]:
        torch.nn.init.normal_(ramp.classifier.weight, std=0.6)
    model.eval()
    with torch.no_grad():
        state = model.block(1, *model.stem(*model.example_inputs(512, seed=SEED)))
        ent = entropy_nats(model.ramp(1, *state).numpy())
    tau = float(np.round(np.quantile(ent, EXIT_SHARE_AT_RAMP_1), 4))
    model.card = dataclasses.replace(model.card, exit_rule={"kind": "entropy", "tau_nats": tau})
    return model
