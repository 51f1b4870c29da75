"""Trained checkpoints under ``artifacts/checkpoints/<name>/``: ``model.pt`` + ``meta.json``.

``meta.json`` holds the data hash, per-ramp accuracy, the chosen exit rule,
the training settings and how long training took. Zoo entries load from here;
``e3 train NAME`` writes here.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch

from e3.core.files import atomic_path, write_json_atomic
from e3.paths import artifacts_dir

__all__ = ["CheckpointMissing", "checkpoint_dir", "save_checkpoint", "load_state", "load_meta"]


class CheckpointMissing(FileNotFoundError):
    """A zoo model whose weights have not been trained yet."""


def checkpoint_dir(name: str) -> Path:
    return artifacts_dir() / "checkpoints" / name


def save_checkpoint(name: str, model: torch.nn.Module, meta: dict) -> Path:
    """Write ``model.pt`` and ``meta.json`` atomically (the folder appears complete or not at all)."""
    final = checkpoint_dir(name)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{name}."))
    with atomic_path(tmp / "model.pt") as part:
        torch.save(model.state_dict(), part)
    write_json_atomic(tmp / "meta.json", meta, indent=2, default=float)
    if final.exists():
        old = final.with_name(f".{name}.old-{os.getpid()}")
        final.rename(old)
        tmp.rename(final)
        for f in old.iterdir():
            f.unlink()
        old.rmdir()
    else:
        tmp.rename(final)
    return final


def load_meta(name: str) -> dict:
    path = checkpoint_dir(name) / "meta.json"
    if not path.exists():
        raise CheckpointMissing(f"{name} is not trained yet (no {path}); run `e3 train {name}`")
    return json.loads(path.read_text())


def load_state(name: str) -> dict:
    path = checkpoint_dir(name) / "model.pt"
    if not path.exists():
        raise CheckpointMissing(f"{name} is not trained yet (no {path}); run `e3 train {name}`")
    return torch.load(path, map_location="cpu", weights_only=True)
