"""Writing files so that a reader never sees half of one: every file the project writes goes through here.

The data goes to a temporary file beside the target, is flushed and fsynced,
and is moved into place with ``os.replace`` (atomic on POSIX). A crash leaves
either the old file or the new one, never a torn one; the temporary file is
removed on any error.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

__all__ = ["write_atomic", "write_json_atomic", "copy_atomic", "atomic_path", "sha256_of"]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A temporary path beside ``path`` (same suffix, so writers that pick a format by suffix work) for a
    library that writes files itself (``savefig``, ``np.savez``, ``torch.save``); on leaving the block
    without an error the file is fsynced and moved onto ``path``, otherwise removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=path.suffix or ".tmp")
    os.close(fd)
    try:
        yield Path(tmp)
        if os.stat(tmp).st_mode & 0o777 == 0o600:   # mkstemp's private mode, not the writer's choice
            os.chmod(tmp, 0o666 & ~_umask())
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_atomic(path: str | Path, data: str | bytes) -> Path:
    """Write ``data`` (text as UTF-8, or bytes) to ``path`` atomically; creates the parent folder."""
    raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    with atomic_path(path) as tmp:
        tmp.write_bytes(raw)
    return Path(path)


def write_json_atomic(path: str | Path, data: Any, *, indent: int | None = 1, sort_keys: bool = True,
                      default: Any = None) -> Path:
    """``data`` as JSON (``indent``, ``sort_keys``; ``default`` as in :func:`json.dumps`), written atomically."""
    return write_atomic(path, json.dumps(data, indent=indent, sort_keys=sort_keys, default=default))


def copy_atomic(src: str | Path, dest: str | Path) -> Path:
    """Copy ``src`` to ``dest`` (with its mode and times) so that ``dest`` is never half-written."""
    with atomic_path(dest) as tmp:
        shutil.copy2(src, tmp)
    return Path(dest)


def sha256_of(path: str | Path) -> str:
    """The SHA-256 of a file's bytes, hex: which version of a file a result was made with."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()
