"""Writing files so that a reader never sees half of one: every file the project writes goes through here.

The data goes to a temporary file beside the target, is flushed and fsynced,
and is moved into place with ``os.replace`` (atomic on POSIX). A crash leaves
either the old file or the new one, never a torn one; the temporary file is
removed on any error.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["write_atomic", "write_json_atomic", "copy_atomic"]


def write_atomic(path: str | Path, data: str | bytes) -> Path:
    """Write ``data`` (text as UTF-8, or bytes) to ``path`` atomically; creates the parent folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path


def write_json_atomic(path: str | Path, data: Any, *, indent: int | None = 1, sort_keys: bool = True,
                      default: Any = None) -> Path:
    """``data`` as JSON (``indent``, ``sort_keys``; ``default`` as in :func:`json.dumps`), written atomically."""
    return write_atomic(path, json.dumps(data, indent=indent, sort_keys=sort_keys, default=default))


def copy_atomic(src: str | Path, dest: str | Path) -> Path:
    """Copy ``src`` to ``dest`` (with its mode and times) so that ``dest`` is never half-written."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
    os.close(fd)
    try:
        shutil.copy2(src, tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, dest)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return dest
