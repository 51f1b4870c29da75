"""``<m>_split_<a>-<b>`` and ``<m>_kvfill_<a>-<b>`` of a generation model on the embedded server.

Stateless: every request is one batch formed by the generation router (``max_batch_size`` 0, no dynamic
batcher; each sequence's cache comes with the request, see :mod:`e3.generation.onnx_splits`), run in one
ONNX Runtime call with ``intra_op_threads`` threads (default 1, so instance counts mean cores). A request
that ONNX Runtime refuses (wrong shapes, missing inputs) gets its own error; the others are answered.
"""

from __future__ import annotations

import os

import onnxruntime as ort

from e3.serving.session import make_session
from e3.serving.triton_io import error_response, model_parameters, tensor_response

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        # A head asked for no positions (K = 0: the full model passing a ramp) makes ONNX Runtime warn
        # about the empty argmax's shape on every call; the result is unused.
        ort.set_default_logger_severity(3)
        _, params = model_parameters(args)
        version_dir = os.path.join(args["model_repository"], args["model_version"])
        self.session = make_session(os.path.join(version_dir, "model.onnx"), int(params.get("intra_op_threads", "1")))
        self.inputs = [i.name for i in self.session.get_inputs()]
        self.outputs = [o.name for o in self.session.get_outputs()]

    def execute(self, requests):
        responses = []
        for request in requests:
            feed = {}
            for name in self.inputs:
                tensor = pb_utils.get_input_tensor_by_name(request, name)
                if tensor is None:
                    break
                feed[name] = tensor.as_numpy()
            if len(feed) != len(self.inputs):
                missing = [n for n in self.inputs if n not in feed]
                responses.append(error_response(f"missing input(s) {', '.join(missing)}", client_error=True))
                continue
            try:
                got = self.session.run(self.outputs, feed)
            except Exception as err:   # ONNX Runtime's message names the bad shape or type
                responses.append(error_response(f"cannot run this batch: {err}", client_error=True))
                continue
            responses.append(tensor_response(dict(zip(self.outputs, got))))
        return responses
