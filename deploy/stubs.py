"""Dead Python-backend stubs: how to tell one from an error message and how to reload its model; the one
owner of stub reloads. The supervisor (``e3 serve``, beside the server: it sees the stubs' processes) and
the controller's loop (over Triton's API: it sees failed-request counters) both call this module.

Triton does not restart a dead stub (2.51): every request to its model instance fails with "Stub process
... is not healthy" until the model is loaded again, and a load whose config equals the live one is a no-op
(measured: "successfully loaded" at once, the dead stub kept), so a reload carries a changed ``e3_reload``
parameter, which makes a new version with fresh stubs.
"""

from __future__ import annotations

import logging
import re
import time
from typing import Any, Callable, Iterable

__all__ = ["is_dead_stub", "with_reload_mark", "reload_dead_stubs"]

log = logging.getLogger(__name__)

_DEAD_STUB = re.compile(r"stub process.*not healthy", re.IGNORECASE | re.DOTALL)


def is_dead_stub(message: str | None) -> bool:
    """True for the Python backend's "Stub process ... is not healthy" error."""
    return bool(message) and _DEAD_STUB.search(message) is not None


def with_reload_mark(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` (a model's JSON config) with a fresh ``e3_reload`` parameter, so that loading it makes a new
    version with fresh stubs (the old version serves until the new one is ready)."""
    return {**config, "parameters": {**config.get("parameters", {}),
                                     "e3_reload": {"string_value": f"{time.time():.6f}"}}}


def reload_dead_stubs(models: Iterable[str], probe: Callable[[str], str | None], reload: Callable[[str], None],
                      *, refused: tuple[type[BaseException], ...] = ()) -> tuple[list[str], list[str]]:
    """Probe each of ``models`` (``probe``: its error message, or None when it answered) and ``reload`` those
    whose stub died. Returns (reloaded, refused): a reload raising one of ``refused`` is logged and listed, so
    the caller can look again later."""
    reloaded, failed = [], []
    for name in models:
        message = probe(name)
        if not is_dead_stub(message):
            if message:
                log.warning("%s had failed requests; its probe failed with: %s", name, message)
            continue
        log.error("%s: Python stub died (%s); reloading it", name, message)
        try:
            reload(name)
            reloaded.append(name)
        except refused as err:
            log.error("reload of %s refused (%s); will try again next window", name, err)
            failed.append(name)
    return reloaded, failed
