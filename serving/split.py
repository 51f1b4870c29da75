"""Python-backend model that runs ``model.onnx`` with ONNX Runtime (the embedded target).

The embedded Triton wheel has no ONNX Runtime backend; this model stands in
for it: the dynamic batcher merges requests, they are concatenated, run in one
ONNX Runtime call with pinned threads (parameter ``intra_op_threads``,
default 1, so that instance counts mean cores) and sliced back per request.
"""

from __future__ import annotations

import os

from e3.core.session import make_session
from e3.serving.triton_io import gather, io_specs, model_parameters, split_responses


class TritonPythonModel:
    def initialize(self, args):
        config, params = model_parameters(args)
        version_dir = os.path.join(args["model_repository"], args["model_version"])
        self.session = make_session(os.path.join(version_dir, params.get("onnx_file", "model.onnx")),
                                    int(params.get("intra_op_threads", "1")))
        self.inputs = io_specs(config, "input")
        self.outputs = [t.name for t in io_specs(config, "output")]

    def execute(self, requests):
        got = gather(requests, self.inputs)
        if got.valid:
            split_responses(got, dict(zip(self.outputs, self.session.run(self.outputs, got.arrays))))
        return got.responses
