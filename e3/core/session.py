"""The one way a split's ONNX file is opened in ONNX Runtime (served splits, the
in-process baseline and ``e3 profile`` all use it, so a profile measures what serves).

In the floor because every room that opens an ONNX file uses it (serving, export's profiler, generation's
engine); onnxruntime is imported inside the function, so importing the floor stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import onnxruntime as ort

__all__ = ["make_session"]


def make_session(path: str | bytes, intra_op_threads: int = 1) -> ort.InferenceSession:
    """``path``: an ONNX file, or a serialised model (a graph composed in memory). CPU provider, ``intra_op_threads`` intra-op threads (default 1: instance counts mean cores),
    one inter-op thread, sequential execution."""
    import onnxruntime as ort   # deferred: importing the floor stays light (see the module docstring)
    options = ort.SessionOptions()
    options.intra_op_num_threads = intra_op_threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
