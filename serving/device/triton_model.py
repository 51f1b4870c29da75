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

``stock`` and ``ee`` answer within ``execute``, their requests batched by Triton's dynamic batcher; all three
answer ``label``, ``exit_ramp`` and ``probs``. ``e3`` answers in one of two forms, chosen by the string
parameter ``answering``:

* ``continuous`` (the default; DESIGN §2b): ``execute`` takes each request's response sender, copies its
  inputs, keeps no request object, admits them to the pipeline and returns ``None``
  (:mod:`~e3.serving.device.continuous`); one engine thread runs the splits for as long as anything is queued
  or in flight, merging the survivors of every request in flight into the constant batches, and one thread
  sends the answers, each the moment its request's last row is decided. ``max_queue_inputs`` bounds the
  inputs held (a request past it: UNAVAILABLE, HTTP 503, at once), as on the CPU router.
* ``inline`` (a labelled fallback): each ``execute`` admits its requests and steps the pipeline in Triton's
  own thread until each of them is answered (or dropped), then returns their responses. Triton's batcher hands
  it the queued requests together (up to ``ROUTER_MAX_BATCH`` rows), which fills the constant batches; it
  cannot merge survivors across executes, each execute ends with its partial batches, and arrivals wait a
  whole execute.

History: the first threaded router on the H200 host answered single requests but stopped answering under 4
concurrent clients; it took its response senders in its answering thread after ``execute`` had returned and
kept the request objects alive, the pattern Triton does not support (Triton's QA test takes the sender inside
``execute``). The inline form was the stop-gap; the continuous form takes the sender where Triton's QA does.
Whether the GPU host still kills it is the first thing the standing GPU run probes
(``benchmarks/threaded_answer_probe.py``).
"""

from __future__ import annotations

import json

import torch

from e3.core.exits import make_exit_rule
from e3.core.rows import request_slices
from e3.serving.device.continuous import ContinuousEngine
from e3.serving.device.executor import DeviceSettings, build_model, prepare_model
from e3.serving.device.pipeline import DevicePipeline, NaiveRunner, StockRunner
from e3.serving.scheduler import MAX_QUEUE_INPUTS, queue_limit
from e3.serving.triton_io import (ResponseSender, error_response, gather, model_parameters, sender_of,
                                  tensor_response)

ROLES = ("e3", "stock", "ee")
ANSWERING = ("continuous", "inline")   # E3's answering forms (module docstring)


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
            self.answering = params.get("answering") or "continuous"
            if self.answering not in ANSWERING:
                raise ValueError(f"answering must be one of {', '.join(ANSWERING)}, got {self.answering!r}")
            self.engine = self.outbox = None
            if self.answering == "continuous":
                self.outbox = ResponseSender("e3 device router")
                self.engine = ContinuousEngine(self.outbox.put, max_queue_inputs=queue_limit(params.get(MAX_QUEUE_INPUTS)))
                answer, fail = self.engine.answered, self.engine.failed
            else:
                self.answers: dict[int, object] = {}
                answer = fail = self.answers.__setitem__
            self.pipeline = DevicePipeline(
                model, cuts=tuple(json.loads(params["cuts"])), batch_sizes=json.loads(params["batch_sizes"]),
                enabled_ramps=enabled, rule=rule, settings=settings, slo_ms=float(params["slo_ms"]),
                slack=float(params.get("slack", "0.2")), answer=answer, fail=fail,
                depth=int(params["depth"]) if params.get("depth") else None)
            if self.engine is not None:
                self.engine.bind(self.pipeline)
        elif self.role == "stock":
            self.runner = StockRunner(model, settings)
        else:
            self.runner = NaiveRunner(model, enabled_ramps=enabled, rule=rule, settings=settings)

    def execute(self, requests):
        got = gather(requests, self.card.inputs)
        if self.role == "e3" and self.engine is not None:
            return self._admit(requests, got)
        if self.role == "e3":
            return self._execute_inline(got)
        if got.valid:
            answer = self.runner.run(got.arrays)
            at = 0
            for i, n in zip(got.valid, got.sizes):
                got.responses[i] = tensor_response({k: v[at:at + n] for k, v in answer.outputs().items()})
                at += n
        return got.responses

    def _admit(self, requests, got):
        """Continuous: take every sender here, admit the valid requests, answer the others now, return None."""
        senders = [sender_of(r) for r in requests]
        del requests   # no request object outlives execute
        for sender, response in zip(senders, got.responses):
            if response is not None:   # malformed: answered now, the others go on
                self.outbox.put(sender, response)
        for i, rows in zip(got.valid, request_slices(got.sizes)):
            refusal = self.engine.submit(senders[i], {k: v[rows] for k, v in got.arrays.items()})
            if refusal is not None:
                self.outbox.put(senders[i], error_response(refusal.message, client_error=refusal.permanent,
                                                           unavailable=True))
        return None

    def _execute_inline(self, got):
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

    def finalize(self):
        if getattr(self, "engine", None) is not None:
            self.engine.close()
            self.outbox.close()
