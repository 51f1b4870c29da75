"""The rooms that only decide things load without torch (STYLE: heavy imports stay out of them), and what
runs outside Triton loads without Triton. Which room may import which: tests/test_layering.py."""

from __future__ import annotations

import subprocess
import sys

import pytest

# Modules that decide: the planner, the controller's decisions, health and loop, the router's policy,
# the cost model and the rest of the vocabulary.
LIGHT = ["e3.controller.planner", "e3.controller.decisions", "e3.controller.health", "e3.controller.loop",
         "e3.controller.forecast", "e3.controller.telemetry", "e3.serving.policy", "e3.serving.ebird.policy", "e3.core.cost",
         "e3.core.plan", "e3.core.profile", "e3.core.exits", "e3.core.manifest", "e3.core.rows", "e3.core.files",
         "e3.core.session"]


def _loaded_after_import(modules: list[str]) -> set[str]:
    code = ("import sys\n" + "".join(f"import {m}\n" for m in modules) +
            "print('\\n'.join(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return set(out.stdout.split())


def test_deciding_modules_import_without_torch():
    """All of them in one interpreter (one start-up instead of one each); a failure names the culprits
    by importing each alone."""
    loaded = _loaded_after_import(LIGHT)
    assert set(LIGHT) <= loaded
    if "torch" in loaded:
        culprits = [m for m in LIGHT if "torch" in _loaded_after_import([m])]
        pytest.fail(f"{culprits} pull in torch")


def test_modules_outside_triton_import_only_serving_modules_that_load_outside_it():
    """The exporter, profiler, benchmarks and deploy run in a plain interpreter: every serving module
    they import (even inside a function) must load without Triton's ``triton_python_backend_utils``."""
    import re
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    used = set()
    for folder in ("export", "deploy", "controller", "client", "benchmarks", "cli", "simulator", "e3"):
        for path in (root / folder).rglob("*.py"):
            used |= set(re.findall(r"from (e3\.serving(?:\.\w+)+) import", path.read_text()))
            used |= set(re.findall(r"^\s*import (e3\.serving(?:\.\w+)+)", path.read_text(), re.M))
    assert used, "no serving import found: the scan is broken"
    # the rooms below serving/ are read too (serving/device/, serving/ebird/): a module of theirs names its room
    assert any(m.startswith(("e3.serving.device.", "e3.serving.ebird.")) for m in used), sorted(used)
    loaded = _loaded_after_import(sorted(used))
    assert "triton_python_backend_utils" not in loaded
