"""What runs on a lent NVIDIA GPU host, in one go: ``python3 benchmarks/gpu_host.py OUT_DIR [side-by-side,profiles,admission,generation,admission-triton]``.

Such a host has PyTorch with CUDA and no package registry; the repository travels without its virtual
environment. So this needs only torch, numpy and tqdm, and imports the project from the checkout through a
temporary ``e3`` namespace (the folders as ``pyproject.toml`` maps them), nothing installed. It writes into
OUT_DIR (each step on its own; one failing does not stop the others):

* ``side_by_side.json``: E3 against the stock and naive early-exit models through Triton's gRPC front door on
  this GPU, with the in-process limit beside it (``benchmarks/gpu_side_by_side.py``, which needs the server and
  client brought in ``.gpu_wheels/``: ``make gpu-wheels``); ``e3 bench gpu --measured OUT_DIR`` renders it;
* ``<m>.<gpu>.json``: the latency profiles of bert-ee and resnet-ee measured on the GPU (``e3 profile --cuda
  --untrained``: FP16, one CUDA graph per call), and bert-ee's eager FP32 one beside it;
* ``admission_gpu.json``: the E²bird analogues on the GPU emulated outside Triton (``e3 bench admission --cuda``);
* ``admission_triton.json``: E²bird's stage through Triton on this GPU, with its memory pool and workers on
  streams, against Triton's batcher (``benchmarks/admission_triton.py``; ``e3 bench admission --measured FILE``
  renders it; not a default step: run it alone, ``... OUT_DIR admission-triton``, it takes a few minutes);
* ``generation_gpu.json``: early-exit generation's modes with the KV cache on the device
  (``benchmarks/generation_gpu.py``);
* ``gpu.txt``: the GPU, its driver, and which ONNX Runtime providers the host has.

Back on a development machine, ``e3 bench gpu --measured OUT_DIR/bert_ee.h100.json`` simulates the
cluster with the measured profile beside the modelled ones, and ``e3 bench admission --cuda --report
OUT_DIR/admission_gpu.json`` writes the analogues into ``docs/RESULTS.md``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _runner():
    """benchmarks/gpu_side_by_side.py, loaded from beside this file (it also makes the ``e3`` namespace)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("gpu_side_by_side", ROOT / "benchmarks" / "gpu_side_by_side.py")
    runner = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = runner   # dataclasses look their module up while the class is made
    spec.loader.exec_module(runner)
    return runner


def _step(name: str, fn) -> None:
    start = time.perf_counter()
    print(f"== {name}", flush=True)
    try:
        fn()
        print(f"== {name}: done in {time.perf_counter() - start:.0f} s", flush=True)
    except Exception:   # noqa: BLE001 - report and go on with the next step
        traceback.print_exc()
        print(f"== {name}: FAILED after {time.perf_counter() - start:.0f} s", flush=True)


DEFAULT_STEPS = ("side-by-side", "profiles", "admission", "generation")


def main(out: Path, steps: tuple[str, ...] = DEFAULT_STEPS) -> int:
    out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(_runner().namespace()))
    try:
        info = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv"],
                              capture_output=True, text=True).stdout
    except OSError:
        info = "nvidia-smi: not found\n"
    try:
        import onnxruntime
        info += f"onnxruntime {onnxruntime.__version__}: {onnxruntime.get_available_providers()}\n"
    except ImportError:
        info += "onnxruntime: not installed\n"
    import torch
    info += f"torch {torch.__version__}, CUDA {torch.version.cuda}, {os.cpu_count()} CPUs\n"
    (out / "gpu.txt").write_text(info)
    print(info, flush=True)

    from e3.export.cuda_profile import CudaSettings, profile_model_cuda
    from e3.export.profiler import format_table

    def profile(model: str, **kw):
        def run():
            from e3.core.profile import ProfileError
            from e3.export.cuda_profile import bls_from_run
            try:   # the BLS hops the side-by-side step measured in Triton on this GPU, where it ran
                kw.setdefault("bls_ms", bls_from_run(out, model))
            except (OSError, ValueError, ProfileError) as err:
                print(f"   (no measured hop for {model}: {err}; Tx adds the assumed exchange)", flush=True)
            p = profile_model_cuda(model, CudaSettings(**kw), progress=False, untrained=True)
            (dev,) = p.devices
            p.save(out / f"{model.replace('-', '_')}.{dev}.json")
            print(format_table(p), flush=True)
        return run

    if "side-by-side" in steps:
        def side_by_side():
            runner = _runner()
            runner.run(runner.Settings(out.resolve(), budget_s=420.0))
        _step("E3 vs stock vs naive early exit through Triton (side by side)", side_by_side)
    if "profiles" in steps:
        _step("profile bert-ee (FP16, CUDA graphs)", profile("bert-ee"))
        _step("profile resnet-ee (FP16, CUDA graphs)", profile("resnet-ee"))
        _step("profile bert-ee (FP32, eager)", profile("bert-ee", precision="fp32", graphs=False))

    def admission():
        from e3.benchmarks.admission_gpu import GpuAdmissionSettings, run_gpu_admission
        doc = run_gpu_admission(GpuAdmissionSettings(), echo=lambda m: print(m, flush=True))
        (out / "admission_gpu.json").write_text(json.dumps(doc, indent=1, default=float))
    if "admission" in steps:
        _step("E2bird analogues on the GPU", admission)
    if "admission-triton" in steps:
        def admission_triton():
            import importlib.util
            spec = importlib.util.spec_from_file_location("admission_triton", ROOT / "benchmarks" / "admission_triton.py")
            runner = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = runner
            spec.loader.exec_module(runner)
            runner.run(runner.Settings(out.resolve(), budget_s=420.0))
        _step("E2bird's stage through Triton on the GPU", admission_triton)
    if "generation" in steps:   # benchmarks/generation_gpu.py: writes generation_gpu.json
        from e3.benchmarks.generation_gpu import run as generation
        _step("early-exit generation, KV on the device", lambda: generation(out))
    return 0


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    sys.exit(main(Path(sys.argv[1]), tuple(sys.argv[2].split(",")) if len(sys.argv) == 3 else DEFAULT_STEPS))
