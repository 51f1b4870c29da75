"""Running the tools that ship inside the Triton client wheel (``perf_analyzer``).

perf_analyzer links two libraries this machine lacks (docs/design.md §4):
``libb64.so.0d`` (Debian ``libb64-0d``: installed by `make setup`, or unpacked
into ``.deps/`` without root) and ``libcudart.so.12`` (PyPI
``nvidia-cuda-runtime-cu12``). :func:`tool_env` puts both on the library path.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path

from e3.paths import project_root

__all__ = ["tool_env", "perf_analyzer_binary"]


def _library_dirs() -> list[str]:
    dirs = []
    spec = importlib.util.find_spec("nvidia.cuda_runtime")
    if spec and spec.submodule_search_locations:
        dirs.append(str(Path(list(spec.submodule_search_locations)[0]) / "lib"))
    deps = Path(os.environ.get("E3_DEPS_DIR", project_root() / ".deps")) / "root"
    dirs += [str(p) for p in deps.glob("usr/lib/*-linux-gnu") if p.is_dir()]
    return dirs


def tool_env(base: dict | None = None) -> dict:
    """Environment in which perf_analyzer finds its shared libraries."""
    env = dict(os.environ if base is None else base)
    env["LD_LIBRARY_PATH"] = os.pathsep.join([*_library_dirs(), *filter(None, [env.get("LD_LIBRARY_PATH")])])
    return env


def perf_analyzer_binary() -> str:
    """perf_analyzer from the tritonclient wheel in this environment (else PATH)."""
    candidate = Path(sys.executable).parent / "perf_analyzer"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("perf_analyzer")
    if not found:
        raise FileNotFoundError("perf_analyzer not found; run `make setup` (it ships in tritonclient[all])")
    return found
