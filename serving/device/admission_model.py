"""``<m>_admission_b<MaxBS>_<policy>``: E²bird's admission stage as one Triton Python model on its instance's device
(KIND_GPU: the GPU, FP16, a CUDA graph per worker; KIND_CPU: the CPU, FP32, eager, one intra-op thread).

Two forms, the ``answer`` parameter choosing:

* ``inline`` (the default): ``execute`` validates its requests, admits them into the engine
  (:mod:`e3.serving.device.admission_engine`) and runs the engine's rounds in its own thread until each is
  answered, then returns the responses. Arrivals enter the memory pool and workers launch as the policy says, all
  within the requests Triton's batcher (no delay) handed this execute: the requests that queued while the last
  execute ran.
* ``thread``: ``execute`` queues the requests for an engine thread and returns ``None``; the engine copies each
  into the pool as it comes, across executes, and a response thread (:class:`~e3.serving.triton_io.
  ResponseSender`) answers each request through its response sender. This is the paper's form (the pool takes
  arrivals while workers compute).

Decision, from a measurement on the H200 host (Triton 2.51, the Python 3.12 stub): the threaded form's
response thread died with a segmentation fault inside ``InferenceResponseSender.send`` within the first few
dozen requests (faulthandler's stacks in the server log: the sender thread in ``send``, the engine thread
waiting, the stub's main thread in C++), and every later request of that model failed with "Stub process ... is
not healthy"; the GPU E3 router's threaded form had stopped answering on the same host earlier. Triton documents
answering after ``execute`` returns for decoupled models only, and a decoupled model cannot be called with a
plain (unary) ``infer``, so a Triton user could not call the stage as they call any other model. The inline form
answers as every other model does; what it gives up is admitting requests that arrive while an execute runs
(they wait in Triton's queue for the next one). The threaded form stays for the CPU, where it runs (``make
test`` covers both).

String parameters (written by :func:`e3.export.device_repository.write_device_model`, system ``admission``):
``model``, ``seed``, ``trained``, ``precision``, ``graphs`` as for the device models; ``policy`` (JSON:
``kind``, ``engine``, ``max_inflight``, ``confs``, as :func:`e3.serving.admission.make_policy` takes them) and
``pool_slots`` (the ring's rows; default 8 x MaxInf, the paper's "several times MaxInf"); ``answer``
(``inline`` or ``thread``); for the threaded form ``poll_s`` (the engine thread's pause between rounds while
workers run, default 50 us; the inline form blocks on the oldest running worker instead) and ``switch_interval_s`` (the process's forced switch of the interpreter lock, default 0.5 ms):
chosen, not measured, so that polling does not starve ``execute`` and the sender of the lock.
"""

from __future__ import annotations

import json
import sys

import torch

from e3.serving.admission import make_policy
from e3.serving.device.admission_engine import AdmissionEngine
from e3.serving.device.admission_ops import TorchOps
from e3.serving.device.executor import DeviceSettings, build_model, prepare_model
from e3.serving.device.pipeline import head_answer
from e3.serving.triton_io import ResponseSender, checked_response, error_response, gather, model_parameters, sender_of


class TritonPythonModel:
    def initialize(self, args):
        _, params = model_parameters(args)   # (also turns faulthandler on: crash stacks in the server log)
        gpu = args.get("model_instance_kind") == "GPU"
        device = f"cuda:{args.get('model_instance_device_id', '0')}" if gpu else "cpu"
        if not gpu:
            torch.set_num_threads(int(params.get("intra_op_threads", "1")))
        spec = json.loads(params["policy"])
        self.policy = make_policy(spec["kind"], engine=spec.get("engine"), max_inflight=spec.get("max_inflight"),
                                  confs=spec.get("confs"), slots=spec.get("slots"))
        settings = DeviceSettings(device=device, precision=params.get("precision") or ("fp16" if gpu else "fp32"),
                                  graphs=params.get("graphs", "yes") == "yes", max_batch=max(self.policy.engine))
        model = prepare_model(build_model(params["model"], seed=int(params.get("seed", "0")),
                                          trained=params.get("trained") == "yes"), settings)
        self.card = model.card
        slots = int(params.get("pool_slots") or 8 * self.policy.max_inflight)
        ops = TorchOps(model, self.policy.engine, capacity=slots, settings=settings)
        self.inline = params.get("answer", "inline") != "thread"
        self._answered: dict = {}
        self.engine = AdmissionEngine(self.policy, ops, capacity=slots, answer=self._answer,
                                      poll_s=float(params.get("poll_s", "0.00005")))
        self.outbox = None
        if not self.inline:
            self.outbox = ResponseSender(f"{params['model']} admission")
            # the engine thread polls events while workers run; it must leave the interpreter lock to execute() and
            # the sender often: a 50 us pause per round, and a 0.5 ms forced switch (Python's default, 5 ms, would
            # let a polling thread hold the lock that long against a thread waiting for it)
            sys.setswitchinterval(float(params.get("switch_interval_s", "0.0005")))
            self.engine.start()

    def _answer(self, request) -> None:
        if self.inline:   # the execute that admitted it builds the response
            self._answered[request.handle] = request
        elif request.failed:
            self.outbox.put(request.handle, request.failed)
        else:
            self.outbox.put(request.handle, head_answer(request.outputs, self.card).outputs())

    def execute(self, requests):
        got = gather(requests, self.card.inputs)
        if self.inline:
            return self._execute_inline(requests, got)
        senders = [sender_of(r) for r in requests]   # taken inside execute; no request object is kept
        for sender, response in zip(senders, got.responses):
            if response is not None:   # malformed: answered now, the others go on
                self.outbox.put(sender, response)
        at = 0
        for i, n in zip(got.valid, got.sizes):
            self.engine.admit(senders[i], {k: v[at:at + n] for k, v in got.arrays.items()})
            at += n
        return None

    def _execute_inline(self, requests, got):
        self._answered = {}
        at = 0
        for i, n in zip(got.valid, got.sizes):
            self.engine.admit(i, {k: v[at:at + n] for k, v in got.arrays.items()})
            at += n
        self.engine.drive(lambda: len(self._answered) >= len(got.valid))
        for i, r in self._answered.items():
            got.responses[i] = error_response(r.failed) if r.failed else \
                checked_response(head_answer(r.outputs, self.card).outputs())
        return got.responses

    def finalize(self):
        self.engine.stop()
        if self.outbox is not None:
            self.outbox.close()
