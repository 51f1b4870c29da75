"""A model repository of device-resident models (:mod:`e3.serving.device.triton_model`): E3's router with its
constant splits inside, and the stock and naive early-exit baselines in the same engine.

Used by the GPU side-by-side (``benchmarks/gpu_side_by_side.py``) on a GPU host (KIND_GPU) and by its CPU mode
in ``make test`` (KIND_CPU). Names: ``<m>_<system>_b<B>`` (``e3``, ``stock``, ``ee``), ``_i<k>`` appended for
a baseline with k instances; the comparison's max batch B is in every name so that every setting of one run
can be loaded side by side.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from e3.core.files import write_atomic
from e3.core.names import ANSWERING, DEVICE_SYSTEMS, ranges_from_cuts, served_name, split_name
from e3.core.plan import DEVICE, Plan, SplitPlan
from e3.core.spec import ModelCard, TensorSpec, answer_specs
from e3.export.triton_config import DynamicBatching, ModelDescription, render_config

__all__ = ["DeviceModel", "device_model_name", "device_plan", "write_device_model", "write_device_config", "write_hop_models", "ROUTER_MAX_BATCH", "SYSTEMS"]

ROUTER_MAX_BATCH = 1024   # requests' rows Triton hands E3's router per execute: admission only, no compute
MODULE = "e3.serving.device.triton_model"
HOPS_MODULE = "e3.serving.device.hops"


@dataclass(frozen=True)
class DeviceModel:
    """One device-resident model to write."""
    model: str                       # zoo name or package.module:factory
    system: str                      # "e3" | "stock" | "ee"
    max_batch: int                   # B: Triton's max batch (baselines), the split batches' bound (E3)
    exit_rule: dict                  # the rule every system applies (forced exits on random weights)
    enabled_ramps: tuple[int, ...]   # ramps computed by E3 and by the naive model
    gpu: bool = False                # KIND_GPU on GPU 0, else KIND_CPU
    instances: int = 1               # Triton instances (each E3 instance holds its own pipeline)
    queue_delay_us: int = 0          # the baselines' dynamic batcher delay
    cuts: tuple[int, ...] = ()       # E3: blocks after which the model is cut
    batch_sizes: tuple[int, ...] = ()  # E3: each split's batch (default B for every split)
    slo_ms: float = 1000.0           # E3: the SLO its dispatch and drops aim for
    trained: bool = False            # the checkpoint, else the architecture with seeded random weights
    precision: str | None = None     # None: fp16 on a GPU, fp32 on the CPU
    seed: int = 0
    variant: str = ""                # appended to the name (E3 planned for one workload mix: "80_20")
    policy: dict | None = None       # admission: the stage's N-Ebird / E-Ebird policy (make_policy's fields)
    pool_slots: int = 0              # admission: rows of its memory pool (0: 8 x the policy's MaxInf)
    answering: str = "continuous"    # E3 and admission: "continuous" (execute admits, an engine thread answers) or "inline"
    max_queue_inputs: int = 0        # continuous: most inputs held at once, past it 503 at once (0: unbounded)

    @property
    def name(self) -> str:
        name = device_model_name(self.model, self.system, self.max_batch, instances=self.instances)
        return f"{name}_{self.variant}" if self.variant else name


def device_model_name(model: str, system: str, max_batch: int, *, instances: int = 1) -> str:
    base = f"{served_name(model)}_{system}_b{max_batch}"
    return base if instances == 1 else f"{base}_i{instances}"


SYSTEMS = DEVICE_SYSTEMS


def write_device_model(repo: Path, desc: DeviceModel, card: ModelCard) -> str:
    """Write ``desc`` (E3's device router or a baseline) into ``repo`` (config.pbtxt and a one-line model.py);
    returns its name. E²bird's stage (system ``admission``) is written by
    :func:`e3.serving.ebird.repository.write_device_stage`, which checks its policy and calls
    :func:`write_device_config`."""
    if desc.system == "admission":
        raise ValueError("E²bird's stage is written by e3.serving.ebird.repository.write_device_stage "
                         "(it checks the policy)")
    return write_device_config(repo, desc, card)


def write_device_config(repo: Path, desc: DeviceModel, card: ModelCard, *, extra_params: dict | None = None,
                        module: str = MODULE) -> str:
    """The config and model.py of any device model (``module``: the Python module its model.py imports;
    ``extra_params``: parameters of a system this file does not know, e.g. E²bird's policy). Front models (E3's
    router, E²bird's stage) only admit in execute: Triton's batcher with no delay and ``ROUTER_MAX_BATCH`` rows
    in front of them (requests that queued while an execute ran arrive in the next one together)."""
    if desc.system not in SYSTEMS:
        raise ValueError(f"system must be one of {', '.join(SYSTEMS)}, got {desc.system!r}")
    if desc.answering not in ANSWERING:
        raise ValueError(f"answering must be one of {', '.join(ANSWERING)}, got {desc.answering!r}")
    if desc.max_queue_inputs < 0:
        raise ValueError(f"max_queue_inputs must be >= 0 (0: unbounded), got {desc.max_queue_inputs}")
    params = {"role": desc.system, "model": desc.model, "seed": str(desc.seed),
              "trained": "yes" if desc.trained else "no", "max_batch": str(desc.max_batch),
              "exit_rule": json.dumps(desc.exit_rule), "enabled_ramps": json.dumps(list(desc.enabled_ramps)),
              "FORCE_CPU_ONLY_INPUT_TENSORS": "yes", **(extra_params or {})}
    if desc.precision:
        params["precision"] = desc.precision
    if desc.system == "e3":
        splits = len(desc.cuts) + 1
        batches = list(desc.batch_sizes) or [desc.max_batch] * splits
        if len(batches) != splits or max(batches) > desc.max_batch:
            raise ValueError(f"{splits} splits need {splits} batch sizes of at most {desc.max_batch}, got {batches}")
        params.update(plan=device_plan(card, desc.exit_rule, cuts=desc.cuts, batch_sizes=batches,
                                       enabled_ramps=desc.enabled_ramps, slo_ms=desc.slo_ms).to_json())
    front = desc.system in ("e3", "admission")   # models that only admit in execute: no delay, large batches
    if front:
        params["answering"] = desc.answering
        if desc.max_queue_inputs:
            params["max_queue_inputs"] = str(desc.max_queue_inputs)
    text = render_config(ModelDescription(
        name=desc.name, kind="python", max_batch_size=ROUTER_MAX_BATCH if front else desc.max_batch,
        inputs=card.inputs, outputs=answer_specs(card), instances=desc.instances,
        instance_kind="KIND_GPU" if desc.gpu else "KIND_CPU", gpus=(0,) if desc.gpu else (),
        dynamic_batching=DynamicBatching(max_queue_delay_us=0 if front else desc.queue_delay_us),
        parameters=params))
    _write_model(repo, desc.name, text, module)
    return desc.name


def device_plan(card: ModelCard, exit_rule: dict, *, cuts: tuple[int, ...], batch_sizes: list[int],
                enabled_ramps: tuple[int, ...], slo_ms: float, slack: float = 0.2) -> Plan:
    """The plan document of E3's device form for ``card`` cut after ``cuts``: one device split per block range,
    each at its batch, one instance (the router's, on its device), the ramps inside it that are enabled."""
    m = served_name(card.name)
    ranges = ranges_from_cuts(list(cuts), card.num_blocks)
    splits = tuple(SplitPlan(model=split_name(m, a, b), first_block=a, last_block=b, batch_size=batch, instances=1,
                             form=DEVICE, queue_delay_us=0,
                             enabled_ramps=tuple(k for k in enabled_ramps if a <= k <= b and k < card.num_blocks))
                   for (a, b), batch in zip(ranges, batch_sizes))
    plan = Plan(model=m, num_blocks=card.num_blocks, exit_rule=dict(exit_rule), splits=splits, slo_ms=slo_ms,
                slack=slack)
    plan.validate(card.ramp_blocks)
    return plan


def _write_model(repo: Path, name: str, config_text: str, module: str) -> None:
    """``<repo>/<name>/config.pbtxt`` and a one-line ``1/model.py`` importing ``module``'s model."""
    out = Path(repo) / name
    (out / "1").mkdir(parents=True, exist_ok=True)
    write_atomic(out / "config.pbtxt", config_text)
    write_atomic(out / "1" / "model.py", f'"""Generated for the device side-by-side; the code lives in the e3 package."""\n'
                                         f"from {module} import TritonPythonModel  # noqa: F401\n")


def write_hop_models(repo: Path, card: ModelCard, *, gpu: bool, precision: str) -> tuple[str, str]:
    """The two models that price a split boundary (:mod:`e3.serving.device.hops`): ``<m>_hop_echo`` and
    ``<m>_hop_prices``, whose state has the shape of the model's cut state (its first state tensor). Device
    tensors in and out (``FORCE_CPU_ONLY_INPUT_TENSORS`` off). Returns (echo, prices)."""
    m = served_name(card.name)
    state = card.state[0]
    echo, prices = f"{m}_hop_echo", f"{m}_hop_prices"
    common = dict(kind="python", max_batch_size=0, instances=1, instance_kind="KIND_GPU" if gpu else "KIND_CPU",
                  gpus=(0,) if gpu else (), dynamic_batching=None)
    dims = (-1, *state.shape)
    # the state crosses the hop in the precision the splits run at: an FP32 cut state is FP16 in an FP16 run
    dtype = "FP16" if precision == "fp16" and state.dtype == "FP32" else state.dtype
    descs = [
        ModelDescription(name=echo, inputs=(TensorSpec("state", dtype, dims),),
                         outputs=(TensorSpec("state_out", dtype, dims),),
                         parameters={"role": "echo", "FORCE_CPU_ONLY_INPUT_TENSORS": "no"}, **common),
        ModelDescription(name=prices, inputs=(TensorSpec("batch", "INT32", (1,)), TensorSpec("repeats", "INT32", (1,))),
                         outputs=(TensorSpec("times_ms", "FP32", (3, -1)),),
                         parameters={"role": "prices", "echo": echo, "state_shape": json.dumps(list(state.shape)),
                                     "state_dtype": {"FP16": "float16", "FP32": "float32"}.get(dtype, dtype.lower()),
                                     "FORCE_CPU_ONLY_INPUT_TENSORS": "no"}, **common)]
    for desc in descs:
        _write_model(repo, desc.name, render_config(desc), HOPS_MODULE)
    return echo, prices
