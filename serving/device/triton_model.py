"""The device-resident models on Triton: E3's router (``role: e3``), the stock model (``stock``) and the naive
early-exit model (``ee``), each one Python-backend model running PyTorch on its instance's device.

Written by :mod:`e3.export.device_repository`. An instance of kind KIND_GPU runs on its GPU
(``cuda:<device id>``), in FP16 with one CUDA graph per batch bucket unless the config says otherwise; an
instance of kind KIND_CPU runs the same code eagerly on the CPU in FP32 with one intra-op thread (``make
test``). String parameters of the config:

* ``model`` (a zoo name or ``package.module:factory``), ``seed`` (weights of a model built with random weights
  are drawn from it, so every model of a comparison holds the same weights), ``trained`` ("yes": the
  checkpoint, else the architecture with random weights);
* ``role``, ``max_batch`` (the executors' largest bucket), ``precision``, ``graphs``;
* ``exit_rule`` and ``enabled_ramps`` (JSON), and for ``e3``: ``cuts`` and ``batch_sizes`` (JSON lists),
  ``slo_ms`` and ``slack``.

All three answer within ``execute``, their requests batched by Triton's dynamic batcher, and answer
``label``, ``exit_ramp`` and ``probs``. ``e3`` admits every request of the execute into its pipeline and
steps the pipeline in the execute's own thread until each of them is answered (or dropped): the rows of all
those requests are merged into the splits' constant batches, and the execute returns their responses.

Decision, from a measurement: the first design answered from a worker thread through response senders (as
the CPU router does) and returned from ``execute`` at once, so that survivors of later executes could merge
with earlier ones. On the H200 host that router answered single requests correctly but stopped answering
under 4 concurrent clients (no error logged; the same pipeline ran to completion in a plain process on the
same GPU, with two split runs in flight). The inline form has no thread besides Triton's own; at load,
Triton's batcher hands it the queued requests together (up to ``ROUTER_MAX_BATCH`` rows), which is what fills
the constant batches; what it gives up is merging across executes (each execute ends with its partial
batches).
"""

from __future__ import annotations

import json

import torch

from e3.core.exits import make_exit_rule
from e3.serving.device.executor import DeviceSettings, build_model, prepare_model
from e3.serving.device.pipeline import DevicePipeline, NaiveRunner, StockRunner
from e3.serving.triton_io import error_response, gather, model_parameters, tensor_response

ROLES = ("e3", "stock", "ee")


class TritonPythonModel:
    def initialize(self, args):
        _, params = model_parameters(args)
        self.role = params["role"]
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
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
        if self.role == "e3":
            self.answers: dict[int, object] = {}
            self.pipeline = DevicePipeline(
                model, cuts=tuple(json.loads(params["cuts"])), batch_sizes=json.loads(params["batch_sizes"]),
                enabled_ramps=enabled, rule=rule, settings=settings, slo_ms=float(params["slo_ms"]),
                slack=float(params.get("slack", "0.2")), answer=self.answers.__setitem__,
                fail=self.answers.__setitem__, depth=int(params["depth"]) if params.get("depth") else None)
        elif self.role == "stock":
            self.runner = StockRunner(model, settings)
        else:
            self.runner = NaiveRunner(model, enabled_ramps=enabled, rule=rule, settings=settings)

    def execute(self, requests):
        got = gather(requests, self.card.inputs)
        if self.role == "e3":
            at = 0
            for i, n in zip(got.valid, got.sizes):
                self.pipeline.admit(i, {k: v[at:at + n] for k, v in got.arrays.items()})
                at += n
            try:
                self.pipeline.run_until_idle()
            except Exception as err:  # noqa: BLE001 - every admitted request gets an answer or an error
                self.pipeline.fail_all(f"the router failed: {err}")
            for i in got.valid:
                what = self.answers.pop(i)   # run_until_idle answers every admitted request
                got.responses[i] = tensor_response(what) if isinstance(what, dict) else error_response(what)
            return got.responses
        if got.valid:
            answer = self.runner.run(got.arrays)
            at = 0
            for i, n in zip(got.valid, got.sizes):
                got.responses[i] = tensor_response({k: v[at:at + n] for k, v in answer.outputs().items()})
                at += n
        return got.responses

