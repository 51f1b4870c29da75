"""Write an elastic admission stage (E²bird) in front of a model already in the repository.

``write_admission(repo, "bert_ee_stock", policy)`` adds ``bert_ee_stock_admission``:
the fronted model's ONNX file (copied: the stage runs it in its own workers,
one copy of the weights shared by all of them), its inputs and outputs, one
instance, no Triton batcher (the stage forms its own batches), the policy in
the ``policy`` parameter. Any model served from one ``model.onnx`` works: a
stock model, or split 1 of a plan (``<m>_split_1-<k>``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Mapping

from tritonclient.grpc import model_config_pb2 as mc

from e3.core.files import write_atomic
from e3.core.manifest import read_manifest, write_manifest
from e3.core.spec import TensorSpec, dtype_from_config
from e3.export.repository import ExportError, _check_owned, _staging, _write_model_py
from e3.export.triton_config import ModelDescription, parse_config, render_config
from e3.serving.admission import make_policy

__all__ = ["admission_name", "write_admission"]


def admission_name(fronted: str) -> str:
    """``<fronted>_admission``: the stage in front of Triton model ``fronted``."""
    return f"{fronted}_admission"


def _specs(tensors) -> tuple[TensorSpec, ...]:
    """A config's input or output list as TensorSpecs."""
    return tuple(TensorSpec(t.name, dtype_from_config(mc.DataType.Name(t.data_type)), tuple(t.dims))
                 for t in tensors)


def write_admission(repo: str | Path, fronted: str, policy: Mapping[str, Any], name: str | None = None,
                    intra_op_threads: int = 1) -> str:
    """Add the admission stage in front of ``fronted`` (a model of ``repo`` with ``1/model.onnx``);
    ``policy``: ``{"kind": "n-ebird"|"e-ebird", "engine": [...], "max_inflight": n, "confs": {...}}``,
    checked here. Returns the stage's name."""
    repo = Path(repo)
    name = name or admission_name(fronted)
    make_policy(policy["kind"], engine=policy.get("engine"), max_inflight=policy.get("max_inflight"),
                confs=policy.get("confs"))   # refuse a malformed policy before writing anything
    src = repo / fronted
    onnx = src / "1" / "model.onnx"
    if not (src / "config.pbtxt").exists():
        raise ExportError(f"{src} is not a model in the repository: export it first (e3 export)")
    if not onnx.exists():
        raise ExportError(f"{fronted} has no 1/model.onnx: the admission stage fronts one-file ONNX models "
                          "(a stock model or a split) exported for the embedded server")
    cfg = parse_config((src / "config.pbtxt").read_text())
    manifest = read_manifest(repo)
    _check_owned(repo, name, manifest)
    desc = ModelDescription(name=name, kind="python", max_batch_size=cfg.max_batch_size,
                            inputs=_specs(cfg.input), outputs=_specs(cfg.output), instances=1,
                            dynamic_batching=None,
                            parameters={"policy": json.dumps(dict(policy), sort_keys=True),
                                        "intra_op_threads": str(intra_op_threads)})
    with _staging(repo, name) as tmp:
        (tmp / "1").mkdir(parents=True)
        shutil.copyfile(onnx, tmp / "1" / "model.onnx")
        _write_model_py(tmp, "e3.serving.elastic")
        write_atomic(tmp / "config.pbtxt", render_config(desc, "embedded"))
    manifest["models"][name] = {"kind": "admission", "model": fronted, "target": "embedded"}
    write_manifest(repo, manifest)
    return name
