"""The standing GPU run: ``python3 benchmarks/gpu_host.py OUT_DIR [STEPS] [--budget-s 420] [--cpu] [--models ...]
[--batches ...] [--mixes ...] [--processes N]``.

What a lent GPU host runs first, in one command (with ``.gpu_wheels/`` carried; ``make gpu-wheels`` fills it).
Such a host has PyTorch with CUDA and no package registry; the repository travels without its virtual
environment and without ``.git`` (prefix ``E3_COMMIT=<hash>`` to record the commit). Needs only torch and numpy;
the project is imported from the checkout through a temporary ``e3`` namespace, nothing installed.

Each step runs in a child process with its own timeout (a hang is killed, the next step runs, what was written
is kept); the whole run keeps to ``--budget-s`` (default 420 s: about 7 minutes on an H100 or H200, the
servers' starts included). The default steps, in order:

* ``probe``: ``benchmarks/threaded_answer_probe.py --kind gpu`` (about a minute): does a KIND_GPU Python model
  answering after ``execute`` survive load, unload and shutdown on this host (called through whatever ``run``
  signature that file has; its failure does not stop the run);
* ``side-by-side``: the headline of ``benchmarks/gpu_side_by_side.py`` with the rest of the budget: BERT-base
  size (``bert-base-ee``), the 80-20 mix, max batch 32 for every system, E3 (continuous answering) against the
  stock and naive early-exit models, each at its best of 1/2/4 instances (and the baselines' batcher delay),
  goodput at p99 20 and 10 ms and saturating, the client's bound beside every figure; other models, batches and
  mixes behind ``--models`` / ``--batches`` / ``--mixes``.

Steps by name only (each a few minutes): ``profiles`` (``e3 profile --cuda --untrained`` of bert-ee and
resnet-ee, FP16 CUDA graphs, and bert-ee FP32 eager), ``admission`` (the E²bird analogues outside Triton),
``generation`` (early-exit generation with the KV cache on the device), ``admission-triton`` (E²bird's stage
through Triton).

The work is written under /tmp (``e3-gpu-run-*``); at most ``MAX_FILES`` (8) files come back into OUT_DIR, flat,
copied after every step: ``gpu.txt`` (``uname -a``, ``nvidia-smi``, torch and CUDA, CPUs, the commit),
``gpu_host.log`` (every step's output), ``side_by_side.json`` and the tail of its server's log
(``side_by_side.server.log``), ``threaded_answer_probe.json`` and its log's tail, then the named steps' JSON.
Back on a development machine: ``e3 bench gpu --measured OUT_DIR`` renders the side-by-side into
docs/RESULTS.md. ``--cpu`` runs the same steps on this machine's CPU (tiny-ee, KIND_CPU), to try the run here.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import os
import shutil
import signal
import site
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

# Deferred imports: standard library only until a step's child has made the e3 namespace (_ensure_e3); torch and
# onnxruntime only to describe the host, which may lack them.
ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
DEPLOY = HERE.parent / "deploy"
MAX_FILES = 8            # files a lent host brings back from OUT_DIR
LOG_TAIL_LINES = 3000    # a server log's tail copied back
DEFAULT_BUDGET_S = 420.0
DEFAULT_STEPS = ("probe", "side-by-side")
NAMED_STEPS = ("profiles", "admission", "generation", "admission-triton")
# each step's own timeout (s); the side-by-side takes what is left of the budget
STEP_TIMEOUT_S = {"probe": 110.0, "profiles": 300.0, "admission": 180.0, "generation": 180.0,
                  "admission-triton": 420.0}
SIDE_BY_SIDE_MIN_S = 150.0   # less left than this: the side-by-side is skipped (a server start alone is a minute)
STOP_MARGIN_S = 35.0         # the side-by-side stops starting measurements this long before its timeout


@dataclass
class Step:
    """One child process of the run."""
    name: str
    argv: list[str]                    # the command
    timeout_s: float
    files: list[tuple[str, str, bool]] = field(default_factory=list)   # (path in the work folder, name in OUT_DIR, tail)


# -- the parent: steps in children, files back ---------------------------------------------------------------------
class _Log:
    """gpu_host.log and the console."""

    def __init__(self, path: Path):
        self.path = path
        self.lock = threading.Lock()

    def write(self, text: str) -> None:
        with self.lock:
            sys.stdout.write(text)
            sys.stdout.flush()
            with self.path.open("a", errors="replace") as f:
                f.write(text)

    def line(self, text: str) -> None:
        self.write(text + "\n")


def _tail(src: Path, dest: Path, lines: int = LOG_TAIL_LINES) -> None:
    with src.open(errors="replace") as f:
        kept = deque(f, maxlen=lines)
    dest.write_text("".join(kept))


def collect(steps: list[Step], work: Path, out: Path, log: _Log, *, first: list[str] = ()) -> list[str]:
    """Copy the steps' files that exist into ``out`` (flat; logs as their tails), at most ``MAX_FILES`` of them
    counting ``first`` (files already written there); returns the names copied. Files past the cap are named in
    the log."""
    copied, left_out = list(first), []
    for step in steps:
        for rel, name, tail in step.files:
            src = work / rel
            if not src.is_file():
                continue
            if len(copied) >= MAX_FILES:
                left_out.append(rel)
                continue
            (_tail if tail else shutil.copyfile)(src, out / name)
            copied.append(name)
    if left_out:
        log.line(f"== not copied (at most {MAX_FILES} files come back): {', '.join(left_out)}; they stay in {work}")
    return copied


def _remove_model_path_file() -> None:
    """The ``.pth`` a runner puts in site-packages for the model processes (gpu_host_setup.model_process_path),
    removed here too: a child killed on its timeout cannot remove it."""
    PTH_NAME = _load("gpu_host_setup", DEPLOY).PTH_NAME
    for folder in site.getsitepackages():
        (Path(folder) / PTH_NAME).unlink(missing_ok=True)


def run_step(step: Step, work: Path, log: _Log) -> str:
    """Run one step's child with its timeout, its output into the log; returns "ok", "failed (rc N)" or
    "timed out" (the child's process group is stopped: SIGTERM, then SIGKILL)."""
    start = time.monotonic()
    log.line(f"== {step.name} (timeout {step.timeout_s:.0f} s)")
    proc = subprocess.Popen(step.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                            start_new_session=True, cwd=work)

    def pump() -> None:
        for line in proc.stdout:
            log.write(line)
    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=step.timeout_s)
        verdict = "ok" if rc == 0 else f"failed (rc {rc})"
    except subprocess.TimeoutExpired:
        verdict = "timed out"
        for sig, wait_s in ((signal.SIGTERM, 15), (signal.SIGKILL, 10)):
            try:
                os.killpg(proc.pid, sig)
                proc.wait(timeout=wait_s)
                break
            except (ProcessLookupError, PermissionError):
                break
            except subprocess.TimeoutExpired:
                continue
    reader.join(timeout=5)
    try:
        _remove_model_path_file()
    except Exception:  # noqa: BLE001 - cleaning up, never a reason to stop
        pass
    log.line(f"== {step.name}: {verdict} after {time.monotonic() - start:.0f} s")
    return verdict


def host_facts(cpu: bool) -> str:
    """gpu.txt: the machine as a GPU run's record needs it."""
    def cmd(argv: list[str]) -> str:
        try:
            return subprocess.run(argv, capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError) as err:
            return f"{argv[0]}: {err}\n"
    text = f"$ uname -a\n{cmd(['uname', '-a'])}"
    if not cpu:
        text += f"$ nvidia-smi\n{cmd(['nvidia-smi'])}"
        text += "$ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv\n" + \
            cmd(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv"])
    try:
        import torch
        text += f"torch {torch.__version__}, CUDA {torch.version.cuda}, "
        text += f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA device'}\n"
    except ImportError:
        text += "torch: not installed\n"
    try:
        import onnxruntime
        text += f"onnxruntime {onnxruntime.__version__}: {onnxruntime.get_available_providers()}\n"
    except ImportError:
        text += "onnxruntime: not installed\n"
    text += f"Python {sys.version.split()[0]}, {os.cpu_count()} CPUs, commit {os.environ.get('E3_COMMIT', 'unknown')}\n"
    return text


def plan_steps(names: list[str], work: Path, options: dict) -> list[Step]:
    """The steps' children and the files each brings back (the side-by-side's timeout is set when it starts; the
    profiles' files, whose names carry the device, when they are written)."""
    me = [sys.executable, str(Path(__file__).resolve()), "--child"]
    model = options.get("reported", "bert-base")
    files = {"probe": [("probe/threaded_answer_probe.json", "threaded_answer_probe.json", False),
                       ("probe/threaded_answer_probe.log", "threaded_answer_probe.log", True)],
             "side-by-side": [("side-by-side/side_by_side.json", "side_by_side.json", False),
                              (f"side-by-side/triton_{model}.log", "side_by_side.server.log", True)],
             "admission": [("admission/admission_gpu.json", "admission_gpu.json", False)],
             "generation": [("generation/generation_gpu.json", "generation_gpu.json", False)],
             "admission-triton": [("admission-triton/admission_triton.json", "admission_triton.json", False)]}
    return [Step(name, [*me, name, str(work / name), json.dumps(options)], STEP_TIMEOUT_S.get(name, 300.0),
                 list(files.get(name, []))) for name in names]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("steps", nargs="?", default=",".join(DEFAULT_STEPS),
                   help=f"comma-separated, in order (default {','.join(DEFAULT_STEPS)}; also {', '.join(NAMED_STEPS)})")
    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, help="the whole run's seconds (default 420)")
    p.add_argument("--cpu", action="store_true", help="this machine's CPU: the probe KIND_CPU, the side-by-side --cpu")
    p.add_argument("--models", default=None, help="the side-by-side's models (default bert-base-ee)")
    p.add_argument("--batches", default=None, help="the side-by-side's max batches (default 32)")
    p.add_argument("--mixes", default=None, help="the side-by-side's mixes (default 80-20)")
    p.add_argument("--processes", type=int, default=None, help="the side-by-side's client processes (default 12)")
    a = p.parse_args(argv)
    names = [s for s in a.steps.split(",") if s]
    unknown = [s for s in names if s not in (*DEFAULT_STEPS, *NAMED_STEPS)]
    if unknown:
        p.error(f"unknown steps {unknown}: choose from {', '.join((*DEFAULT_STEPS, *NAMED_STEPS))}")
    started = time.monotonic()
    out = a.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="e3-gpu-run-"))
    log = _Log(work / "gpu_host.log")
    (out / "gpu.txt").write_text(host_facts(a.cpu))
    log.write((out / "gpu.txt").read_text())
    models = (a.models or ("tiny-ee" if a.cpu else "bert-base-ee")).split(",")
    options = {"cpu": a.cpu, "models": a.models, "batches": a.batches, "mixes": a.mixes, "processes": a.processes,
               "reported": {"bert-base-ee": "bert-base"}.get(models[0], models[0])}
    steps = plan_steps(names, work, options)
    for step in steps:
        left = a.budget_s - (time.monotonic() - started)
        if step.name == "side-by-side":
            step.timeout_s = left - 5.0
            if step.timeout_s < SIDE_BY_SIDE_MIN_S:
                log.line(f"== side-by-side: skipped, {left:.0f} s of the budget left")
                continue
            step.argv[-1] = json.dumps({**options, "budget_s": step.timeout_s - STOP_MARGIN_S})
        else:
            step.timeout_s = min(step.timeout_s, left - 5.0)
            if step.timeout_s < 30:
                log.line(f"== {step.name}: skipped, {left:.0f} s of the budget left")
                continue
        (work / step.name).mkdir(parents=True, exist_ok=True)
        run_step(step, work, log)
        if step.name == "profiles":
            step.files = [(str(f.relative_to(work)), f.name, False) for f in sorted((work / "profiles").glob("*.json"))]
        collect(steps, work, out, log, first=["gpu.txt", "gpu_host.log"])
        _tail(log.path, out / "gpu_host.log", lines=20000)
    log.line(f"== done in {time.monotonic() - started:.0f} s; OUT_DIR holds {sorted(f.name for f in out.iterdir())}; "
             f"the work stays in {work}")
    _tail(log.path, out / "gpu_host.log", lines=20000)
    return 0


# -- a child: one step ----------------------------------------------------------------------------------------------
def _load(name: str, folder: Path = HERE):
    """``folder/<name>.py`` (benchmarks/ by default) as a module of that name (the runners import their siblings
    by name on a bare host; ``deploy/gpu_host_setup.py`` is standard library only)."""
    if name in sys.modules:
        return sys.modules[name]
    sys.path.insert(0, str(HERE))
    spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def _ensure_e3() -> None:
    """``e3`` with its rooms importable: installed, or a temporary namespace from the checkout
    (gpu_host_setup.namespace)."""
    try:
        if importlib.util.find_spec("e3.serving") is not None:
            return
    except ImportError:
        pass
    sys.modules.pop("e3", None)
    sys.path.insert(0, str(_load("gpu_host_setup", DEPLOY).namespace()))


def child(name: str, out: Path, options: dict) -> int:
    """One step, in this process (the parent gives it its timeout)."""
    out.mkdir(parents=True, exist_ok=True)
    echo = lambda m: print(m, flush=True)   # noqa: E731
    if name == "probe":
        probe = _load("threaded_answer_probe")
        params = inspect.signature(probe.run).parameters
        wanted = {"kind": "cpu" if options.get("cpu") else "gpu", "echo": echo}
        kwargs = {k: v for k, v in wanted.items() if k in params}
        try:
            doc = probe.run(out, **kwargs)
        except Exception:  # noqa: BLE001 - the probe is a check; the run goes on with the next step
            traceback.print_exc()
            return 1
        return 0 if isinstance(doc, dict) and doc.get("ok", True) else 1
    if name == "side-by-side":
        runner = _load("gpu_side_by_side")
        argv = [str(out), *(["--cpu"] if options.get("cpu") else [])]
        for flag in ("models", "batches", "mixes", "processes"):
            if options.get(flag):
                argv += [f"--{flag}", str(options[flag])]
        if options.get("budget_s"):
            argv += ["--budget-s", f"{options['budget_s']:.0f}"]
        return runner.main(argv)
    _ensure_e3()
    if name == "profiles":
        from e3.core.profile import ProfileError
        from e3.profiling.cuda_profile import CudaSettings, bls_from_run, profile_cuda
        from e3.profiling.profiler import format_table
        failed = 0
        # bert-base-ee first: the side-by-side's model, whose settings the simulator is validated on (issue 42)
        for model, kw in (("bert-base-ee", {}), ("bert-ee", {}), ("resnet-ee", {}),
                          ("bert-ee", {"precision": "fp32", "graphs": False})):
            try:   # the BLS hops the side-by-side measured in Triton on this GPU, where it ran
                kw.setdefault("bls_ms", bls_from_run(out.parent / "side-by-side", model))
            except (OSError, ValueError, ProfileError) as err:
                echo(f"   (no measured hop for {model}: {err}; Tx adds the assumed exchange)")
            try:
                prof = profile_cuda(model, CudaSettings(**kw), progress=False, untrained=True)
            except Exception:  # noqa: BLE001 - one model's failure costs the step that model, not the others
                traceback.print_exc()
                failed += 1
                continue
            (dev,) = prof.devices
            prof.save(out / f"{model.replace('-', '_')}.{dev}.json")
            echo(format_table(prof))
        return 1 if failed else 0
    if name == "admission":
        from e3.benchmarks.admission_gpu import GpuAdmissionSettings, run_gpu_admission
        doc = run_gpu_admission(GpuAdmissionSettings(), echo=echo)
        (out / "admission_gpu.json").write_text(json.dumps(doc, indent=1, default=float))
        return 0
    if name == "generation":
        from e3.benchmarks.generation_gpu import run as generation
        generation(out)
        return 0
    if name == "admission-triton":
        runner = _load("admission_triton")
        runner.run(runner.Settings(out.resolve(), budget_s=300.0))
        return 0
    raise SystemExit(f"unknown step {name!r}")


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        sys.exit(child(sys.argv[2], Path(sys.argv[3]), json.loads(sys.argv[4])))
    sys.exit(main())
