"""E3 on Triton: serving early-exit neural networks on NVIDIA Triton Inference Server.

Rooms (see docs/architecture.md):
  e3.core        the shared vocabulary: names, plans, model cards, exit rules
  e3.models      the early-exit models in PyTorch: interface, zoo, data, training, evaluation, workloads
  e3.profiling   what a model costs, measured: the latency profiles the planner and the simulator read
  e3.export      a model's ONNX splits -> a Triton model repository
  e3.serving     what runs inside Triton: the router, splits, baselines, preprocessing and their glue
  e3.controller  forecaster, planner and the controller that applies plans
  e3.client      client SDK, load generator, workload reader
  e3.deploy      starting and stopping tritonserver (embedded), device pools, deployment files
  e3.generation  early-exit generation (decoders, the engine, HELIOS, ExeGPT)
  e3.simulator   the served system in simulated time
  e3.benchmarks  every `e3 bench ...` driver and the sections of docs/RESULTS.md
  e3.cli         the `e3` command line, one module per verb group
e3/ itself holds only the floor (e3.core and e3.paths); it imports no room above it.
"""

__version__ = "0.1.0"
