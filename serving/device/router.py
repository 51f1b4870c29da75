"""``<m>_router`` for every plan: the device router for a plan of device splits, else the CPU router.

The one ``<m>_router`` a plan is served by (``e3 export`` writes it; the controller reloads it with a new plan in
a config override). Its ``initialize`` reads the plan and becomes

* the **device router** (:class:`DeviceRouter`, docs/design.md §2b) when every split is of the device form
  (:attr:`e3.core.plan.Plan.on_device`): the plan's splits run inside this process on the instance's device
  (KIND_GPU: ``cuda:<id>``, FP16, a CUDA graph per batch bucket; KIND_CPU: eager FP32, one intra-op thread) by
  :class:`~e3.serving.device.pipeline.DevicePipeline`, answering continuously
  (:mod:`~e3.serving.device.continuous`) or, where the config says ``answering: inline``, inline;
* the CPU router (:mod:`e3.serving.router`) otherwise, unchanged (it imports no torch).

So a plan switch between forms is a reload like any other. The device router builds the model from what
``e3 export`` shipped beside it (``1/``): ``model`` (a zoo name or a user's ``package.module:factory``, its module
under ``1/e3_models/``: Triton's stub ignores ``PYTHONPATH``) and ``weights`` (a safetensors file of its state
dict), or, for the GPU side-by-side's random-weight models, ``seed`` and ``trained``. It reports the CPU
router's metrics (inputs, batches, ramps reached and exited, drops, refusals) so that the controller reads a
device plan's batch profile as any other's.
"""

from __future__ import annotations

import json
import os
import sys

import triton_python_backend_utils as pb_utils

from e3.core.exits import SHIPPED_RULES_DIR, make_exit_rule
from e3.core.names import SHIPPED_MODELS_DIR
from e3.core.plan import Plan
from e3.core.rows import request_slices
from e3.core.spec import ModelCard
from e3.serving.device.continuous import ContinuousEngine
from e3.serving.router_metrics import RouterMetrics
from e3.serving.scheduler import MAX_QUEUE_INPUTS, queue_limit
from e3.serving.triton_io import (ResponseSender, admit_continuously, checked_response, error_response, gather,
                                  model_parameters)

__all__ = ["TritonPythonModel", "DeviceRouter", "ANSWERING"]

ANSWERING = ("continuous", "inline")    # the device router's answering forms (module docstring)


class TritonPythonModel:
    """Chooses the router for the plan in the config (module docstring)."""

    def initialize(self, args):
        _, params = model_parameters(args)
        if Plan.from_json(params["plan"]).on_device:
            self.impl = DeviceRouter()
        else:
            from e3.serving.router import TritonPythonModel as CpuRouter   # deferred: a device plan loads no onnx
            self.impl = CpuRouter()
        self.impl.initialize(args)

    def execute(self, requests):
        return self.impl.execute(requests)

    def finalize(self):
        self.impl.finalize()


class DeviceRouter:
    """E3's device form as a Triton Python model (module docstring)."""

    def initialize(self, args):
        # deferred: torch and the device modules load only for a plan of the device form (a CPU plan's router
        # imports no torch)
        import torch
        from e3.models.zoo import load_shipped_model
        from e3.serving.device.executor import DeviceSettings, build_model, prepare_model
        from e3.serving.device.pipeline import DevicePipeline

        _, params = model_parameters(args)
        self.plan = plan = Plan.from_json(params["plan"])
        version_dir = os.path.join(args["model_repository"], args["model_version"])
        gpu = args.get("model_instance_kind") == "GPU"
        device = f"cuda:{args.get('model_instance_device_id', '0')}" if gpu else "cpu"
        if not gpu:
            torch.set_num_threads(int(params.get("intra_op_threads") or "1"))
        settings = DeviceSettings(device=device, precision=params.get("precision") or ("fp16" if gpu else "fp32"),
                                  graphs=(params.get("graphs") or "yes") == "yes",
                                  max_batch=max(s.batch_size for s in plan.splits))
        if params.get("weights"):
            model = load_shipped_model(params["model"], os.path.join(version_dir, params["weights"]),
                                       modules=os.path.join(version_dir, SHIPPED_MODELS_DIR))
        else:
            model = build_model(params["model"], seed=int(params.get("seed") or "0"),
                                trained=params.get("trained") == "yes")
        model = prepare_model(model, settings)
        self.card = model.card
        if params.get("model_card"):
            expected = ModelCard.from_dict(json.loads(params["model_card"]))
            if expected.num_blocks != self.card.num_blocks or expected.inputs != self.card.inputs:
                raise ValueError(f"{params['model']} builds a model unlike the card it was exported with")
        plan.validate(self.card.ramp_blocks)
        rule = make_exit_rule(plan.exit_rule, paths=[os.path.join(version_dir, SHIPPED_RULES_DIR)])
        self.answering = params.get("answering") or "continuous"
        if self.answering not in ANSWERING:
            raise ValueError(f"answering must be one of {', '.join(ANSWERING)}, got {self.answering!r}")
        self.metrics = RouterMetrics(plan.model, plan.plan_id)
        self.engine = self.outbox = None
        if self.answering == "continuous":
            # the engine thread sends, between its steps: no send runs while another thread drives the device
            # (serving.device.continuous, "Sending from the engine thread")
            self.outbox = ResponseSender(f"{plan.model} device router", thread=False)
            self.engine = ContinuousEngine(self.outbox.put, max_queue_inputs=queue_limit(params.get(MAX_QUEUE_INPUTS)),
                                           drain=self.outbox.drain)
            self.outbox.wake = self.engine.wake
            answer, fail = self.engine.answered, self.engine.failed
        else:
            self.answers: dict[int, object] = {}
            answer = fail = self.answers.__setitem__
        self.pipeline = DevicePipeline(
            model, cuts=tuple(plan.cuts), batch_sizes=[s.batch_size for s in plan.splits],
            enabled_ramps=plan.enabled_ramps, rule=rule, settings=settings, slo_ms=plan.slo_ms, slack=plan.slack,
            answer=answer, fail=fail, depth=int(params["depth"]) if params.get("depth") else None,
            on_run=lambda s, route: self.metrics.record(route, new_inputs=len(route.label) if s == 0 else 0),
            on_drop=self.metrics.dropped)
        if self.engine is not None:
            self.engine.bind(self.pipeline)
        pb_utils.Logger.log_info(
            f"{plan.model} device router: {len(plan.splits)} splits "
            f"{', '.join(f'{s.first_block}-{s.last_block}' for s in plan.splits)} at batches "
            f"{[s.batch_size for s in plan.splits]} on {device} ({settings.precision}"
            f"{', CUDA graphs' if settings.cuda and settings.graphs else ', eager'}), answering {self.answering}")
        sys.setswitchinterval(0.0005)   # the engine thread and execute share the interpreter lock (router.py)

    def execute(self, requests):
        got = gather(requests, self.card.inputs)
        if self.engine is not None:
            return self._admit(requests, got)
        return self._execute_inline(got)

    def _admit(self, requests, got):
        """Continuous: take every sender here, admit the valid requests, answer the others now, return None."""
        admit_continuously(self.engine, self.outbox, requests, got, on_refused=self.metrics.rejected)
        return None

    def _execute_inline(self, got):
        """Inline (the labelled fallback): admit this execute's requests and run them out in Triton's thread."""
        for i, rows in zip(got.valid, request_slices(got.sizes)):
            self.pipeline.admit(i, {k: v[rows] for k, v in got.arrays.items()})
        try:
            self.pipeline.run_until_idle()
        except Exception as err:  # noqa: BLE001 - every admitted request gets an answer or an error
            self.pipeline.fail_all(f"the router failed: {err}")
        for i in got.valid:
            what = self.answers.pop(i)   # run_until_idle answers every admitted request
            got.responses[i] = checked_response(what) if isinstance(what, dict) else error_response(what)
        return got.responses

    def finalize(self):
        if self.engine is not None:
            self.engine.close()
            self.outbox.close()
        self.metrics.close()
