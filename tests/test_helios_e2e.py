"""HELIOS on the real embedded tritonserver: a request stream whose difficulty shifts drives the breach counter
to both of its decisions (load the rest of the model; switch model), the models Triton has loaded follow, no
request fails, and every answer equals the PyTorch reference decoder of the configuration that served it.

The candidates are ``tiny-helios-a`` and ``-b`` (:func:`e3.generation.decoder.banded_decoder`; 2 layers, an
exit after layer 1: split models ``_kv_split_1-1``, ``_kv_split_2-2``, ``_kvfill_2-2``). Difficulty is the
prompt's band: A answers band 1 at its exit and band 2 only at its final head; B answers band 3 at its exit
and bands 1-2 at its final head. Costs per token (layer-equivalents, head 0.33, k/v copy 0.11): 1.33 up to
layer 1, 1.44 whole when the token left at layer 1, 2.67 when it went through. So:

1. band 1: Step 2 evaluates both (2 prompts each, whole): A left at layer 1 always, B never: A up to layer 1;
2. band 2: A's exit breaches on every token; the rest of A (1.44 per token by its profile) beats B whole
   (2.67): **load the rest**. After 10 served prompts (RI), Step 2 again, on the next prompts;
3. A is evaluated on a band-1 and a band-2 prompt, B on a band-3 and a band-1 prompt: each left at layer 1
   half of the time, so each is feasible up to layer 1 (breach rate 0.5, the tolerance) at the same cost: A
   (first) is chosen; then band-2 prompts make A breach again, and B up to layer 1 (1.33) is predicted 1.54x
   faster than the rest of A (0.5 x 1.44 + 0.5 x 2.67): **switch**. A's models are unloaded.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.http as http

from helpers import serving

pytestmark = pytest.mark.e2e

TAU, NEW = 0.5, 8


@pytest.fixture(scope="module")
def helios(tmp_path_factory):
    from e3.generation.repository import export_helios_repository
    repo = tmp_path_factory.mktemp("helios")
    # cbc_max 10 of 20 tokens: two all-breach sequences trigger; min_tokens high so that decisions come from
    # the evaluated profiles (the pure tests cover measured rows).
    export_helios_repository(["tiny-helios-a", "tiny-helios-b"], repo, memory_mb=0.25, tau=TAU, eval_prompts=2,
                             ri=10, cbc_max=10, window=20, min_tokens=10**6, progress=False, fixed=False)
    with serving(repo, ["helios_generate"], name="helios") as server:
        yield server


def _generate(client, prompt: list[int]):
    ids = http.InferInput("input_ids", [len(prompt)], "INT64")
    ids.set_data_from_numpy(np.array(prompt, np.int64))
    n = http.InferInput("max_new_tokens", [1], "INT32")
    n.set_data_from_numpy(np.array([NEW], np.int32))
    r = client.infer("helios_generate", [ids, n])
    return r.as_numpy("tokens").tolist(), r.as_numpy("exit_layers").tolist(), r.as_numpy("served_by")[0].decode()


def _status(client) -> dict:
    s = http.InferInput("status", [1], "BYTES")
    s.set_data_from_numpy(np.array([b"?"], dtype=object))
    return json.loads(client.infer("helios_generate", [s]).as_numpy("text_out")[0])


def _loaded(client) -> set[str]:
    return {m["name"] for m in client.get_model_repository_index() if m.get("state") == "READY"} - {"helios_generate"}


def _prompts(band: int, n: int, seed: int) -> list[list[int]]:
    from e3.generation.decoder import BAND_TOKENS
    rng = np.random.default_rng(seed)
    tokens = list(BAND_TOKENS[band])
    return [[int(t) for t in rng.choice(tokens, size=int(rng.integers(2, 6)))] for _ in range(n)]


def _phase(url, prompts, workers=1):
    with ThreadPoolExecutor(workers) as pool:
        def one(p):
            with http.InferenceServerClient(url) as c:
                return _generate(c, p)
        return list(pool.map(one, prompts))


def _split_models(m: str, depth: int) -> set[str]:
    """Split models of candidate m served up to ``depth`` (2 layers, an exit after layer 1)."""
    return {f"{m}_kv_split_1-1"} | ({f"{m}_kv_split_2-2", f"{m}_kvfill_2-2"} if depth == 2 else set())


def test_breach_counter_loads_the_rest_then_switches_model_and_triton_follows(helios):
    from e3.generation.models import load_generation_model
    from e3.generation.reference import generate_early_exit
    decoders = {f"tiny_helios_{x}": load_generation_model(f"tiny-helios-{x}").decoder for x in "ab"}
    url = helios.http_url
    answers = []
    with http.InferenceServerClient(url) as client:
        assert _loaded(client) == set()                                   # nothing before the first request

        easy = _prompts(1, 8, seed=1)
        answers += list(zip(easy, _phase(url, easy)))
        st = _status(client)
        assert st["chosen"] == ["tiny_helios_a", 1] and [d["kind"] for d in st["decisions"]] == ["choose"], json.dumps(st)
        assert _loaded(client) == _split_models("tiny_helios_a", 1)      # partial: split 1-1 only

        medium = _prompts(2, 6, seed=2)
        answers += list(zip(medium, _phase(url, medium, workers=2)))
        st = _status(client)
        assert st["decisions"][1]["kind"] == "load_rest", st["decisions"]
        assert st["chosen"] == ["tiny_helios_a", 2]
        assert _loaded(client) == _split_models("tiny_helios_a", 2)

        assert [d["kind"] for d in st["decisions"]] == ["choose", "load_rest", "evaluate"], st["decisions"]

        mixed = [*_prompts(1, 1, 3), *_prompts(2, 1, 4), *_prompts(3, 1, 5), *_prompts(1, 1, 6),   # Step 2
                 *_prompts(2, 2, 7), *_prompts(3, 2, 8)]
        answers += list(zip(mixed, _phase(url, mixed)))
        st = _status(client)
        kinds = [d["kind"] for d in st["decisions"]]
        assert kinds == ["choose", "load_rest", "evaluate", "choose", "switch"], st["decisions"]
        assert st["decisions"][3]["after"] == ["tiny_helios_a", 1]
        assert st["chosen"] == ["tiny_helios_b", 1]
        assert _loaded(client) == _split_models("tiny_helios_b", 1)      # A's models are gone
        assert st["memory_bytes"] <= int(0.25 * 2**20)

    import urllib.request

    from e3.core.telemetry import metric_samples
    text = urllib.request.urlopen(helios.metrics_url, timeout=10).read().decode()
    decisions = {labels["kind"]: v for name, labels, v in metric_samples(text) if name == "e3_helios_decisions"}
    assert decisions == {"choose": 2, "load_rest": 1, "evaluate": 1, "switch": 1}, decisions
    breaches = {labels["depth"]: v for name, labels, v in metric_samples(text)
                if name == "e3_helios_breaches" and labels["model"] == "tiny_helios_a"}
    assert breaches.get("1", 0) >= 2 * NEW and breaches.get("2", 0) == 0    # a whole model never breaches

    served = {}
    for prompt, (tokens, exits, by) in answers:                          # every request answered, and right
        m, depth = by.split(":")
        ref = generate_early_exit(decoders[m], prompt, NEW, tau=TAU, depth=int(depth))
        assert (tokens, exits) == (ref.tokens, ref.exit_layers), (prompt, by)
        served[by] = served.get(by, 0) + 1
    assert {"tiny_helios_a:1", "tiny_helios_a:2", "tiny_helios_b:2", "tiny_helios_b:1"} <= set(served), served


def test_bad_requests_get_errors_and_helios_keeps_serving(helios):
    from tritonclient.utils import InferenceServerException
    with http.InferenceServerClient(helios.http_url) as client:
        tau = http.InferInput("tau", [1], "FP32")
        tau.set_data_from_numpy(np.array([0.1], np.float32))
        ids = http.InferInput("input_ids", [2], "INT64")
        ids.set_data_from_numpy(np.array([1, 2], np.int64))
        with pytest.raises(InferenceServerException, match="input tau is not accepted"):
            client.infer("helios_generate", [ids, tau])
        bad = http.InferInput("input_ids", [2], "INT64")
        bad.set_data_from_numpy(np.array([1, 999], np.int64))
        with pytest.raises(InferenceServerException, match="out of the vocabulary"):
            client.infer("helios_generate", [bad])
        big = http.InferInput("input_ids", [1], "INT64")
        big.set_data_from_numpy(np.array([1], np.int64))
        n = http.InferInput("max_new_tokens", [1], "INT32")
        n.set_data_from_numpy(np.array([2000], np.int32))
        with pytest.raises(InferenceServerException, match="more than the memory budget"):
            client.infer("helios_generate", [big, n])
        tokens, _, _ = _generate(client, [1, 2, 3])
        assert len(tokens) == NEW
