"""The two images build from what they copy: for each Dockerfile (deploy/ngc/Dockerfile, the Triton image;
deploy/helm/images/e3.Dockerfile, the controller's and exporter's), its COPY lines are parsed, exactly those
paths (less what the Dockerfile's .dockerignore drops) are copied into an empty folder, and the package is
installed from there with pip into a throwaway target, as the Dockerfile's RUN line does. The installed package
is then imported from that target alone, and `e3 --help` runs from it. No Docker here: the base images and the
dependencies come from this machine's environment, which is what `--no-deps` leaves to the image."""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILES = {"ngc": ROOT / "deploy" / "ngc" / "Dockerfile",
               "e3": ROOT / "deploy" / "helm" / "images" / "e3.Dockerfile"}


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    out, pending = [], ""
    for line in text.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        word, _, rest = pending.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        pending = ""
    return out


def copy_list(dockerfile: Path) -> list[tuple[list[str], str]]:
    """(sources, destination under the image's WORKDIR) of every COPY from the build context."""
    workdir, out = "/", []
    for word, args in instructions(dockerfile.read_text()):
        if word == "WORKDIR":
            workdir = os.path.join(workdir, args)
        elif word in ("COPY", "ADD"):
            parts = args.split()
            assert not any(p.startswith("--from") for p in parts), f"{dockerfile}: COPY --from is not handled here"
            parts = [p for p in parts if not p.startswith("--")]
            out.append((parts[:-1], os.path.join(workdir, parts[-1])))
    return out


def ignored(rel: str, patterns: list[str]) -> bool:
    """Whether the build context drops ``rel`` (a .dockerignore subset: globs, ``**/`` prefixes)."""
    for pat in patterns:
        pat = pat.rstrip("/")
        bare = pat[3:] if pat.startswith("**/") else pat
        parts = rel.split("/")
        if fnmatch.fnmatch(rel, pat) or any(fnmatch.fnmatch(p, bare) for p in parts) and pat.startswith("**/"):
            return True
        if parts[0] == pat:
            return True
    return False


def build_context(dockerfile: Path, into: Path) -> Path:
    """Copy exactly the Dockerfile's COPY sources into ``into`` as the image lays them out; the folder that
    stands for the image's WORKDIR (where `pip install .` runs)."""
    dockerignore = dockerfile.with_name(dockerfile.name + ".dockerignore")
    patterns = [p.strip() for p in dockerignore.read_text().splitlines()
                if p.strip() and not p.startswith("#")] if dockerignore.exists() else []
    workdir = None
    for word, args in instructions(dockerfile.read_text()):
        if word == "WORKDIR":
            workdir = args
    for sources, dest in copy_list(dockerfile):
        for src in sources:
            path = ROOT / src
            assert path.exists(), f"{dockerfile.name} copies {src}, which the repository does not have"
            target = into / dest.lstrip("/")
            if path.is_dir():   # COPY dir dest: the folder's contents into dest
                for f in path.rglob("*"):
                    rel = f.relative_to(ROOT).as_posix()
                    if f.is_file() and not ignored(rel, patterns):
                        (target / f.relative_to(path)).parent.mkdir(parents=True, exist_ok=True)
                        shutil.copy2(f, target / f.relative_to(path))
            else:
                where = target / path.name if dest.endswith("/") else target
                where.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, where)
    assert workdir, f"{dockerfile} sets no WORKDIR"
    return into / workdir.lstrip("/")


def test_the_dockerfile_parser_reads_copy_lines(tmp_path):
    (tmp_path / "Dockerfile").write_text("FROM x\nWORKDIR /opt/e3\n# COPY nothing\nCOPY a b \\\n  ./\n"
                                         "COPY --chown=1 e3 e3\n")
    assert copy_list(tmp_path / "Dockerfile") == [(["a", "b"], "/opt/e3/./"), (["e3"], "/opt/e3/e3")]
    assert ignored("serving/__pycache__/x.pyc", ["**/__pycache__"]) and ignored("artifacts/a", ["artifacts"])
    assert not ignored("serving/x.py", ["**/__pycache__", "artifacts"])


@pytest.mark.parametrize("image", sorted(DOCKERFILES))
def test_the_package_installs_from_exactly_what_the_dockerfile_copies(image, tmp_path):
    dockerfile = DOCKERFILES[image]
    context = build_context(dockerfile, tmp_path / "image")
    pyproject = (context / "pyproject.toml").read_text()
    # every package folder pyproject maps must be in the image (the error pip gives otherwise is cryptic)
    folders = re.findall(r'"e3[\w.]*"\s*=\s*"([\w/]+)"', pyproject)
    missing = [f for f in folders if not (context / f).is_dir()]
    assert not missing, f"{dockerfile.relative_to(ROOT)} copies no {missing} (pyproject.toml's package-dir)"
    target = tmp_path / "site"
    run = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                          "--no-compile", "--target", str(target), str(context)],
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, f"pip install from {image}'s COPY list failed:\n{run.stdout}\n{run.stderr}"
    # Import from the throwaway target only (not the repository, not the venv's editable install): what the
    # Dockerfiles' RUN lines check, and the controller's and exporter's entry point.
    check = ("import sys, e3, e3.serving.policy, e3.core.plan, e3.simulator, e3.cli\n"
             f"assert e3.__file__.startswith({str(target)!r}), e3.__file__\n"
             "sys.argv = ['e3', '--help']\n"
             "from e3.cli import main\n"
             "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n")
    env = {**os.environ, "PYTHONPATH": str(target)}
    run = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, cwd=tmp_path, env=env,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    assert "control" in run.stdout and "export" in run.stdout


def test_the_e3_image_does_not_train_or_claim_to():
    text = DOCKERFILES["e3"].read_text()
    assert "trains on first use" not in text and "pip install --no-cache-dir --no-deps --no-build-isolation -e" \
        not in text
    assert not re.search(r"\b[\w-]+\.(io|com|org)/", text)   # no registry host in the file
