"""HELIOS's decisions (generation/helios.py), pure: evaluation, partial depth, the breach counter's two
decisions, re-assessment, and the memory arithmetic."""

from __future__ import annotations

import pytest

from e3.generation.helios import Candidate, HeliosController, HeliosSettings, check_candidates

A = Candidate("a", exits=(1, 2), num_layers=4, layer_bytes=100, base_bytes=1000, head_bytes=10, kv_bytes=2,
              head_cost=0.5)
B = Candidate("b", exits=(1, 2), num_layers=4, layer_bytes=100, base_bytes=1000, head_bytes=10, kv_bytes=2,
              head_cost=0.5)


def settings(**kw):
    base = dict(candidates=(A, B), tau=0.5, eval_prompts=2, ri=50, cbc_max=5, window=10, switch_gain=1.25,
                min_tokens=1000)
    return HeliosSettings(**{**base, **kw})


def seq(exit_layer: int, conf: float, n: int = 8, first_conf: float = 1.0):
    """A finished sequence: the prefill token from the last head, then n-1 tokens leaving at exit_layer."""
    return [4] + [exit_layer] * (n - 1), [first_conf] + [conf] * (n - 1)


def evaluate(ctl: HeliosController, a_seq, b_seq, tps=(100.0, 100.0)):
    """Run Step 2: the router routes eval requests and reports them; both candidates measured at ``tps``."""
    for _ in range(4):
        config, is_eval = ctl.route()
        assert is_eval and config[1] == 4
        exits, confs = a_seq if config[0] == "a" else b_seq
        ctl.observe_time(config, len(exits), len(exits) / tps[config[0] == "b"])
        decision = ctl.observe(config, exits, confs, evaluation=True)
    return decision


def test_memory_counts_loaded_layers_heads_and_kv():
    assert A.weight_bytes(1) == 1000 + 100 + 10
    assert A.weight_bytes(4) == 1000 + 400 + 20
    assert A.sequence_bytes(16, 2) == 16 * 2 * 2
    with pytest.raises(ValueError, match="depth 3 is not an exit layer"):
        A.weight_bytes(3)
    check_candidates(HeliosSettings(candidates=(A,), memory_bytes=1420 + 16 * 4 * 2), 16)
    with pytest.raises(ValueError, match="candidate a needs"):
        check_candidates(HeliosSettings(candidates=(A,), memory_bytes=1420 + 16 * 4 * 2 - 1), 16)


def test_token_cost_counts_layers_and_heads_read():
    assert A.token_cost(1) == 1 + 0.5            # left at the first ramp: one head read
    assert A.token_cost(4) == 4 + 3 * 0.5        # two ramps and the final head
    assert A.token_cost(4, depth=2) == 2 + 2 * 0.5   # forced out at the last loaded head
    assert A.token_cost(1, depth=2) == 1 + 0.5


def test_evaluation_chooses_the_shallowest_feasible_depth_of_the_fastest_candidate():
    ctl = HeliosController(settings())
    assert ctl.evaluating
    d = evaluate(ctl, seq(1, 0.9), seq(4, 0.9))       # a leaves at layer 1; b needs every layer
    assert d.kind == "choose" and ctl.chosen == ("a", 1)
    assert ctl.partial_depth("b") == 4
    (breach, tps), (_, tps_b) = ctl.predicted(("a", 1)), ctl.predicted(("b", 4))
    # one pooled calibration (seconds per layer-equivalent): the ratio is the cost model's
    assert breach == 0 and tps / tps_b == pytest.approx(B.token_cost(4) / A.token_cost(1, 1))
    assert ctl.route() == (("a", 1), False)


def test_breaches_on_a_partial_model_load_the_rest_when_no_switch_pays():
    ctl = HeliosController(settings())
    evaluate(ctl, seq(1, 0.9), seq(4, 0.9))
    for _ in range(2):                                  # the stream turns hard for a's first exit
        d = ctl.observe(("a", 1), *seq(1, 0.1, n=4))
    assert d.kind == "load_rest" and d.before == ("a", 1) and d.after == ("a", 4)
    assert ctl.chosen == ("a", 4) and ctl.cbc == 0     # the counter restarts


def test_breaches_switch_when_the_other_candidate_is_predicted_faster():
    cheap_b = Candidate("b", exits=(1, 2), num_layers=4, layer_bytes=100, base_bytes=1000, head_bytes=10, kv_bytes=2,
                        head_cost=0.1)
    ctl = HeliosController(settings(candidates=(A, cheap_b)))
    half = ([4] + [1, 4] * 4, [1.0] + [0.9] * 8)       # b: half its tokens leave at layer 1
    evaluate(ctl, seq(1, 0.9), half)
    # b up to layer 1: breach rate 0.5 (= the tolerance), cost 1.1 per token < a up to layer 1, 1.5
    assert ctl.chosen == ("b", 1) and ctl.predicted(("b", 1))[0] == 0.5
    ctl.observe(("b", 1), *seq(1, 0.1, n=4))
    d = ctl.observe(("b", 1), *seq(1, 0.1, n=4))
    # the rest of b costs (1.1 + 4.3) / 2 = 2.7 per token, a up to layer 1 1.5: more than switch_gain apart
    assert d.kind == "switch" and d.after == ("a", 1)
    assert ctl.route() == (("a", 1), False)


def test_a_row_measured_long_enough_speaks_for_itself():
    ctl = HeliosController(settings(min_tokens=10))
    evaluate(ctl, seq(1, 0.9), seq(4, 0.9))
    ctl.observe_time(("a", 1), 40, 2.0)
    ctl.observe(("a", 1), [1] * 40, [0.1] * 20 + [0.9] * 20)
    assert ctl.predicted(("a", 1)) == (0.5, 20.0)


def test_a_whole_model_never_breaches():
    ctl = HeliosController(settings())
    evaluate(ctl, seq(4, 0.9), seq(4, 0.9))
    assert ctl.chosen == ("a", 4)
    for _ in range(5):                                  # unsure even at its final head: the final head answers
        assert ctl.observe(("a", 4), *seq(4, 0.01, n=4)) is None
    assert ctl.cbc == 0 and ctl.chosen == ("a", 4)


def test_tokens_within_tolerance_do_not_trigger():
    ctl = HeliosController(settings())
    evaluate(ctl, seq(1, 0.9), seq(4, 0.9))
    for _ in range(10):                                 # 5 breaches in every 10 tokens: not more than cbc_max
        assert ctl.observe(("a", 1), [1] * 10, [0.1, 0.9] * 5) is None
    assert ctl.chosen == ("a", 1)


def test_re_assessment_after_ri_prompts():
    ctl = HeliosController(settings(ri=3))
    evaluate(ctl, seq(1, 0.9), seq(4, 0.9))
    assert ctl.observe(("a", 1), *seq(1, 0.9)) is None
    assert ctl.observe(("a", 1), *seq(1, 0.9)) is None
    d = ctl.observe(("a", 1), *seq(1, 0.9))
    assert d.kind == "evaluate" and ctl.pht == {}
    assert ctl.route() == (("a", 4), True)             # Step 2 again, on the live stream
    assert ctl.chosen == ("a", 1)                       # still serving the others meanwhile


def test_requests_wait_on_the_last_candidate_until_evaluation_finishes():
    ctl = HeliosController(settings())
    for _ in range(4):
        ctl.route()
    assert ctl.route() == (("b", 4), False)
    assert ctl.chosen is None


def test_settings_are_checked():
    with pytest.raises(ValueError, match="at least one candidate"):
        HeliosSettings(candidates=()).validate()
    with pytest.raises(ValueError, match="names repeat"):
        HeliosSettings(candidates=(A, A)).validate()
    with pytest.raises(ValueError, match="cbc_max"):
        settings(cbc_max=10).validate()
    with pytest.raises(ValueError, match="tau"):
        settings(tau=2.0).validate()


def test_export_helios_writes_the_front_door_and_refuses_what_cannot_work(tmp_path, capsys):
    import json

    from e3.cli import main
    assert main(["export-helios", "tiny-helios-a", "tiny-helios-b", "--repo", str(tmp_path), "--memory-mb", "1",
                 "--tau", "0.5"]) == 0
    from e3.export.triton_config import parse_config
    config = parse_config((tmp_path / "helios_generate" / "config.pbtxt").read_text())
    doc = json.loads(config.parameters["helios"].string_value)
    assert [c["candidate"]["name"] for c in doc["candidates"]] == ["tiny_helios_a", "tiny_helios_b"]
    assert doc["settings"]["memory_bytes"] == 2**20 and doc["settings"]["tau"] == 0.5
    assert (tmp_path / "tiny_helios_a_kv_split_1-1").is_dir() and (tmp_path / "helios_only_tiny_helios_b").is_dir()
    capsys.readouterr()
    assert main(["export-helios", "tiny-helios-a", "--repo", str(tmp_path), "--memory-mb", "0.01"]) == 2
    assert "candidate tiny_helios_a needs" in capsys.readouterr().err
    assert main(["export-helios", "no-such-model", "--repo", str(tmp_path)]) == 2
    assert "unknown generation model 'no-such-model'" in capsys.readouterr().err
