"""``<m>_admission_b<MaxBS>_<policy>``: E²bird's admission stage as one Triton Python model on its instance's device
(KIND_GPU: the GPU, FP16, a CUDA graph per worker; KIND_CPU: the CPU, FP32, eager, one intra-op thread).

``execute`` only validates the requests and queues them for the engine (:mod:`e3.serving.device.
admission_engine`), then returns ``None``; the engine thread copies each into the memory pool as it comes, runs
the workers N-Ebird or E-Ebird launches, and hands each finished request to the response thread
(:class:`~e3.serving.triton_io.ResponseSender`: one thread sends every response, the router's lesson), which
answers it through its own response sender (allowed for a non-decoupled model: plain ``infer`` calls work).
Triton's batcher in front has no delay, so requests that queued while ``execute`` ran arrive in one call.

String parameters (written by :func:`e3.export.device_repository.write_device_model`, system ``admission``):
``model``, ``seed``, ``trained``, ``precision``, ``graphs`` as for the device models; ``policy`` (JSON:
``kind``, ``engine``, ``max_inflight``, ``confs``, as :func:`e3.serving.admission.make_policy` takes them) and
``pool_slots`` (the ring's rows; default 8 x MaxInf, the paper's "several times MaxInf"); ``poll_s`` (the engine
thread's pause between rounds while workers run, default 50 us) and ``switch_interval_s`` (the process's forced
switch of the interpreter lock, default 0.5 ms): chosen, not measured, so that polling does not starve
``execute`` and the sender of the lock.

Decision: answers leave through a sender thread, not from ``execute``: the pool exists so that arrivals are
copied while workers compute, which needs ``execute`` to return before its requests are done. (The GPU E3 router
answers inline because its threaded form stopped answering under load on the H200, cause not found; the GPU
runner checks this stage's answers under concurrent clients first, with a timeout, so the same failure would
show there as errors, not as a hung bench.)
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
from e3.serving.triton_io import ResponseSender, gather, model_parameters


class TritonPythonModel:
    def initialize(self, args):
        _, params = model_parameters(args)
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
        self.outbox = ResponseSender(f"{params['model']} admission")
        # the engine thread polls events while workers run; it must leave the interpreter lock to execute() and the
        # sender often: a 50 us pause per round, and a 0.5 ms forced switch (Python's default, 5 ms, would let a
        # polling thread hold the lock that long against a thread waiting for it)
        sys.setswitchinterval(float(params.get("switch_interval_s", "0.0005")))
        self.engine = AdmissionEngine(self.policy, ops, capacity=slots, answer=self._answer,
                                      poll_s=float(params.get("poll_s", "0.00005"))).start()

    def _answer(self, request) -> None:
        if request.failed:
            self.outbox.put(request.handle, request.failed)
        else:
            self.outbox.put(request.handle, head_answer(request.outputs, self.card).outputs())

    def execute(self, requests):
        got = gather(requests, self.card.inputs)
        for request, response in zip(requests, got.responses):
            if response is not None:   # malformed: answered now, the others go on
                self.outbox.put(request, response)
        at = 0
        for i, n in zip(got.valid, got.sizes):
            self.engine.admit(requests[i], {k: v[at:at + n] for k, v in got.arrays.items()})
            at += n
        return None

    def finalize(self):
        self.engine.stop()
        self.outbox.close()
