"""E²bird's elastic admission stage (Yuan et al., TPDS), all of it in this room.

Who decides: :mod:`.policy` (N-Ebird and E-Ebird, pure). What holds the inputs: :mod:`.pool` (the memory
pool's ring, pure). Who drives: :mod:`.engine` (the serving loop over one device seam), answering continuously
through :class:`e3.serving.device.continuous.ContinuousEngine` (shared with E3's device router) or inline. Who
computes: :mod:`.torch_ops` (PyTorch: CUDA streams, or CPU tensors) and :mod:`.host_ops` (an ONNX model on the
CPU: worker threads or worker processes). The Triton model: :mod:`.model`. Offline: :mod:`.offline` (the one
profiling phase and its rule) and :mod:`.repository` (``e3 admission``'s writer).
"""
