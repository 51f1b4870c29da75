"""The model repository's manifest, ``e3_repository.json``: what e3 wrote into a repository.

The exporter writes it (:mod:`e3.export.repository`); the server launcher reads
which models to load from it (``e3 serve`` without ``--models``); the batch
histogram benchmark reads the plan in force. Keeping its name and reader here
lets both sides use it without importing each other.

Fields: ``models`` (name -> kind, zoo model, target) lists every model e3
created (a model it does not list is never touched); ``deployments`` (served
name -> zoo model, model card, plan, front door, router, baselines, and
``serve``: the models to load, in order).
"""

from __future__ import annotations

import json
from pathlib import Path

from e3.core.files import write_json_atomic

__all__ = ["MANIFEST", "ManifestError", "read_manifest", "write_manifest", "models_to_serve"]

MANIFEST = "e3_repository.json"


class ManifestError(ValueError):
    """A manifest that cannot be read; the message says what to do."""


def read_manifest(repo: str | Path) -> dict:
    """The repository's manifest, or an empty one if e3 has not written there yet."""
    path = Path(repo) / MANIFEST
    if not path.exists():
        return {"created_by": "e3", "models": {}, "deployments": {}}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ManifestError(f"{path} is not valid JSON ({err}); remove it or re-export into an empty folder") from None


def write_manifest(repo: str | Path, manifest: dict) -> None:
    """Replace the repository's manifest atomically."""
    write_json_atomic(Path(repo) / MANIFEST, manifest, indent=2)


def models_to_serve(repo: str | Path) -> list[str]:
    """Models of every deployment's current plan and its baselines, in load order, without repeats.

    Raises :class:`ManifestError` when the repository has no manifest (nothing was exported there).
    """
    if not (Path(repo) / MANIFEST).exists():
        raise ManifestError(f"{repo} has no {MANIFEST}: export a model first (`e3 export MODEL`) "
                            "or name the models to load with --models")
    names: list[str] = []
    for deployment in read_manifest(repo)["deployments"].values():
        names += deployment["serve"]
    return list(dict.fromkeys(names))
