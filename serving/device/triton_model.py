"""The device-resident models of the GPU side-by-side on Triton: E3's router (``role: e3``), the stock model
(``stock``) and the naive early-exit model (``ee``), each one Python-backend model running PyTorch on its
instance's device.

Written by :mod:`e3.export.device_repository`. An instance of kind KIND_GPU runs on its GPU
(``cuda:<device id>``), in FP16 with one CUDA graph per batch bucket unless the config says otherwise; an
instance of kind KIND_CPU runs the same code eagerly on the CPU in FP32 with one intra-op thread (``make
test``). String parameters of the config:

* ``model`` (a zoo name or ``package.module:factory``), ``seed`` (weights of a model built with random weights
  are drawn from it, so every model of a comparison holds the same weights), ``trained`` ("yes": the
  checkpoint, else the architecture with random weights);
* ``role``, ``precision``, ``graphs``;
* for ``stock`` and ``ee``: ``max_batch`` (the executors' largest bucket), ``exit_rule`` and ``enabled_ramps``
  (JSON);
* for ``e3``: ``plan`` (a plan document of device splits, :mod:`e3.core.plan`), ``answering``
  (``continuous`` or ``inline``) and ``max_queue_inputs``.

``e3`` is the product's device router itself (:class:`e3.serving.device.router.DeviceRouter`, the code that
serves ``<m>_router`` for a device plan), so the side-by-side measures what a user serves. ``stock`` and ``ee``
answer within ``execute``, their requests batched by Triton's dynamic batcher. All three answer ``label``,
``exit_ramp`` and ``probs``.
"""

from __future__ import annotations

import json

import torch

from e3.core.exits import make_exit_rule
from e3.core.names import SIDE_BY_SIDE
from e3.serving.device.executor import DeviceSettings, build_model, prepare_model
from e3.serving.device.pipeline import NaiveRunner, StockRunner
from e3.serving.device.router import DeviceRouter
from e3.serving.triton_io import gather, model_parameters, tensor_response

ROLES = SIDE_BY_SIDE   # the models this file serves (E²bird's stage is e3.serving.ebird.model)


class TritonPythonModel:
    def initialize(self, args):
        _, params = model_parameters(args)
        self.role = params["role"]
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.role == "e3":
            self.router = DeviceRouter()
            self.router.initialize(args)
            return
        gpu = args.get("model_instance_kind") == "GPU"
        device = f"cuda:{args.get('model_instance_device_id', '0')}" if gpu else "cpu"
        if not gpu:
            torch.set_num_threads(int(params.get("intra_op_threads", "1")))
        settings = DeviceSettings(device=device, precision=params.get("precision") or ("fp16" if gpu else "fp32"),
                                  graphs=params.get("graphs", "yes") == "yes", max_batch=int(params["max_batch"]))
        model = prepare_model(build_model(params["model"], seed=int(params.get("seed", "0")),
                                          trained=params.get("trained") == "yes"), settings)
        self.card = model.card
        rule = make_exit_rule(json.loads(params["exit_rule"]))
        enabled = tuple(json.loads(params["enabled_ramps"]))
        if self.role == "stock":
            self.runner = StockRunner(model, settings)
        else:
            self.runner = NaiveRunner(model, enabled_ramps=enabled, rule=rule, settings=settings)

    def execute(self, requests):
        if self.role == "e3":
            return self.router.execute(requests)
        got = gather(requests, self.card.inputs)
        if got.valid:
            answer = self.runner.run(got.arrays)
            at = 0
            for i, n in zip(got.valid, got.sizes):
                got.responses[i] = tensor_response({k: v[at:at + n] for k, v in answer.outputs().items()})
                at += n
        return got.responses

    def finalize(self):
        if self.role == "e3":
            self.router.finalize()
