"""A BERT-style encoder classifier with a DeeBERT ramp after chosen layers.

The architecture follows BERT (post-LayerNorm, erf GELU, [CLS] pooler), so the
same code serves the tiny random-weight demo model and, later, MiniLM-sized
checkpoints. Written out by hand (not ``nn.TransformerEncoderLayer``) so that
ONNX export is plain, the checkpoints' parameter names (``query``, ``key``,
``value``, ...) load as they are and every layer is addressable as a block.

Attention goes through ``torch.nn.functional.scaled_dot_product_attention``:
on a GPU it is one fused kernel (memory-efficient attention with the padding
bias) where the matmul, softmax, matmul it replaces ran the stock BERT-base at
half the speed of ``nn.TransformerEncoderLayer``'s fused path on an H200
(the H200 measurement made when the design was written, docs/design.md §5). Every system (the stock model, the early-exit
model, E3's splits) runs this one layer, so they stay comparable. The padding
keeps its old form, an additive bias of -10000 on padded keys, not a boolean
mask: a row whose keys are all padding (a padding row of a batch bucket) then
gets uniform weights, as before, instead of NaN. The TorchScript ONNX exporter
(opset 17, :mod:`e3.export.onnx_export`) writes the call out as MatMul, Add,
Softmax, MatMul (the scale's square root multiplied into q and k), checked
against PyTorch like every exported file, so no separate export path is kept.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from e3.core.spec import ModelCard, TensorSpec
from e3.models.api import EarlyExitModel

__all__ = ["EncoderConfig", "EncoderEE"]


@dataclass(frozen=True)
class EncoderConfig:
    vocab_size: int = 512       # token ids 0..vocab_size-1 (0: padding)
    hidden: int = 32            # width of every block's state
    layers: int = 4             # transformer blocks, L
    heads: int = 2              # attention heads per block (hidden % heads == 0)
    ffn: int = 64               # width of a block's feed-forward layer
    max_seq_len: int = 16       # tokens per input, padded (docs/design.md §2)
    num_classes: int = 3        # labels every ramp and the head answer
    ramp_blocks: tuple[int, ...] = field(default=(1, 2, 3))  # blocks followed by a ramp (< layers)
    layer_norm_eps: float = 1e-12
    dropout: float = 0.1
    pooling: str = "cls"   # what a ramp/head reads: "cls" ([CLS] state, DeeBERT) or "mean" (masked mean)


class _Embeddings(nn.Module):
    def __init__(self, c: EncoderConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(c.vocab_size, c.hidden)
        self.position_embeddings = nn.Embedding(c.max_seq_len, c.hidden)
        self.token_type_embeddings = nn.Embedding(2, c.hidden)
        self.LayerNorm = nn.LayerNorm(c.hidden, eps=c.layer_norm_eps)
        self.dropout = nn.Dropout(c.dropout)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        x = (self.word_embeddings(input_ids) + self.position_embeddings(positions)
             + self.token_type_embeddings(torch.zeros_like(input_ids)))
        return self.dropout(self.LayerNorm(x))


class _Layer(nn.Module):
    def __init__(self, c: EncoderConfig):
        super().__init__()
        self.heads, self.head_dim = c.heads, c.hidden // c.heads
        self.query = nn.Linear(c.hidden, c.hidden)
        self.key = nn.Linear(c.hidden, c.hidden)
        self.value = nn.Linear(c.hidden, c.hidden)
        self.attn_out = nn.Linear(c.hidden, c.hidden)
        self.attn_norm = nn.LayerNorm(c.hidden, eps=c.layer_norm_eps)
        self.intermediate = nn.Linear(c.hidden, c.ffn)
        self.output = nn.Linear(c.ffn, c.hidden)
        self.out_norm = nn.LayerNorm(c.hidden, eps=c.layer_norm_eps)
        self.dropout = nn.Dropout(c.dropout)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        return x.view(b, s, self.heads, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """[B, S, H] states and the [B, S] 0/1 mask -> [B, S, H] states after the layer."""
        b, s, h = x.shape
        q, k, v = self._heads(self.query(x)), self._heads(self.key(x)), self._heads(self.value(x))
        bias = (1.0 - mask.to(x.dtype))[:, None, None, :] * -10000.0  # padding gets ~0 weight
        ctx = nn.functional.scaled_dot_product_attention(   # softmax(q k^T / sqrt(d) + bias) v, fused
            q, k, v, attn_mask=bias, dropout_p=self.dropout.p if self.training else 0.0,
            scale=1.0 / math.sqrt(self.head_dim))   # a constant: the ONNX graph computes no scale from shapes
        ctx = ctx.transpose(1, 2).reshape(b, s, h)
        x = self.attn_norm(x + self.dropout(self.attn_out(ctx)))
        ffn = self.output(nn.functional.gelu(self.intermediate(x)))
        return self.out_norm(x + self.dropout(ffn))


class _Ramp(nn.Module):
    """DeeBERT highway: pooler (dense + tanh) -> dropout -> linear, on the [CLS] state or on
    the masked mean of the layer's states (``pooling``)."""

    def __init__(self, c: EncoderConfig):
        super().__init__()
        self.mean = c.pooling == "mean"
        self.pooler = nn.Linear(c.hidden, c.hidden)
        self.dropout = nn.Dropout(c.dropout)
        self.classifier = nn.Linear(c.hidden, c.num_classes)

    def pool(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """[B, S, H] states -> [B, H] what the pooler reads."""
        if not self.mean:
            return x[:, 0]
        m = mask.to(x.dtype).unsqueeze(-1)
        return (x * m).sum(1) / m.sum(1).clamp(min=1.0)

    def from_pooled(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.dropout(torch.tanh(self.pooler(pooled))))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.from_pooled(self.pool(x, mask))


def _mask_spec(seq_len: int) -> TensorSpec:
    return TensorSpec("attention_mask", "INT64", (seq_len,), (0, 1))


class EncoderEE(EarlyExitModel):
    """Text classifier: inputs ``input_ids`` and ``attention_mask`` (INT64 [S]),
    state ``hidden`` (FP32 [S, H]) and ``attention_mask``."""

    def __init__(self, name: str, config: EncoderConfig, exit_rule: dict, max_batch_size: int = 64,
                 preprocess: str | None = None):
        super().__init__()
        c = self.config = config
        self.embeddings = _Embeddings(c)
        self.layers = nn.ModuleList(_Layer(c) for _ in range(c.layers))
        self.ramps = nn.ModuleDict({str(k): _Ramp(c) for k in c.ramp_blocks})
        self.head = _Ramp(c)
        s = c.max_seq_len
        self.card = ModelCard(
            name=name, num_blocks=c.layers, ramp_blocks=tuple(c.ramp_blocks), num_classes=c.num_classes,
            # bounds: what a served model accepts (e3.serving.input_policy): ids inside the vocabulary
            # (ONNX Gather would read a negative id from the table's end), a 0/1 mask
            inputs=(TensorSpec("input_ids", "INT64", (s,), (0, c.vocab_size - 1)), _mask_spec(s)),
            state=(TensorSpec("hidden", "FP32", (s, c.hidden)), _mask_spec(s)),
            exit_rule=dict(exit_rule), max_batch_size=max_batch_size, max_seq_len=s, preprocess=preprocess)

    def stem(self, input_ids, attention_mask):
        return self.embeddings(input_ids), attention_mask

    def block(self, k, hidden, attention_mask):
        return self.layers[k - 1](hidden, attention_mask), attention_mask

    def ramp(self, k, hidden, attention_mask):
        ramp = self.head if k == self.card.num_blocks else self.ramps[str(k)]
        return ramp(hidden, attention_mask)

    def example_inputs(self, n, seed=0):
        """Random token ids with random lengths (>= 2), padded with 0 past the length."""
        g = torch.Generator().manual_seed(seed)
        s = self.config.max_seq_len
        ids = torch.randint(1, self.config.vocab_size, (n, s), generator=g)
        lengths = torch.randint(2, s + 1, (n,), generator=g)
        mask = (torch.arange(s)[None, :] < lengths[:, None]).long()
        return ids * mask, mask
