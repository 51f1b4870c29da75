import json

import pytest

from e3.core.plan import Plan, PlanError, default_plan


def make_plan(**overrides):
    plan = default_plan("m", 6, [(1, 2), (3, 4), (5, 6)], exit_rule={"kind": "entropy", "tau_nats": 0.3},
                        ramp_blocks=(1, 2, 3, 4, 5), batch_size=16)
    data = plan.to_dict()
    data.update(overrides)
    return data


def test_plan_round_trips_through_json():
    data = make_plan()
    plan = Plan.from_json(json.dumps(data))
    assert plan.to_dict() == data
    assert plan.cuts == [2, 4]
    assert plan.tau_nats == 0.3
    assert [s.enabled_ramps for s in plan.splits] == [(1, 2), (3, 4), (5,)]


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.pop("splits"), "missing the field 'splits'"),
    (lambda d: d["splits"].pop(1), "starts at block 5; expected 3"),
    (lambda d: d["splits"][0].update(last_block=3, model="m_split_1-3"), "starts at block 3; expected 4"),
    (lambda d: d["splits"][0].update(model="m_split_1-9"), "name should be 'm_split_1-2'"),
    (lambda d: d["splits"][2].update(enabled_ramps=[6]), "enabled ramp 6"),
    (lambda d: d["splits"][0].update(batch_size=0), "batch_size"),
    (lambda d: d["splits"][0].update(batch_size="8"), "must be an integer"),
    (lambda d: d.update(exit_rule={"kind": "magic"}), "unknown exit rule"),
    (lambda d: d.update(version=99), "version 99"),
    (lambda d: d.update(slack=1.5), "slack"),
    (lambda d: d.update(surprise=1), "unknown fields"),
    (lambda d: d["splits"].pop(), "must end at block 6"),
])
def test_malformed_plans_name_the_problem(mutate, message):
    data = make_plan()
    mutate(data)
    with pytest.raises(PlanError, match=message):
        Plan.from_dict(data)


def test_not_json_and_not_object():
    with pytest.raises(PlanError, match="not valid JSON"):
        Plan.from_json("{oops")
    with pytest.raises(PlanError, match="JSON object"):
        Plan.from_dict([1, 2])


def test_ramps_checked_against_the_model():
    plan = Plan.from_dict(make_plan())
    with pytest.raises(PlanError, match="has no ramp"):
        plan.validate(ramp_blocks=(2, 4))


def test_router_instances_one_scheduler_unless_every_split_is_compact():
    from dataclasses import replace
    from e3.core.plan import COMPACT
    plan = default_plan("m", 4, [(1, 2), (3, 4)], exit_rule={"kind": "entropy", "tau_nats": 0.3}, ramp_blocks=(1, 2, 3), instances=2)
    assert plan.router_instances == 1                       # constant splits: one scheduler merges every row
    compact = replace(plan, splits=tuple(replace(s, form=COMPACT) for s in plan.splits))
    assert compact.router_instances == 2                    # compact only: one router per worker set
    uneven = replace(compact, splits=(replace(compact.splits[0], instances=4), compact.splits[1]))
    assert uneven.router_instances == 2                     # gcd(4, 2)
    mixed = replace(plan, splits=(replace(plan.splits[0], form=COMPACT), plan.splits[1]))
    assert mixed.router_instances == 1
