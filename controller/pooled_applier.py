"""The controller's view of and hands on several Triton servers (pools) serving one model.

The router's server runs the router and the splits the plan keeps there (reached by BLS); other
servers run the splits the plan places on them (``SplitPlan.server``, their gRPC address, reached by
the router over gRPC). :class:`PooledApplier` implements the controller's interfaces
(:mod:`e3.controller.applier`) over one :class:`~e3.controller.triton_applier.TritonApplier` per
server, so the control loop (:mod:`e3.controller.loop`) runs unchanged.

Decisions:
* A split is loaded, probed, reloaded and measured on the server the plan in force places it on.
* Moving a split (same name, another server) is: load it on the new server, switch the router, and
  let the loop's drained unload remove the old copy. For that, :meth:`loaded_splits` names a copy on a
  server the plan in force does not place it on ``<split>@<server>`` (``@router`` for the router's own
  server), which no plan uses, so the loop unloads it after the drain; :meth:`unload` understands it.
  A copy pre-loaded for a plan that waits for a retry is unloaded too, and loaded again on the retry.
* With a scaler (Kubernetes), a plan that needs more pods in a pool than it has
  (:func:`e3.deploy.pools.replicas_needed`) scales the pool up and waits for the pods to be ready
  before its splits load; pods are given back only after the drain, down to what the plan in force
  needs. Model control reaches a pool through its Service, so per-split instance counts are changed
  on one pod: new pods start with the models the chart's values list for the pool.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Iterable

from e3.controller.applier import ControlError, ServerControl, ServerView
from e3.controller.health import SplitStats
from e3.controller.triton_applier import TritonApplier
from e3.core.plan import Plan, SplitPlan

if TYPE_CHECKING:
    from e3.controller.k8s_scaler import PoolScaler
    from e3.deploy.pools import Pools

__all__ = ["PooledApplier", "PlacingPlanner", "ROUTER_SERVER", "located"]

log = logging.getLogger(__name__)

ROUTER_SERVER = "router"   # how a copy on the router's own server is named in ``<split>@<server>``


def located(split: str, server: str) -> str:
    """``<split>@<server>``: a loaded copy on a server the plan in force does not place it on."""
    return f"{split}@{server or ROUTER_SERVER}"


class PooledApplier(ServerView, ServerControl):
    """``router``: the applier of the router's server; ``servers``: gRPC address (as plans name a split's
    server) -> the applier of that server's HTTP API."""

    def __init__(self, router_model: str, router: TritonApplier, servers: dict[str, TritonApplier], *,
                 pools: Pools | None = None, scaler: PoolScaler | None = None, ready_timeout_s: float = 600.0):
        if scaler is not None and pools is None:
            raise ValueError("a scaler needs the pools it scales")
        self.router_model, self.router, self.servers = router_model, router, dict(servers)
        self.pools, self.scaler, self.ready_timeout_s = pools, scaler, ready_timeout_s

    def close(self) -> None:
        """Close every server's clients (this thread's)."""
        for _, applier in self._everywhere():
            applier.close()

    def _at(self, server: str) -> TritonApplier:
        if not server:
            return self.router
        try:
            return self.servers[server]
        except KeyError:
            raise ControlError(f"no pool serves {server!r} (pools: {sorted(self.servers)}); add it to the "
                               "controller's pools") from None

    def _everywhere(self) -> list[tuple[str, TritonApplier]]:
        return [("", self.router), *self.servers.items()]

    def _placement(self) -> dict[str, str]:
        """Split model -> the server the plan in force places it on ("" = the router's)."""
        plan = self.router.current_plan(self.router_model)
        return {s.model: s.server for s in plan.triton_splits} if plan else {}

    def _owner(self, name: str) -> tuple[str, TritonApplier]:
        split, _, where = name.partition("@")
        if where:
            return split, self.router if where == ROUTER_SERVER else self._at(where)
        return split, self._at(self._placement().get(split, ""))

    # -- ServerView ----------------------------------------------------------------------------------
    def current_plan(self, router: str) -> Plan | None:
        return self.router.current_plan(router)

    def loaded_splits(self, model: str) -> dict[str, int]:
        placement = self._placement()
        out: dict[str, int] = {}
        for server, applier in self._everywhere():
            for name, count in applier.loaded_splits(model).items():
                out[name if placement.get(name, "") == server else located(name, server)] = count
        return out

    def exported(self, split: str) -> bool:
        return self.router.exported(split)

    def split_stats(self, names: Iterable[str]) -> dict[str, SplitStats]:
        placement, out = self._placement(), {}
        for name in names:
            out.update(self._at(placement.get(name, "")).split_stats([name]))
        return out

    def failed_requests(self) -> dict[str, float]:
        total: dict[str, float] = {}
        for _, applier in self._everywhere():
            for model, n in applier.failed_requests().items():
                total[model] = total.get(model, 0.0) + n
        return total

    def probe(self, name: str) -> str | None:
        split, applier = self._owner(name)
        return applier.probe(split)

    # -- ServerControl -------------------------------------------------------------------------------
    def export(self, splits: list[SplitPlan], plan_in_force: Plan | None) -> None:
        self.router.export(splits, plan_in_force)

    def configure_split(self, split: SplitPlan) -> None:
        self._at(split.server).configure_split(split)

    def switch_plan(self, router: str, plan: Plan) -> None:
        for s in plan.triton_splits:
            if not s.server:
                continue
            try:
                ready = self._at(s.server).control.is_ready(s.model)
            except ControlError:
                raise
            except Exception as err:  # noqa: BLE001 - a pool that cannot be reached: refuse with its address
                raise ControlError(f"cannot reach {s.server} (pool of {s.model}) before switching {router}: "
                                   f"{err}") from None
            if not ready:
                raise ControlError(f"load the plan's splits before switching {router}: {s.model} is not ready "
                                   f"on {s.server}")
        self.router.switch_plan(router, plan)

    def prepare(self, plan: Plan) -> None:
        """Scale up the pools whose pods cannot hold the plan's instances, and wait for them to be ready."""
        if self.scaler is None:
            return
        from e3.deploy.pools import PoolError, replicas_needed
        try:
            need = replicas_needed(plan, self.pools)
        except PoolError as err:
            raise ControlError(str(err)) from None
        for pool in self.pools.pools:
            if need[pool.name] > self.scaler.replicas(pool):
                self.scaler.scale(pool, need[pool.name])
        for pool in self.pools.pools:
            self.scaler.wait_ready(pool, need[pool.name], self.ready_timeout_s)

    def settle(self, plan: Plan) -> None:
        """Scale down pools that hold more pods than the plan in force needs (never below min_replicas)."""
        if self.scaler is None:
            return
        from e3.deploy.pools import PoolError, replicas_needed
        try:
            need = replicas_needed(plan, self.pools)
        except PoolError as err:
            raise ControlError(str(err)) from None
        for pool in self.pools.pools:
            if need[pool.name] < self.scaler.replicas(pool):
                self.scaler.scale(pool, need[pool.name])

    def unload(self, name: str) -> None:
        split, applier = self._owner(name)
        applier.unload(split)

    def reload(self, name: str) -> None:
        split, applier = self._owner(name)
        applier.reload(split)


class PlacingPlanner:
    """The controller's planner with every plan placed on the pools (:func:`e3.deploy.pools.place`):
    the planner chooses devices per split, the pools say which server has them. A plan the pools cannot
    hold raises :class:`~e3.deploy.pools.PoolError` (a ValueError: the loop keeps the running plan)."""

    def __init__(self, planner, pools: Pools):
        self.planner, self.pools = planner, pools
        self.latency = getattr(planner, "latency", None)

    def plan(self, forecast, devices):
        from e3.deploy.pools import place
        return place(self.planner.plan(forecast, devices), self.pools)

    def throughput(self, plan: Plan, forecast) -> float | None:
        return self.planner.throughput(plan, forecast)
