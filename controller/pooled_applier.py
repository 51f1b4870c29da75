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
  needs. Loads, unloads and reloads go to every pod of a pool (its headless Service lists them),
  a split's instances spread over them; the router's pool runs one pod. Reads (loaded models,
  statistics, counters) go through the pool's Service, which answers from one pod.
"""

from __future__ import annotations

import logging
import math
import socket
from dataclasses import replace
from typing import TYPE_CHECKING, Callable, Iterable

from e3.controller.applier import ControlError, PlanRefused, ServerControl, ServerView
from e3.controller.decisions import devices_used
from e3.controller.health import SplitStats
from e3.controller.planner.placement import NoRoom, place
from e3.controller.triton_applier import TritonApplier
from e3.core.plan import Plan, SplitPlan
from e3.deploy.pools import PoolError, Pools, replicas_needed

if TYPE_CHECKING:
    from e3.controller.k8s_scaler import PoolScaler

__all__ = ["PooledApplier", "PlacingPlanner", "ROUTER_SERVER", "POD_READY_TIMEOUT_S", "located", "dns_pods"]

log = logging.getLogger(__name__)

POD_READY_TIMEOUT_S = 600.0   # the longest an apply waits for a pool's new pods to be ready (seconds)
ROUTER_SERVER = "router"   # how a copy on the router's own server is named in ``<split>@<server>``


def dns_pods(host: str, port: int) -> list[str]:
    """``ip:port`` of every address ``host`` resolves to (a headless Service: one per ready pod), sorted."""
    addresses = {info[4][0] for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)}
    return sorted(f"[{a}]:{port}" if ":" in a else f"{a}:{port}" for a in addresses)


def located(split: str, server: str) -> str:
    """``<split>@<server>``: a loaded copy on a server the plan in force does not place it on."""
    return f"{split}@{server or ROUTER_SERVER}"


class PooledApplier(ServerView, ServerControl):
    """``router``: the applier of the router's server; ``servers``: gRPC address (as plans name a split's
    server) -> the applier of that server's HTTP API (its Service). With ``pools`` whose ``pods_host`` is
    set, changes to a pool go to each of its pods (``resolve(host, port)`` lists their ``ip:port``; default:
    DNS, one record per ready pod of a headless Service), a split's instances spread over them; reads
    go through the Service. ``make_applier(url)`` builds a pod's applier (default :class:`TritonApplier`)."""

    def __init__(self, router_model: str, router: TritonApplier, servers: dict[str, TritonApplier], *,
                 pools: Pools | None = None, scaler: PoolScaler | None = None,
                 ready_timeout_s: float = POD_READY_TIMEOUT_S,
                 resolve: Callable[[str, int], list[str]] | None = None,
                 make_applier: Callable[[str], TritonApplier] | None = None):
        if scaler is not None and pools is None:
            raise ValueError("a scaler needs the pools it scales")
        self.router_model, self.router, self.servers = router_model, router, dict(servers)
        self.pools, self.scaler, self.ready_timeout_s = pools, scaler, ready_timeout_s
        self._resolve = resolve or dns_pods
        self._make_applier = make_applier or TritonApplier
        self._pod_appliers: dict[str, TritonApplier] = {}

    def close(self) -> None:
        """Close every server's clients (this thread's)."""
        for _, applier in self._everywhere():
            applier.close()
        for applier in self._pod_appliers.values():
            applier.close()

    def _at(self, server: str) -> TritonApplier:
        if not server:
            return self.router
        try:
            return self.servers[server]
        except KeyError:
            raise ControlError(f"no pool serves {server!r} (pools: {sorted(self.servers)}); add it to the "
                               "controller's pools") from None

    def _pods(self, server: str) -> list[TritonApplier]:
        """The appliers a change on ``server`` goes to: each pod of its pool when the pool has a
        ``pods_host`` (never the router's pool: it runs one pod), else the server's own."""
        if not server or self.pools is None:
            return [self._at(server)]
        try:
            pool = self.pools.of_server(server)
        except PoolError as err:
            raise ControlError(str(err)) from None
        if pool.router or not pool.pods_host:
            return [self._at(server)]
        port = int(pool.http_url.rpartition(":")[2])
        try:
            urls = self._resolve(pool.pods_host, port)
        except OSError as err:
            raise ControlError(f"pool {pool.name!r}: cannot list its pods ({pool.pods_host}): {err}") from None
        if not urls:
            raise ControlError(f"pool {pool.name!r} has no ready pod ({pool.pods_host})")
        out = []
        for url in urls:
            if url not in self._pod_appliers:
                self._pod_appliers[url] = self._make_applier(url)
                self._pod_appliers[url].gpus = pool.gpus_per_pod   # split instances spread over the pod's GPUs
            out.append(self._pod_appliers[url])
        return out

    def _everywhere(self) -> list[tuple[str, TritonApplier]]:
        return [("", self.router), *self.servers.items()]

    def _placement(self) -> dict[str, str]:
        """Split model -> the server the plan in force places it on ("" = the router's)."""
        plan = self.router.current_plan(self.router_model)
        return {s.model: s.server for s in plan.triton_splits} if plan else {}

    def _owner(self, name: str) -> tuple[str, str]:
        """(split, server) of a name from :meth:`loaded_splits`: ``<split>@<server>`` or a placed split."""
        split, _, where = name.partition("@")
        if where:
            return split, "" if where == ROUTER_SERVER else where
        return split, self._placement().get(split, "")

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
        split, server = self._owner(name)
        for applier in self._pods(server):
            error = applier.probe(split)
            if error is not None:
                return error
        return None

    # -- ServerControl -------------------------------------------------------------------------------
    def export(self, splits: list[SplitPlan], plan_in_force: Plan | None) -> None:
        self.router.export(splits, plan_in_force)

    def configure_split(self, split: SplitPlan) -> None:
        """Load the split on every pod of its pool, its instances spread over them (ceil(instances / pods)
        each, within the pool's devices per pod as :func:`e3.deploy.pools.replicas_needed` sized it)."""
        pods = self._pods(split.server)
        per_pod = math.ceil(split.instances / len(pods))
        for applier in pods:
            applier.configure_split(replace(split, instances=per_pod))

    def switch_plan(self, router: str, plan: Plan) -> None:
        for s in plan.triton_splits:
            if not s.server:
                continue
            for applier in self._pods(s.server):
                try:
                    ready = applier.control.is_ready(s.model)
                except ControlError:
                    raise
                except Exception as err:  # noqa: BLE001 - a pool that cannot be reached: refuse with its address
                    raise ControlError(f"cannot reach {s.server} (pool of {s.model}) before switching {router}: "
                                       f"{err}") from None
                if not ready:
                    raise ControlError(f"load the plan's splits before switching {router}: {s.model} is not "
                                       f"ready on {s.server}")
        self.router.switch_plan(router, plan)

    def _pods_needed(self, plan: Plan) -> dict[str, int]:
        """Pool name -> pods the plan needs there (a plan the pools cannot hold is a ControlError)."""
        try:
            return replicas_needed(plan, self.pools)
        except PoolError as err:
            raise PlanRefused(str(err)) from None

    def prepare(self, plan: Plan) -> None:
        """Scale up the pools whose pods cannot hold the plan's instances, and wait for them to be ready."""
        if self.scaler is None:
            return
        need = self._pods_needed(plan)
        if not self.scaler.owns_replicas:   # an autoscaler scales on the published signal: no wait here
            ready = {p.name: self.scaler.ready(p) for p in self.pools.pools}
            short = {name: (have, need[name]) for name, have in ready.items() if have < need[name]}
            if short:
                raise ControlError("waiting for the autoscaler: " + ", ".join(
                    f"pool {name!r} has {have} of {want} pods ready" for name, (have, want) in short.items()))
            return
        for pool in self.pools.pools:
            if need[pool.name] > self.scaler.replicas(pool):
                self.scaler.scale(pool, need[pool.name])
        for pool in self.pools.pools:
            self.scaler.wait_ready(pool, need[pool.name], self.ready_timeout_s)

    def settle(self, plan: Plan) -> None:
        """Scale down pools that hold more pods than the plan in force needs (never below min_replicas)."""
        if self.scaler is None or not self.scaler.owns_replicas:
            return
        need = self._pods_needed(plan)
        for pool in self.pools.pools:
            if need[pool.name] < self.scaler.replicas(pool):
                self.scaler.scale(pool, need[pool.name])

    def unload(self, name: str) -> None:
        split, server = self._owner(name)
        for applier in self._pods(server):
            applier.unload(split)

    def reload(self, name: str) -> None:
        split, server = self._owner(name)
        for applier in self._pods(server):
            applier.reload(split)

class PlacingPlanner:
    """The controller's planner with every plan placed on the pools (:func:`e3.controller.planner.placement.place`):
    the planner chooses devices per split, the pools say which server has them. The planner is told what the
    pools really hold: when a plan does not fit (a split finds no pool of its device with room), the device's
    count is lowered below what that plan used and the planner asked again, until a plan fits or no device is
    left (then :class:`~e3.deploy.pools.PoolError`, a ValueError: the loop keeps the running plan)."""

    def __init__(self, planner, pools: Pools):
        self.planner, self.pools = planner, pools
        self.latency = getattr(planner, "latency", None)

    def plan(self, forecast, devices):
        devices = dict(devices)
        while True:
            candidate = self.planner.plan(forecast, devices)
            try:
                return place(candidate, self.pools)
            except NoRoom as err:
                fewer = devices_used(candidate).get(err.device, 0) - 1
                if fewer < 1:
                    raise
                log.info("plan %s does not fit the pools (%s); planning with %s:%d", candidate.plan_id, err,
                         err.device, fewer)
                devices[err.device] = fewer

    def throughput(self, plan: Plan, forecast) -> float | None:
        return self.planner.throughput(plan, forecast)

    def for_rate(self, rate_rps: float) -> None:
        for_rate = getattr(self.planner, "for_rate", None)
        if for_rate is not None:
            for_rate(rate_rps)
