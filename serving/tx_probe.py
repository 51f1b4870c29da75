"""Python-backend models that measure ``Tx``, the cost of one BLS hop (``e3 profile``).

Three roles, chosen by the config parameter ``role``:

* ``echo``   returns its inputs as ``<name>_out`` (no compute): the far end of a hop;
* ``front``  takes a model's inputs and answers the front door's tensors (label,
  exit ramp, probabilities: zeros) at once: a front door without compute, for
  the host CPU a request costs outside the model (``request_ms``);
* ``caller`` receives one cut's tensors (at the batch size being measured) and an
  INT32 ``repeats`` tensor, calls the echo model by BLS ``warmup + repeats`` times
  and answers ``times_ms`` (FP32 [repeats]): the wall time of each call, timed
  inside the caller with ``time.perf_counter``.

Timing inside the caller measures exactly what the router pays per hop (build
the request, copy the tensors into the callee, its execute, copy the response
back) and leaves out the client's HTTP serialisation, which is not part of a
hop between splits.
"""

from __future__ import annotations

import json
import time

import numpy as np
import triton_python_backend_utils as pb_utils

from e3.core.names import state_output
from e3.serving.triton_io import (answer_responses, bls, error_response, gather, io_specs, model_parameters,
                                  split_responses, tensor_response)

REPEATS = "repeats"
TIMES = "times_ms"


class _Zeros:
    """The front door's answers for ``rows`` inputs, all zero (what :func:`answer_responses` reads)."""

    def __init__(self, rows: int, num_classes: int):
        self.label = np.zeros(rows, np.int64)
        self.exit_ramp = np.zeros(rows, np.int32)
        self.probs = np.zeros((rows, num_classes), np.float32)


class TritonPythonModel:
    def initialize(self, args):
        config, params = model_parameters(args)
        self.role = params.get("role", "echo")
        self.inputs = io_specs(config, "input")
        if self.role == "front":
            self.num_classes = int(next(t.shape[0] for t in io_specs(config, "output") if t.name == "probs"))
        if self.role == "caller":
            self.callee = params["callee"]
            self.warmup = int(params.get("warmup", "3"))
            self.state = [t for t in self.inputs if t.name != REPEATS]
            self.callee_outputs = json.loads(params["callee_outputs"])

    def execute(self, requests):
        if self.role == "echo":
            got = gather(requests, self.inputs)
            return split_responses(got, {state_output(name): a for name, a in got.arrays.items()})
        if self.role == "front":
            got = gather(requests, self.inputs)
            return answer_responses(got, _Zeros(got.rows, self.num_classes))
        return [self._time_hops(r) for r in requests]

    def _time_hops(self, request):
        try:
            arrays = {t.name: pb_utils.get_input_tensor_by_name(request, t.name).as_numpy() for t in self.state}
            repeats = int(pb_utils.get_input_tensor_by_name(request, REPEATS).as_numpy().reshape(-1)[0])
            times = np.empty(max(repeats, 0), dtype=np.float32)
            for i in range(self.warmup + repeats):
                start = time.perf_counter()
                bls(self.callee, arrays, self.callee_outputs)
                if i >= self.warmup:
                    times[i - self.warmup] = (time.perf_counter() - start) * 1e3
            return tensor_response({TIMES: times})
        except Exception as err:  # one bad request gets its own error, the model keeps serving
            return error_response(f"tx probe: {err}")
