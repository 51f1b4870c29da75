"""Export ExeGPT's front door ``<m>_generate_exegpt`` (``generation/exegpt/router.py``) beside a repository that
``e3 export-generate`` wrote: the same ``<m>_kv_split_*`` and kv-fill models, one more Python-backend model
whose config parameters carry the engine specs and the scheduler's settings (profile, planned output lengths,
prompt length, batch sizes, latency bound, re-plan policy, the schedule kinds it may choose, an optional
pinned schedule), and WAA's encode worker: ``<m>_enc_split_<a>-<b>``, one more set of the model's splits
(stateless, sharing the ``<m>_split_<a>-<b>`` ONNX files, one instance x one intra-op thread each), which
prefill the prompts and return their k/v for the hand-over to the decode worker (the ``<m>_kv_split_*``
models, which RRA also runs on).
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import asdict
from pathlib import Path

from e3.core.spec import TensorSpec
from e3.export.triton_config import ModelDescription
from e3.generation.engine import EngineSpec, kvfill_name, split_name
from e3.generation.repository import DOOR_INPUTS, DOOR_OUTPUTS, SPLIT_OUTPUTS, _write
from e3.generation.exegpt.scheduler import ReplanPolicy, RraSchedule, WaaSchedule
from e3.generation.exegpt.workload import LayerProfile, LengthDistribution

__all__ = ["exegpt_name", "encoder_name", "export_exegpt_door", "door_models"]

INPUTS = (*DOOR_INPUTS, TensorSpec("control", "BYTES", (1,)))
OUTPUTS = DOOR_OUTPUTS


def exegpt_name(model: str) -> str:
    """``smollm2-ee`` -> ``smollm2_ee_generate_exegpt``."""
    return f"{model.replace('-', '_')}_generate_exegpt"


def encoder_name(model: str) -> str:
    """Name prefix of WAA's encode-worker splits: ``smollm2-ee`` -> ``smollm2_ee_enc`` (so its splits are
    ``smollm2_ee_enc_split_<a>-<b>``, docs/design.md §2's form)."""
    return f"{model.replace('-', '_')}_enc"


def door_models(repo: Path, model: str) -> list[str]:
    """The Triton models the door needs loaded: the kv splits, the kv-fill models, WAA's encode-worker splits
    and the door itself."""
    spec = EngineSpec.from_dict(json.loads((repo / f"{model.replace('-', '_')}_generation.json").read_text()))
    m = spec.model
    L = spec.num_layers
    return ([f"{m}_kv_split_{a}-{b}" for a, b in spec.ranges] + [kvfill_name(m, b + 1, L) for _, b in spec.ranges[:-1]]
            + [split_name(encoder_name(model), a, b) for a, b in spec.ranges] + [exegpt_name(model)])


def _export_encoder(repo: Path, model: str, spec: EngineSpec) -> None:
    """``<m>_enc_split_<a>-<b>``: the stateless splits again, as Triton models of their own (WAA's encode worker)."""
    m = model.replace("-", "_")
    for a, b in spec.ranges:
        name = split_name(encoder_name(model), a, b)
        out = repo / name
        shutil.rmtree(out, ignore_errors=True)
        first = TensorSpec("input_ids", "INT64", (-1, -1)) if a == 1 else TensorSpec("hidden", "FP32", (-1, -1, -1))
        inputs = (first, TensorSpec("positions", "INT64", (-1, -1)), TensorSpec("past_kv", "FP32", (-1,) * 6),
                  TensorSpec("key_valid", "BOOL", (-1, -1)), TensorSpec("head_index", "INT64", (-1, -1)))
        outputs = SPLIT_OUTPUTS
        _write(out, ModelDescription(name=name, kind="onnx", max_batch_size=0, inputs=inputs, outputs=outputs,
                                     dynamic_batching=None, parameters={
                                         "intra_op_threads": "1",
                                         "onnx_file": f"../../{split_name(m, a, b)}/1/model.onnx"}),
               "e3.generation.generate_split")


def export_exegpt_door(repo: Path, model: str, profile: LayerProfile, *, lengths: LengthDistribution,
                       prompt_tokens: float, batch_sizes: tuple[int, ...], bound_ms: float = math.inf,
                       policy: ReplanPolicy = ReplanPolicy(), schedule: RraSchedule | WaaSchedule | None = None,
                       stop_at_eos: bool = True, name: str | None = None,
                       schedules: tuple[str, ...] = ("rra", "waa")) -> str:
    """Write ``<m>_generate_exegpt`` (or ``name``) into ``repo``, which must hold ``model`` exported by
    ``e3 export-generate``; returns the door's name.

    ``profile``: what plans start from until the door has timed its own steps (the offline profiler's, or any
    :class:`LayerProfile`); ``lengths``: the output lengths planned for at start (tokens); ``bound_ms``: the
    latency bound (inf: none; ``control`` requests change it); ``schedule``: pinned instead of planned;
    ``stop_at_eos`` False: every sequence runs to its ``max_new_tokens`` (benchmarks that draw output lengths
    from a distribution, as ``--validate`` does); ``schedules``: the kinds the planner may choose ("rra",
    "waa"; WAA runs on the encode worker ``<m>_enc_split_*`` this also writes, and the decode worker)."""
    from e3.generation.repository import _mark_optional, _write   # the same writers as the other routers
    m = model.replace("-", "_")
    spec_file = repo / f"{m}_generation.json"
    if not spec_file.exists():
        raise FileNotFoundError(f"{spec_file} not found: run `e3 export-generate {model} --repo {repo}` first")
    base = EngineSpec.from_dict(json.loads(spec_file.read_text()))
    # admission is the scheduler's: the engine admits whatever the door hands it
    spec = EngineSpec(**{**base.__dict__, "max_active": 1 << 20, "kv_in_splits": True, "split_model": f"{m}_kv",
                         "eos_id": base.eos_id if stop_at_eos else None})
    doc = {"profile": profile.to_dict(), "lengths": {"lengths": list(lengths.lengths), "probs": list(lengths.probs)},
           "prompt_tokens": float(prompt_tokens), "batch_sizes": sorted(set(int(b) for b in batch_sizes)),
           "bound_ms": None if math.isinf(bound_ms) else float(bound_ms), "policy": asdict(policy),
           "schedule": None if schedule is None else schedule.as_list(), "schedules": list(schedules)}
    unknown = set(schedules) - {"rra", "waa"}
    if unknown or not schedules:
        raise ValueError(f"schedules must name some of rra, waa; got {list(schedules)}")
    encoder = EngineSpec(**{**base.__dict__, "max_active": 1 << 20, "kv_in_splits": False,
                            "split_model": encoder_name(model), "eos_id": spec.eos_id})
    _export_encoder(repo, model, base)
    name = name or exegpt_name(model)
    out = repo / name
    shutil.rmtree(out, ignore_errors=True)
    params = {"engine": json.dumps(spec.to_dict()), "encoder": json.dumps(encoder.to_dict()), "exegpt": json.dumps(doc)}
    router = repo / f"{m}_generate" / "tokenizer.json"
    if router.exists():
        params["tokenizer"] = "tokenizer.json"
    _write(out, ModelDescription(name=name, kind="python", max_batch_size=0, inputs=INPUTS, outputs=OUTPUTS,
                                 dynamic_batching=None, parameters=params), "e3.generation.exegpt.router")
    if router.exists():
        shutil.copyfile(router, out / "tokenizer.json")
    _mark_optional(out / "config.pbtxt", [t.name for t in INPUTS])
    return name
