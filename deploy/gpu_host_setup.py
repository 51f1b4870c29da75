"""A bare GPU host made ready for the GPU runners (``benchmarks/gpu_host.py`` and the runners it starts): the
project as an ``e3`` namespace from the checkout, the server and client unpacked from ``.gpu_wheels/``
(``deploy/gpu_wheels.sh`` fills it), and the model processes' path. Standard library only: it runs before
anything of the project can be imported, so the runners find it by putting ``deploy/`` at the end of
``sys.path``."""

from __future__ import annotations

import atexit
import os
import re
import shutil
import site
import sys
import tarfile
import tempfile
import traceback
import zipfile
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent


def rooms() -> dict[str, str]:
    """``e3`` subpackage -> its top-level folder, from pyproject.toml's package-dir (``models`` -> ``models``)."""
    line = re.search(r"^package-dir\s*=\s*\{(.*)\}", (ROOT / "pyproject.toml").read_text(), re.M)[1]
    pairs = re.findall(r'"e3\.(\w+)"\s*=\s*"(\w+)"', line)
    return dict(pairs)


def namespace() -> Path:
    """A temporary folder holding ``e3`` as the installed package lays it out (e3/ plus the rooms)."""
    ns = Path(tempfile.mkdtemp(prefix="e3-ns-"))
    shutil.copytree(ROOT / "e3", ns / "e3")
    for package, folder in rooms().items():
        (ns / "e3" / package).symlink_to(ROOT / folder)
    return ns



def _install_wheel(wheel: Path, site: Path) -> None:
    """What pip does for a wheel that needs no build, without pip: unzip it and move its ``<dist>.data/purelib``
    and ``platlib`` trees to the top (where the tritonclient wheel keeps its package)."""
    zipfile.ZipFile(wheel).extractall(site)
    for data in site.glob("*.data"):
        for kind in ("purelib", "platlib"):
            for item in (data / kind).glob("*") if (data / kind).is_dir() else ():
                target = site / item.name
                if target.exists():
                    shutil.rmtree(target) if target.is_dir() else target.unlink()
                shutil.move(str(item), str(target))
        shutil.rmtree(data)


def unpack_host(wheels: Path, work: Path) -> tuple[Path, list[str]]:
    """Unpack the server and the client on a bare host. Returns (the tritonserver binary, folders the model
    processes must import first: numpy<2 for the Python-backend stub)."""
    work.mkdir(parents=True, exist_ok=True)
    server = work / "pt"
    tars = sorted(wheels.glob("tritonserver-*.tar.xz"))
    whls = sorted(wheels.glob("nvidia_pytriton-*.whl"))
    if not (server / "pytriton").is_dir():
        if tars:
            with tarfile.open(tars[-1]) as t:
                t.extractall(server)
        elif whls:
            zipfile.ZipFile(whls[-1]).extractall(server)
        else:
            raise SystemExit(f"no tritonserver-*.tar.xz or nvidia_pytriton-*.whl in {wheels}: run `make gpu-wheels` "
                             "on a machine with the package registry and carry .gpu_wheels/")
    binary = server / "pytriton" / "tritonserver" / "bin" / "tritonserver"
    binary.chmod(0o755)
    for stub in (server / "pytriton" / "tritonserver" / "python_backend_stubs").glob("*/triton_python_backend_stub"):
        stub.chmod(0o755)
    site = work / "site"
    for pattern in ("tritonclient-*.whl", "python_rapidjson-*.whl"):
        for w in wheels.glob(pattern):
            _install_wheel(w, site)
    sys.path.insert(0, str(site))
    stub_first = []
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    for w in wheels.glob(f"numpy-1*-{tag}-*.whl"):
        np1 = work / "np1"
        zipfile.ZipFile(w).extractall(np1)
        stub_first.append(str(np1))
    return binary, stub_first


PTH_NAME = "e3_gpu_side_by_side.pth"


def model_process_path(folders: list[str]) -> None:
    """Put ``folders`` first on the path of every Python process started from now on with this interpreter's
    site-packages: a ``.pth`` file there, removed when this process exits.

    Measured on the lent GPU host: the Python-backend stub ignores ``PYTHONPATH`` (its model imports failed
    with "No module named 'e3'" while the variable named the package's folder), yet it reads this
    interpreter's site-packages (it imports torch from there), whose ``.pth`` files run before the stub
    imports numpy. So the project's namespace and numpy<2 reach the model processes this way."""
    if not folders:
        return
    pth = Path(site.getsitepackages()[0]) / PTH_NAME
    pth.write_text(f"import sys; sys.path[:0] = {folders!r}\n")
    atexit.register(lambda: pth.unlink(missing_ok=True))


def prepare_host(out: Path, *, cpu: bool, wheels: Path | None) -> tuple[Path | None, Path]:
    """Everything a runner does before it imports the project's serving code: the ``e3`` namespace (unless the
    project is installed), on a GPU host (or with ``wheels`` given) the server and client unpacked and the model
    processes' path set, then the working folder moved to ``out`` (created): the model processes start there, not
    in the checkout, whose ``e3/`` (the floor alone) would shadow the namespace. Returns (the tritonserver binary,
    None for the installed one; ``out`` resolved)."""
    binary, ns = None, None
    try:
        import e3   # installed (a development machine), or a namespace a caller made (gpu_host.py)
        root = Path(e3.__file__).resolve().parent
        if (root / "serving").is_dir():   # a namespace folder: e3/ with the rooms inside it
            ns = root.parent
    except ImportError:
        ns = namespace()
        sys.path.insert(0, str(ns))
    if not cpu or wheels:
        wheels = (wheels or ROOT / ".gpu_wheels").resolve()
        binary, stub_first = unpack_host(wheels, Path(tempfile.gettempdir()) / "e3-gpu-host")
        os.environ.setdefault("E3_ARTIFACTS", str(Path(tempfile.gettempdir()) / "e3-gpu-artifacts"))
        model_process_path([*stub_first, *([str(ns)] if ns else [])])
    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    os.chdir(out)
    return binary, out


MODEL_MIN_S = 150.0   # a runner starts no model with less of its time budget left


def measure_each(names, results, measure: Callable[[str], None], *, left_s: Callable[[], float],
                 echo=print) -> None:
    """Every runner's model loop: ``measure(name)`` for each model in turn; a model is skipped (and listed under
    ``skipped``) once fewer than :data:`MODEL_MIN_S` seconds of the time budget are left, a model that fails is
    reported with its traceback and listed under ``failed`` while the run goes on with the next, and ``results``
    (anything with a ``doc`` dict and ``save()``) is saved after each, so a run cut short keeps what it
    measured."""
    for name in names:
        if left_s() < MODEL_MIN_S:
            echo(f"== {name}: skipped, {left_s():.0f} s of the time budget left and a model needs {MODEL_MIN_S:.0f} s "
                 "(a server start alone is a minute): raise --budget-s")
            results.doc.setdefault("skipped", []).append(name)
            continue
        echo(f"== {name}")
        try:
            measure(name)
        except Exception:   # noqa: BLE001 - report, keep what was measured, go on with the next model
            traceback.print_exc()
            results.doc.setdefault("failed", []).append(name)
        results.save()
