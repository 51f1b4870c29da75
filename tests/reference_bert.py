"""An independent reference for the MiniLM backbone: BERT's forward pass and WordPiece in numpy.

Written from the BERT paper / Hugging Face ``BertModel`` layout, not from
``e3.models.zoo``: it reads the raw checkpoint (``model.safetensors``,
``config.json``, ``tokenizer.json`` from the model zip the project locates with
``minilm_zip``) and shares no model code with the project, so a test that
compares the two catches a mistake in either. Float64 throughout, so that the
reference is the more precise side of the comparison.
"""

from __future__ import annotations

import json
import math
import unicodedata
import zipfile
from dataclasses import dataclass

import numpy as np

__all__ = ["Checkpoint", "load_checkpoint", "bert_hidden_states", "sentence_embedding", "wordpiece_ids"]


@dataclass(frozen=True)
class Checkpoint:
    weights: dict[str, np.ndarray]  # Hugging Face BERT names -> float64 arrays
    config: dict                    # config.json
    pooling: dict                   # 1_Pooling/config.json (sentence-transformers)
    modules: list[str]              # sentence-transformers module types, in order
    vocab: dict[str, int]           # WordPiece token -> id


def load_checkpoint(zip_path) -> Checkpoint:
    """Everything the reference needs, read straight from the model package's zip."""
    from safetensors.numpy import load as load_safetensors
    with zipfile.ZipFile(zip_path) as z:
        raw = load_safetensors(z.read("model.safetensors"))
        config = json.loads(z.read("config.json"))
        pooling = json.loads(z.read("1_Pooling/config.json"))
        modules = [m["type"].rsplit(".", 1)[-1] for m in json.loads(z.read("modules.json"))]
        vocab = json.loads(z.read("tokenizer.json"))["model"]["vocab"]
    weights = {k: v.astype(np.float64) for k, v in raw.items() if k != "embeddings.position_ids"}
    return Checkpoint(weights, config, pooling, modules, vocab)


def _layer_norm(x, w, b, eps):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)  # biased variance, as BERT's LayerNorm
    return (x - mu) / np.sqrt(var + eps) * w + b


def _gelu_erf(x):
    erf = np.vectorize(math.erf)
    return 0.5 * x * (1.0 + erf(x / math.sqrt(2.0)))


def _dense(x, w, prefix):
    return x @ w[prefix + ".weight"].T + w[prefix + ".bias"]  # torch Linear stores [out, in]


def bert_hidden_states(ckpt: Checkpoint, ids: np.ndarray, mask: np.ndarray) -> list[np.ndarray]:
    """BERT encoder states: [embeddings, after layer 1, ..., after layer N], each float64 [B, S, H].

    ``ids``, ``mask``: int [B, S]; masked keys get a large negative score so that no
    real token attends to padding. Token type is 0 everywhere (single sentences).
    """
    w, c = ckpt.weights, ckpt.config
    eps, heads = c["layer_norm_eps"], c["num_attention_heads"]
    b, s = ids.shape
    x = (w["embeddings.word_embeddings.weight"][ids] + w["embeddings.position_embeddings.weight"][:s][None]
         + w["embeddings.token_type_embeddings.weight"][0])
    x = _layer_norm(x, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"], eps)
    states = [x]
    h = x.shape[-1]
    d = h // heads
    key_bias = np.where(mask.astype(bool), 0.0, -1e9)[:, None, None, :]  # [B, 1, 1, S_keys]
    for i in range(c["num_hidden_layers"]):
        p = f"encoder.layer.{i}."

        def split_heads(t):
            return t.reshape(b, s, heads, d).transpose(0, 2, 1, 3)  # [B, heads, S, d]

        q = split_heads(_dense(x, w, p + "attention.self.query"))
        k = split_heads(_dense(x, w, p + "attention.self.key"))
        v = split_heads(_dense(x, w, p + "attention.self.value"))
        scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(d) + key_bias
        scores -= scores.max(-1, keepdims=True)
        probs = np.exp(scores)
        probs /= probs.sum(-1, keepdims=True)
        ctx = (probs @ v).transpose(0, 2, 1, 3).reshape(b, s, h)
        x = _layer_norm(x + _dense(ctx, w, p + "attention.output.dense"),
                        w[p + "attention.output.LayerNorm.weight"], w[p + "attention.output.LayerNorm.bias"], eps)
        inner = _gelu_erf(_dense(x, w, p + "intermediate.dense"))
        x = _layer_norm(x + _dense(inner, w, p + "output.dense"),
                        w[p + "output.LayerNorm.weight"], w[p + "output.LayerNorm.bias"], eps)
        states.append(x)
    return states


def sentence_embedding(last_hidden: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """sentence-transformers' embedding for this model: masked mean of the token states, L2-normalised.
    [B, S, H], [B, S] -> [B, H]."""
    m = mask.astype(np.float64)[..., None]
    mean = (last_hidden * m).sum(1) / m.sum(1)
    return mean / np.linalg.norm(mean, axis=-1, keepdims=True)


def _is_punctuation(ch: str) -> bool:
    cp = ord(ch)
    # BERT counts every non-alphanumeric ASCII symbol as punctuation, plus Unicode P* categories.
    if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
        return True
    return unicodedata.category(ch).startswith("P")


def _basic_tokens(text: str) -> list[str]:
    """Uncased BERT pre-tokenisation: lowercase, strip accents, split on whitespace and punctuation."""
    text = unicodedata.normalize("NFD", text.lower())
    text = "".join(ch for ch in text if unicodedata.category(ch) != "Mn")
    tokens: list[str] = []
    for word in text.split():
        current = ""
        for ch in word:
            if _is_punctuation(ch):
                tokens += [current] if current else []
                tokens.append(ch)
                current = ""
            else:
                current += ch
        tokens += [current] if current else []
    return tokens


def wordpiece_ids(text: str, vocab: dict[str, int]) -> list[int]:
    """[CLS] + greedy longest-match-first WordPiece ids + [SEP] (no truncation, no padding)."""
    ids = [vocab["[CLS]"]]
    for word in _basic_tokens(text):
        pieces, start = [], 0
        while start < len(word):
            end = len(word)
            while end > start:
                piece = word[start:end] if start == 0 else "##" + word[start:end]
                if piece in vocab:
                    break
                end -= 1
            if end == start:  # no piece matches: the whole word is unknown
                pieces = [vocab["[UNK]"]]
                break
            pieces.append(vocab[piece])
            start = end
        ids += pieces
    return ids + [vocab["[SEP]"]]
