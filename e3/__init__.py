"""E3 on Triton: serving early-exit neural networks on NVIDIA Triton Inference Server.

Rooms (see docs/architecture.md):
  e3.core        the shared vocabulary: names, plans, model cards, exit rules
  e3.export      PyTorch early-exit models -> ONNX splits -> a Triton model repository
  e3.serving     what runs inside Triton: the router, splits, baselines, preprocessing and their glue
  e3.controller  forecaster, planner and the controller that applies plans
  e3.client      client SDK, load generator, benchmark tables
  e3.deploy      starting and stopping tritonserver (embedded), deployment files
"""

__version__ = "0.1.0"
