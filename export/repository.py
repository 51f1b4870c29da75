"""Write a Triton model repository for an early-exit model and a plan.

For model ``m`` (served name ``<m>``) and a plan with splits S1..Sn it writes:

* ``<m>_split_<a>-<b>``  one ONNX split per plan split (dynamic batching, instance group)
* ``<m>_router``         the E3 router (Python backend, BLS), the plan in its parameters
* ``<m>_stock``          the stock model (no ramps), one ONNX file
* ``<m>_ee``             the naive in-process early-exit baseline (one ONNX file per block, named as the
                         router's, composed into one graph at load under an entropy rule)
* ``e3_repository.json`` the manifest: models e3 created, the current plan, the model card, and what every
                         exported part (block file, split model) reads and writes (``part_io``)

Everything serving needs is checked here, so that a repository that exports also loads: the model's state
layout (every block hands on every state tensor the card names), the exit rule (built, its module shipped
beside the router and ``<m>_ee`` under ``1/e3_rules/`` and built again in an isolated interpreter from
there, and the exported blocks under it answering as PyTorch does: :mod:`e3.export.rules`). torch.onnx
drops an input a graph never reads (a state a block overwrites without reading, a state only ramps read
given to the final block); each part's reads are recorded (the split models' configs declare exactly
those inputs, the router and ``<m>_ee`` get them in their ``part_io`` parameter) and serving passes each
part exactly those.

Each model is written into a temporary directory and moved into place, so a
failure leaves nothing half-written; a failed export puts the repository back as
it found it (the models it replaced, its manifest, or no repository at all: a
half-exported deployment would load in ``e3 serve`` without its router). A
directory in the repository that the manifest does not list as e3's is never touched.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from safetensors.torch import save_model
from tqdm import tqdm

from e3.core.files import write_atomic
from e3.core.manifest import MANIFEST, ManifestError, read_manifest, write_manifest
from e3.core.names import (INPUT_BOUNDS, SHIPPED_MODELS_DIR, WEIGHTS_FILE, block_file, ee_name, preprocess_name, ramp_output, ramps_in_range,
                           ranges_from_cuts, router_name, served_name, split_name, state_output, stock_name)
from e3.core.plan import Plan, SplitPlan, default_plan
from e3.core.spec import ModelCard, TensorSpec, answer_specs
from e3.export import tensorrt
from e3.models.api import EarlyExitModel, SplitModule
from e3.export.onnx_export import StateLayoutError, check_state_layout, export_onnx, part_io
from e3.export.rules import RuleError, check_rule_parity, check_shipped, resolve_rule, ship_module, ship_rule
from e3.export.triton_config import DynamicBatching, EnsembleStep, ModelDescription, render_config
from e3.models.data.text import minilm_tokenizer_json
from e3.models.zoo import load_shipped_model, resolve_model, resolve_stock
from e3.serving.tokenizer import TOKENIZER_FILE

__all__ = ["ExportError", "ExportSettings", "export_repository", "answer_specs",
           "all_ranges"]

log = logging.getLogger(__name__)
SERVING = "e3.serving"   # the package whose modules the generated model.py files import
# <m>_router's module: the CPU router, or the device router for a plan of device splits (chosen at load, so a
# plan switch between forms is a reload like any other)
ROUTER_MODULE = f"{SERVING}.device.router"


class ExportError(RuntimeError):
    """The repository cannot be written as asked; the message says why."""


@dataclass(frozen=True)
class ExportSettings:
    target: str = "embedded"        # "embedded" (Python backend + ONNX Runtime) or "ngc"
    batch_size: int = 8             # preferred batch size of every split (until the planner sets them)
    split_instances: int = 1        # Triton instances per split
    router_instances: int | None = None  # router instances; None: what the plan needs (Plan.router_instances)
    baseline_instances: int = 1     # instances of <m>_stock and <m>_ee
    queue_delay_us: int = 2000      # dynamic batchers' max queue delay
    slo_ms: float = 1000.0
    format: str = "onnx"            # split/stock files: "onnx", or "tensorrt" (model.plan; --target ngc only)
    fp16: bool = False              # TensorRT engines may use FP16 kernels
    baselines: bool = True          # also write <m>_stock and <m>_ee (False: the E3 path only)
    # Splits' queue policy (REJECT calls whose BLS timeout expired in their queue). Off by default: with any
    # queue policy Triton 2.51's batcher stops prefetching and waits for a free instance by polling; measured
    # here (E3 router, 2 constant splits, 16 clients x 8 inputs, 3 interleaved rounds of 8 s): p99 203, 627,
    # 541 ms with it against 128, 122, 139 without, and 2,110 against 2,398 inputs/s. Late rows are still
    # dropped by the router's scheduler before dispatch and by its watchdog at the deadline (+50 ms).
    split_queue_policy: bool = False
    # Most inputs the router holds at once (admitted, not yet answered); a request that would exceed it is
    # refused at once with HTTP 503 and counted in e3_rejected_total. None: unbounded (the router admits
    # every request). The router's config parameter max_queue_inputs; kept across plan switches.
    max_queue_inputs: int | None = None
    # GPUs of the pod that serves the splits (--target ngc): > 0 makes every split and <m>_stock a KIND_GPU model
    # spread over GPUs 0..gpus-1 (triton_config.gpu_instance_groups; ONNX files then run on ONNX Runtime's CUDA
    # provider in Triton's onnxruntime backend). 0: CPU instances (ONNX) or GPU 0 (TensorRT plans).
    gpus: int = 0


FORMATS = ("onnx", "tensorrt")


def _check_settings(settings: ExportSettings) -> None:
    if settings.max_queue_inputs is not None and settings.max_queue_inputs < 1:
        raise ExportError(f"max_queue_inputs must be at least 1 (inputs), got {settings.max_queue_inputs}; "
                          "leave it out for no limit")
    if settings.gpus < 0 or (settings.gpus and settings.target != "ngc"):
        raise ExportError(f"gpus must be >= 0 and needs --target ngc (the embedded server has no GPU backend); "
                          f"got {settings.gpus} with target {settings.target}")
    if settings.format not in FORMATS:
        raise ExportError(f"unknown format {settings.format!r}; use one of {', '.join(FORMATS)}")
    if settings.format == "tensorrt":
        if settings.target != "ngc":
            raise ExportError("--format tensorrt needs --target ngc: the embedded server has no TensorRT backend "
                              "(its splits run ONNX Runtime in the Python backend); use --format onnx there")
        try:
            tensorrt.import_tensorrt()  # fail before anything is written
        except tensorrt.TensorRTError as err:
            raise ExportError(str(err)) from None


def all_ranges(num_blocks: int) -> list[tuple[int, int]]:
    """Every contiguous block range a..b of an L-block model (L(L+1)/2 splits)."""
    return [(a, b) for a in range(1, num_blocks + 1) for b in range(a, num_blocks + 1)]


def export_repository(model_name: str, cuts: str | list[int] | None, repo: Path,
                      *, settings: ExportSettings = ExportSettings(), plan: Plan | None = None,
                      progress: bool = True, extra_ranges: list[tuple[int, int]] = ()) -> Plan:
    """Export ``model_name`` cut at ``cuts`` (or as ``plan`` says) into ``repo``; returns the plan.

    ``extra_ranges`` pre-exports further split models (e.g. :func:`all_ranges`) beside
    the plan's, so that a controller can switch cuts without exporting on the
    critical path; they get the plan's first split's batching settings and every ramp.
    """
    repo = Path(repo)
    _check_settings(settings)
    model = resolve_model(model_name)
    card = model.card
    try:
        check_state_layout(model)
    except StateLayoutError as err:
        raise ExportError(f"{model_name}: {err}") from None
    m = served_name(model_name)
    if plan is None:
        ranges = ranges_from_cuts(cuts, card.num_blocks)
        plan = default_plan(m, card.num_blocks, ranges, exit_rule=card.exit_rule, ramp_blocks=card.ramp_blocks,
                            batch_size=settings.batch_size, instances=settings.split_instances,
                            queue_delay_us=settings.queue_delay_us, slo_ms=settings.slo_ms)
    plan.validate(card.ramp_blocks)
    try:
        rule = resolve_rule(plan.exit_rule)
        with tempfile.TemporaryDirectory(prefix="e3-rule-") as tmp:   # before anything is written
            ship_rule(rule, Path(tmp))
            check_shipped(rule, Path(tmp))
    except RuleError as err:
        raise ExportError(f"{model_name}: {err}") from None
    undo = _Undo(repo)
    try:
        plan = _export_steps(model_name, model, plan, repo, settings, rule, extra_ranges, progress, undo)
    except BaseException:
        undo.rollback()
        raise
    undo.commit()
    return plan


def _export_steps(model_name: str, model: EarlyExitModel, plan: Plan, repo: Path, settings: ExportSettings,
                  rule, extra_ranges, progress: bool, undo: "_Undo") -> Plan:
    """:func:`export_repository`'s writing half: every model of ``plan`` into ``repo``, then the manifest (what
    it replaces kept by ``undo`` until the caller commits or rolls back)."""
    card = model.card
    m = served_name(model_name)
    _check_writable(repo)
    try:
        manifest = read_manifest(repo)
    except ManifestError as err:
        raise ExportError(str(err)) from None
    splits = {s.model: s for s in plan.triton_splits}
    for a, b in extra_ranges:
        extra = SplitPlan(model=split_name(m, a, b), first_block=a, last_block=b,
                          batch_size=plan.splits[0].batch_size, instances=plan.splits[0].instances,
                          queue_delay_us=plan.splits[0].queue_delay_us,
                          enabled_ramps=ramps_in_range(card.ramp_blocks, a, b, num_blocks=card.num_blocks))
        splits.setdefault(extra.model, extra)
    baselines = [stock_name(m), ee_name(m)] if settings.baselines else []
    steps = [*[(name, "split") for name in splits], (router_name(m), "router"),
             *[(name, kind) for name, kind in zip(baselines, ("stock", "ee"))]]
    if card.preprocess:  # text front door: <m> = <m>_preprocess -> <m>_router
        steps += [(preprocess_name(m), "preprocess"), (m, "ensemble")]
    for name, _ in steps:
        check_owned(repo, name, manifest)
    io: dict[str, dict[str, list[str]]] = {}   # part (block file, split model) -> what it reads and writes
    for name, kind in tqdm(steps, desc=f"export {m}", unit="model", disable=not progress):
        with staging(repo, name, undo=undo) as tmp:
            if kind == "split":
                io[name] = _write_split(model, splits[name], tmp, settings)
            elif kind == "router":
                io.update(_write_router(model, plan, name, tmp, settings, rule=rule, split_io=io,
                                        source=model_name))
            elif kind == "stock":
                _write_stock(model_name, name, tmp, settings)
            elif kind == "preprocess":
                _write_preprocess(card, name, tmp, settings)
            elif kind == "ensemble":
                _write_ensemble(card, m, tmp, settings)
            else:
                _write_ee(model, plan, name, tmp, settings, rule=rule)
        manifest["models"][name] = {"kind": kind, "model": model_name, "target": settings.target}
    front = [router_name(m), *([preprocess_name(m), m] if card.preprocess else [])]
    manifest["deployments"][m] = {"model": model_name, "card": card.to_dict(), "plan": plan.to_dict(),
                                  "front_door": m if card.preprocess else router_name(m), "router": router_name(m),
                                  "baselines": baselines, "part_io": io,
                                  "serve": [*(s.model for s in plan.triton_splits), *front, *baselines]}
    write_manifest(repo, manifest)
    return plan


def _write_split(model: EarlyExitModel, split, out: Path, settings: ExportSettings) -> dict[str, list[str]]:
    """One constant split's Triton model; returns what its graph reads and writes (its config declares
    exactly the inputs it reads)."""
    module = SplitModule(model, split.first_block, split.last_block, split.enabled_ramps)
    card = model.card
    outputs = _output_specs(card, module)
    return _write_onnx_model(module, out, ModelDescription(
        name=split.model, kind="onnx", max_batch_size=card.max_batch_size, inputs=module.input_specs,
        outputs=outputs, instances=split.instances,
        # No delay in Triton's batcher: the router's scheduler forms the batches (the plan's delay is its wait),
        # and a delayed batcher would merge them.
        dynamic_batching=DynamicBatching((split.batch_size,), 0, reject_late=settings.split_queue_policy)), settings)


def _write_stock(model_name: str, name: str, out: Path, settings: ExportSettings) -> None:
    stock = resolve_stock(model_name)
    card = stock.card
    module = SplitModule(stock, 1, card.num_blocks, ())
    _write_onnx_model(module, out, ModelDescription(
        name=name, kind="onnx", max_batch_size=card.max_batch_size, inputs=card.inputs,
        outputs=(TensorSpec("logits", "FP32", (card.num_classes,)),), instances=settings.baseline_instances,
        dynamic_batching=DynamicBatching((settings.batch_size,), settings.queue_delay_us)), settings,
        output_names=["logits"])


def _write_ee(model: EarlyExitModel, plan: Plan, name: str, out: Path, settings: ExportSettings,
              *, rule) -> None:
    card = model.card
    enabled = plan.enabled_ramps
    io = {}
    for k in range(1, card.num_blocks + 1):
        # named as the router's blocks: its compact split's code runs them (serving/compact.py)
        path = out / "1" / block_file(k, ramp=k in enabled)
        export_onnx(SplitModule(model, k, k, tuple(r for r in enabled if r == k)), path,
                    max_batch_size=card.max_batch_size)
        io[path.name] = part_io(path)
    _ship(rule, out / "1")
    _write_python_model(out, ModelDescription(
        name=name, kind="python", max_batch_size=card.max_batch_size, inputs=card.inputs,
        outputs=answer_specs(card), instances=settings.baseline_instances,
        dynamic_batching=DynamicBatching((settings.batch_size,), settings.queue_delay_us),
        parameters={"model_card": json.dumps(card.to_dict()), "exit_rule": json.dumps(plan.exit_rule),
                    "enabled_ramps": json.dumps(list(enabled)), "intra_op_threads": "1",
                    "part_io": json.dumps(io, sort_keys=True)}),
        f"{SERVING}.ee", settings)


def _ship(rule, version_dir: Path) -> None:
    """The rule's module beside a model that runs it (e3.export.rules; export_repository checked up front that
    it builds from what is shipped, in an isolated interpreter)."""
    try:
        ship_rule(rule, version_dir)
    except RuleError as err:
        raise ExportError(str(err)) from None


def _write_router(model: EarlyExitModel, plan: Plan, name: str, out: Path, settings: ExportSettings,
                  *, rule, split_io: dict, source: str) -> dict[str, dict[str, list[str]]]:
    """The router, with every block as its own ONNX file beside it, with and without its ramp: what it
    runs itself for a compact split (and any later plan may make a split compact or disable a ramp, so
    they are always there). Checks the rule on those blocks against PyTorch; returns what every block file
    reads and writes (its ``part_io`` parameter also holds the split models' ``split_io``)."""
    card = model.card
    io = {}
    for k, ramp in [*((k, False) for k in range(1, card.num_blocks + 1)), *((k, True) for k in card.ramp_blocks)]:
        path = out / "1" / block_file(k, ramp=ramp)
        export_onnx(SplitModule(model, k, k, (k,) if ramp else ()), path, max_batch_size=card.max_batch_size)
        io[path.name] = part_io(path)
    _ship(rule, out / "1")
    try:
        check_rule_parity(model, rule, out / "1", enabled_ramps=plan.enabled_ramps, reads=_reads(io))
    except RuleError as err:
        raise ExportError(f"{name}: {err}") from None
    first = plan.splits[0]
    # the model itself too, for the device form: any later plan may run it on the router's device (a plan switch
    # is a reload of this model with the plan in a config override), as any later plan may make a split compact
    device = _ship_model(model, source, out / "1")
    gpu = plan.on_device and settings.gpus > 0
    _write_python_model(out, ModelDescription(
        name=name, kind="python", max_batch_size=card.max_batch_size, inputs=card.inputs,
        outputs=answer_specs(card), instances=settings.router_instances or plan.router_instances,
        # the device form: one instance per GPU (each holds every split on its device); KIND_CPU runs it eagerly
        instance_kind="KIND_GPU" if gpu else "KIND_CPU", gpus=tuple(range(settings.gpus)) if gpu else (),
        # One instance: its execute only admits requests to its scheduler and returns at once, no reason to
        # hold them; several (inline): requests gather in Triton's queue (Plan.router_queue_delay_us).
        dynamic_batching=DynamicBatching((first.batch_size,), plan.router_queue_delay_us),
        parameters={"model_card": json.dumps(card.to_dict()), "plan": json.dumps(plan.to_dict(), sort_keys=True),
                    "part_io": json.dumps({**split_io, **io}, sort_keys=True), **device,
                    **({"max_queue_inputs": str(settings.max_queue_inputs)} if settings.max_queue_inputs else {})}),
        ROUTER_MODULE, settings)
    return io


def _ship_model(model: EarlyExitModel, name: str, version_dir: Path) -> dict[str, str]:
    """What the device router builds its model from (:mod:`e3.serving.device.router`): the model's weights
    (``weights.safetensors``, its state dict) and, for a user's ``package.module:factory``, the factory's
    module under ``e3_models/`` (Triton's stub ignores ``PYTHONPATH``); returns the router's parameters naming
    them. ``name``: how the model was named to ``e3 export`` (a zoo name or ``package.module:factory``; a card's
    own name may differ). Checked here: the architecture built as the server will build it loads the weights
    exactly."""
    if ":" in name:
        try:
            ship_module(name.partition(":")[0], version_dir, SHIPPED_MODELS_DIR)
        except ValueError as err:
            raise ExportError(f"{name}: {err}") from None
    version_dir.mkdir(parents=True, exist_ok=True)
    save_model(model, str(version_dir / WEIGHTS_FILE))
    load_shipped_model(name, str(version_dir / WEIGHTS_FILE), modules=str(version_dir / SHIPPED_MODELS_DIR))
    return {"model": name, "weights": WEIGHTS_FILE}


def _reads(io: dict[str, dict[str, list[str]]]) -> dict[str, list[str]]:
    return {part: v["reads"] for part, v in io.items()}


def _write_preprocess(card: ModelCard, name: str, out: Path, settings: ExportSettings) -> None:
    _write_python_model(out, ModelDescription(
        name=name, kind="python", max_batch_size=card.max_batch_size, inputs=(TensorSpec("TEXT", "BYTES", (1,)),),
        outputs=card.inputs, instances=1, dynamic_batching=DynamicBatching((), 0),
        parameters={"model_card": json.dumps(card.to_dict())}), f"{SERVING}.preprocess", settings)
    if card.preprocess == "minilm":
        write_atomic(out / "1" / TOKENIZER_FILE, minilm_tokenizer_json())


def _write_ensemble(card: ModelCard, m: str, out: Path, settings: ExportSettings) -> None:
    """``<m>``: TEXT -> <m>_preprocess -> <m>_router -> label, exit_ramp, probs."""
    inner = {t.name: f"_{t.name}" for t in card.inputs}
    answers = {t.name: t.name for t in answer_specs(card)}
    (out / "1").mkdir(parents=True, exist_ok=True)
    write_atomic(out / "config.pbtxt", render_config(ModelDescription(
        name=m, kind="ensemble", max_batch_size=card.max_batch_size, inputs=(TensorSpec("TEXT", "BYTES", (1,)),),
        outputs=answer_specs(card), dynamic_batching=None,
        steps=(EnsembleStep(preprocess_name(m), {"TEXT": "TEXT"}, inner),
               EnsembleStep(router_name(m), {k: v for k, v in inner.items()}, answers))), settings.target))


def _output_specs(card: ModelCard, module: SplitModule) -> tuple[TensorSpec, ...]:
    state = tuple(TensorSpec(state_output(t.name), t.dtype, t.shape) for t in card.state_after(module.last)) \
        if module.last < card.num_blocks else ()
    return (*state, *(TensorSpec(ramp_output(k), "FP32", (card.num_classes,)) for k in module.ramps))


def _write_onnx_model(module: SplitModule, out: Path, desc: ModelDescription, settings: ExportSettings,
                      output_names: list[str] | None = None) -> dict[str, list[str]]:
    """Export ``module`` as ``model.onnx`` (or a TensorRT plan) with its config, which declares exactly the
    inputs the graph reads; returns what it reads and writes."""
    export_onnx(module, out / "1" / "model.onnx", output_names=output_names, max_batch_size=desc.max_batch_size)
    io = part_io(out / "1" / "model.onnx")
    desc = ModelDescription(**{**desc.__dict__, "inputs": tuple(t for t in desc.inputs if t.name in io["reads"])})
    if settings.format == "tensorrt":
        preferred = desc.dynamic_batching.preferred_batch_sizes if desc.dynamic_batching else ()
        engine = tensorrt.EngineSettings(opt_batch=min(preferred or (desc.max_batch_size,)),
                                         max_batch=desc.max_batch_size, fp16=settings.fp16)
        try:  # the parity-checked ONNX file is the engine's source; Triton loads only the plan
            tensorrt.build_engine(out / "1" / "model.onnx", out / "1" / "model.plan", desc.inputs, settings=engine)
        except tensorrt.TensorRTError as err:
            raise ExportError(f"{desc.name}: {err}") from None
        (out / "1" / "model.onnx").unlink()
        desc = ModelDescription(**{**desc.__dict__, "kind": "tensorrt", "instance_kind": "KIND_GPU",
                                   "gpus": tuple(range(settings.gpus)) or (0,)})
    elif settings.gpus:
        desc = ModelDescription(**{**desc.__dict__, "instance_kind": "KIND_GPU", "gpus": tuple(range(settings.gpus))})
    if settings.target == "embedded":
        # Value bounds of the inputs (token ids, masks) travel as a parameter: the split checks them
        # (e3.serving.input_policy) before ONNX Runtime sees the values.
        bounds = {t.name: list(t.bounds) for t in desc.inputs if t.bounds is not None}
        desc = ModelDescription(**{**desc.__dict__, "parameters": {
            **desc.parameters, "intra_op_threads": "1", **({INPUT_BOUNDS: json.dumps(bounds)} if bounds else {})}})
        write_model_py(out, f"{SERVING}.split")
    write_atomic(out / "config.pbtxt", render_config(desc, settings.target))
    return io


def _write_python_model(out: Path, desc: ModelDescription, module: str, settings: ExportSettings) -> None:
    write_model_py(out, module)
    write_atomic(out / "config.pbtxt", render_config(desc, settings.target))


def write_model_py(out: Path, module: str) -> None:
    write_atomic(out / "1" / "model.py", f'"""Generated by `e3 export`; the model\'s code lives in the e3 package."""\n'
                                         f"from {module} import TritonPythonModel  # noqa: F401\n")


def _check_writable(repo: Path) -> None:
    try:
        repo.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=repo, prefix=".e3-probe-", delete=True)
        probe.close()
    except OSError as err:
        raise ExportError(f"cannot write to the repository {repo}: {err.strerror or err}") from None


def check_owned(repo: Path, name: str, manifest: dict) -> None:
    if (repo / name).exists() and name not in manifest["models"]:
        raise ExportError(f"{repo / name} exists and was not created by e3; "
                          "choose another repository or remove that model yourself")


class _Undo:
    """What one export changed in a repository, to put back if it fails: whether the folder existed, the
    manifest's bytes, and every model it placed with the one it replaced (kept aside until :meth:`commit`)."""

    def __init__(self, repo: Path):
        self.repo = repo
        self.created = not repo.exists()
        path = repo / MANIFEST
        self.manifest = path.read_bytes() if path.is_file() else None
        self.placed: list[tuple[Path, Path | None]] = []   # (model folder, its predecessor set aside or None)

    def commit(self) -> None:
        for _, old in self.placed:
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        self.placed = []

    def rollback(self) -> None:
        """Remove the models placed, move back the ones they replaced, restore the manifest (or its absence) and
        remove the repository folder if the export created it and nothing else is in it."""
        for final, old in reversed(self.placed):
            shutil.rmtree(final, ignore_errors=True)
            if old is not None:
                old.rename(final)
        self.placed = []
        path = self.repo / MANIFEST
        if self.manifest is not None:
            write_atomic(path, self.manifest)
        elif path.exists():
            path.unlink()
        if self.created and self.repo.is_dir() and not any(self.repo.iterdir()):
            self.repo.rmdir()


class staging:
    """Write a model into a temporary sibling directory, then swap it into place (``undo``: keep the model it
    replaces aside, for an export that may still fail)."""

    def __init__(self, repo: Path, name: str, undo: _Undo | None = None):
        self.repo, self.name, self.undo = repo, name, undo

    def __enter__(self) -> Path:
        self.tmp = Path(tempfile.mkdtemp(dir=self.repo, prefix=f".{self.name}.tmp-"))
        return self.tmp

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return
        final = self.repo / self.name
        old = None
        if final.exists():
            old = self.repo / f".{self.name}.old-{os.getpid()}"
            final.rename(old)
        self.tmp.rename(final)
        if self.undo is not None:
            self.undo.placed.append((final, old))
        elif old is not None:
            shutil.rmtree(old, ignore_errors=True)
