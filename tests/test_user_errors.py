"""Errors a user serving their own model can act on (issue 41, "Serve your own model"): each names the cause
and the fix. Unit tests, no server: the rule's checked call, the exact cast of inputs, the warning about a rule
module that imports torch, a failed export that leaves the repository as it found it, the load report's exit
comparison, the evaluation plot of a rule without a sweep, and --out on the commands that write results."""

from __future__ import annotations

import numpy as np
import pytest

from e3.core.exits import ExitRule, exit_mask
from e3.serving.policy import BatchRoute


class _IntRule(ExitRule):
    """Returns 0/1 integers: the walk-through user's first rule."""

    def decide(self, block, logits, state, rows):
        return (logits[:, 0] > 0).astype(np.int64)


class _ShapeRule(ExitRule):
    """Returns one decision for the whole batch."""

    def decide(self, block, logits, state, rows):
        return bool(logits[:, 0].mean() > 0)


class _ColumnRule(ExitRule):
    """Returns a column [len(rows), 1]."""

    def decide(self, block, logits, state, rows):
        return (logits[:, :1] > 0)


def _route(rule, n=3):
    return BatchRoute(n, 2, 3, rule)


def test_a_rule_returning_integers_is_told_to_return_booleans():
    logits = np.array([[1.0, 0.0], [-1.0, 0.0], [2.0, 0.0]], np.float32)
    with pytest.raises(ValueError, match=r"decide\(\) at ramp 1 returned a int64 array of shape \[3\]; expected a "
                                         r"boolean array of shape \[len\(rows\)\] = \[3\]: integers are read as row "
                                         r"numbers, not decisions"):
        _route(_IntRule()).observe({1: logits})


@pytest.mark.parametrize("rule, what", [(_ShapeRule(), "bool True"), (_ColumnRule(), r"bool array of shape \[3, 1\]")])
def test_a_wrong_shaped_decision_names_the_expected_shape_and_what_came_back(rule, what):
    logits = np.array([[1.0, 0.0], [-1.0, 0.0], [2.0, 0.0]], np.float32)
    with pytest.raises(ValueError, match=rf"returned a {what}; expected a boolean array of shape \[len\(rows\)\] "
                                         r"= \[3\]: return one bool per row"):
        _route(rule).observe({1: logits})


def test_a_boolean_decision_passes_unchanged():
    class Good(ExitRule):
        def decide(self, block, logits, state, rows):
            return logits[:, 0] > 0
    mask = exit_mask(Good(), 1, np.array([[1.0, 0], [-1.0, 0]]), {}, np.arange(2))
    assert mask.dtype == np.bool_ and mask.tolist() == [True, False]


# --- inputs in numpy's default float64 ---------------------------------------------------------------------

def test_float64_inputs_holding_float32_values_are_cast_for_the_model():
    from e3.client.sdk import typed_inputs
    x = np.array([[0.5, -2.0], [1.25, 3.0]])                      # float64, every value a float32 value
    ids = np.array([[1, 2]], dtype=np.int32)
    out = typed_inputs({"x": x, "ids": ids}, {"x": "TYPE_FP32", "ids": "TYPE_INT64"})
    assert out["x"].dtype == np.float32 and out["ids"].dtype == np.int64
    np.testing.assert_array_equal(out["x"], x)


def test_float64_inputs_that_would_round_are_refused_with_the_reason_and_the_fix():
    from e3.client.sdk import ClientError, typed_inputs
    x = np.array([[0.5, 0.1]])                                     # 0.1 is no float32
    with pytest.raises(ClientError, match=r"input 'x' is float64 and the model takes FP32 \(float32\): 1 of its 2 "
                                          r"values would change in the conversion \(row 0: 0\.1 -> 0\.1\d*\); send "
                                          r"float32 yourself \(`x\.astype\(np\.float32\)`\)"):
        typed_inputs({"x": x}, {"x": "TYPE_FP32"})


def test_a_data_file_goes_through_the_same_cast(tmp_path):
    from e3.core.spec import ModelCard, TensorSpec
    from e3.models.user_data import DataError, load_data
    card = ModelCard(name="t", num_blocks=2, ramp_blocks=(1,), num_classes=2,
                     inputs=(TensorSpec("x", "FP32", (2,)),), state=(TensorSpec("h", "FP32", (2,)),),
                     exit_rule={"kind": "entropy", "tau_nats": 0.1})
    np.savez(tmp_path / "ok.npz", x=np.ones((3, 2)), labels=np.zeros(3, np.int64))
    (x,), _ = load_data(tmp_path / "ok.npz", card)
    assert x.dtype == np.float32
    np.savez(tmp_path / "bad.npz", x=np.full((3, 2), 1e-50), labels=np.zeros(3, np.int64))
    with pytest.raises(DataError, match=r"bad\.npz: input 'x' is float64 and the model takes FP32 \(float32\): 6 of "
                                        r"its 6 values would change"):
        load_data(tmp_path / "bad.npz", card)


# --- a rule module that imports torch ------------------------------------------------------------------------

def test_export_warns_when_a_rule_module_imports_torch(tmp_path, monkeypatch, caplog):
    import logging
    import sys
    from e3.export.rules import check_shipped, resolve_rule, ship_rule
    src = tmp_path / "src"
    src.mkdir()
    (src / "torchy_rule.py").write_text(
        "import numpy as np\nimport torch  # noqa: F401\nfrom e3.core.exits import ExitRule\n\n"
        "class Rule(ExitRule):\n    def decide(self, block, logits, state, rows):\n"
        "        return np.zeros(len(rows), bool)\n")
    monkeypatch.syspath_prepend(str(src))
    rule = resolve_rule({"kind": "torchy_rule:Rule"})
    ship_rule(rule, tmp_path / "v")
    with caplog.at_level(logging.WARNING, logger="e3.export.rules"):
        check_shipped(rule, tmp_path / "v")
    sys.modules.pop("torchy_rule", None)
    assert ("exit rule torchy_rule:Rule: its module torchy_rule imports torch, which then loads in every serving "
            "process that runs the rule: about 200 MB more in each of the router's and <m>_ee's processes "
            "(measured: 248 and 281 MB against 51 and 82 MB)") in caplog.text
    assert "imports only numpy and e3" in caplog.text


def test_a_numpy_only_rule_module_gets_no_warning(tmp_path, caplog):
    import logging
    from e3.export.rules import check_shipped, resolve_rule, ship_rule
    rule = resolve_rule({"kind": "custom_rule:MeanAgreeRule", "margin": 0.3, "num_classes": 3})
    ship_rule(rule, tmp_path)
    with caplog.at_level(logging.WARNING, logger="e3.export.rules"):
        check_shipped(rule, tmp_path)
    assert "imports torch" not in caplog.text


# --- a failed export --------------------------------------------------------------------------------------------

def _snapshot(folder):
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else None) for p in sorted(folder.rglob("*"))}


def test_a_failed_export_leaves_the_repository_as_it_found_it(tmp_path, monkeypatch):
    """The walk-through's failure: split models written, then the router's rule check fails. Before, the split
    models and a manifest listing them stayed (and `e3 serve` loaded them without a router)."""
    import json
    import custom_ee
    from custom_rule import ForgetfulRule
    from e3.core.manifest import MANIFEST
    from e3.export.repository import ExportError, export_repository
    monkeypatch.setattr(custom_ee, "forgetful", lambda: custom_ee.SummitEE(rule=ForgetfulRule()), raising=False)
    repo = tmp_path / "repo"
    (repo / "forgetful_split_1-2" / "1").mkdir(parents=True)      # an earlier export's split, to be replaced
    (repo / "forgetful_split_1-2" / "1" / "model.onnx").write_bytes(b"the earlier split")
    (repo / "notes.txt").write_text("the user's own file")
    (repo / MANIFEST).write_text(json.dumps({"created_by": "e3", "deployments": {},
                                             "models": {"forgetful_split_1-2": {"kind": "split"}}}))
    before = _snapshot(repo)
    with pytest.raises(ExportError, match="unlike PyTorch"):
        export_repository("custom_ee:forgetful", [2], repo, progress=False)
    assert _snapshot(repo) == before                                # split 3-4 gone, split 1-2 and manifest back


# --- e3 load's exit comparison ----------------------------------------------------------------------------------

def test_the_exit_comparison_says_which_ramps_the_workload_was_recorded_with():
    from collections import Counter
    from e3.client.loadgen import LoadResult
    from e3.client.report import exit_comparison
    result = LoadResult("summit_patience_router", inputs=1000, labelled=1000, exit_mismatches=412,
                        exit_counts=Counter({2: 600, 5: 400}), reference_ramps=[1, 2, 3, 4])
    text = exit_comparison(result)
    assert text.startswith("exit ramps differing from the workload's reference: 412 of 1000 (served exits 2:60% "
                           "5:40%). The reference was recorded with ramps 1, 2, 3, 4 enabled; a plan that disables "
                           "ramps moves the exits of inputs that would leave there to later ramps")
    result.reference_ramps = None                                  # a workload written before it said
    assert "recorded with every ramp of the model (the workload does not list them)" in exit_comparison(result)


def test_a_workload_file_carries_its_ramps_to_the_load_generator(tmp_path):
    import json
    from e3.client.workloads import load_workload
    np.savez(tmp_path / "w.npz", x=np.zeros((2, 3), np.float32), exit_ramp=np.array([1, 5]), label=np.array([0, 1]),
             hard=np.array([False, True]))
    (tmp_path / "w.json").write_text(json.dumps({"inputs": ["x"], "enabled_ramps": [1, 2, 3, 4],
                                                 "phases": [{"mix": "all", "start_index": 0, "count": 2}]}))
    assert load_workload(tmp_path / "w.npz").meta["enabled_ramps"] == [1, 2, 3, 4]


# --- e3 evaluate's plot for a rule of one's own ----------------------------------------------------------------

def test_a_custom_rules_evaluation_plot_has_no_empty_panel():
    from e3.models.evaluate import Evaluation, evaluation_figure
    ev = Evaluation("summit:summit", 5, {"kind": "summit_rules:MarginAgree", "min_gap": 0.6, "num_classes": 4},
                    {"accuracy": 0.9, "exit_share": {1: 0.5, 5: 0.5}, "blocks_fraction": 0.6}, None, 0.92, [])
    fig = evaluation_figure(ev)
    left, right = fig.axes
    assert left.has_data() and right.has_data()
    assert [t.get_text() for t in left.get_xticklabels()] == ["EE accuracy", "compute saved", "head alone"]
    assert left.get_xlabel() == "at the rule summit_rules:MarginAgree (its own parameters: no threshold to sweep)"
    assert [round(p.get_height(), 1) for p in left.patches] == [90.0, 40.0, 92.0]


# --- --out on the commands that write results --------------------------------------------------------------------

@pytest.mark.parametrize("argv", [["evaluate", "m"], ["workload", "m"], ["profile", "m"],
                                  ["plan", "--latency-profile", "p.json", "--reach", "1", "--devices", "cpu:2", "--slo-ms", "9"],
                                  ["bench", "side-by-side"], ["bench", "simulator"], ["bench", "gpu"]])
def test_commands_that_write_results_take_out(argv):
    from e3.cli.main import build_parser
    assert build_parser().parse_args([*argv, "--out", "elsewhere"]).out == "elsewhere"


# --- e3 serve on a repository with nothing to load ---------------------------------------------------------------

def test_serve_refuses_a_repository_whose_manifest_lists_no_deployment(tmp_path):
    """What an export that failed before this fix left: models in the manifest, no deployment. e3 serve started,
    loaded 0 models and said nothing; now it exits (ServerError: the CLI prints it, exit 2) before starting."""
    import json
    import threading
    from e3.core.manifest import MANIFEST
    from e3.deploy.serve import serve_until_stopped
    from e3.deploy.server import ServerError
    (tmp_path / MANIFEST).write_text(json.dumps({"created_by": "e3", "deployments": {},
                                                 "models": {"m_split_1-2": {"kind": "split"}}}))
    with pytest.raises(ServerError, match=r"has no model to load: its manifest lists no deployment \(an export that "
                                          r"did not finish writes none\); run `e3 export MODEL` again, or name the "
                                          r"models with --models"):
        serve_until_stopped(tmp_path, None, threading.Event(), host="127.0.0.1", http_port=1, grpc_port=1,
                            metrics_port=1, tritonserver=None, timeout_s=1, headers=None)
