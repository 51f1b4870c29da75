"""Each image imports what its served code loads (issue 39, item 1), checked without Docker.

For each Dockerfile: its pip lines are parsed (requirements given inline or through ``-r`` files it copies); every
requirement must be pinned (``==``). The pinned set and its dependencies (their metadata, markers evaluated) are
taken from this machine's environment and laid out alone in a folder; the project goes beside it exactly as the
Dockerfile's COPY list lays it out (tests/test_images.py). A fresh interpreter (``-I -S``: no site-packages, no
repository) with only those folders on its path then imports every module the image serves: for the NGC image
the modules each exported ``model.py`` names, the CPU router the ``<m>_router`` becomes, with Triton's
``triton_python_backend_utils`` (the stub's own file) beside them; for the e3 image the controller, the guards
and the command line. The third-party names those modules import inside functions (found in their source:
lazy imports run only when a model or the controller reaches them) are imported too.

Why not a venv per Dockerfile: building one needs the network or a wheel cache this machine does not have, and
takes minutes; the versions here are the pinned ones (checked), so the set on the path is what the image gets,
less the base image's own files. Where a pin must differ from this machine's version (the NGC image's Python is
older), the difference is named in SUBSTITUTED with its reason. The e3 image's installed size is summed from the
RECORD files of that package set and printed."""

from __future__ import annotations

import ast
import importlib.metadata as metadata
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from test_images import DOCKERFILES, ROOT, build_context, instructions

# The Python of each base image: the NGC 24.10 image ships Ubuntu 22.04's 3.10; PYTHON_IMAGE defaults to 3.11.
IMAGE_PYTHON = {"ngc": {"24.10-py3": "3.10"}, "e3": {"python:3.11-slim": "3.11"}}
# (image, package): why its pin differs from the version on this machine (the check imports the local one)
SUBSTITUTED = {("ngc", "onnxruntime"): "1.31 needs Python >= 3.11; 1.20.1 is the image's (3.10), same API used"}
# Third-party names a served module imports inside a function that the image deliberately lacks
NOT_IN_IMAGE = {"ngc": {"torch": "device-form plans only (the device router); the NGC image serves split plans"},
                "e3": {"torch": "e3 export only (the export image, E3_EXPORT=1), never the controller or guard",
                       "tensorrt": "the gpu extra (TensorRT builds)", "matplotlib": "plots of reports, not served"}}
STUB_UTILS = Path(sys.prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / \
    "site-packages" / "pytriton" / "tritonserver" / "backends" / "python"


def pip_requirements(dockerfile: Path, context: Path) -> list[Requirement]:
    """Every requirement the Dockerfile's RUN lines hand to ``pip install`` (``-r FILE`` read from the copied
    context; the project itself, ``.``, left out: it is laid out apart)."""
    reqs = []
    for word, args in instructions(dockerfile.read_text()):
        if word != "RUN":
            continue
        for command in re.split(r"&&|;", args):
            words = command.replace('"', " ").split()
            if "pip" not in words or "install" not in words:
                continue
            rest = words[words.index("install") + 1:]
            i = 0
            while i < len(rest):
                w = rest[i]
                if w in ("-r", "--requirement"):
                    for line in (context / rest[i + 1]).read_text().splitlines():
                        line = line.split("#")[0].strip()
                        if line and not line.startswith("-"):
                            reqs.append(Requirement(line))
                    i += 2
                    continue
                if w in ("-c", "--constraint"):
                    i += 2
                    continue
                if not w.startswith("-") and not w.startswith(".") and "$" not in w:
                    reqs.append(Requirement(w))
                i += 1
    return reqs


def closure(image: str, reqs: list[Requirement]) -> dict[str, metadata.Distribution]:
    """The pinned distributions and everything they require (markers evaluated), from this environment."""
    env, out, todo = default_environment(), {}, [(r, True) for r in reqs]
    while todo:
        req, top = todo.pop()
        key = req.name.lower().replace("_", "-")
        dist = metadata.distribution(req.name)
        if top:
            pins = [s.version for s in req.specifier if s.operator == "=="]
            assert pins, f"{DOCKERFILES[image].name}: pin {req.name} (==), as the environment it was checked in"
            if dist.version != pins[0]:
                assert (image, key) in SUBSTITUTED, \
                    f"{image}: {req.name}=={pins[0]} pinned, {dist.version} here: pin {dist.version} or say why"
        elif not req.specifier.contains(dist.version, prereleases=True):
            raise AssertionError(f"{image}: {req} needed, {dist.version} here")
        if key in out:
            continue
        out[key] = dist
        for text in dist.requires or []:
            sub = Requirement(text)
            if sub.marker is None or any(sub.marker.evaluate({**env, "extra": e}) for e in [""] + list(req.extras)):
                todo.append((sub, False))
    return out


def python_fits(image: str, dists: dict[str, metadata.Distribution], pinned: list[Requirement],
                python: str) -> list[str]:
    """Pinned distributions (used as is) whose Requires-Python refuses the image's Python (pip picks the
    unpinned ones below them for that Python)."""
    names = {r.name.lower().replace("_", "-") for r in pinned}
    return [f"{k} {d.version} needs Python {d.metadata['Requires-Python']}" for k, d in dists.items()
            if k in names and (image, k) not in SUBSTITUTED and d.metadata.get("Requires-Python")
            and not SpecifierSet(d.metadata["Requires-Python"]).contains(python)]


def lay_out(dists: dict[str, metadata.Distribution], into: Path) -> int:
    """Link each distribution's top-level files into ``into``; their installed size in bytes (RECORD)."""
    into.mkdir(parents=True)
    size = 0
    for dist in dists.values():
        for f in dist.files or []:
            if f.parts[0] == "..":
                continue
            size += f.size or 0
            top = into / f.parts[0]
            if not top.exists():
                top.symlink_to(Path(dist.locate_file(f.parts[0])))
    return size


def project_layout(context: Path, into: Path) -> Path:
    """The project as installed from the copied context: pyproject's package-dir folders under ``e3``."""
    mapping = dict(re.findall(r'"(e3[\w.]*)"\s*=\s*"([\w/]+)"', (context / "pyproject.toml").read_text()))
    for package, folder in sorted(mapping.items()):
        target = into / package.replace(".", "/")
        target.parent.mkdir(parents=True, exist_ok=True)
        if not target.exists():
            target.symlink_to(context / folder)
    return into


def served_modules(image: str) -> list[str]:
    """The modules each image's served code starts from."""
    if image == "ngc":
        from e3.export.repository import ROUTER_MODULE, SERVING
        return [ROUTER_MODULE, f"{SERVING}.router", f"{SERVING}.ee", f"{SERVING}.preprocess"]
    return ["e3.cli", "e3.cli.control", "e3.cli.serve", "e3.controller.loop", "e3.controller.k8s_scaler",
            "e3.controller.pooled_applier", "e3.controller.triton_applier", "e3.controller.metrics",
            "e3.controller.forecast", "e3.deploy.serve", "e3.deploy.guard", "e3.deploy.grpc_guard"]


def lazy_third_party(files: list[str]) -> set[str]:
    """Top-level third-party names imported anywhere in ``files`` (inside functions too; not under
    ``if TYPE_CHECKING``)."""
    names = set()
    for path in files:
        tree = ast.parse(Path(path).read_text())
        skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n not in ("e3", "__future__",
                                                                                "triton_python_backend_utils")}


CHECK = """
import importlib, json, sys
sys.path[:0] = json.loads(sys.argv[1])
failed = {}
for name in json.loads(sys.argv[2]):
    try:
        importlib.import_module(name)
    except Exception as e:
        failed[name] = f"{type(e).__name__}: {e}"
files = sorted({m.__file__ for n, m in list(sys.modules.items())
                if n.startswith("e3.") and getattr(m, "__file__", None)})
print(json.dumps({"failed": failed, "e3_files": files}))
"""


def isolated_import(path: list[Path], modules: list[str]) -> dict:
    run = subprocess.run([sys.executable, "-I", "-S", "-c", CHECK, json.dumps([str(p) for p in path]),
                          json.dumps(modules)], capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1])


def image_check(image: str, dockerfile: Path, tmp: Path) -> tuple[dict, int]:
    """(failed imports, installed size in bytes of the pip set) of ``image`` built from ``dockerfile``."""
    context = build_context(dockerfile, tmp / "context")
    args = dict(a.split("=", 1) for w, a in instructions(dockerfile.read_text()) if w == "ARG" and "=" in a)
    base = args.get("TRITON_TAG") or args.get("PYTHON_IMAGE")
    assert base in IMAGE_PYTHON[image], f"{dockerfile.name}: base {base}: add its Python to IMAGE_PYTHON"
    pinned = pip_requirements(dockerfile, context)
    dists = closure(image, pinned)
    bad = python_fits(image, dists, pinned, IMAGE_PYTHON[image][base])
    assert not bad, f"{image}: pins the image's Python {IMAGE_PYTHON[image][base]} cannot install: {bad}"
    size = lay_out(dists, tmp / "site")
    path = [tmp / "site", project_layout(context, tmp / "project")] + ([STUB_UTILS] if image == "ngc" else [])
    first = isolated_import(path, served_modules(image))
    lazy = sorted(lazy_third_party(first["e3_files"]) - set(NOT_IN_IMAGE[image]))
    second = isolated_import(path, lazy)
    return {**first["failed"], **second["failed"]}, size


@pytest.mark.parametrize("image", sorted(DOCKERFILES))
def test_each_image_imports_what_it_serves(image, tmp_path):
    failed, size = image_check(image, DOCKERFILES[image], tmp_path)
    assert not failed, f"{DOCKERFILES[image].relative_to(ROOT)} lacks what its served code imports: {failed}"
    print(f"{image} image: pip set installs {size / 2**30:.2f} GiB (RECORD sizes)")
    if image == "e3":
        assert size < 1.5 * 2**30, f"the controller image's packages take {size / 2**30:.2f} GiB (target 1.5)"
        for heavy in ("torch", "nvidia-cudnn-cu12", "nvidia-cublas-cu12", "pytest", "hypothesis",
                      "helm-python-sdk", "nvidia-pytriton"):
            assert heavy not in closure(image, pip_requirements(DOCKERFILES[image], build_context(
                DOCKERFILES[image], tmp_path / "again"))), heavy


def test_the_check_fails_without_onnx(tmp_path):
    """The NGC Dockerfile as it was (no onnx on its pip line) fails the check, naming onnx."""
    text = DOCKERFILES["ngc"].read_text()
    assert re.search(r'"onnx==[\d.]+" ', text)
    old = tmp_path / "Dockerfile"
    old.write_text(re.sub(r'"onnx==[\d.]+" ', "", text))
    (tmp_path / "Dockerfile.dockerignore").write_text(
        DOCKERFILES["ngc"].with_name("Dockerfile.dockerignore").read_text())
    failed, _ = image_check("ngc", old, tmp_path / "check")
    assert any("onnx" in why for why in failed.values()), failed
