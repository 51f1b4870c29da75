"""The controller's scaling signals, pure: the rate it plans for and the pods each pool should run.

E3 plans for a request rate R (§3.2). A fixed R sizes pods for that rate forever: a surge then produces
drops, not pods. With ``follow_traffic`` the controller plans each window for the traffic it observed,
never below the configured rate (the floor, what the pools are sized for at rest):

    planned R = max(floor, (inputs that entered split 1 + inputs dropped) / window seconds)

Dropped inputs count as demand: they are requests the plan in force did not serve in time. (Requests the
router refused at its ``max_queue_inputs`` bound are not in the window; the drop rate is published beside
the desired replicas so an autoscaler or an alert can see them.)

The desired replicas of a pool are what :func:`e3.deploy.pools.replicas_needed` asks for the plan the
controller wants in force (the pending plan if one waits for pods, else the running one); a plan that needs
more than a pool's ``max_replicas`` is published at ``max_replicas`` (the planner was given more devices
than the pools hold; the controller refuses that plan and says so).
"""

from __future__ import annotations

import math

from e3.core.plan import COMPACT, Plan
from e3.deploy.pools import PoolError, Pools, replicas_needed

__all__ = ["observed_rate_rps", "drop_rate_rps", "planned_rate_rps", "desired_replicas"]


def observed_rate_rps(inputs: float, dropped: float, duration_s: float) -> float:
    """Offered inputs per second in a window: inputs that entered split 1 plus inputs dropped."""
    if not duration_s > 0:
        return 0.0
    return max(0.0, inputs + dropped) / duration_s


def drop_rate_rps(dropped: float, duration_s: float) -> float:
    """Inputs dropped per second in a window (0 for an empty window)."""
    return max(0.0, dropped) / duration_s if duration_s > 0 else 0.0


def planned_rate_rps(floor_rps: float, observed_rps: float | None) -> float:
    """The rate to plan for: the observed rate, never below ``floor_rps`` (no observation: the floor)."""
    if observed_rps is None or not math.isfinite(observed_rps):
        return floor_rps
    return max(floor_rps, observed_rps)


def desired_replicas(plan: Plan | None, pools: Pools) -> dict[str, int]:
    """Pool name -> pods for ``plan`` (each pool's ``min_replicas`` when there is no plan), clamped to
    ``max_replicas``."""
    if plan is None:
        return {p.name: p.min_replicas for p in pools.pools}
    try:
        return replicas_needed(plan, pools)
    except PoolError:   # more than a pool holds: publish its ceiling
        out = {}
        for p in pools.pools:
            instances = sum(s.instances for s in plan.splits
                            if (pools.router if s.form == COMPACT else _pool_of(pools, s.server)) is p)
            out[p.name] = min(p.max_replicas, max(p.min_replicas, math.ceil(instances / p.devices_per_pod)))
        return out


def _pool_of(pools: Pools, server: str):
    try:
        return pools.of_server(server)
    except PoolError:
        return None
