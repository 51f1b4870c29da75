"""What a model costs, measured: the profiles the planner and the simulator read.

profiler.py          ``e3 profile``: E3's P(k, c, B) and Tx on the runtime that serves the splits (ONNX Runtime)
host_profile.py      the host-side curves: the exit check between blocks, the router's own work per batch
server_profile.py    what is measured on a running tritonserver: one BLS hop (Tx), the CPU per request
cuda_profile.py      ``e3 profile --cuda``: the same units measured on an NVIDIA GPU with PyTorch
modelled_profile.py  a GPU profile modelled from public figures when no GPU was lent (labelled so)

A profile is a file (``e3.core.profile``); the planner reads the file, not this room.
"""
