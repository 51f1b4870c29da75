"""Render Triton ``config.pbtxt`` files from one description.

The description (:class:`ModelDescription`) is filled in once; the target
decides how it is served:

* ``embedded`` -- the Triton wheel has no ONNX Runtime backend, so ONNX models
  are Python-backend models that run ``model.onnx`` in ONNX Runtime;
* ``ngc`` -- an NGC Triton image: ``platform: "onnxruntime_onnx"`` for a
  ``model.onnx``, ``platform: "tensorrt_plan"`` for a ``model.plan`` (kind
  ``tensorrt``: NGC only, GPU instances only).

Rendering goes through Triton's own ``ModelConfig`` protobuf (shipped in
tritonclient), so a field that Triton does not know cannot be written.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from e3.core.spec import TensorSpec, config_dtype

__all__ = ["TARGETS", "DynamicBatching", "EnsembleStep", "ModelDescription", "render_config", "parse_config",
           "OWNER_KEY", "gpu_instance_groups"]

TARGETS = ("embedded", "ngc")
OWNER_KEY = "e3_owner"  # parameter marking models that e3 created (export never touches others)
# A reject-late queue's own timeout. Triton applies a request's timeout (the router's BLS deadline)
# only where it is shorter than the queue's default, and a default of 0 means "no timeout", which
# silently disables every override (measured: a split held a request with a 1 ms timeout for its
# whole 1 s queue delay and ran it). One hour: longer than any SLO, so only the router's deadlines
# reject, and a request without a timeout (a client or a profiler calling a split) still runs.
QUEUE_DEFAULT_TIMEOUT_US = 3_600_000_000


@dataclass(frozen=True)
class DynamicBatching:
    preferred_batch_sizes: tuple[int, ...] = ()
    max_queue_delay_us: int = 0
    reject_late: bool = False   # queue policy: reject requests whose (BLS-given) timeout expired in the queue
    #                             (the queue's own default is QUEUE_DEFAULT_TIMEOUT_US, see there)


@dataclass(frozen=True)
class EnsembleStep:
    model: str                        # composing model
    input_map: dict[str, str]         # the step model's input name -> ensemble tensor name
    output_map: dict[str, str]        # the step model's output name -> ensemble tensor name


@dataclass(frozen=True)
class ModelDescription:
    name: str
    kind: str                                  # "onnx" (a model.onnx), "tensorrt" (a model.plan), "python", "ensemble"
    max_batch_size: int
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    instances: int = 1
    instance_kind: str = "KIND_CPU"           # or KIND_GPU
    gpus: tuple[int, ...] = ()                # KIND_GPU: the GPUs ``instances`` are spread over (gpu_instance_groups);
    #                                           empty: GPU 0 only
    dynamic_batching: DynamicBatching | None = DynamicBatching()
    parameters: dict[str, str] = field(default_factory=dict)
    steps: tuple[EnsembleStep, ...] = ()      # kind "ensemble" only


def render_config(desc: ModelDescription, target: str = "embedded") -> str:
    """config.pbtxt text for ``desc`` on ``target``."""
    if target not in TARGETS:
        raise ValueError(f"unknown target {target!r}; use one of {', '.join(TARGETS)}")
    cfg = mc.ModelConfig(name=desc.name, max_batch_size=desc.max_batch_size)
    if desc.kind == "tensorrt":
        if target != "ngc":
            raise ValueError(f"model {desc.name}: TensorRT plans need Triton's tensorrt backend, which only an "
                             "NGC Triton image has; use --target ngc (or --format onnx for the embedded server)")
        if desc.instance_kind != "KIND_GPU":
            raise ValueError(f"model {desc.name}: a TensorRT plan runs on a GPU; its instance kind must be "
                             f"KIND_GPU, not {desc.instance_kind}")
        cfg.platform = "tensorrt_plan"
        cfg.default_model_filename = "model.plan"
    elif desc.kind == "onnx" and target == "ngc":
        cfg.platform = "onnxruntime_onnx"
    elif desc.kind in ("onnx", "python"):
        cfg.backend = "python"
    elif desc.kind == "ensemble":
        cfg.platform = "ensemble"
        for step in desc.steps:
            s = cfg.ensemble_scheduling.step.add(model_name=step.model, model_version=-1)
            s.input_map.update(step.input_map)
            s.output_map.update(step.output_map)
    else:
        raise ValueError(f"model {desc.name}: unknown kind {desc.kind!r}")
    for spec, target_list in ((desc.inputs, cfg.input), (desc.outputs, cfg.output)):
        for t in spec:
            target_list.add(name=t.name, data_type=mc.DataType.Value(config_dtype(t.dtype)),
                            dims=list(t.shape))
    if desc.kind != "ensemble" and desc.instance_kind == "KIND_GPU":
        for group in gpu_instance_groups(desc.instances, desc.gpus or (0,)):
            cfg.instance_group.add(count=group["count"], kind=mc.ModelInstanceGroup.KIND_GPU, gpus=group["gpus"])
    elif desc.kind != "ensemble":  # an ensemble has neither instances nor a batcher of its own
        group = cfg.instance_group.add(count=desc.instances,
                                       kind=mc.ModelInstanceGroup.Kind.Value(desc.instance_kind))
        group.gpus.extend(desc.gpus)
    if desc.dynamic_batching is not None and desc.kind != "ensemble":
        db = cfg.dynamic_batching
        db.preferred_batch_size.extend(desc.dynamic_batching.preferred_batch_sizes)
        db.max_queue_delay_microseconds = desc.dynamic_batching.max_queue_delay_us
        if desc.dynamic_batching.reject_late:
            db.default_queue_policy.timeout_action = mc.ModelQueuePolicy.TimeoutAction.REJECT
            db.default_queue_policy.default_timeout_microseconds = QUEUE_DEFAULT_TIMEOUT_US
            db.default_queue_policy.allow_timeout_override = True
    params = dict(desc.parameters)
    params[OWNER_KEY] = "e3"
    if desc.kind == "onnx" and target == "ngc":
        # One intra-op thread per instance, so instance counts mean cores.
        params.update(intra_op_thread_count="1", inter_op_thread_count="1")
    for key, value in sorted(params.items()):
        cfg.parameters[key].string_value = value if isinstance(value, str) else json.dumps(value)
    return text_format.MessageToString(cfg)


def gpu_instance_groups(instances: int, gpus: int | tuple[int, ...] | list[int]) -> list[dict]:
    """Triton instance groups (JSON form) that run ``instances`` instances of a model on ``gpus`` (a count:
    GPUs 0..n-1 of the pod, or the GPU ids): one ``KIND_GPU`` group per GPU, each naming its one GPU,
    instance ``i`` on GPU ``i mod n``.

    Decisions: Triton puts a ``KIND_GPU`` group's ``count`` on *every* GPU it lists, and on every visible GPU
    when it lists none (a 2-GPU pod would run twice the plan's instances), so every group names one GPU. The
    spread is the same for every split, so the ``j``-th instance of each split of a chain sits on the same GPU
    (with as many instances per split as GPUs, split 1 -> split 2 of a chain never changes GPU); a plan has no
    field that says otherwise yet. Fewer instances than GPUs leave the last GPUs to other models.
    """
    ids = list(range(gpus)) if isinstance(gpus, int) else [int(g) for g in gpus]
    if instances < 1 or not ids or min(ids) < 0 or len(set(ids)) != len(ids):
        raise ValueError(f"gpu_instance_groups needs instances >= 1 and distinct GPU ids >= 0 (or a count >= 1); "
                         f"got {instances} instances on {gpus!r}")
    counts = {g: 0 for g in ids}
    for i in range(instances):
        counts[ids[i % len(ids)]] += 1
    return [{"count": n, "kind": "KIND_GPU", "gpus": [g]} for g, n in counts.items() if n]


def parse_config(text: str) -> mc.ModelConfig:
    """Parse config.pbtxt text into Triton's ModelConfig (raises on unknown fields)."""
    return text_format.Parse(text, mc.ModelConfig())
