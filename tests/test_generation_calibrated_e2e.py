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
    names = [n for n in model_names("tiny-gen", spec) if "_kv_split" in n or "_kvfill_" in n] + [
        "tiny_gen_generate", "tiny_gen_generate_stream"]
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
    # on_slower=serve: exits as asked whatever the served costs predict (the in-process engine's costs differ)
    served = {kw: [generate(server.http_url, "tiny_gen_generate", p, max_new_tokens=8, **dict(kw)) for p in prompts]
              for kw in ((("min_agreement", 0.8), ("on_slower", "serve")),
                         (("tau", 0.5), ("measure", "classifier"), ("on_slower", "serve")))}
    files = onnx_files(repo, spec)
    stateful = EngineSpec.from_dict(engine)
    shapes = {stateful.split(j): (b - a + 1, 2, spec.kv_heads, spec.head_dim) for j, (a, b) in enumerate(spec.ranges)}
    for kw, got in served.items():
        runner = StoreRunner(OrtRunner({**files, **{stateful.split(j): files[spec.split(j)]
                                                    for j in range(len(spec.ranges))}}), shapes)
        want, _ = engine_tokens(stateful, None, prompts, new_tokens=8, mode="calm", runner=runner,
                                **{"tau": 2.0, **dict(kw)})
        assert all(g.parameters["e3_mode"] == ("full" if g.parameters.get("e3_fallback") else "calm") for g in got)
        assert [(g.tokens, g.exit_layers) for g in got] == [(w.tokens, w.exit_layers) for w in want], kw
    with pytest.raises(GenerationError, match="calibrated targets"):
        generate(server.http_url, "tiny_gen_generate", [1, 2], max_new_tokens=4, min_agreement=0.999)
    assert len(generate(server.http_url, "tiny_gen_generate", [1, 2], max_new_tokens=4).tokens) == 4


@pytest.mark.e2e
def test_plain_calls_send_nothing_and_say_how_they_were_served(calibrated):
    """Issue 40: a plain generate() / generate_stream() sends no knob, so the calibrated default applies
    (min_agreement 0.9; tiny-gen's random heads never pay: plain decoding, the full model's tokens), and the
    response's parameters say so; a raw threshold is predicted under the costs as served, and a request
    predicted slower is decoded plainly (fallback) or refused with the prediction (on_slower=refuse)."""
    from e3.generation.client import GenerationError, generate, generate_stream
    from e3.generation.models import load_generation_model
    from e3.generation.reference import generate_full
    server, spec, _ = calibrated
    model = load_generation_model("tiny-gen").decoder
    L = spec.num_layers
    for p in _prompts(10):   # >= 32 engine steps: the table is refitted from the timed calls at least once
        out = generate(server.http_url, "tiny_gen_generate", p, 6)
        assert out.tokens == generate_full(model, p, 6).tokens and set(out.exit_layers) == {L}
        assert out.parameters["e3_mode"] == "full" and out.parameters["e3_fallback"] is True
        assert "min_agreement 0.9" in out.parameters["e3_reason"]
    costs = out.costs   # the table as served: each kind of call the router timed (>= 8 calls each)
    assert {"split0", "split1", "split2+head"} <= set(costs["served"]), costs["served"]
    stream = generate_stream(server.grpc_url, "tiny_gen_generate_stream", _prompts(1)[0], 6)
    assert [t for c, _ in stream for t in c] == generate_full(model, _prompts(1)[0], 6).tokens
    assert stream.parameters["e3_mode"] == "full" and stream.parameters["e3_fallback"] is True
    for tau in (0.0, 0.3, 0.9):
        out = generate(server.http_url, "tiny_gen_generate", [1, 2, 3], 6, tau=tau)
        gain = float(out.parameters["e3_predicted_speedup"])
        assert out.parameters.get("e3_fallback", False) == (gain < 1.01), out.parameters
        if gain < 1.01:   # fallback: the full model's calls and tokens
            assert set(out.exit_layers) == {L} and "predicted at" in out.parameters["e3_reason"]
            with pytest.raises(GenerationError, match="refused.*predicted at"):
                generate(server.http_url, "tiny_gen_generate", [1, 2, 3], 6, tau=tau, on_slower="refuse")
    with pytest.raises(GenerationError, match="not both"):
        generate(server.http_url, "tiny_gen_generate", [1, 2], 4, tau=0.5, min_agreement=0.9)


@pytest.mark.e2e
def test_docs_examples_run(calibrated, capsys):
    """Issue 40: every example of docs/generation.md runs. The Python block runs as written against this
    tiny-gen server (its addresses and model prefix substituted; its prompt as token ids: tiny-gen has no
    tokenizer); of the shell block, the models `e3 serve` is told to load are those `e3 export-generate
    smollm2-ee` writes, and `e3 bench generate` takes the flags shown."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    from e3.generation.engine import EngineSpec
    from e3.generation.repository import model_names
    server, _, _ = calibrated
    text = (Path(__file__).resolve().parent.parent / "docs" / "generation.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks
    for code in blocks:
        code = (code.replace("127.0.0.1:8000", server.http_url).replace("127.0.0.1:8001", server.grpc_url)
                .replace("smollm2_ee", "tiny_gen").replace('chat_prompt("Name a fruit.")', "[1, 2, 3]"))
        exec(compile(code, "docs/generation.md", "exec"), {})
    printed = capsys.readouterr().out
    assert "full" in printed   # e3_mode of the plain call (tiny-gen's calibration falls back)
    shell = next(b for b in re.findall(r"```\n(.*?)```", text, re.S) if "e3 serve" in b)
    served = re.search(r"--models (.*?)\n\.venv", shell.replace("\\\n", ""), re.S).group(1).split(",")
    smollm2 = EngineSpec(model="smollm2_ee", ranges=((1, 10), (11, 20), (21, 30)), kv_heads=3, head_dim=64)
    assert set(served) <= set(model_names("smollm2-ee", smollm2)), set(served) - set(model_names("smollm2-ee", smollm2))
    for line in shell.splitlines():
        if line.startswith(".venv/bin/e3 bench generate"):
            args = line.split("#")[0].split()[3:]
            got = subprocess.run([str(Path(sys.executable).parent / "e3"), "bench", "generate", *args, "--help"],
                                 capture_output=True, text=True, timeout=60)
            assert got.returncode == 0, got.stderr
