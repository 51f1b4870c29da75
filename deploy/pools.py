"""Device pools: where a plan's splits run when one model is served by several Triton servers.

A pool is one Triton Deployment (and Service) on one kind of device: the Helm chart
(``deploy/helm/e3``) renders one per entry of its ``pools`` values and writes them, as this module
reads them, into ``pools.json`` in its settings ConfigMap. Everything here is pure (no Kubernetes,
no Triton): the models each pool loads for a placed plan, and the pod replicas each
pool needs for a plan. The controller's Kubernetes scaler (:mod:`e3.controller.k8s_scaler`) applies
the replicas; the placement of splits on pools is the planner's
(:func:`e3.controller.planner.placement.place`).

Decisions (the paper places splits on devices of 26 machines, E3 §3.2.1, §3.3; it is silent on how
machines are grouped):
* A split goes to a pool of its device configuration (``SplitPlan.device`` = ``Pool.device``). The
  router's own pool wins when its device fits: the split is then reached by BLS, with no network
  hop; otherwise the first pool of that device in the values' order, reached over gRPC.
* Compact splits run inside the router, so they need the router's pool to have their device.
* The router's pool runs exactly one pod: one router is E3's one scheduler, merging the survivors of
  every request, and the controller switches its plan through the pool's Service. Other pools may
  run several pods; the controller reaches each of them through the pool's headless Service
  (``pods_host``: one DNS record per ready pod) and spreads a split's instances over them.
* Replicas: a pod holds ``devices_per_pod`` split instances (GPUs per pod on a GPU pool); a pool
  needs ceil(instances placed on it / devices_per_pod) pods, within its min and max replicas.
  A plan that needs more than ``max_replicas`` is refused (the planner was given more devices
  than the pools hold).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from e3.core.plan import COMPACT, Plan

__all__ = ["Pool", "Pools", "PoolError", "load_pools", "pool_models", "replicas_needed", "devices"]


class PoolError(ValueError):
    """Pools that cannot be used, or a plan they cannot hold; the message says what to change."""


@dataclass(frozen=True)
class Pool:
    name: str                 # the pool's name in the chart's values (e.g. "t4")
    device: str               # device configuration of its pods, as in plans and latency profiles
    deployment: str           # its Kubernetes Deployment (and Service) name
    grpc_url: str             # host:port of its Triton's gRPC endpoint (what a plan's SplitPlan.server names)
    http_url: str             # host:port of its Triton's HTTP endpoint (model control, statistics)
    metrics_url: str = ""     # its Triton's metrics page (http://host:port/metrics); "": port 8002 of http_url's host
    devices_per_pod: int = 1  # split instances one pod runs
    min_replicas: int = 1     # fewest pods
    max_replicas: int = 1     # most pods
    price: float = 1.0        # cost per device (per hour, or any unit the planner's alpha uses)
    router: bool = False      # True for the pool whose Triton serves the router
    pods_host: str = ""       # DNS name with one record per ready pod (headless Service); "": only http_url
    gpus_per_pod: int = 0     # GPUs of each pod (nvidia.com/gpu); > 0: split instances are KIND_GPU, one group per GPU


@dataclass(frozen=True)
class Pools:
    pools: tuple[Pool, ...]
    namespace: str = "default"   # Kubernetes namespace of the Deployments

    @property
    def router(self) -> Pool:
        return next(p for p in self.pools if p.router)

    def named(self, name: str) -> Pool:
        for p in self.pools:
            if p.name == name:
                return p
        raise PoolError(f"no pool named {name!r} (pools: {', '.join(p.name for p in self.pools)})")

    def of_server(self, server: str) -> Pool:
        """The pool a split's ``server`` names ("" = the router's pool)."""
        if not server:
            return self.router
        for p in self.pools:
            if p.grpc_url == server:
                return p
        raise PoolError(f"no pool serves {server!r} (pools' gRPC addresses: "
                        f"{', '.join(p.grpc_url for p in self.pools)})")


def load_pools(source: str | Path | Mapping[str, Any]) -> Pools:
    """Pools from the chart's ``pools.json`` (a path or the parsed document), validated."""
    if not isinstance(source, Mapping):
        try:
            source = json.loads(Path(source).read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise PoolError(f"cannot read pools from {source}: {err}") from None
    entries = source.get("pools")
    if not isinstance(entries, list) or not entries:
        raise PoolError("pools: expected a non-empty list under 'pools'")
    pools = []
    for i, e in enumerate(entries):
        try:
            pool = Pool(name=str(e["name"]), device=str(e["device"]), deployment=str(e["deployment"]),
                        grpc_url=str(e["grpc_url"]), http_url=str(e["http_url"]),
                        metrics_url=str(e.get("metrics_url", "")),
                        devices_per_pod=int(e.get("devices_per_pod", 1)), min_replicas=int(e.get("min_replicas", 1)),
                        max_replicas=int(e.get("max_replicas", 1)), price=float(e.get("price", 1.0)),
                        router=bool(e.get("router", False)), pods_host=str(e.get("pods_host", "")),
                        gpus_per_pod=int(e.get("gpus_per_pod", 0)))
        except KeyError as missing:
            raise PoolError(f"pools[{i}] is missing the field {missing}") from None
        except (TypeError, ValueError) as err:
            raise PoolError(f"pools[{i}]: {err}") from None
        if pool.gpus_per_pod < 0:
            raise PoolError(f"pool {pool.name!r}: gpus_per_pod must be >= 0, got {pool.gpus_per_pod}")
        if pool.devices_per_pod < 1 or not 0 <= pool.min_replicas <= pool.max_replicas:
            raise PoolError(f"pool {pool.name!r}: devices_per_pod must be >= 1 and 0 <= min_replicas <= "
                            f"max_replicas (got {pool.devices_per_pod}, {pool.min_replicas}, {pool.max_replicas})")
        pools.append(pool)
    names = [p.name for p in pools]
    if len(set(names)) != len(names):
        raise PoolError(f"pool names must be unique, got {names}")
    routers = [p for p in pools if p.router]
    if len(routers) != 1:
        raise PoolError(f"exactly one pool must serve the router, got {[p.name for p in routers] or 'none'}")
    if routers[0].max_replicas != 1 or routers[0].min_replicas != 1:
        raise PoolError(f"the router's pool {routers[0].name!r} runs exactly one pod (one scheduler merges every "
                        f"request's survivors): set its minReplicas and maxReplicas to 1, and its devicesPerPod "
                        f"to the instances it needs")
    return Pools(tuple(pools), namespace=str(source.get("namespace") or "default"))


def pool_models(plan: Plan, pools: Pools, router_models: tuple[str, ...] = ()) -> dict[str, list[str]]:
    """Pool name -> the models its Triton loads for ``plan``: the router's pool loads ``router_models``
    (the front door, preprocess, ``<m>_router``) and its splits; every pool the splits placed on it."""
    out: dict[str, list[str]] = {p.name: [] for p in pools.pools}
    out[pools.router.name] += list(router_models)
    for s in plan.triton_splits:
        out[pools.of_server(s.server).name].append(s.model)
    return out


def replicas_needed(plan: Plan, pools: Pools) -> dict[str, int]:
    """Pool name -> pods it needs for ``plan``: ceil(split instances on it / devices per pod), at least its
    min_replicas; raises :class:`PoolError` when a pool would need more than its max_replicas."""
    instances = {p.name: 0 for p in pools.pools}
    for s in plan.splits:
        pool = pools.router if s.form == COMPACT else pools.of_server(s.server)
        instances[pool.name] += s.instances
    out = {}
    for p in pools.pools:
        need = max(p.min_replicas, math.ceil(instances[p.name] / p.devices_per_pod))
        if need > p.max_replicas:
            raise PoolError(f"plan {plan.plan_id} needs {need} pods in pool {p.name!r} ({instances[p.name]} instances, "
                            f"{p.devices_per_pod} per pod); its max_replicas is {p.max_replicas}: raise it in the "
                            "chart's values or give the planner fewer devices")
        out[p.name] = need
    return out


def devices(pools: Pools) -> dict[str, int]:
    """Devices per device configuration the planner may use: every pool at its max_replicas (what the
    chart writes as ``E3_DEVICES``)."""
    out: dict[str, int] = {}
    for p in pools.pools:
        out[p.device] = out.get(p.device, 0) + p.max_replicas * p.devices_per_pod
    return out
