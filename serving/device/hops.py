"""What a split boundary costs on a device, measured inside Triton at one batch size: the prices the GPU
side-by-side records beside its runs (docs/gpu.md, "Hops").

Two roles (config parameter ``role``):

* ``echo``: returns its input ``state`` as ``state_out``, on the device it came on (DLPack, no copy): the far
  end of a BLS hop between two Triton models on one GPU;
* ``prices``: receives ``batch`` (INT32 [1]) and ``repeats`` (INT32 [1]); makes a cut state of the model's
  shape at that batch on its device (``state_shape``/``state_dtype`` parameters) and times, each ``repeats``
  times after a few untimed calls, with the device synchronised around each:

  - ``bls_ms``: one BLS call of ``echo`` passing the state as a device tensor and asking for a device tensor
    back (what a split boundary between two Triton models on the GPU costs; ``FORCE_CPU_ONLY_INPUT_TENSORS``
    off for both);
  - ``host_ms``: the state copied to the host and back (a hop through host memory);
  - ``handoff_ms``: what E3's device-resident form pays instead: the survivors' rows gathered on the device
    (``index_select`` of a random half) into a buffer of their own.

  It answers ``times_ms`` (FP32 [3, repeats]: those three rows).
"""

from __future__ import annotations

import json
import time

import numpy as np
import torch
import triton_python_backend_utils as pb_utils
from torch.utils.dlpack import from_dlpack, to_dlpack

from e3.serving.triton_io import model_parameters

__all__ = ["TritonPythonModel", "PRICES"]

PRICES = ("bls_ms", "host_ms", "handoff_ms")
WARMUP = 3


class TritonPythonModel:
    def initialize(self, args):
        _, params = model_parameters(args)
        self.role = params["role"]
        gpu = args.get("model_instance_kind") == "GPU"
        self.device = torch.device(f"cuda:{args.get('model_instance_device_id', '0')}" if gpu else "cpu")
        self.echo = params.get("echo", "")
        self.shape = tuple(json.loads(params.get("state_shape", "[1]")))
        self.dtype = getattr(torch, params.get("state_dtype", "float32"))

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _time(self, fn, repeats: int) -> list[float]:
        for _ in range(WARMUP):
            fn()
        out = []
        for _ in range(repeats):
            self._sync()
            start = time.perf_counter()
            fn()
            self._sync()
            out.append((time.perf_counter() - start) * 1e3)
        return out

    def execute(self, requests):
        if self.role == "echo":
            return [pb_utils.InferenceResponse([pb_utils.Tensor.from_dlpack(
                "state_out", pb_utils.get_input_tensor_by_name(r, "state").to_dlpack())]) for r in requests]
        responses = []
        for r in requests:
            batch = int(pb_utils.get_input_tensor_by_name(r, "batch").as_numpy().reshape(-1)[0])
            repeats = int(pb_utils.get_input_tensor_by_name(r, "repeats").as_numpy().reshape(-1)[0])
            state = torch.randn((batch, *self.shape), device=self.device).to(self.dtype)
            keep = torch.randperm(batch, device=self.device)[:max(1, batch // 2)].sort().values
            memory = pb_utils.PreferredMemory(pb_utils.TRITONSERVER_MEMORY_GPU if self.device.type == "cuda"
                                              else pb_utils.TRITONSERVER_MEMORY_CPU, 0)

            def bls():
                request = pb_utils.InferenceRequest(
                    model_name=self.echo, requested_output_names=["state_out"],
                    inputs=[pb_utils.Tensor.from_dlpack("state", to_dlpack(state))], preferred_memory=memory)
                response = request.exec()
                if response.has_error():
                    raise pb_utils.TritonModelException(response.error().message())
                return from_dlpack(pb_utils.get_output_tensor_by_name(response, "state_out").to_dlpack())

            rows = [self._time(bls, repeats), self._time(lambda: state.cpu().to(self.device), repeats),
                    self._time(lambda: state.index_select(0, keep), repeats)]
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("times_ms", np.asarray(rows, np.float32))]))
        return responses
