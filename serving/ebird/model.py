"""E²bird's elastic admission stage as one Triton Python model: ``<m>_admission`` in front of a model served from
one ONNX file on the CPU, or ``<m>_admission_b<MaxBS>_<policy>`` running the model's head path in PyTorch on the
instance's device (KIND_GPU: the GPU, FP16, a CUDA graph per worker; KIND_CPU: the CPU, FP32, eager).

One engine (:class:`~e3.serving.ebird.engine.AdmissionEngine`: the memory pool, N-Ebird or E-Ebird from
:mod:`e3.serving.ebird.policy`, the workers) over one device seam, chosen by the parameters:

* ``model`` set (what :func:`e3.export.device_repository.write_device_model` writes, system ``admission``): the
  model's head path in PyTorch (:class:`~e3.serving.ebird.torch_ops.TorchOps`), parameters ``model``, ``seed``,
  ``trained``, ``precision``, ``graphs`` as for the device models;
* otherwise (what :func:`e3.serving.ebird.repository.write_admission` writes): the ONNX file of the fronted model
  (:class:`~e3.serving.ebird.host_ops.HostOps`), its batches on the instances of ``workers_model`` by BLS, or,
  without it, on one shared ONNX Runtime session (``onnx_file``, ``intra_op_threads``).

Two answering forms, parameter ``answering``:

* ``continuous`` (the default, the paper's form): ``execute`` takes each request's response sender, submits its
  inputs and returns ``None`` at once; the engine thread of :class:`~e3.serving.device.continuous.
  ContinuousEngine` (shared with E3's device router) stages arrivals into the pool while workers compute,
  launches workers and answers through ``response_threads`` sending threads. This is the pattern Triton
  supports for non-decoupled models (python_backend >= 24.06; Triton's own QA test does it); the threaded form
  that died on the H200 took its senders *after* ``execute`` (:class:`~e3.serving.triton_io.ResponseSender`).
  The inputs held are bounded by ``max_queue_inputs`` (unset: unbounded; past it a request gets 503 at once).
* ``inline`` (the labelled fallback): ``execute`` admits its requests and runs the engine's rounds in its own
  thread until each is answered; requests that arrive meanwhile wait in Triton's queue for the next execute.

Other parameters: ``policy`` (JSON: ``kind``, ``engine``, ``max_inflight``, ``confs``, ``slots``, as
:func:`~e3.serving.ebird.policy.make_policy` takes them), ``pool_slots`` (the ring's rows; default 8 x MaxInf,
the paper's "several times MaxInf"), ``poll_s`` (the engine's pause between rounds while workers run on CUDA
streams, default 50 us; chosen, not measured, so that polling does not starve ``execute`` and the senders of the
interpreter lock; worker threads wake the engine themselves).
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import threading

import triton_python_backend_utils as pb_utils

from e3.core.session import make_session
from e3.core.spec import TensorSpec
from e3.serving.device.continuous import ANSWERING, ContinuousEngine
from e3.serving.ebird.engine import AdmissionEngine
from e3.serving.ebird.host_ops import HostOps
from e3.serving.ebird.policy import make_policy
from e3.serving.scheduler import MAX_QUEUE_INPUTS, queue_limit
from e3.serving.triton_io import (ResponseSender, admit_continuously, bls, checked_response, error_response, gather,
                                  io_specs, model_parameters)

__all__ = ["TritonPythonModel"]

GPU_POLL_S = 0.00005    # the engine's pause between rounds while CUDA workers run (module docstring)
SAFETY_POLL_S = 0.05    # worker threads wake the engine; this only bounds a wake-up that never comes


class TritonPythonModel:
    def initialize(self, args):
        config, params = model_parameters(args)   # (also turns faulthandler on: crash stacks in the server log)
        spec = json.loads(params["policy"])
        self.policy = make_policy(spec["kind"], engine=spec.get("engine"), max_inflight=spec.get("max_inflight"),
                                  confs=spec.get("confs"), slots=spec.get("slots"))
        self.answering = params.get("answering") or "continuous"
        if self.answering not in ANSWERING:
            raise ValueError(f"answering must be one of {', '.join(ANSWERING)}, got {self.answering!r}")
        slots = int(params.get("pool_slots") or 8 * self.policy.max_inflight)
        who = f"{args.get('model_name', 'e3')} admission"
        self.outboxes, self.continuous = [], None
        if self.answering == "continuous":
            self.outboxes = [ResponseSender(who) for _ in range(int(params.get("response_threads", "1")))]
            turn = itertools.cycle(self.outboxes)
            self.continuous = ContinuousEngine(lambda sender, what: next(turn).put(sender, what), name="e3-ebird-engine",
                                               max_queue_inputs=queue_limit(params.get(MAX_QUEUE_INPUTS)))
            answer = self._answer_later
        else:
            self._answered: dict = {}
            answer = self._answered_now
        wake = self.continuous.wake if self.continuous is not None else (lambda: None)
        if params.get("model"):
            ops, self.inputs, self.to_outputs, poll_s = _torch_side(args, params, self.policy, slots)
        else:
            ops, self.inputs, self.to_outputs, poll_s = _onnx_side(args, config, params, self.policy, slots, wake)
        self.engine = AdmissionEngine(self.policy, ops, capacity=slots, answer=answer)
        if self.continuous is not None:
            self.continuous.poll_s = float(params.get("poll_s") or poll_s)
            # the engine thread, the senders and execute share the interpreter lock: switch it often (Python's
            # default, 5 ms, would let a polling thread hold it that long against a thread waiting for it)
            sys.setswitchinterval(0.0005)
            self.continuous.bind(self.engine)

    def execute(self, requests):
        got = gather(requests, self.inputs)
        if self.continuous is not None:
            admit_continuously(self.continuous, self.outboxes[0], requests, got)
            return None
        at = 0
        self._answered = {}
        for i, n in zip(got.valid, got.sizes):
            self.engine.admit(i, {k: v[at:at + n] for k, v in got.arrays.items()})
            at += n
        self.engine.drive(lambda: len(self._answered) >= len(got.valid))
        for i, r in self._answered.items():
            got.responses[i] = error_response(r.failed) if r.failed else checked_response(self.to_outputs(r.outputs))
        return got.responses

    def _answer_later(self, r) -> None:
        if r.failed:
            self.continuous.failed(r.handle, r.failed)
        else:
            self.continuous.answered(r.handle, self.to_outputs(r.outputs))

    def _answered_now(self, r) -> None:
        self._answered[r.handle] = r

    def finalize(self):
        if self.continuous is not None:
            self.continuous.close(message="the admission stage is unloading; send again")
        self.engine.close()
        for outbox in self.outboxes:
            outbox.close()


def _torch_side(args, params, policy, slots):
    """The model's head path in PyTorch on the instance's device: (ops, inputs, outputs of a result, poll_s)."""
    # deferred: torch and the device modules load only for a model run in PyTorch (an ONNX-fronted stage has none)
    import torch
    from e3.serving.device.executor import DeviceSettings, build_model, prepare_model
    from e3.serving.device.pipeline import head_answer
    from e3.serving.ebird.torch_ops import LOGITS, TorchOps
    gpu = args.get("model_instance_kind") == "GPU"
    device = f"cuda:{args.get('model_instance_device_id', '0')}" if gpu else "cpu"
    if not gpu:
        torch.set_num_threads(int(params.get("intra_op_threads", "1")))
    settings = DeviceSettings(device=device, precision=params.get("precision") or ("fp16" if gpu else "fp32"),
                              graphs=params.get("graphs", "yes") == "yes", max_batch=max(policy.engine))
    model = prepare_model(build_model(params["model"], seed=int(params.get("seed", "0")),
                                      trained=params.get("trained") == "yes"), settings)
    card = model.card
    ops = TorchOps(model, policy.engine, capacity=slots, settings=settings)
    # on the CPU a launch runs the batch before it returns: the next round finds it done, no pause needed
    return ops, card.inputs, lambda out: head_answer(out[LOGITS], card).outputs(), GPU_POLL_S if gpu else 0.0


def _onnx_side(args, config, params, policy, slots, wake):
    """The fronted model's ONNX file on the CPU: (ops, inputs, outputs of a result, poll_s)."""
    inputs: tuple[TensorSpec, ...] = io_specs(config, "input")
    outputs = [t.name for t in io_specs(config, "output")]
    workers_model = params.get("workers_model", "")
    if workers_model:
        run = _bls_runner(workers_model, outputs)
    else:   # the workers as threads of this process, one shared session
        version_dir = os.path.join(args["model_repository"], args["model_version"])
        session = make_session(os.path.join(version_dir, params.get("onnx_file", "model.onnx")),
                               int(params.get("intra_op_threads", "1")))

        def run(feed):
            return dict(zip(outputs, session.run(outputs, feed)))
    ops = HostOps(inputs, policy.engine, capacity=slots, run=run, on_done=wake)
    return ops, inputs, lambda out: out, SAFETY_POLL_S


def _bls_runner(workers_model: str, outputs: list[str]):
    """``run(feed)`` on a free instance of ``workers_model`` (BLS), loading that model on the first batch if it is
    not loaded yet (explicit model control, as ``e3 serve`` runs; list it beside the stage to load it up front)."""
    loaded, lock = [False], threading.Lock()

    def run(feed):
        if not loaded[0]:
            with lock:
                if not loaded[0] and not pb_utils.is_model_ready(model_name=workers_model):
                    pb_utils.Logger.log_info(f"e3 admission: loading the workers' model {workers_model}")
                    pb_utils.load_model(model_name=workers_model)
                    if not pb_utils.is_model_ready(model_name=workers_model):
                        raise RuntimeError(f"the workers' model {workers_model} could not be loaded")
                loaded[0] = True
        return bls(workers_model, feed, outputs)
    return run
