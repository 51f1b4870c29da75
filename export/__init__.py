"""Data plane: early-exit models (zoo), ONNX export of splits, Triton repository generation."""
