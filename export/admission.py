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
:mod:`e3.serving.elastic`). Any model served from one ``model.onnx`` works: a
stock model, or split 1 of a plan (``<m>_split_1-<k>``).
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from tritonclient.grpc import model_config_pb2 as mc

from e3.core.files import write_atomic
from e3.core.manifest import read_manifest, write_manifest
from e3.core.spec import NUMPY_DTYPES, TensorSpec, dtype_from_config
from e3.export.repository import SERVING, ExportError, _check_owned, _staging, _write_model_py
from e3.export.triton_config import DynamicBatching, ModelDescription, parse_config, render_config
from e3.serving.admission import (PROFILED_TOTALS, best_worker_sets, engine_for, make_policy, max_batch_for_qos,
                                  naive_engine, worker_sets)
from e3.core.session import make_session

__all__ = ["admission_name", "workers_name", "write_admission", "profile_admission", "profile_served_model",
           "stage_policy", "naive_engine"]


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
                    intra_op_threads: int = 1, worker_processes: int | None = 2, response_threads: int = 2) -> str:
    """Add the admission stage in front of ``fronted`` (a model of ``repo`` with ``1/model.onnx``);
    ``policy``: ``{"kind": "n-ebird"|"e-ebird", "engine": [...], "max_inflight": n, "confs": {...}}``,
    checked here. ``worker_processes``: Triton instances (of ``intra_op_threads`` threads each) of
    ``<name>_workers``, which run the workers' batches; the policy's ``slots`` (workers running at once)
    is set to it. None: the workers are threads of the stage (no workers' model). ``response_threads``:
    threads of the stage that send its answers (each send waits for the server's reply). Returns the stage's
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
    _check_owned(repo, name, manifest)
    workers = workers_name(name) if worker_processes is not None else None
    if response_threads < 1:
        raise ValueError(f"response_threads must be >= 1, got {response_threads}")
    params = {"policy": json.dumps(dict(policy), sort_keys=True), "intra_op_threads": str(intra_op_threads),
              "response_threads": str(response_threads)}
    if workers is not None:
        _check_owned(repo, workers, manifest)
        params["workers_model"] = workers
        wdesc = ModelDescription(name=workers, kind="python", max_batch_size=cfg.max_batch_size,
                                 inputs=_specs(cfg.input), outputs=_specs(cfg.output), instances=worker_processes,
                                 dynamic_batching=None, parameters={"intra_op_threads": str(intra_op_threads)})
        with _staging(repo, workers) as tmp:
            (tmp / "1").mkdir(parents=True)
            shutil.copyfile(onnx, tmp / "1" / "model.onnx")
            _write_model_py(tmp, f"{SERVING}.split")
            write_atomic(tmp / "config.pbtxt", render_config(wdesc, "embedded"))
        manifest["models"][workers] = {"kind": "admission-workers", "model": fronted, "target": "embedded"}
    # Triton's batcher with no delay in front of the stage: nothing waits, and requests that arrived while
    # the stage was busy reach it in one execute call (one round trip to its process, not one per request)
    desc = ModelDescription(name=name, kind="python", max_batch_size=cfg.max_batch_size,
                            inputs=_specs(cfg.input), outputs=_specs(cfg.output), instances=1,
                            dynamic_batching=DynamicBatching((), 0), parameters=params)
    with _staging(repo, name) as tmp:
        (tmp / "1").mkdir(parents=True)
        if workers is None:
            shutil.copyfile(onnx, tmp / "1" / "model.onnx")
        _write_model_py(tmp, f"{SERVING}.elastic")
        write_atomic(tmp / "config.pbtxt", render_config(desc, "embedded"))
    manifest["models"][name] = {"kind": "admission", "model": fronted, "target": "embedded",
                                **({"workers": workers} if workers else {})}
    write_manifest(repo, manifest)
    return name


def profile_admission(onnx_file: str | Path, example: Mapping[str, np.ndarray], qos_ms: float, *,
                      batches: Sequence[int] = (1, 2, 4, 8, 16, 32), totals: Sequence[int] = PROFILED_TOTALS,
                      max_workers: int = 4, repeats: int = 3, intra_op_threads: int = 1,
                      progress: bool = True, clock: str = "wall") -> dict:
    """The offline phase of both policies, measured in this process on one shared session (as the stage
    runs it): the latency (ms, median of ``repeats``) of one worker per batch size, MaxBS for ``qos_ms``
    (:func:`~e3.serving.admission.max_batch_for_qos`), and for every TotalBS up to MaxBS the mean
    latency of every worker set of at most ``max_workers`` run concurrently, with the best set per
    TotalBS (E-Ebird's ``confs``). ``example``: name -> [n, ...] inputs, n >= the largest batch.

    A set's latency is the mean over its *inputs* (each worker's latency weighted by its batch). The
    paper averages over workers, which favours sets whose small workers finish early while most
    inputs wait in the large one (measured here on bert: [8, 4, 2, 2] "beat" [8, 8] by the workers'
    mean while its 8 inputs in the worker of 8 took as long).

    The paper profiles every set (Equation 6); sets of more than ``max_workers`` workers are left out
    here: on a CPU of a few cores they only time-slice the same cores (documented choice).

    ``clock``: ``"wall"`` (default) times each run by the wall clock; ``"cpu"`` by the CPU time of the
    thread that ran it, which is the run's compute when the session has one intra-op thread (ONNX Runtime
    then computes on the calling thread): what the run takes with a core to itself, whatever else the
    machine runs meanwhile (the bench's choice on a shared machine; it does not see two workers slowing
    each other through shared caches or memory bandwidth, nor more workers than cores)."""
    if clock not in ("wall", "cpu"):
        raise ValueError(f"clock must be 'wall' or 'cpu', got {clock!r}")
    if clock == "cpu" and intra_op_threads != 1:
        raise ValueError("clock='cpu' times the calling thread: it needs intra_op_threads=1")
    timer = time.thread_time if clock == "cpu" else time.perf_counter
    from tqdm import tqdm
    session = make_session(str(onnx_file), intra_op_threads)
    outputs = [o.name for o in session.get_outputs()]

    def feed(b: int) -> dict:
        return {k: np.ascontiguousarray(v[:b]) for k, v in example.items()}

    def run_set(workers: Sequence[int]) -> float:
        """Mean latency (ms) over the inputs of the workers, started together, each on its own batch."""
        feeds = [feed(b) for b in workers]
        took = [0.0] * len(workers)

        def one(i: int) -> None:
            t = timer()
            session.run(outputs, feeds[i])
            took[i] = (timer() - t) * 1e3

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(workers))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return sum(ms * b for ms, b in zip(took, workers)) / sum(workers)

    n = len(next(iter(example.values())))
    batches = [b for b in batches if b <= n]
    run_set([1])   # warm-up: the first run allocates
    latency = {}
    for b in tqdm(batches, desc="admission profile: one worker per batch", disable=not progress):
        latency[b] = float(np.median([run_set([b]) for _ in range(repeats)]))
    max_bs = max_batch_for_qos(latency, qos_ms)
    sets = [w for t in totals if t <= max_bs and t <= n for w in worker_sets(t, max_workers)]
    measured = {}
    for workers in tqdm(sets, desc="admission profile: worker sets per TotalBS", disable=not progress):
        measured[tuple(workers)] = float(np.median([run_set(workers) for _ in range(repeats)]))
    confs = best_worker_sets(measured)
    return {"qos_ms": qos_ms, "clock": clock, "latency_ms": {str(b): round(ms, 3) for b, ms in latency.items()},
            "max_bs": max_bs, "max_workers": max_workers,
            "sets_ms": {",".join(map(str, w)): round(ms, 3) for w, ms in measured.items()},
            "confs": {str(t): list(w) for t, w in confs.items()}, "engine": list(engine_for(confs)) if confs else []}


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
    ``profile`` (:func:`profile_admission`): MaxBS caps the inputs in flight."""
    max_bs = profile["max_bs"]
    if kind == "n-ebird":
        return {"kind": "n-ebird", "engine": naive_engine(max_bs), "max_inflight": max_bs}
    return {"kind": "e-ebird", "confs": profile["confs"], "max_inflight": max_bs}
