"""End to end: the generation router and its splits on the real tritonserver (tiny-gen, random weights).

Must show (issue 14): for 50 prompts the served tokens equal the reference early-exit decoder's (greedy,
same tau), with their exit layers; in speculative (lossless) mode they equal the full model's greedy tokens.
The 50 requests are sent at once, so the router decodes them with continuous batching.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from helpers import serving

TAU = 0.3          # tiny-gen's random heads: about a third of the tokens leave at layer 1 or 2
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def gen_server(tmp_path_factory):
    from e3.generation.repository import export_generation_repository, model_names, router_names
    repo = tmp_path_factory.mktemp("gen-repo")
    spec = export_generation_repository("tiny-gen", repo, max_active=16, progress=False)
    names = model_names("tiny-gen", spec)
    with serving(repo, names, name="generation") as server:
        yield server, spec, router_names("tiny-gen")


def _prompts(n: int) -> list[list[int]]:
    out = []
    for seed in range(n):
        r = random.Random(seed)
        out.append([r.randrange(64) for _ in range(r.randint(1, 12))])
    return out


def _serve_all(server, model, prompts, **kw):
    from e3.generation.client import generate
    with ThreadPoolExecutor(16) as pool:
        return list(pool.map(lambda p: generate(server.http_url, model, p, max_new_tokens=NEW_TOKENS, **kw), prompts))


def test_served_tokens_equal_the_reference_early_exit_decoder(gen_server):
    from e3.generation.models import load_generation_model
    from e3.generation.reference import generate_early_exit
    server, spec, names = gen_server
    model = load_generation_model("tiny-gen").decoder
    prompts = _prompts(50)
    served = _serve_all(server, names["continuous"], prompts, mode="calm", tau=TAU)
    exits = 0
    for p, got in zip(prompts, served):
        ref = generate_early_exit(model, p, NEW_TOKENS, tau=TAU)
        assert (got.tokens, got.exit_layers) == (ref.tokens, ref.exit_layers), f"prompt {p}"
        exits += sum(e < spec.num_layers for e in ref.exit_layers)
    assert exits > 50   # the test exercises exits (and the KV fill of skipped layers), not only the full model


def test_kv_passed_as_tensors_gives_the_same_tokens(gen_server):
    """The alternative cache placement (the router keeps it and passes each split its rows' slice) serves
    the same tokens, with CALM exits and kv fills, and in speculative mode."""
    from e3.generation.models import load_generation_model
    from e3.generation.reference import generate_early_exit, generate_full
    server, _, names = gen_server
    model = load_generation_model("tiny-gen").decoder
    prompts = _prompts(20)
    calm = _serve_all(server, names["tensors"], prompts, mode="calm", tau=TAU)
    spec = _serve_all(server, names["tensors"], prompts, mode="speculative", draft_tokens=3)
    for p, c, s in zip(prompts, calm, spec):
        ref = generate_early_exit(model, p, NEW_TOKENS, tau=TAU)
        assert (c.tokens, c.exit_layers) == (ref.tokens, ref.exit_layers), f"prompt {p}"
        assert s.tokens == generate_full(model, p, NEW_TOKENS).tokens, f"prompt {p}"


def test_speculative_mode_equals_full_greedy(gen_server):
    from e3.generation.models import load_generation_model
    from e3.generation.reference import generate_full
    server, _, names = gen_server
    model = load_generation_model("tiny-gen").decoder
    prompts = _prompts(50)
    served = _serve_all(server, names["continuous"], prompts, mode="speculative", draft_tokens=3)
    for p, got in zip(prompts, served):
        assert got.tokens == generate_full(model, p, NEW_TOKENS).tokens, f"prompt {p}"


def test_naive_router_and_stream_give_the_same_tokens(gen_server):
    from e3.generation.client import generate, generate_stream
    server, _, names = gen_server
    p = _prompts(3)[2]
    plain = generate(server.http_url, names["continuous"], p, max_new_tokens=NEW_TOKENS, tau=TAU)
    naive = generate(server.http_url, names["naive"], p, max_new_tokens=NEW_TOKENS, tau=TAU)
    chunks = list(generate_stream(server.grpc_url, names["stream"], p, max_new_tokens=NEW_TOKENS, tau=TAU))
    assert naive.tokens == plain.tokens
    assert len(chunks) >= 2   # one response per step, not one at the end
    assert [t for c, _ in chunks for t in c] == plain.tokens


def test_bad_requests_get_errors_and_the_router_keeps_serving(gen_server):
    from e3.generation.client import GenerationError, generate
    server, _, names = gen_server
    with pytest.raises(GenerationError, match="empty prompt"):
        generate(server.http_url, names["continuous"], [], max_new_tokens=NEW_TOKENS)
    with pytest.raises(GenerationError, match="mode must be one of"):
        generate(server.http_url, names["continuous"], [1, 2], max_new_tokens=NEW_TOKENS, mode="fast")
    with pytest.raises(GenerationError, match="no tokenizer"):
        generate(server.http_url, names["continuous"], "hello", max_new_tokens=NEW_TOKENS)
    with pytest.raises(GenerationError, match="out of the vocabulary"):
        generate(server.http_url, names["continuous"], [1, 10_000], max_new_tokens=NEW_TOKENS)
    assert len(generate(server.http_url, names["continuous"], [1, 2, 3], max_new_tokens=NEW_TOKENS).tokens) == NEW_TOKENS
