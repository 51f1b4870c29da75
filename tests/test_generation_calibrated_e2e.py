"""A calibrated generation model on the real tritonserver (tiny-gen, random weights): the router records its
calibration and costs in its config, serves min_agreement and the cheap measures with the in-process engine's
tokens, and names a target it was not calibrated to."""

from __future__ import annotations

import json
import random

import pytest

from helpers import serving


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    from e3.generation.repository import export_generation_repository, model_names
    repo = tmp_path_factory.mktemp("gen-calibrated")
    spec = export_generation_repository("tiny-gen", repo, max_active=16, progress=False, calibrate=True,
                                        calibration_prompts=24)
    names = [n for n in model_names("tiny-gen", spec) if "_kv_split" in n or "_kvfill_" in n] + ["tiny_gen_generate"]
    with serving(repo, names, name="generation-calibrated") as server:
        yield server, spec, repo


def _prompts(n: int) -> list[list[int]]:
    return [[random.Random(i).randrange(64) for _ in range(random.Random(i).randint(1, 10))] for i in range(n)]


@pytest.mark.e2e
def test_router_serves_its_calibration(calibrated):
    from e3.benchmarks.generation import engine_tokens
    from e3.generation.client import GenerationError, generate
    from e3.generation.engine import EngineSpec
    from e3.generation.kv_store import StoreRunner
    from e3.generation.repository import onnx_files
    from e3.generation.engine import OrtRunner
    server, spec, repo = calibrated
    from tritonclient import http
    config = http.InferenceServerClient(server.http_url).get_model_config("tiny_gen_generate")
    engine = json.loads(config["parameters"]["engine"]["string_value"])   # what the served model records
    assert [t["min_agreement"] for t in engine["calibration"]["targets"]] == [0.8, 0.9, 0.95, 0.99]
    assert len(engine["costs"]["splits"]) == 3
    prompts = _prompts(12)
    served = {kw: [generate(server.http_url, "tiny_gen_generate", p, max_new_tokens=8, **dict(kw)) for p in prompts]
              for kw in ((("min_agreement", 0.8),), (("tau", 0.5), ("measure", "classifier")))}
    files = onnx_files(repo, spec)
    stateful = EngineSpec.from_dict(engine)
    shapes = {stateful.split(j): (b - a + 1, 2, spec.kv_heads, spec.head_dim) for j, (a, b) in enumerate(spec.ranges)}
    for kw, got in served.items():
        runner = StoreRunner(OrtRunner({**files, **{stateful.split(j): files[spec.split(j)]
                                                    for j in range(len(spec.ranges))}}), shapes)
        want, _ = engine_tokens(stateful, None, prompts, new_tokens=8, mode="calm", runner=runner,
                                **{"tau": 2.0, **dict(kw)})
        assert [(g.tokens, g.exit_layers) for g in got] == [(w.tokens, w.exit_layers) for w in want], kw
    with pytest.raises(GenerationError, match="calibrated targets"):
        generate(server.http_url, "tiny_gen_generate", [1, 2], max_new_tokens=4, min_agreement=0.999)
    assert len(generate(server.http_url, "tiny_gen_generate", [1, 2], max_new_tokens=4).tokens) == 4
