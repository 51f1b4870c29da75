"""ExeGPT's WAA over two engines in process (no server): an encode worker over stateless splits hands prefilled
sequences, caches included, to a decode worker whose splits keep the cache; the answers are the reference
model's. Also the engine's hand-over hooks on their own. About 2 s (tiny-gen)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from e3.generation.decoder import tiny_decoder
from e3.generation.engine import EngineSpec, GenerationEngine, GenRequest, OrtRunner
from e3.generation.reference import generate_early_exit, generate_full


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    from e3.generation.kv_store import StoreRunner
    from e3.generation.repository import export_generation_repository, onnx_files
    repo = tmp_path_factory.mktemp("tiny-gen-waa")
    spec = export_generation_repository("tiny-gen", repo, progress=False)
    files = onnx_files(repo, spec)
    c = tiny_decoder().config

    def make():
        enc = GenerationEngine(EngineSpec(**{**spec.__dict__, "max_active": 1 << 20}), OrtRunner(files))
        dspec = EngineSpec(**{**spec.__dict__, "max_active": 1 << 20, "kv_in_splits": True,
                              "split_model": "tiny_gen_kv"})
        shapes = {dspec.split(j): (b - a + 1, 2, c.num_kv_heads, c.head_dim) for j, (a, b) in enumerate(spec.ranges)}
        runner = StoreRunner(OrtRunner({**files, **{dspec.split(j): files[spec.split(j)]
                                                    for j in range(len(spec.ranges))}}), shapes)
        return enc, GenerationEngine(dspec, runner), runner
    return make


def _prompts(n: int) -> list[list[int]]:
    return [[random.Random(i).randrange(64) for _ in range(random.Random(i).randint(1, 12))] for i in range(n)]


def test_waa_over_two_engines_answers_as_the_reference(engines):
    from e3.generation.exegpt.waa import WaaPair
    enc, dec, runner = engines()
    pair = WaaPair(enc)
    modes = ["full", "calm", "speculative"]
    prompts = _prompts(24)
    waiting = [GenRequest(i, p, 1 + i % 9, mode=modes[i % 3], tau=0.3, draft_tokens=1 + i % 3)
               for i, p in enumerate(prompts)]
    done, adopted_per_iter, b_e = {}, [], 4
    try:
        while waiting or pair.busy() or dec.active:
            got = pair.collect(wait=True)    # lock-step: each iteration takes the hand-over begun at the last
            if got is not None:
                assert not got.failed
                dec.adopt(got.seqs)
                adopted_per_iter.append(len(got.seqs))
            if waiting and not pair.busy():
                pair.hand(waiting[:b_e])
                waiting = waiting[b_e:]
            done.update({f.request_id: f for f in dec.step()})
    finally:
        pair.close()
    model = tiny_decoder()
    for i, p in enumerate(prompts):
        n = 1 + i % 9
        ref = generate_early_exit(model, p, n, tau=0.3) if modes[i % 3] == "calm" else generate_full(model, p, n)
        assert done[i].error is None and done[i].tokens == ref.tokens, (i, modes[i % 3])
        assert done[i].total_s >= done[i].ttft_s > 0
    assert max(adopted_per_iter) == b_e and sum(adopted_per_iter) == len(prompts)
    assert all(not store.kv for store in runner.stores.values())   # every cache released at the end
    assert enc.idle


def test_the_hand_over_is_a_copy_of_the_prompts_cache(engines):
    """After adoption, the decode worker's split stores hold exactly the k/v the encode worker's prefill made."""
    enc, dec, runner = engines()
    enc.submit(GenRequest("a", [5, 6, 7, 8, 9], 3, mode="full"))
    enc.submit(GenRequest("b", [1, 2], 3, mode="full"))
    seqs, failed = enc.encode()
    assert not failed and enc.idle and [len(s.tokens) for s in seqs] == [1, 1]
    caches = [s.kv.copy() for s in seqs]
    dec.adopt(seqs)
    assert dec.step() == []
    for s, kv in zip(seqs, caches):
        n = len(s.req.prompt)
        for j, (a, b) in enumerate(dec.spec.ranges):
            stored = runner.stores[dec.spec.split(j)].kv[s.sid]
            assert np.array_equal(stored[:, :, :, :n], kv[a - 1:b, :, :, :n])
            assert s.lengths[j] == n + 1


def test_the_hooks_refuse_the_wrong_engine_forms(engines):
    from e3.generation.exegpt.waa import WaaPair
    enc, dec, _ = engines()
    with pytest.raises(ValueError, match="kv_in_splits False"):
        dec.encode()
    with pytest.raises(ValueError, match="stateless splits"):
        WaaPair(dec)
    dec.submit(GenRequest("x", [1, 2, 3], 2, mode="full"))
    dec.step()
    with pytest.raises(ValueError, match="cache travelled"):
        enc.adopt(list(dec.active))
