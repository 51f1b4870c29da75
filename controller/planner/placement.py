"""Plan placement: which device pool runs each constant split of a plan (the planner's last step when the
model is served by several Triton servers, ``docs/kubernetes.md``).

A compact or device split runs inside the router, so it stays in the router's pool. A constant split goes to the
router's pool when that pool has the split's device and room for its instances, else to the next pool of that
device with room (splits of many instances first, so that a large one still finds a pool): a pool holds at most
``max_replicas * devices_per_pod`` instances, so two pools of one device share a plan that one cannot hold.
``pin`` overrides the choice. The split's ``server`` is the chosen pool's gRPC address ("" for the router's own
server). A plan no arrangement holds is refused with a :class:`~e3.deploy.pools.PoolError` naming the split.
"""

from __future__ import annotations

import uuid
from dataclasses import replace
from typing import Mapping

from e3.core.plan import COMPACT, DEVICE, Plan
from e3.deploy.pools import Pool, PoolError, Pools

__all__ = ["place", "capacity", "NoRoom"]


class NoRoom(PoolError):
    """No pool of ``device`` has room for a split of the plan (more devices than the pools really hold)."""

    def __init__(self, message: str, device: str):
        super().__init__(message)
        self.device = device


def capacity(pool: Pool) -> int:
    """Split instances ``pool`` holds at its most pods."""
    return pool.max_replicas * pool.devices_per_pod


def place(plan: Plan, pools: Pools, pin: Mapping[str, str] | None = None) -> Plan:
    """``plan`` with every constant split's ``server`` set from the pools (see this module's docstring).

    ``pin`` maps split model names to pool names, overriding the choice (e.g. to move a split); a pin
    to a pool of another device is refused. The result has a new ``plan_id`` when any server changed.
    """
    pin = dict(pin or {})
    unknown = set(pin) - {s.model for s in plan.splits}
    if unknown:
        raise PoolError(f"pinned splits {sorted(unknown)} are not in plan {plan.plan_id}")
    router = pools.router
    room = {p.name: capacity(p) for p in pools.pools}
    chosen: dict[int, Pool] = {}
    for i, s in enumerate(plan.splits):
        if s.form in (COMPACT, DEVICE):
            if s.device != router.device or s.model in pin and pin[s.model] != router.name:
                raise PoolError(f"{s.model} is {s.form} (it runs inside the router), so it needs the router's pool "
                                f"{router.name!r} ({router.device}); the plan puts it on {s.device}")
            room[router.name] -= s.instances if s.form == COMPACT else 0
        elif s.model in pin:
            pool = pools.named(pin[s.model])
            if pool.device != s.device:
                raise PoolError(f"{s.model} runs on {s.device}; pool {pool.name!r} has {pool.device}")
            chosen[i] = pool
            room[pool.name] -= s.instances
    free = sorted((i for i, s in enumerate(plan.splits) if s.form not in (COMPACT, DEVICE) and i not in chosen),
                  key=lambda i: -plan.splits[i].instances)
    for i in free:
        s = plan.splits[i]
        fits = [p for p in pools.pools if p.device == s.device]
        if not fits:
            raise PoolError(f"no pool has device {s.device!r} for {s.model} (pools: "
                            f"{', '.join(f'{p.name}={p.device}' for p in pools.pools)})")
        fits.sort(key=lambda p: not p.router)        # the router's pool first (no hop), then the pools' order
        pool = next((p for p in fits if room[p.name] >= s.instances), None)
        if pool is None:
            raise NoRoom(f"no pool of device {s.device!r} has room for {s.model}'s {s.instances} instances "
                            f"(room left: {', '.join(f'{p.name}={room[p.name]}' for p in fits)}; a pool holds "
                            "max_replicas x devices_per_pod): raise maxReplicas in the chart's values or give the "
                            "planner fewer devices", s.device)
        chosen[i] = pool
        room[pool.name] -= s.instances
    splits_t = tuple(replace(s, server="" if chosen[i].router else chosen[i].grpc_url) if i in chosen else s
                     for i, s in enumerate(plan.splits))
    if splits_t == plan.splits:
        return plan
    placed = replace(plan, splits=splits_t, plan_id=uuid.uuid4().hex[:12])
    placed.validate()
    return placed
