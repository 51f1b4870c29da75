"""Plan placement: which device pool runs each constant split of a plan (the planner's last step when the
model is served by several Triton servers, ``docs/kubernetes.md``).

A compact or device split runs inside the router, so it stays in the router's pool; a constant split goes to the
router's pool when that pool has the split's device, else to the first pool that has it; ``pin`` overrides
the choice. The split's ``server`` is the chosen pool's gRPC address ("" for the router's own server).
"""

from __future__ import annotations

import uuid
from dataclasses import replace
from typing import Mapping

from e3.core.plan import COMPACT, DEVICE, Plan
from e3.deploy.pools import PoolError, Pools

__all__ = ["place"]


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
    splits = []
    for s in plan.splits:
        if s.form in (COMPACT, DEVICE):
            if s.device != router.device or s.model in pin and pin[s.model] != router.name:
                raise PoolError(f"{s.model} is {s.form} (it runs inside the router), so it needs the router's pool "
                                f"{router.name!r} ({router.device}); the plan puts it on {s.device}")
            splits.append(s)
            continue
        if s.model in pin:
            pool = pools.named(pin[s.model])
            if pool.device != s.device:
                raise PoolError(f"{s.model} runs on {s.device}; pool {pool.name!r} has {pool.device}")
        else:
            fits = [p for p in pools.pools if p.device == s.device]
            if not fits:
                raise PoolError(f"no pool has device {s.device!r} for {s.model} (pools: "
                                f"{', '.join(f'{p.name}={p.device}' for p in pools.pools)})")
            pool = router if router in fits else fits[0]
        splits.append(replace(s, server="" if pool.router else pool.grpc_url))
    splits_t = tuple(splits)
    if splits_t == plan.splits:
        return plan
    placed = replace(plan, splits=splits_t, plan_id=uuid.uuid4().hex[:12])
    placed.validate()
    return placed
