"""What the controller is asked to do (:class:`ControlSettings`, validated once at start) and where its files go."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from e3.core.names import router_name
from e3.paths import artifacts_dir

__all__ = ["ControlSettings", "files_dir", "history_path", "state_path"]


@dataclass(frozen=True)
class ControlSettings:
    """What the controller is asked to do; :meth:`validate` once at start says what is wrong and what to write."""
    model: str                              # served model name <m> (e.g. "tiny_ee")
    devices: dict[str, int]                 # device configuration -> devices (Triton instances here)
    slo_ms: float                           # latency objective per request (ms)
    rate_rps: float                         # offered request rate R the plans are made for (inputs/s)
    slack: float = 0.2                      # share of the SLO kept in reserve
    window_s: float = 120.0                 # seconds between two steps (E3: 2 minutes)
    margin: float = 0.10                    # apply when new throughput > running x (1 + margin)
    drift_threshold: float = 0.2            # max |forecast - observed| reach share that is not drift
    straggler_factor: float | None = 2.0    # measured / profiled latency past which a split straggles; None: off
    min_executions: int = 5                 # executions a split needs in a window before it can straggle
    backoff_base_s: float = 1.0             # first retry delay after Triton refuses (s)
    backoff_max_s: float = 60.0             # retry delay cap (s)
    drain_s: float | None = None            # wait after a switch before unloading (s); None: the SLO
    dry_run: bool = False                   # plan and report, never touch Triton
    follow_traffic: bool = False            # plan every window for the observed rate, rate_rps as the floor
    #                                         (e3.controller.signals); False: always for rate_rps
    state_dir: Path | None = None           # history and state files (default artifacts/controller)

    @property
    def router(self) -> str:
        """The served router model, ``<m>_router``."""
        return router_name(self.model)

    @property
    def drain_wait_s(self) -> float:
        """Seconds between a switch and the unload of splits the new plan does not use."""
        return self.slo_ms / 1e3 if self.drain_s is None else self.drain_s

    def validate(self) -> None:
        """Raises ValueError naming the bad setting and what to write instead."""
        if not self.devices or any(int(n) < 1 for n in self.devices.values()):
            raise ValueError(f"devices need at least one device per configuration, e.g. {{'cpu': 2}} "
                             f"(--devices cpu:2); got {self.devices}")
        if not self.slo_ms > 0 or not self.rate_rps > 0:
            raise ValueError(f"slo_ms and rate_rps must be > 0 (e.g. 200 and 50); got {self.slo_ms}, {self.rate_rps}")
        if not 0 <= self.slack < 1:
            raise ValueError(f"slack is a share of the SLO in [0, 1), e.g. 0.2; got {self.slack}")
        if not (math.isfinite(self.window_s) and self.window_s >= 1.0):
            raise ValueError(f"window_s must be >= 1 s (E3 uses 120); got {self.window_s}")
        if not self.margin >= 0:
            raise ValueError(f"margin is a share >= 0, e.g. 0.1 for 10%; got {self.margin}")
        if not 0 < self.drift_threshold <= 1:
            raise ValueError(f"drift_threshold is a share of B0 in (0, 1], e.g. 0.2; got {self.drift_threshold}")
        if self.straggler_factor is not None and not self.straggler_factor > 1:
            raise ValueError(f"straggler_factor must be > 1 (e.g. 2.0), or None to turn detection off; "
                             f"got {self.straggler_factor}")
        if self.min_executions < 1:
            raise ValueError(f"min_executions must be >= 1 (e.g. 5); got {self.min_executions}")
        if not 0 < self.backoff_base_s <= self.backoff_max_s:
            raise ValueError(f"need 0 < backoff_base_s <= backoff_max_s; got {self.backoff_base_s}, "
                             f"{self.backoff_max_s}")
        if self.drain_s is not None and self.drain_s < 0:
            raise ValueError(f"drain_s must be >= 0 seconds; got {self.drain_s}")

    def history_path(self) -> Path:
        """The plan history file of this model."""
        return history_path(self.model, self.state_dir)

    def state_path(self) -> Path:
        """The state file ``e3 status`` reads (the last window's report)."""
        return state_path(self.model, self.state_dir)


def files_dir(state_dir: str | Path | None = None) -> Path:
    """Folder of the controller's files: ``state_dir``, else artifacts/controller."""
    if state_dir is not None:
        return Path(state_dir)
    return artifacts_dir() / "controller"


def history_path(model: str, state_dir: str | Path | None = None) -> Path:
    """The plan history file of served model ``model``."""
    return files_dir(state_dir) / f"{model}.history.json"


def state_path(model: str, state_dir: str | Path | None = None) -> Path:
    """The state file of served model ``model`` (the controller's last window, for ``e3 status``)."""
    return files_dir(state_dir) / f"{model}.state.json"
