"""A Triton model repository for early-exit generation: split models, kv-fill models and generation routers.

For a model ``<m>`` (``smollm2-ee`` -> ``smollm2_ee``) with exit heads after layers e1 < e2 < ...:

* ``<m>_split_<a>-<b>``: layers a..b and the head after b (ONNX; on the embedded server a Python-backend
  model running it in ONNX Runtime, one intra-op thread; see ``generation/generate_split.py``), stateless: the
  caller passes each sequence's cache; prefill and decode both use them;
* ``<m>_kv_split_<a>-<b>``: the same split (sharing its ONNX file) keeping each sequence's cache in its
  instance (:mod:`e3.generation.kv_store`, one instance);
* ``<m>_kvfill_<e+1>-<L>`` per exit e: the skipped layers' k/v from the exit state (CALM);
* ``<m>_generate``: the generation router (``generation/generate_router.py``) over the ``_kv_split`` models,
  continuous batching over up to ``max_active`` sequences, per-token exits, survivors re-batched between
  splits; a plain (non-decoupled) model any HTTP/gRPC client can call;
* ``<m>_generate_naive``: the same, one sequence at a time (``max_active`` 1), the naive early-exit baseline;
* ``<m>_generate_stream``: the same as ``<m>_generate``, decoupled, one response per step (gRPC streaming);
* ``<m>_generate_tensors``: the same as ``<m>_generate`` over the stateless splits, the KV cache passed as
  tensors: the placement measured against (``e3 bench generate``: kept in the instances ran 1.5x faster).

Splits have no dynamic batcher (``max_batch_size`` 0): the router forms every batch itself (a batch is the
rows of one step, and their caches differ in length, so Triton could not concatenate two calls anyway).
"""

from __future__ import annotations

import json
import logging
import random
import shutil
from dataclasses import asdict, replace
from pathlib import Path

from tqdm import tqdm

from e3.core.names import served_name
from e3.core.spec import TensorSpec
from e3.export.triton_config import ModelDescription, render_config
from e3.generation.calibration import calibrate_model
from e3.generation.engine import EngineSpec, kvfill_name, split_name
from e3.generation.helios import Candidate, HeliosSettings, check_candidates
from e3.generation.models import heads_path, load_generation_model
from e3.generation.onnx_splits import export_kvfill, export_split, split_ranges
from e3.generation.training import calibration_prompts

# A generation front door's request and answer tensors (every router of generated text takes these, plus its
# own control input; HELIOS's door answers which model served too)
DOOR_INPUTS = (TensorSpec("input_ids", "INT64", (-1,)), TensorSpec("text", "BYTES", (1,)),
               TensorSpec("max_new_tokens", "INT32", (1,)), TensorSpec("mode", "BYTES", (1,)),
               TensorSpec("tau", "FP32", (1,)), TensorSpec("draft_tokens", "INT32", (1,)))
# a stateless split's outputs (generation/onnx_splits.py), wherever its Triton config is written
SPLIT_OUTPUTS = (TensorSpec("hidden_out", "FP32", (-1, -1, -1)), TensorSpec("new_kv", "FP32", (-1,) * 6),
                 TensorSpec("token", "INT64", (-1, -1)), TensorSpec("confidence", "FP32", (-1, -1)),
                 TensorSpec("exit_scores", "FP32", (-1, -1, 2)))
# the generation routers' CALM controls beside ``tau``: a quality target, and the confidence measure for tau
CALM_INPUTS = (TensorSpec("min_agreement", "FP32", (1,)), TensorSpec("measure", "BYTES", (1,)),
               TensorSpec("on_slower", "BYTES", (1,)))
DOOR_OUTPUTS = (TensorSpec("tokens", "INT64", (-1,)), TensorSpec("exit_layers", "INT32", (-1,)),
                TensorSpec("text_out", "BYTES", (1,)), TensorSpec("ttft_ms", "FP32", (1,)),
                TensorSpec("total_ms", "FP32", (1,)))

__all__ = ["export_generation_repository", "served_name", "router_names", "onnx_files", "model_names"]

log = logging.getLogger(__name__)


def router_names(model: str) -> dict[str, str]:
    m = served_name(model)
    return {"continuous": f"{m}_generate", "naive": f"{m}_generate_naive", "stream": f"{m}_generate_stream",
            "tensors": f"{m}_generate_tensors"}


def onnx_files(repo: Path, spec: EngineSpec) -> dict[str, str]:
    """{served model name: its model.onnx} for the splits and kv-fill models of ``spec`` in ``repo`` (for
    :class:`e3.generation.engine.OrtRunner`)."""
    L = spec.num_layers
    names = [split_name(spec.model, a, b) for a, b in spec.ranges]
    names += [kvfill_name(spec.model, b + 1, L) for _, b in spec.ranges[:-1]]
    return {n: str(repo / n / "1" / "model.onnx") for n in names}


def model_names(model: str, spec: EngineSpec) -> list[str]:
    """Every Triton model :func:`export_generation_repository` writes for ``model`` (what a server loads)."""
    m = served_name(model)
    L = spec.num_layers
    return ([split_name(p, a, b) for p in (m, f"{m}_kv") for a, b in spec.ranges]
            + [kvfill_name(m, b + 1, L) for _, b in spec.ranges[:-1]] + list(router_names(model).values()))


def _write(out: Path, desc: ModelDescription, module: str) -> None:
    (out / "1").mkdir(parents=True, exist_ok=True)
    (out / "1" / "model.py").write_text(f'"""Generated by `e3 export-generate`; the code lives in the e3 package."""\n'
                                        f"from {module} import TritonPythonModel  # noqa: F401\n")
    (out / "config.pbtxt").write_text(render_config(desc, "embedded"))


def export_generation_repository(model: str, repo: Path, max_active: int = 16, *, progress: bool = True,
                                 tokenizer: bool = True, calibrate: bool | None = None,
                                 calibration_prompts: int = 64) -> EngineSpec:
    """Export ``model`` (see :mod:`e3.generation.models`) into ``repo``; returns the engine spec the routers use.

    Existing models of the same names are replaced. Each ONNX file is checked against PyTorch. With
    ``calibrate`` (default: models with a tokenizer, i.e. SmolLM2) the splits' costs are profiled and CALM's
    exits calibrated to every ``min_agreement`` target on ``calibration_prompts`` held-out prompts
    (:mod:`e3.generation.calibration`, cached beside the heads); both go into the routers' engine spec, so the
    served model records what it was calibrated to."""
    gm = load_generation_model(model, progress=progress)
    c = gm.decoder.config
    m = served_name(model)
    ranges = tuple(split_ranges(c.num_layers, c.exit_layers))
    spec = EngineSpec(model=m, ranges=ranges, kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                      max_active=max_active, eos_id=gm.eos_id, vocab_size=c.vocab_size)
    repo.mkdir(parents=True, exist_ok=True)
    jobs = [("split", a, b) for a, b in ranges] + [("kvfill", b + 1, c.num_layers) for _, b in ranges[:-1]]
    for kind, a, b in tqdm(jobs, desc=f"exporting {m}", unit="model", disable=not progress):
        name = split_name(m, a, b) if kind == "split" else kvfill_name(m, a, b)
        out = repo / name
        shutil.rmtree(out, ignore_errors=True)
        if kind == "split":
            export_split(gm.decoder, a, b, path=out / "1" / "model.onnx")
            inputs = (TensorSpec("input_ids", "INT64", (-1, -1)) if a == 1 else TensorSpec("hidden", "FP32", (-1, -1, -1)),
                      TensorSpec("positions", "INT64", (-1, -1)), TensorSpec("past_kv", "FP32", (-1,) * 6),
                      TensorSpec("key_valid", "BOOL", (-1, -1)), TensorSpec("head_index", "INT64", (-1, -1)))
            outputs = SPLIT_OUTPUTS
        else:
            export_kvfill(gm.decoder, a, b, path=out / "1" / "model.onnx")
            inputs = (TensorSpec("hidden", "FP32", (-1, -1, -1)), TensorSpec("positions", "INT64", (-1, -1)),
                      TensorSpec("head_index", "INT64", (-1, -1)))
            outputs = (TensorSpec("new_kv", "FP32", (-1,) * 6), TensorSpec("token", "INT64", (-1, -1)),
                       TensorSpec("confidence", "FP32", (-1, -1)))
        _write(out, ModelDescription(name=name, kind="onnx", max_batch_size=0, inputs=inputs, outputs=outputs,
                                     dynamic_batching=None, parameters={"intra_op_threads": "1"}),
               f"{__package__}.generate_split")
    if calibrate if calibrate is not None else gm.tokenizer is not None:
        spec = _calibrated(gm, spec, repo, calibration_prompts, progress)
    router_inputs, router_outputs = (*DOOR_INPUTS, *CALM_INPUTS), (*DOOR_OUTPUTS, TensorSpec("served_as", "BYTES", (1,)))
    tok_file = "tokenizer.json" if tokenizer and gm.tokenizer is not None else ""
    for a, b in ranges:   # the same splits keeping the cache in their instance
        name = split_name(f"{m}_kv", a, b)
        out = repo / name
        shutil.rmtree(out, ignore_errors=True)
        first = TensorSpec("input_ids", "INT64", (-1, -1)) if a == 1 else TensorSpec("hidden", "FP32", (-1, -1, -1))
        inputs = (first, TensorSpec("positions", "INT64", (-1, -1)), TensorSpec("head_index", "INT64", (-1, -1)),
                  TensorSpec("chunk_valid", "BOOL", (-1, -1)), TensorSpec("seq_id", "INT64", (-1,)),
                  TensorSpec("past_len", "INT64", (-1,)), TensorSpec("new_count", "INT64", (-1,)),
                  TensorSpec("append_kv", "FP32", (-1,) * 6), TensorSpec("append_count", "INT64", (-1,)),
                  TensorSpec("release_ids", "INT64", (-1,)))
        outputs = (TensorSpec("hidden_out", "FP32", (-1, -1, -1)), TensorSpec("token", "INT64", (-1, -1)),
                   TensorSpec("confidence", "FP32", (-1, -1)), TensorSpec("exit_scores", "FP32", (-1, -1, 2)))
        _write(out, ModelDescription(name=name, kind="onnx", max_batch_size=0, inputs=inputs, outputs=outputs,
                                     dynamic_batching=None, parameters={
                                         "intra_op_threads": "1", "kv_store": "1",
                                         "onnx_file": f"../../{split_name(m, a, b)}/1/model.onnx"}),
               f"{__package__}.generate_split")
        _mark_optional(out / "config.pbtxt", [t.name for t in inputs])
    for kind, name in router_names(model).items():
        out = repo / name
        shutil.rmtree(out, ignore_errors=True)
        s = EngineSpec(**{**spec.__dict__, "max_active": 1 if kind == "naive" else max_active,
                          **({} if kind == "tensors" else {"kv_in_splits": True, "split_model": f"{m}_kv"})})
        params = {"engine": json.dumps(s.to_dict()), "decoupled": "1" if kind == "stream" else "0"}
        if tok_file:
            params["tokenizer"] = tok_file   # beside config.pbtxt
        desc = ModelDescription(name=name, kind="python", max_batch_size=0, inputs=router_inputs,
                                outputs=router_outputs, dynamic_batching=None, parameters=params)
        _write(out, desc, f"{__package__}.generate_router")
        if kind == "stream":
            with (out / "config.pbtxt").open("a") as f:
                f.write("model_transaction_policy {\n  decoupled: true\n}\n")
        if tok_file:
            gm.tokenizer.save(str(out / "tokenizer.json"))
        _mark_optional(out / "config.pbtxt", [t.name for t in router_inputs])
    (repo / f"{m}_generation.json").write_text(json.dumps(spec.to_dict(), indent=1))
    return spec


def _calibrated(gm, spec: EngineSpec, repo: Path, prompts: int, progress: bool) -> EngineSpec:
    """``spec`` with measured costs and the calibration of CALM's exits (cached per trained heads)."""
    heads = heads_path(gm.name)
    stamp = f"{heads.stat().st_mtime_ns}-{prompts}" if heads.exists() else "untrained"
    cache = heads.with_name(f"{heads.stem.removesuffix('_heads')}_calibration_{stamp}.json")
    if gm.tokenizer is not None:
        ids = [gm.tokenizer.encode(p).ids for p in calibration_prompts(prompts)]
    else:   # a test model without a tokenizer: seeded random prompts
        r, vocab = random.Random(300), gm.decoder.config.vocab_size
        ids = [[r.randrange(vocab) for _ in range(r.randint(2, 12))] for _ in range(prompts)]
        cache = None if gm.name.startswith("tiny") else cache
    costs, doc = calibrate_model(gm.decoder, spec, onnx_files(repo, spec), ids, cache=cache, progress=progress)
    for t in doc["targets"]:
        log.info("min_agreement %.2f: %s, thresholds %s, predicted agreement %.3f, speed-up %.2f%s",
                 t["min_agreement"], t["measure"], t["thresholds"], t["predicted_agreement"],
                 t["predicted_speedup"], " (fallback: exits do not pay)" if t["fallback"] else "")
    return replace(spec, costs=costs, calibration=doc)


def _mark_optional(config: Path, names: list[str]) -> None:
    """Mark inputs ``names`` optional (the model checks what it needs: a router one of ``input_ids``/``text``;
    a split with a store, either a batch or ``release_ids``)."""
    text = config.read_text()
    for name in names:
        text = text.replace(f'name: "{name}"\n', f'name: "{name}"\n  optional: true\n', 1)
    config.write_text(text)


HELIOS = "helios_generate"


def helios_candidate(model: str) -> dict:
    """The sizes HELIOS's memory budget and cost model count for ``model`` (float32 weights as served)."""
    gm = load_generation_model(model, progress=False)
    d, c = gm.decoder, gm.decoder.config
    layer = sum(p.numel() for p in d.layers[0].parameters())
    head = c.hidden_size * c.hidden_size
    cand = Candidate(name=served_name(model), exits=tuple(c.exit_layers), num_layers=c.num_layers,
                     layer_bytes=4 * layer, base_bytes=4 * (d.embed_tokens.weight.numel() + d.norm.weight.numel()),
                     head_bytes=4 * head, kv_bytes=2 * c.num_kv_heads * c.head_dim * 4,
                     head_cost=round((c.vocab_size * c.hidden_size + head) / layer, 3),
                     fill_cost=round(2 * c.hidden_size * c.num_kv_heads * c.head_dim / layer, 4))
    return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(cand).items()}


def export_helios_repository(models: list[str], repo: Path, *, memory_mb: float, tau: float = 0.9,
                             eval_prompts: int = 5, ri: int = 150, cbc_max: int = 50, window: int = 100,
                             switch_gain: float = 1.25, min_tokens: int = 20, progress: bool = True,
                             fixed: bool = True, reuse_splits: bool = False) -> list[str]:
    """Export every candidate in ``models`` (their splits and kv-fill models, see
    :func:`export_generation_repository`) and HELIOS's front door ``helios_generate``
    (``generation/helios_router.py``) over them, with the memory budget ``memory_mb`` MiB. With ``fixed``, also
    ``helios_only_<m>`` per candidate: the same router serving that candidate whole under the same budget, no
    controller (the baselines of ``e3 bench helios``). Returns the front doors' names; load only those (the
    router loads the split models it needs)."""
    if len(models) < 1:
        raise ValueError("HELIOS needs at least one candidate model")
    cands = [helios_candidate(model) for model in models]     # checked before anything is written
    vocab = {load_generation_model(m, progress=False).decoder.config.vocab_size for m in models}
    if len(vocab) != 1:
        raise ValueError(f"HELIOS's candidates must share a tokenizer; their vocabularies differ: {sorted(vocab)}")
    settings = dict(tau=tau, memory_bytes=int(memory_mb * 2**20), eval_prompts=eval_prompts, ri=ri, cbc_max=cbc_max,
                    window=window, switch_gain=switch_gain, min_tokens=min_tokens)
    hs = HeliosSettings(candidates=tuple(Candidate(**{**c, "exits": tuple(c["exits"])}) for c in cands), **settings)
    hs.validate()
    check_candidates(hs, 64)
    specs = []
    for model in models:
        saved = repo / f"{served_name(model)}_generation.json"
        if reuse_splits and saved.exists():
            spec = EngineSpec.from_dict(json.loads(saved.read_text()))
        else:
            spec = export_generation_repository(model, repo, progress=progress, tokenizer=False)
        specs.append(EngineSpec(**{**spec.__dict__, "max_active": 256, "kv_in_splits": True,
                                   "split_model": f"{served_name(model)}_kv"}))
    gm = load_generation_model(models[0], progress=False)
    tok_file = "tokenizer.json" if gm.tokenizer is not None else ""
    inputs = (*DOOR_INPUTS, TensorSpec("status", "BYTES", (1,)))
    outputs = (*DOOR_OUTPUTS, TensorSpec("served_by", "BYTES", (1,)))
    doors = {HELIOS: None}
    if fixed:
        doors.update({f"helios_only_{c['name']}": [c["name"], c["num_layers"]] for c in cands})
    for name, only in doors.items():
        out = repo / name
        shutil.rmtree(out, ignore_errors=True)
        doc = {"candidates": [{"candidate": c, "engine": s.to_dict()} for c, s in zip(cands, specs)],
               "settings": settings, "fixed": only}
        params = {"helios": json.dumps(doc)}
        if tok_file:
            params["tokenizer"] = tok_file
        _write(out, ModelDescription(name=name, kind="python", max_batch_size=0, inputs=inputs, outputs=outputs,
                                     dynamic_batching=None, parameters=params), f"{__package__}.helios_router")
        if tok_file:
            gm.tokenizer.save(str(out / "tokenizer.json"))
        _mark_optional(out / "config.pbtxt", [t.name for t in inputs])
    return list(doors)
