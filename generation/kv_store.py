"""The KV cache kept inside a split's instance: the alternative to passing it as tensors.

A split model with a store (``kv_store`` = 1) holds, per sequence id, the k/v of its own layers. A call
carries, per row, ``seq_id``, ``past_len`` (positions the sequence has before this chunk, counting any
appended now), ``new_count`` (chunk positions to keep) and optionally ``append_kv`` / ``append_count``
(k/v the router computed elsewhere for positions just before the chunk: CALM's kv fill of a token that left
at an earlier exit). The store writes the appended k/v at ``[past_len - append_count, past_len)``, builds the
padded ``past_kv`` and ``key_valid`` for ONNX Runtime from ``[0, past_len)``, and writes the chunk's new k/v
at ``[past_len, past_len + new_count)``. Positions beyond are dropped implicitly: a speculative rejection is
just a smaller ``past_len`` next time. ``release_ids`` drops finished sequences.

Pure numpy (no Triton), shared by ``generation/generate_split.py`` and the in-process runner
(:class:`StoreRunner`), and tested without a server.

Decision: one instance per split with a store (a sequence's cache must be where its rows run; Triton's
sequence batcher could route by correlation id, but it batches one sequence per slot and so cannot take a
router-formed batch of many sequences in one request).
"""

from __future__ import annotations

import numpy as np

__all__ = ["KvStore", "StoreRunner", "STORE_INPUTS"]

STORE_INPUTS = ("seq_id", "past_len", "new_count", "append_kv", "append_count", "release_ids")


class KvStore:
    """Per-sequence k/v of one split: ``[n_layers, 2, kv_heads, capacity, head_dim]`` float32 each."""

    def __init__(self):
        self.kv: dict[int, np.ndarray] = {}

    def _room(self, sid: int, length: int, like: np.ndarray) -> np.ndarray:
        kv = self.kv.get(sid)
        if kv is None or kv.shape[3] < length:
            cap = max(16, 1 << int(max(1, length) - 1).bit_length())
            grown = np.zeros((*like.shape[:3], cap, like.shape[4]), np.float32)
            if kv is not None:
                grown[:, :, :, :kv.shape[3]] = kv
            self.kv[sid] = kv = grown
        return kv

    def release(self, ids) -> None:
        for sid in np.asarray(ids).reshape(-1).tolist():
            self.kv.pop(int(sid), None)

    def feed(self, inputs: dict, shape: tuple[int, int, int, int]) -> dict:
        """ONNX inputs ``past_kv`` and ``key_valid`` for a call (see the module docstring); ``shape`` =
        (n_layers, 2, kv_heads, head_dim) of this split. Writes ``append_kv`` first."""
        ids = inputs["seq_id"].reshape(-1).astype(np.int64)
        past = inputs["past_len"].reshape(-1).astype(np.int64)
        n, two, kvh, d = shape
        like = np.zeros((n, two, kvh, 1, d), np.float32)
        if "append_kv" in inputs and inputs["append_kv"].size:
            counts = inputs["append_count"].reshape(-1)
            for i, (sid, t, c) in enumerate(zip(ids, past, counts)):
                if c:
                    kv = self._room(int(sid), int(t), like)
                    kv[:, :, :, t - c:t] = inputs["append_kv"][i, :, :, :, :c]
        width = int(past.max()) if len(past) else 0
        chunk = inputs["chunk_valid"]
        kv_in = np.zeros((len(ids), n, two, kvh, width, d), np.float32)
        valid = np.zeros((len(ids), width + chunk.shape[1]), bool)
        for i, (sid, t) in enumerate(zip(ids, past)):
            if t:
                kv_in[i, :, :, :, :t] = self.kv[int(sid)][:, :, :, :t]
            valid[i, :t] = True
        valid[:, width:] = chunk
        return {"past_kv": kv_in, "key_valid": valid}

    def keep(self, inputs: dict, new_kv: np.ndarray) -> None:
        """Store the first ``new_count`` chunk positions of ``new_kv`` [B, n, 2, kvh, S, d] after ``past_len``."""
        ids = inputs["seq_id"].reshape(-1)
        for i, (sid, t, c) in enumerate(zip(ids, inputs["past_len"].reshape(-1), inputs["new_count"].reshape(-1))):
            kv = self._room(int(sid), int(t + c), new_kv[i])
            kv[:, :, :, t:t + c] = new_kv[i, :, :, :, :c]


class StoreRunner:
    """In-process ``run`` for an engine whose splits keep the cache (:class:`KvStore` per split), over
    :class:`e3.generation.engine.OrtRunner`: what ``generation/generate_split.py`` does with ``kv_store`` = 1."""

    def __init__(self, ort_runner, shapes: dict[str, tuple[int, int, int, int]]):
        self.ort, self.shapes = ort_runner, shapes
        self.stores = {name: KvStore() for name in shapes}

    def __call__(self, name: str, inputs: dict) -> dict:
        if name not in self.stores:
            return self.ort(name, inputs)
        store = self.stores[name]
        if "release_ids" in inputs:
            store.release(inputs["release_ids"])
            return {}
        feed = {k: v for k, v in inputs.items() if k not in STORE_INPUTS and k != "chunk_valid"}
        feed.update(store.feed(inputs, self.shapes[name]))
        out = self.ort(name, feed)
        store.keep(inputs, out["new_kv"])
        return {k: v for k, v in out.items() if k != "new_kv"}
