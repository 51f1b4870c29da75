"""Where generated things live. Everything generated goes under ``artifacts/``
(checkpoints, profiles, plans, logs, results) except the model repository,
which sits at ``model_repository/`` as the design card fixes. ``e3 clean``
removes both (keeping model_repository/README.md).

``E3_ARTIFACTS`` and ``E3_MODEL_REPOSITORY`` override the two locations.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["project_root", "artifacts_dir", "default_repository"]


def project_root() -> Path:
    """The checkout this package runs from (the folder holding pyproject.toml), else the cwd."""
    here = Path(__file__).resolve().parent.parent
    return here if (here / "pyproject.toml").exists() else Path.cwd()


def artifacts_dir() -> Path:
    return Path(os.environ.get("E3_ARTIFACTS", project_root() / "artifacts"))


def default_repository() -> Path:
    return Path(os.environ.get("E3_MODEL_REPOSITORY", project_root() / "model_repository"))
