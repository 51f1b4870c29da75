"""A small early-exit encoder with a wide state, for the cross-pool gRPC hop (tests/test_remote_hop_e2e.py):
3 blocks of hidden 256 over 128 tokens, so the state after a block is 128 x 256 x 4 B = 128 KiB per input
(plus the mask): 40 inputs carry 5.1 MiB, past gRPC's 4 MiB default receive limit. Random (seeded) weights;
``tau_nats`` 0 with the entropy rule never exits (an entropy is never < 0), so every input of a batch reaches
the last split and the whole batch crosses the hop. Built as ``wide_model:wide_ee`` (package.module:factory)."""

from __future__ import annotations

import torch

from e3.models.zoo.encoder import EncoderConfig, EncoderEE

SEQ, HIDDEN = 128, 256
STATE_BYTES_PER_INPUT = SEQ * HIDDEN * 4 + SEQ * 8   # hidden (FP32) + attention mask (INT64)


def wide_ee() -> EncoderEE:
    torch.manual_seed(7)
    config = EncoderConfig(hidden=HIDDEN, layers=3, heads=2, ffn=64, max_seq_len=SEQ, ramp_blocks=(1, 2))
    return EncoderEE("wide-ee", config, exit_rule={"kind": "entropy", "tau_nats": 0.0}).eval()
