"""An in-memory server that records every call: the controller's tests drive it instead of Triton."""

from __future__ import annotations

from typing import Iterable

from e3.controller.applier import ControlError, ServerControl, ServerView
from e3.controller.health import SplitStats
from e3.core.plan import Plan, SplitPlan

__all__ = ["RecordingApplier"]


class RecordingApplier(ServerView, ServerControl):
    """A server held in memory; ``calls`` lists what was done to it, in order.

    ``fail`` maps an operation name (``configure``, ``switch``, ``unload``,
    ``export``, ``reload``) to how many of its next calls raise ControlError;
    ``stats``, ``failures`` and ``probe_errors`` are what the view reports.
    """

    def __init__(self, plan: Plan | None = None, exported: Iterable[str] | None = None):
        self.plan = plan
        self.splits: dict[str, dict] = {s.model: {"instances": s.instances, "batch": s.batch_size}
                                        for s in (plan.triton_splits if plan else ())}
        self.repository: set[str] | None = set(exported) if exported is not None else None   # None: everything
        self.calls: list[tuple] = []
        self.fail: dict[str, int] = {}
        self.stats: dict[str, SplitStats] = {}
        self.failures: dict[str, float] = {}
        self.probe_errors: dict[str, str] = {}

    def _maybe_fail(self, op: str, what: str) -> None:
        if self.fail.get(op, 0) > 0:
            self.fail[op] -= 1
            self.calls.append(("refused", op, what))
            raise ControlError(f"{op} {what}: refused (recorded failure)")

    # -- ServerView ----------------------------------------------------------------------------------
    def current_plan(self, router: str) -> Plan | None:
        return self.plan

    def loaded_splits(self, model: str) -> dict[str, int]:
        return {n: v["instances"] for n, v in self.splits.items() if n.startswith(f"{model}_split_")}

    def exported(self, split: str) -> bool:
        return self.repository is None or split in self.repository

    def split_stats(self, names: Iterable[str]) -> dict[str, SplitStats]:
        return {n: self.stats[n] for n in names if n in self.stats}

    def failed_requests(self) -> dict[str, float]:
        return dict(self.failures)

    def probe(self, name: str) -> str | None:
        self.calls.append(("probe", name))
        return self.probe_errors.get(name)

    # -- ServerControl -------------------------------------------------------------------------------
    def export(self, splits: list[SplitPlan], plan_in_force: Plan | None) -> None:
        self._maybe_fail("export", ",".join(s.model for s in splits))
        self.calls.append(("export", tuple(s.model for s in splits)))
        if self.repository is not None:
            self.repository.update(s.model for s in splits)

    def configure_split(self, split: SplitPlan) -> None:
        want = {"instances": split.instances, "batch": split.batch_size}
        if self.splits.get(split.model) == want:
            return   # as Triton's applier: no load when the live config already matches
        if not self.exported(split.model):
            raise ControlError(f"load {split.model}: not in the repository")
        self._maybe_fail("configure", split.model)
        self.calls.append(("load", split.model, split.instances, split.batch_size))
        self.splits[split.model] = want

    def switch_plan(self, router: str, plan: Plan) -> None:
        self._maybe_fail("switch", plan.plan_id)
        missing = [s.model for s in plan.triton_splits if s.model not in self.splits]
        if missing:
            raise ControlError(f"load the plan's splits before switching {router}: {missing} not ready")
        self.calls.append(("switch", plan.plan_id))
        self.plan = plan

    def unload(self, name: str) -> None:
        self._maybe_fail("unload", name)
        self.calls.append(("unload", name))
        self.splits.pop(name, None)

    def reload(self, name: str) -> None:
        self._maybe_fail("reload", name)
        self.calls.append(("reload", name))
        self.probe_errors.pop(name, None)
