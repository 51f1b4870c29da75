"""Write an elastic admission stage (E²bird) in front of a model already in the repository.

``write_admission(repo, "bert_ee_stock", policy)`` adds ``bert_ee_stock_admission``
(the stage: the fronted model's inputs and outputs, one instance, Triton's
batcher with no delay, so requests queued while the stage was busy arrive in
one call, the stage forming its own batches; the policy in the ``policy``
parameter) and ``bert_ee_stock_admission_workers``: the fronted model's ONNX
file (copied) served by ``worker_processes`` Triton instances of one intra-op
thread each, no batcher, on which the stage runs its workers' batches (BLS).
With ``worker_processes=None`` the stage holds the ONNX file and runs its
workers as threads of its own process on one shared session (one copy of the
weights, as the paper shares them; measured slower on 2 cores, see
:mod:`e3.serving.ebird.host_ops`). Any model served from one ``model.onnx`` works: a
stock model, or split 1 of a plan (``<m>_split_1-<k>``).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from tritonclient.grpc import model_config_pb2 as mc

from e3.core.files import write_atomic
from e3.core.names import ANSWERING, INPUT_BOUNDS
from e3.core.manifest import read_manifest, write_manifest
from e3.core.spec import NUMPY_DTYPES, TensorSpec, dtype_from_config
from e3.export.device_repository import DeviceModel, write_device_config
from e3.export.repository import SERVING, ExportError, check_owned, staging, write_model_py
from e3.export.triton_config import DynamicBatching, ModelDescription, parse_config, render_config
from e3.serving.ebird.offline import CPU_RULE, offline_phase, onnx_timer, policies
from e3.serving.ebird.policy import POLICIES, PROFILED_TOTALS, make_policy, naive_engine

__all__ = ["admission_name", "workers_name", "write_admission", "write_device_stage", "profile_admission",
           "profile_served_model", "stage_policy", "naive_engine", "MODULE"]

MODULE = "e3.serving.ebird.model"   # what every stage's model.py imports


def admission_name(fronted: str) -> str:
    """``<fronted>_admission``: the stage in front of Triton model ``fronted``."""
    return f"{fronted}_admission"


def workers_name(stage: str) -> str:
    """``<stage>_workers``: the model whose instances run the stage's batches."""
    return f"{stage}_workers"


def _specs(tensors) -> tuple[TensorSpec, ...]:
    """A config's input or output list as TensorSpecs."""
    return tuple(TensorSpec(t.name, dtype_from_config(mc.DataType.Name(t.data_type)), tuple(t.dims))
                 for t in tensors)


def write_admission(repo: str | Path, fronted: str, policy: Mapping[str, Any], *, name: str | None = None,
                    intra_op_threads: int = 1, worker_processes: int | None = 2, response_threads: int = 2,
                    answering: str = "continuous") -> str:
    """Add the admission stage in front of ``fronted`` (a model of ``repo`` with ``1/model.onnx``);
    ``policy``: ``{"kind": "n-ebird"|"e-ebird", "engine": [...], "max_inflight": n, "confs": {...}}``,
    checked here. ``worker_processes``: Triton instances (of ``intra_op_threads`` threads each) of
    ``<name>_workers``, which run the workers' batches; the policy's ``slots`` (workers running at once)
    is set to it. None: the workers are threads of the stage (no workers' model). ``response_threads``:
    threads of the stage that send its answers (each send waits for the server's reply). ``answering``:
    ``continuous`` (the default: arrivals staged while workers compute) or ``inline`` (the fallback),
    :mod:`e3.serving.ebird.model`. Returns the stage's
    name; serve it with :func:`workers_name` of it (the stage loads that itself if it is not loaded)."""
    repo = Path(repo)
    name = name or admission_name(fronted)
    if worker_processes is not None:
        if worker_processes < 1:
            raise ValueError(f"worker_processes must be >= 1, got {worker_processes}")
        policy = {**policy, "slots": worker_processes}
    make_policy(policy["kind"], engine=policy.get("engine"), max_inflight=policy.get("max_inflight"),
                confs=policy.get("confs"), slots=policy.get("slots"))   # refuse a malformed policy first
    src = repo / fronted
    onnx = src / "1" / "model.onnx"
    if not (src / "config.pbtxt").exists():
        raise ExportError(f"{src} is not a model in the repository: export it first (e3 export)")
    if not onnx.exists():
        raise ExportError(f"{fronted} has no 1/model.onnx: the admission stage fronts one-file ONNX models "
                          "(a stock model or a split) exported for the embedded server")
    cfg = parse_config((src / "config.pbtxt").read_text())
    manifest = read_manifest(repo)
    check_owned(repo, name, manifest)
    workers = workers_name(name) if worker_processes is not None else None
    if response_threads < 1:
        raise ValueError(f"response_threads must be >= 1, got {response_threads}")
    if answering not in ANSWERING:
        raise ValueError(f"answering must be one of {', '.join(ANSWERING)}, got {answering!r}")
    params = {"policy": json.dumps(dict(policy), sort_keys=True), "intra_op_threads": str(intra_op_threads),
              "response_threads": str(response_threads), "answering": answering}
    # the fronted model's value bounds (token ids within the vocabulary, masks 0/1): the stage checks them when a
    # request arrives, so a bad request is refused alone instead of failing the worker batch it would share
    if INPUT_BOUNDS in cfg.parameters:
        params[INPUT_BOUNDS] = cfg.parameters[INPUT_BOUNDS].string_value
    if workers is not None:
        check_owned(repo, workers, manifest)
        params["workers_model"] = workers
        wdesc = ModelDescription(name=workers, kind="python", max_batch_size=cfg.max_batch_size,
                                 inputs=_specs(cfg.input), outputs=_specs(cfg.output), instances=worker_processes,
                                 dynamic_batching=None, parameters={"intra_op_threads": str(intra_op_threads)})
        with staging(repo, workers) as tmp:
            (tmp / "1").mkdir(parents=True)
            shutil.copyfile(onnx, tmp / "1" / "model.onnx")
            write_model_py(tmp, f"{SERVING}.split")
            write_atomic(tmp / "config.pbtxt", render_config(wdesc, "embedded"))
        manifest["models"][workers] = {"kind": "admission-workers", "model": fronted, "target": "embedded"}
    # Triton's batcher with no delay in front of the stage: nothing waits, and requests that arrived while
    # the stage was busy reach it in one execute call (one round trip to its process, not one per request)
    desc = ModelDescription(name=name, kind="python", max_batch_size=cfg.max_batch_size,
                            inputs=_specs(cfg.input), outputs=_specs(cfg.output), instances=1,
                            dynamic_batching=DynamicBatching((), 0), parameters=params)
    with staging(repo, name) as tmp:
        (tmp / "1").mkdir(parents=True)
        if workers is None:
            shutil.copyfile(onnx, tmp / "1" / "model.onnx")
        write_model_py(tmp, MODULE)
        write_atomic(tmp / "config.pbtxt", render_config(desc, "embedded"))
    manifest["models"][name] = {"kind": "admission", "model": fronted, "target": "embedded",
                                **({"workers": workers} if workers else {})}
    write_manifest(repo, manifest)
    return name


def write_device_stage(repo: str | Path, desc: DeviceModel, card) -> str:
    """E²bird's stage on a device (``desc.system == "admission"``: the model's head path in PyTorch on the
    instance's device, :mod:`e3.serving.ebird.model`) in ``repo``, after checking its policy: one instance (one
    pool), workers no larger than ``desc.max_batch``, a pool that can feed its largest worker. Returns its name."""
    if desc.system != "admission" or not desc.policy or desc.instances != 1:
        raise ValueError("an admission stage needs system 'admission', its policy and runs as one instance (one pool)")
    policy = make_policy(desc.policy["kind"], engine=desc.policy.get("engine"),
                         max_inflight=desc.policy.get("max_inflight"), confs=desc.policy.get("confs"))
    if max(policy.engine) > desc.max_batch:
        raise ValueError(f"the policy's workers go up to {max(policy.engine)} rows, above max_batch {desc.max_batch}")
    if desc.pool_slots and desc.pool_slots < max(policy.engine):
        raise ValueError(f"a pool of {desc.pool_slots} slots cannot feed a worker of {max(policy.engine)}")
    return write_device_config(Path(repo), desc, card, module=MODULE, extra_params={
        "policy": json.dumps(desc.policy, sort_keys=True), "pool_slots": str(desc.pool_slots or "")})


def profile_admission(onnx_file: str | Path, example: Mapping[str, np.ndarray], qos_ms: float, *,
                      batches: Sequence[int] = CPU_RULE.batches, totals: Sequence[int] = PROFILED_TOTALS,
                      max_workers: int = 4, repeats: int = CPU_RULE.repeats, intra_op_threads: int = 1,
                      progress: bool = True, clock: str = "wall") -> dict:
    """E²bird's offline phase (:func:`e3.serving.ebird.offline.offline_phase`, the CPU stage's rule
    :data:`~e3.serving.ebird.offline.CPU_RULE`) on one ONNX Runtime session of ``onnx_file``, its workers on
    threads as the stage runs them: one worker's latency per batch, MaxBS for ``qos_ms``, every set of at most
    ``max_workers`` workers per TotalBS up to MaxBS and the best per TotalBS (E-Ebird's ``confs``).
    ``example``: name -> [n, ...] inputs, n >= the largest batch; ``clock``: :func:`~e3.serving.ebird.offline.
    onnx_timer`'s."""
    n = len(next(iter(example.values())))
    rule = dataclasses.replace(CPU_RULE, batches=tuple(b for b in batches if b <= n), totals=tuple(totals),
                               max_workers=max_workers, repeats=repeats)
    doc = offline_phase(onnx_timer(onnx_file, example, intra_op_threads=intra_op_threads, clock=clock), rule,
                        qos_ms=qos_ms, echo=None, progress=progress)
    return {**doc, "qos_ms": qos_ms, "clock": clock}


def profile_served_model(repo: Path, model: str, qos_ms: float, *, max_workers: int) -> dict:
    """:func:`profile_admission` of ``model``, a model of the repository ``repo`` (its ``config.pbtxt`` and
    ``1/model.onnx``), on zeros of its inputs' shapes: a latency does not depend on the values (token 0 is
    padding)."""
    config_file = Path(repo) / model / "config.pbtxt"
    if not config_file.exists():
        raise ExportError(f"{config_file} does not exist: name a model of {repo} (e3 export writes them)")
    cfg = parse_config(config_file.read_text())
    example = {t.name: np.zeros((32, *t.dims), NUMPY_DTYPES[dtype_from_config(mc.DataType.Name(t.data_type))])
               for t in cfg.input}
    return profile_admission(Path(repo) / model / "1" / "model.onnx", example, qos_ms, max_workers=max_workers)


def stage_policy(kind: str, profile: Mapping[str, Any]) -> dict:
    """The admission stage's policy document for ``kind`` (``n-ebird`` or ``e-ebird``) from the offline
    ``profile`` (:func:`profile_admission`)."""
    if kind not in POLICIES:
        raise ValueError(f"unknown admission policy {kind!r}: choose one of {', '.join(POLICIES)}")
    return policies(profile)["N-Ebird" if kind == "n-ebird" else "E-Ebird"]
