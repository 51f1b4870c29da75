"""Exit rules as a public extension point, without a server: a user's rule built from its dict form, its
module shipped and built again in an isolated interpreter, and the errors export gives (at export, naming
the problem) for an unknown rule, a rule that cannot load where the server runs it, a rule object in the
card, and a block that drops a state tensor."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from e3.core.exits import EntropyRule, PatienceRule, make_exit_rule
from e3.core.plan import Plan, PlanError, default_plan
from e3.export.onnx_export import StateLayoutError, check_state_layout
from e3.export.repository import ExportError, export_repository
from e3.export.rules import RuleError, check_shipped, resolve_rule, ship_rule

import custom_ee
from custom_rule import ForgetfulRule, MeanAgreeRule


def test_a_users_rule_is_built_from_its_dict_form_and_carries_state_across_ramps():
    rule = make_exit_rule({"kind": "custom_rule:MeanAgreeRule", "margin": 0.2, "num_classes": 2})
    assert isinstance(rule, MeanAgreeRule) and rule.dependent
    assert rule.to_dict() == {"kind": "custom_rule:MeanAgreeRule", "margin": 0.2, "num_classes": 2}
    state = rule.init_state(3)
    rows = np.arange(3)
    # ramp 1: rows 0 and 1 confident for class 0, row 2 for class 1 but not by the margin
    first = np.log(np.array([[0.9, 0.1], [0.8, 0.2], [0.45, 0.55]]))
    assert rule.decide(1, first, state, rows).tolist() == [True, True, False]
    # ramp 2: row 2 confident for class 0 now, but the running sum (0.45+0.95 vs 0.55+0.05) agrees: exits
    assert rule.decide(2, np.log(np.array([[0.5, 0.5]] * 2 + [[0.95, 0.05]])), state, rows)[2]
    np.testing.assert_allclose(state["votes"][2], [1.4, 0.6])


def test_built_in_rules_go_through_the_same_door():
    assert isinstance(make_exit_rule({"kind": "e3.core.exits:EntropyRule", "tau_nats": 0.3}), EntropyRule)
    assert make_exit_rule({"kind": "patience", "patience": 2}).to_dict() == {"kind": "patience", "patience": 2}
    assert not EntropyRule(0.1).dependent and PatienceRule(1).dependent
    assert PatienceRule(2).relies_on(4, (1, 2, 3, 4)) == (2, 3)
    assert EntropyRule(0.1).relies_on(4, (1, 2, 3)) == ()


@pytest.mark.parametrize("config, message", [
    ({"kind": "margin_agree"}, "unknown exit rule 'margin_agree'"),
    ({"kind": "no_such_module_xyz:Rule"}, "cannot import 'no_such_module_xyz'"),
    ({"kind": "custom_rule:NotThere"}, "has no ExitRule subclass 'NotThere'"),
    ({"kind": "custom_rule:MeanAgreeRule", "margin": 0.2}, "do not build it"),
    ({"kind": "__main__:Rule"}, "defined in a script"),
])
def test_bad_rules_are_named(config, message):
    with pytest.raises(ValueError, match=message):
        make_exit_rule(config)


def test_a_plan_names_a_users_rule_without_importing_it():
    plan = default_plan("m", 2, [(1, 2)], exit_rule={"kind": "somewhere.else:Rule", "x": 1}, ramp_blocks=(1,))
    assert Plan.from_json(plan.to_json()).exit_rule["kind"] == "somewhere.else:Rule"
    with pytest.raises(PlanError, match="unknown exit rule"):
        Plan.from_dict({**plan.to_dict(), "exit_rule": {"kind": "margin_agree"}})


def test_the_rule_module_is_shipped_and_loads_in_an_isolated_interpreter(tmp_path):
    rule = resolve_rule({"kind": "custom_rule:MeanAgreeRule", "margin": 0.3, "num_classes": 3})
    assert ship_rule(rule, tmp_path) == "e3_rules/custom_rule.py"
    check_shipped(rule, tmp_path)                          # no working directory, no PYTHONPATH: from e3_rules
    assert ship_rule(EntropyRule(0.2), tmp_path / "b") is None


def test_a_rule_whose_module_imports_an_unshipped_sibling_fails_at_export(tmp_path, monkeypatch):
    src = tmp_path / "src"
    src.mkdir()
    (src / "siblinghelper.py").write_text("LIMIT = 0.5\n")
    (src / "siblingrule.py").write_text(
        "import numpy as np\nfrom e3.core.exits import ExitRule\nimport siblinghelper\n\n"
        "class Rule(ExitRule):\n    def __init__(self):\n        pass\n"
        "    def decide(self, block, logits, state, rows):\n        return np.zeros(len(rows), bool)\n")
    monkeypatch.syspath_prepend(str(src))
    rule = resolve_rule({"kind": "siblingrule:Rule"})
    ship_rule(rule, tmp_path / "v")
    with pytest.raises(RuleError, match="does not load where the server will run it.*siblinghelper"):
        check_shipped(rule, tmp_path / "v")
    sys.modules.pop("siblingrule", None)


def test_an_exit_rule_object_in_the_card_is_its_dict_form():
    model = custom_ee.SummitEE(rule=MeanAgreeRule(0.4, 3))
    assert model.card.exit_rule == {"kind": "custom_rule:MeanAgreeRule", "margin": 0.4, "num_classes": 3}


class _Dropping(custom_ee.SummitEE):
    def block(self, k, h, summ, scratch):
        h, summ, scratch = super().block(k, h, summ, scratch)
        return (h, summ) if k == 2 else (h, summ, scratch)


def test_a_block_that_drops_a_state_tensor_is_named():
    with pytest.raises(StateLayoutError, match="block 2 returns 2 state tensor.*drops 'scratch'"):
        check_state_layout(_Dropping())
    check_state_layout(custom_ee.summit())


def test_export_refuses_an_unknown_rule_before_writing_anything(tmp_path, monkeypatch):
    monkeypatch.setattr(custom_ee, "unknown_rule", lambda: custom_ee.SummitEE(rule={"kind": "margin_agree"}),
                        raising=False)
    with pytest.raises(ExportError, match="unknown exit rule 'margin_agree'"):
        export_repository("custom_ee:unknown_rule", None, tmp_path / "repo", progress=False)
    assert not (tmp_path / "repo").exists() or not any((tmp_path / "repo").iterdir())


def test_export_checks_the_rule_against_pytorch(tmp_path, monkeypatch):
    monkeypatch.setattr(custom_ee, "forgetful", lambda: custom_ee.SummitEE(rule=ForgetfulRule()), raising=False)
    with pytest.raises(ExportError, match="answers .* example inputs unlike PyTorch"):
        export_repository("custom_ee:forgetful", None, tmp_path / "repo", progress=False)
    assert not (tmp_path / "repo").exists()      # a failed export removes what it wrote, the folder it made too
