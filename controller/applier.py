"""The controller's contract with a server: what it reads (:class:`ServerView`) and what it changes
(:class:`ServerControl`).

Two implementations: :class:`~e3.controller.triton_applier.TritonApplier`
talks to a running Triton, :class:`~e3.controller.recording_applier.RecordingApplier`
is an in-memory server that records calls (tests). Both implement both
interfaces; a dry run needs only a view.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:
    from e3.controller.health import SplitStats
    from e3.core.plan import Plan, SplitPlan

__all__ = ["ControlError", "ServerView", "ServerControl"]


class ControlError(RuntimeError):
    """The server refused a control operation (or could not be reached); the message is the server's."""


class PlanRefused(ControlError):
    """The plan cannot be served as it stands whatever the retries (e.g. the pools cannot hold it): the loop
    reports it once and does not retry it."""


class ServerView(ABC):
    """What the controller reads from the server. Methods raise :class:`ControlError` when the server refuses."""

    @abstractmethod
    def current_plan(self, router: str) -> Plan | None:
        """The plan in the router's live config (None when the router is not loaded)."""

    @abstractmethod
    def loaded_splits(self, model: str) -> dict[str, int]:
        """Loaded (READY) split models of served model ``model`` -> their instance count."""

    @abstractmethod
    def exported(self, split: str) -> bool:
        """Is the split model in the repository (loadable)?"""

    @abstractmethod
    def split_stats(self, names: Iterable[str]) -> dict[str, SplitStats]:
        """Cumulative per-model statistics of the named (loaded) models; models without stats are absent."""

    @abstractmethod
    def failed_requests(self) -> dict[str, float]:
        """Model -> cumulative failed requests (Triton's ``nv_inference_request_failure``)."""

    @abstractmethod
    def probe(self, name: str) -> str | None:
        """Send one tiny request to ``name``; None when it answered (or no probe can be built), else the error."""


class ServerControl(ABC):
    """What the controller changes on the server. Methods raise :class:`ControlError` when the server refuses."""

    @abstractmethod
    def export(self, splits: list[SplitPlan], plan_in_force: Plan | None) -> None:
        """Export missing split models into the repository (off the request path)."""

    @abstractmethod
    def configure_split(self, split: SplitPlan) -> None:
        """Load ``split.model`` (or reload it) with the split's instances, preferred batch and queue delay."""

    @abstractmethod
    def switch_plan(self, router: str, plan: Plan) -> None:
        """Hand ``plan`` to the router; every split it names must be loaded."""

    @abstractmethod
    def unload(self, name: str) -> None:
        """Unload a model."""

    @abstractmethod
    def reload(self, name: str) -> None:
        """Reload ``name`` with its live config and fresh instances (new stub processes)."""

    def prepare(self, plan: Plan) -> None:
        """Make room for ``plan`` before its splits load (e.g. scale pools' pods up); default: nothing."""

    def settle(self, plan: Plan) -> None:
        """Give back what the plan in force no longer needs, after the drain (e.g. pods); default: nothing."""
