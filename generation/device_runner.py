"""The served generation splits as PyTorch modules on a device, each sequence's KV cache kept there.

:class:`DeviceRunner` has the call contract of the served ``_kv_split`` models (:mod:`e3.generation.kv_store`),
so the unchanged engine drives it on a GPU (``benchmarks/generation_gpu.py``) or on this machine's CPU (tests).
"""

from __future__ import annotations

import copy

import numpy as np
import torch

from e3.generation.engine import kvfill_name
from e3.generation.onnx_splits import DecodeSplit, KvFill

__all__ = ["DeviceRunner"]


class DeviceRunner:
    """``run(name, inputs)`` for the engine over PyTorch modules on ``device``: split j of ``spec`` and the
    kv-fill models. A call with ``seq_id`` keeps the cache on the device (the ``_kv_split`` contract of
    :mod:`e3.generation.kv_store`); a call with ``past_kv`` is stateless (profiling)."""

    def __init__(self, model, spec, device: str):
        self.device = device
        model = copy.deepcopy(model).to(device).eval()   # the caller's model stays where it is
        L = spec.full_layers or spec.num_layers
        self.modules = {}
        for j, (a, b) in enumerate(spec.ranges):
            self.modules[spec.split(j)] = DecodeSplit(model, a, b)
            if b != L:
                self.modules[kvfill_name(spec.model, b + 1, L)] = KvFill(model, b + 1, L)
        self.cache: dict[str, dict[int, object]] = {name: {} for name in self.modules}

    def _t(self, a):
        return torch.as_tensor(np.ascontiguousarray(a), device=self.device)

    def __call__(self, name: str, inputs: dict) -> dict:
        module, store = self.modules[name], self.cache[name]
        with torch.no_grad():
            if "release_ids" in inputs:
                for sid in inputs["release_ids"].reshape(-1).tolist():
                    store.pop(int(sid), None)
                return {}
            if "_kvfill_" in name:
                out = module(self._t(inputs["hidden"]), self._t(inputs["positions"]), self._t(inputs["head_index"]))
                return dict(zip(module.output_names, (o.cpu().numpy() for o in out)))
            x = self._t(inputs["input_ids" if "input_ids" in inputs else "hidden"])
            if "seq_id" not in inputs:   # stateless
                out = module(x, self._t(inputs["positions"]), self._t(inputs["past_kv"]), self._t(inputs["key_valid"]),
                             self._t(inputs["head_index"]))
                return dict(zip(module.output_names, (o.cpu().numpy() for o in out)))
            past_kv, key_valid = self._feed(store, inputs, module)
            out = module(x, self._t(inputs["positions"]), past_kv, key_valid, self._t(inputs["head_index"]))
            new = out[1]
            for i, (sid, t, c) in enumerate(zip(inputs["seq_id"].tolist(), inputs["past_len"].tolist(),
                                                inputs["new_count"].tolist())):
                self._write(store, int(sid), int(t), new[i, :, :, :, :c])
            return {k: v.cpu().numpy() for k, v in zip(module.output_names, out) if k != "new_kv"}

    def _write(self, store: dict, sid: int, at: int, kv) -> None:
        """Write kv [n, 2, kvh, c, d] at positions [at, at + c) of sequence sid's cache (grown by doubling)."""
        end = at + kv.shape[3]
        cur = store.get(sid)
        if cur is None or cur.shape[3] < end:
            grown = torch.zeros((*kv.shape[:3], max(16, 2 * end), kv.shape[4]), device=self.device)
            if cur is not None:
                grown[:, :, :, :cur.shape[3]] = cur
            store[sid] = cur = grown
        cur[:, :, :, at:end] = kv

    def _feed(self, store: dict, inputs: dict, module):
        ids, past = inputs["seq_id"].tolist(), inputs["past_len"].tolist()
        if "append_kv" in inputs and inputs["append_kv"].size:
            app = self._t(inputs["append_kv"])
            for i, (sid, t, c) in enumerate(zip(ids, past, inputs["append_count"].tolist())):
                if c:
                    self._write(store, int(sid), int(t - c), app[i, :, :, :, :c])
        c = module.model.config
        n = module.last - module.first + 1
        width = max(past) if past else 0
        kv = torch.zeros((len(ids), n, 2, c.num_kv_heads, width, c.head_dim), device=self.device)
        for i, (sid, t) in enumerate(zip(ids, past)):
            if t:
                kv[i, :, :, :, :t] = store[int(sid)][:, :, :, :t]
        chunk = inputs["chunk_valid"]
        valid = np.zeros((len(ids), width + chunk.shape[1]), bool)
        for i, t in enumerate(past):
            valid[i, :t] = True
        valid[:, width:] = chunk
        return kv, self._t(valid)
