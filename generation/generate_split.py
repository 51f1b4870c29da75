"""``<m>_split_<a>-<b>`` and ``<m>_kvfill_<a>-<b>`` of a generation model on the embedded server.

Stateless by default: every request is one batch formed by the generation router (``max_batch_size`` 0, no
dynamic batcher; each sequence's cache comes with the request, see :mod:`e3.generation.onnx_splits`), run in
one ONNX Runtime call with ``intra_op_threads`` threads (default 1, so instance counts mean cores).

With parameter ``kv_store`` = 1 (``<m>_kv_split_<a>-<b>``, one instance) the split keeps each sequence's
cache itself (:class:`e3.generation.kv_store.KvStore`): requests carry sequence ids and lengths instead of
cache slices, and a request holding only ``release_ids`` drops finished sequences. ``onnx_file`` (relative to
the version folder) lets it share the stateless split's file.

A request ONNX Runtime refuses (wrong shapes, missing inputs) gets its own error; the others are answered.
"""

from __future__ import annotations

import os

import numpy as np
import onnxruntime as ort
import triton_python_backend_utils as pb_utils

from e3.generation.kv_store import KvStore
from e3.core.session import make_session
from e3.serving.triton_io import error_response, io_specs, model_parameters, tensor_response


class TritonPythonModel:
    def initialize(self, args):
        # A head asked for no positions (K = 0: the full model passing a ramp) makes ONNX Runtime warn
        # about the empty argmax's shape on every call; the result is unused.
        ort.set_default_logger_severity(3)
        config, params = model_parameters(args)
        version_dir = os.path.join(args["model_repository"], args["model_version"])
        path = os.path.normpath(os.path.join(version_dir, params.get("onnx_file", "model.onnx")))
        self.session = make_session(path, int(params.get("intra_op_threads", "1")))
        self.onnx_inputs = [i.name for i in self.session.get_inputs()]
        self.onnx_outputs = [o.name for o in self.session.get_outputs()]
        self.store = KvStore() if params.get("kv_store", "0") == "1" else None
        self.inputs = [t.name for t in io_specs(config, "input")]
        self.outputs = [t.name for t in io_specs(config, "output")]
        if self.store is not None:
            shape = self.session.get_inputs()[self.onnx_inputs.index("past_kv")].shape
            self.kv_shape = tuple(int(shape[i]) for i in (1, 2, 3, 5))

    def execute(self, requests):
        responses = []
        for request in requests:
            got = {}
            for name in self.inputs:
                tensor = pb_utils.get_input_tensor_by_name(request, name)
                if tensor is not None:
                    got[name] = tensor.as_numpy()
            try:
                responses.append(tensor_response(self._run(got)))
            except KeyError as err:
                responses.append(error_response(f"missing input {err}", client_error=True))
            except Exception as err:   # ONNX Runtime's message names the bad shape or type
                responses.append(error_response(f"cannot run this batch: {err}", client_error=True))
        return responses

    def _run(self, got: dict) -> dict:
        if self.store is None:
            feed = {name: got[name] for name in self.onnx_inputs}
            return dict(zip(self.onnx_outputs, self.session.run(self.onnx_outputs, feed)))
        if "release_ids" in got:
            self.store.release(got["release_ids"])
            return {}
        feed = {name: got[name] for name in self.onnx_inputs if name not in ("past_kv", "key_valid")}
        feed.update(self.store.feed(got, self.kv_shape))
        out = dict(zip(self.onnx_outputs, self.session.run(self.onnx_outputs, feed)))
        self.store.keep(got, out["new_kv"])
        return {k: np.ascontiguousarray(v) for k, v in out.items() if k in self.outputs}
