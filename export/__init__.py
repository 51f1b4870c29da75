"""Export: a PyTorch early-exit model written as a Triton model repository.

onnx_export.py        a split of blocks (and its ramps) as an ONNX file, checked against PyTorch
tensorrt.py           the TensorRT plans of a GPU target (built on the GPU host, never here)
triton_config.py      one model's ``config.pbtxt``: inputs, outputs, batcher, instances and threads
repository.py         ``e3 export``: splits, router, baselines and the manifest, written atomically
device_repository.py  the device form's repository: every split inside ``<m>_router``'s process
rules.py              a model's exit rule resolved, checked against PyTorch and shipped beside the router

The models themselves live in ``models/``; what they cost is measured by ``profiling/``.
"""
