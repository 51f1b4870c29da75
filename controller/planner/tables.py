"""The planner's inputs: devices parsed and checked, the B0 candidates, and one B0's cost table.

A table holds, for one input batch B0, every split's stage and hop time for every
start, end, device configuration and instance count, in the form (constant or
compact) with the smaller stage time. It is priced by E3's one cost model
(:func:`e3.core.cost.form_table`) with the ramps the exit-wrapper keeps at that
B0 (:mod:`e3.controller.planner.ramps`); the planner never interpolates a
latency profile itself. The device form, a form of the whole plan, is priced by
the same model (:func:`e3.core.cost.device_table`) in :mod:`~e3.controller.planner.device`,
for the configurations :func:`runs_device_form` admits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import numpy as np

from e3.controller.planner.ramps import RampVerdict, candidate_ramps, wrap_for_devices
from e3.controller.planner.result import PlannerError, SearchContext
from e3.core.cost import effective_reach, form_table
from e3.core.plan import FORMS
from e3.core.profile import BatchProfile, LatencyProfile

__all__ = ["parse_devices", "parse_forms", "runs_device_form", "check_inputs", "b0_candidates", "Tables", "build_tables",
           "plan_ramps", "plan_tables"]


def parse_devices(text: str) -> dict[str, int]:
    """``"v100:6,t4:8"`` -> ``{"v100": 6, "t4": 8}`` (names lower-cased)."""
    out: dict[str, int] = {}
    for item in (p.strip() for p in text.split(",")):
        if not item:
            continue
        name, sep, count = item.partition(":")
        try:
            n = int(count) if sep else -1
        except ValueError:
            n = -1
        if not name.strip() or n < 0:
            raise PlannerError(f"devices are written CONFIG:COUNT[,CONFIG:COUNT...], e.g. cpu:2 or v100:6,t4:8; "
                               f"got {item!r}")
        out[name.strip().lower()] = out.get(name.strip().lower(), 0) + n
    if not out:
        raise PlannerError("no devices given; write e.g. cpu:2")
    return out


def parse_forms(text: str | Sequence[str]) -> tuple[str, ...]:
    """``"constant,compact"`` (or a sequence) -> the split forms the planner may choose, in FORMS order."""
    items = [p.strip().lower() for p in (text.split(",") if isinstance(text, str) else text) if p.strip()]
    unknown = [f for f in items if f not in FORMS]
    if unknown or not items:
        raise PlannerError(f"split forms are some of {','.join(FORMS)} (e.g. constant,compact or constant); "
                           f"got {text!r}")
    return tuple(f for f in FORMS if f in items)


def runs_device_form(latency: LatencyProfile, config: str) -> bool:
    """Whether the planner offers the device form (docs/design.md §2b: every split inside the router, on the router
    instance's device) on device configuration ``config`` of ``latency``: an accelerator whose profile prices
    the form's one sync per run.

    Decision, two conditions:

    * **an accelerator**: the name says it, as it says everything else about a configuration in a latency
      profile: a CPU configuration is named ``cpu`` (``e3 profile``'s default) or ``cpu<anything>``, every
      other one is an accelerator. A CPU is left out because its profile prices ONNX Runtime sessions (the
      constant and compact forms), not the device executor the form runs (on a CPU only eagerly, as the
      tests' check of its answers), and there the compact form already runs in the router's process with
      rows leaving between blocks.
    * **its exit check priced** (``check_ms`` on ``config``: the logits to the host, the rule and the
      survivors' gather on the device; ``e3 profile --cuda`` measures it with the serving executor, a
      modelled GPU profile models it): it is the form's price of a cut, and a profile without it would price
      every run's sync at 0, so that the form would win on no evidence.

    ``--forms`` (``forms=``) without ``device`` turns the form off everywhere.
    """
    return not config.lower().startswith("cpu") and config in latency.check_ms


def check_inputs(latency: LatencyProfile, batch: BatchProfile | None, devices: Mapping[str, int],
                 *, slo_ms: float, slack: float, rate_rps: float) -> dict[str, int]:
    """The devices with a count > 0; raises :class:`PlannerError` naming what the planner cannot use."""
    unknown = sorted(set(devices) - set(latency.devices))
    if unknown:
        raise PlannerError(f"device configuration(s) {unknown} are not in the latency profile of "
                           f"{latency.model!r}, which has {sorted(latency.devices)}; profile them or drop them")
    if any(int(n) < 0 for n in devices.values()):
        raise PlannerError(f"device counts must be >= 0, got {dict(devices)}")
    res = {c: int(n) for c, n in devices.items() if int(n) > 0}
    if not res:
        raise PlannerError(f"no devices to plan with: {dict(devices)}")
    if batch is not None and len(batch.reach) != latency.num_blocks:
        raise PlannerError(f"the batch profile has {len(batch.reach)} blocks, the latency profile "
                           f"{latency.num_blocks}; they must describe the same model")
    if not slo_ms > 0 or not 0 <= slack < 1 or not rate_rps > 0:
        raise PlannerError(f"need slo_ms > 0, 0 <= slack < 1 and rate_rps > 0; got {slo_ms}, {slack}, {rate_rps}")
    return res


def b0_candidates(latency: LatencyProfile, devices: Mapping[str, int], rate_rps: float,
                  *, latency_budget_ms: float) -> list[int]:
    """Powers of two up to max measured batch x total devices whose fill time (B0-1)/R fits the budget."""
    top = latency.batch_sizes[-1] * max(1, sum(devices.values()))
    out, b = [], 1
    while b <= top and 1e3 * (b - 1) / rate_rps < latency_budget_ms:
        out.append(b)
        b *= 2
    return out


@dataclass
class Tables:
    b0: int
    configs: list[str]           # configuration names, grid axis order
    caps: list[int]              # devices of each configuration (grid axis c has caps[c] + 1 cells)
    prices: np.ndarray           # [C]
    T: list[np.ndarray]          # per c: [a-1, j-1, m-1] stage time of split a..j with m instances, inf if illegal
    tx: list[np.ndarray]         # per c: [a-1, j-1, m-1] hop into that split (0 when compact)
    form: list[np.ndarray]       # per c: [a-1, j-1, m-1] its form, an index into e3.core.plan.FORMS
    stage: list[np.ndarray]      # per c: max(T, tx)  (what the pipelined cycle sees)
    lat: list[np.ndarray]        # per c: T + tx      (what latency sees)
    batch_in: np.ndarray         # [a-1] B_a: inputs entering block a per cycle (with the enabled ramps)
    ramps: tuple[int, ...] = ()  # the enabled ramps the table is priced with
    verdicts: tuple[RampVerdict, ...] = ()  # the exit-wrapper's verdicts at this B0 (empty: wrapper off)


def build_tables(latency: LatencyProfile, reach: np.ndarray, devices: Mapping[str, int], *, b0: int,
                 ramps: Iterable[int] | None = None, forms: Sequence[str] = FORMS, router: bool = True,
                 verdicts: Sequence[RampVerdict] = (), exact: Mapping[str, Sequence[float]] | None = None) -> Tables:
    """One B0's table with the ramps ``ramps`` enabled (None: every ramp the profile prices, ``reach`` as
    given) in the better of ``forms`` per cell. ``router=False``: without the router's work (the stock
    model). Illegal cells are inf: more instances than inputs entering the split (m > max(1, ceil(B_a)))
    or a per-instance batch above the largest measured batch. ``exact``: measured reach per set of ramps
    (:func:`e3.core.cost.effective_reach`)."""
    bmax = float(latency.batch_sizes[-1])
    ramps = None if ramps is None else tuple(sorted(int(k) for k in ramps))
    Bk = b0 * effective_reach(reach, ramps, exact)       # [L] inputs reaching block k
    configs = list(devices)
    T_l, tx_l, f_l, st_l, lat_l = [], [], [], [], []
    for c in configs:
        M = devices[c]
        m = np.arange(1, M + 1, dtype=float)
        per = Bk[:, None] / m[None, :]             # [a, m] per-instance batch entering a split at a
        legal = (m[None, :] <= np.maximum(1.0, np.ceil(Bk[:, None] - 1e-9))) & (per <= bmax + 1e-9)
        T, tx, form = form_table(latency, c, Bk, max_instances=M, ramps=ramps, forms=forms, router=router)
        T = np.where(legal[:, None, :], T, np.inf)
        T_l.append(T)
        tx_l.append(tx)
        f_l.append(form)
        st_l.append(np.maximum(T, tx))
        lat_l.append(T + tx)
    prices = np.array([latency.devices[c].price for c in configs], dtype=float)
    all_ramps = tuple(range(1, latency.num_blocks)) if ramps is None else ramps
    return Tables(b0, configs, [devices[c] for c in configs], prices, T_l, tx_l, f_l, st_l, lat_l, Bk,
                  all_ramps, tuple(verdicts))


def plan_ramps(latency: LatencyProfile, reach: np.ndarray, configs: Sequence[str], *, b0: int,
               ctx: SearchContext) -> tuple[tuple[int, ...], tuple[RampVerdict, ...]]:
    """The ramps a plan on ``configs`` enables at this B0, and the exit-wrapper's verdicts: the wrapper's
    choice among ``ctx.ramp_blocks`` (when ``ctx.exit_wrapper``), else those ramps as they are."""
    ramps = candidate_ramps(latency, reach) if ctx.ramp_blocks is None else ctx.ramp_blocks
    if not ctx.exit_wrapper:
        return tuple(ramps), ()
    return wrap_for_devices(latency, reach, list(configs), b0=b0, ramps=ramps, exact=ctx.exact_reach,
                            relies_on=ctx.relies_on)


def plan_tables(latency: LatencyProfile, reach: np.ndarray, devices: Mapping[str, int], *, b0: int,
                ctx: SearchContext) -> Tables:
    """One B0's table as a search needs it: the exit-wrapper (when ``ctx.exit_wrapper``) picks the ramps of
    ``ctx.ramp_blocks`` worth keeping at this B0 on ``devices``, the table is priced with them and
    ``ctx.forms``. The one way the product's searches and the tests' reference search build tables."""
    ramps, verdicts = plan_ramps(latency, reach, list(devices), b0=b0, ctx=ctx)
    return build_tables(latency, reach, devices, b0=int(b0), ramps=ramps, forms=ctx.forms, verdicts=verdicts,
                        exact=ctx.exact_reach)
