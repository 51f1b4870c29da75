"""Every plan the controller applied, validated on write and on read, in one atomically replaced JSON file.

Decisions
---------
* **Files** the controller writes (this history, the state file for
  ``e3 status``) are validated JSON written through
  :func:`e3.core.files.write_json_atomic` (a temporary file, fsync,
  ``os.replace``): a crash leaves the old file or the new one, never a torn one.
* A history that does not validate raises :class:`HistoryError` and is never
  silently replaced: the message says to move it away.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from e3.core.files import write_json_atomic
from e3.core.plan import Plan, PlanError
from e3.core.profile import BatchProfile

__all__ = ["PlanHistory", "HistoryError", "HISTORY_VERSION"]

HISTORY_VERSION = 1


class HistoryError(ValueError):
    """A plan history file that cannot be used; the message names the problem."""


class PlanHistory:
    """Every applied plan, oldest first, in one JSON file; the last entry is the last good plan.

    Entries: ``{"applied_at": <epoch s>, "reason": str, "forecast": [reach] | None, "plan": {...}}``.
    Each plan is validated (:meth:`Plan.from_dict`) on write and on read; a
    file that does not validate raises :class:`HistoryError`. Only the last
    ``keep`` entries are kept.
    """

    def __init__(self, path: str | Path, model: str, keep: int = 200):
        self.path, self.model, self.keep = Path(path), model, keep
        self.entries: list[dict] = self._read() if self.path.exists() else []

    def _read(self) -> list[dict]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise HistoryError(f"plan history {self.path} is unreadable ({err}); "
                               "move it away to start afresh") from None
        if not isinstance(data, dict) or data.get("version") != HISTORY_VERSION or not isinstance(
                data.get("entries"), list):
            raise HistoryError(f"plan history {self.path} is not a version-{HISTORY_VERSION} history; "
                               "move it away to start afresh")
        for i, e in enumerate(data["entries"]):
            try:
                Plan.from_dict(e["plan"])
            except (PlanError, KeyError, TypeError) as err:
                raise HistoryError(f"plan history {self.path}: entry {i} holds no valid plan ({err})") from None
        return data["entries"]

    @property
    def last_good(self) -> Plan | None:
        """The last applied plan (None before the first)."""
        return Plan.from_dict(self.entries[-1]["plan"]) if self.entries else None

    def append(self, plan: Plan, reason: str, forecast: BatchProfile | None = None,
               at_s: float | None = None) -> None:
        """Validates ``plan`` and rewrites the file atomically with it appended (``at_s``: epoch seconds)."""
        checked = Plan.from_dict(json.loads(plan.to_json()))   # raises PlanError before anything is written
        entry = {"applied_at": time.time() if at_s is None else at_s, "reason": reason,
                 "forecast": list(forecast.reach) if forecast is not None else None, "plan": checked.to_dict()}
        entries = (self.entries + [entry])[-self.keep:]
        write_json_atomic(self.path, {"version": HISTORY_VERSION, "model": self.model, "entries": entries})
        self.entries = entries
