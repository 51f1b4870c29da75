"""Early-exit generation: decoder LLMs served token by token in splits (exits per token, KV cache of
skipped layers, lossy and lossless modes), and the planners built on it (HELIOS, ExeGPT)."""
