"""What the controller must know about the served model, without its checkpoint.

The controller plans and scores plans; for that it needs the model's block count, which blocks have a
ramp, and its exit rule. It never needs the weights, so it never resolves the zoo model (which loads a
checkpoint: a controller image has none, and a controller that raised ``CheckpointMissing`` would
crash-loop). :func:`model_facts` takes them, in this order, from

1. the repository's manifest (``e3_repository.json``: the model card ``e3 export`` wrote), when the
   controller sees the repository;
2. else a plan: ``--plan PLAN.json`` (e.g. the plan the repository was exported with), or the plan the
   router serves now (its config's ``plan`` parameter): the exit rule and the block count; the ramps are
   the ones the latency profile measured (``e3 profile`` times every ramp the model has).

Decisions: the latency profile is always required (the planner's input) and must describe the same block
count as the card or plan; a disagreement is an error naming both, not a guess. A plan enables a subset
of the model's ramps, so its enabled ramps never stand for the model's ramps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from e3.core.exits import make_exit_rule
from e3.core.plan import Plan
from e3.core.profile import LatencyProfile

__all__ = ["ModelFacts", "model_facts", "PlanningFacts", "planning_facts"]


@dataclass(frozen=True)
class ModelFacts:
    num_blocks: int                   # L
    ramp_blocks: tuple[int, ...]      # blocks followed by a ramp (< L)
    exit_rule: dict[str, Any]         # e3.core.exits rule, e.g. {"kind": "entropy", "tau_nats": 0.47}
    source: str                       # where they came from (printed at start)


def model_facts(latency: LatencyProfile, *, card: Mapping[str, Any] | None = None, plan: Plan | None = None,
                plan_source: str = "plan") -> ModelFacts:
    """The served model's facts from a manifest ``card`` (dict) or a ``plan``, checked against ``latency``.

    Raises ValueError naming what is missing or inconsistent and what to give instead.
    """
    if card is not None:
        facts = ModelFacts(int(card["num_blocks"]), tuple(int(k) for k in card["ramp_blocks"]),
                           dict(card.get("exit_rule") or {}), "the repository's manifest (model card)")
        if not facts.exit_rule:
            raise ValueError("the repository's model card has no exit rule; re-export the model")
    elif plan is not None:
        facts = ModelFacts(plan.num_blocks, tuple(latency.ramp_blocks()), dict(plan.exit_rule),
                           f"{plan_source} {plan.plan_id} (exit rule) and the latency profile (ramps)")
    else:
        raise ValueError(f"nothing tells the controller {latency.model}'s exit rule: the repository is not visible "
                         "here (--repo), no --plan was given and the router serves no plan yet; give --plan "
                         "PLAN.json (the plan the repository was exported with) or --repo REPO")
    if facts.num_blocks != latency.num_blocks:
        raise ValueError(f"the latency profile is for {latency.num_blocks} blocks of {latency.model}, but "
                         f"{facts.source} says {facts.num_blocks}: profile the served model (e3 profile)")
    missing = sorted(set(facts.ramp_blocks) - set(latency.ramp_blocks()))
    if missing:
        raise ValueError(f"the latency profile has no timings for the ramps after blocks {missing} that "
                         f"{facts.source} lists: profile the served model with its ramps (e3 profile)")
    return facts


@dataclass(frozen=True)
class PlanningFacts:
    """What ``e3 plan`` plans with."""
    ramp_blocks: tuple[int, ...]        # the model's ramps, written into the plan
    exit_rule: dict[str, Any]
    relies_on: Callable | None          # what the rule's decisions rely on (None: independent ramps)
    planner_ramps: tuple[int, ...] | None   # best_plan's ramp_blocks (None: the ramps the profiles support)


def planning_facts(latency: LatencyProfile, batch, *, card=None, tau_nats: float = 0.0) -> PlanningFacts:
    """The ramps, exit rule and rule dependencies ``e3 plan`` uses.

    With the model's ``card`` (a :class:`~e3.models.api.ModelCard`): its ramps and rule, and the rule's
    ``relies_on``; the planner is held to those ramps. Without it (a latency and a batch profile alone): the ramps
    the latency profile measured, the batch profile's rule (else an entropy rule at ``tau_nats``), and the
    planner picks among the ramps the profiles support. Decision: a batch-profile rule whose module does not
    import here (a user's rule) is taken as relying on every earlier ramp, the side on which the exit-wrapper
    never disables a ramp it cannot re-price."""
    if card is not None:
        rule = dict(card.exit_rule)
        ramps = tuple(int(k) for k in card.ramp_blocks)
        return PlanningFacts(ramps, rule, make_exit_rule(rule).relies_on, ramps)
    rule = dict(batch.exit_rule) or {"kind": "entropy", "tau_nats": tau_nats}
    relies_on = None
    if batch.exit_rule:
        try:
            relies_on = make_exit_rule(rule).relies_on
        except ValueError:
            def relies_on(block, enabled):
                return tuple(k for k in enabled if k < block)
    return PlanningFacts(tuple(latency.ramp_blocks()), rule, relies_on, None)
