"""A user's own early-exit model (tests/custom_ee.py, not a zoo model) through the public interface only: its
stateful exit rule lives in a module of its own (tests/custom_rule.py), which export ships to Triton; its
state has a tensor only the ramps read (``summ``: the final block's graph drops it) and one block 2 overwrites
without reading (``scratch``: block 2's graph drops it). The router and ``<m>_ee`` answer every input as the
PyTorch reference does (label, exit ramp, probabilities) with constant splits, a compact split and mixed,
and the same network under the entropy rule in the composed one-graph form."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from e3.client.sdk import E3Client
from e3.controller.triton_api import TritonControl
from e3.core.exits import make_exit_rule
from e3.core.plan import COMPACT, CONSTANT, DEVICE, Plan, default_plan
from e3.core.manifest import read_manifest
from e3.models.reference import reference_answers
from e3.export.repository import ExportSettings, export_repository
from e3.models.zoo import resolve_model
from helpers import serving

pytestmark = pytest.mark.e2e
CUSTOM, ENTROPY = "custom_ee:summit", "custom_ee:summit_entropy"


@pytest.fixture(scope="module")
def summit_server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("summit-repo")
    settings = ExportSettings(slo_ms=10_000.0, batch_size=8)
    export_repository(CUSTOM, "1,3", repo, settings=settings, progress=False)
    export_repository(ENTROPY, "2", repo, settings=replace(settings, baselines=True), progress=False)
    with serving(repo, name="summit") as server:
        yield server, repo


def _ask(url, model, x, sizes):
    """Send ``x`` in requests of ``sizes`` rows; (label, exit_ramp, probs) in input order."""
    out, at = [], 0
    with E3Client(url) as client:
        for n in sizes:
            out.append(client.infer(model, {"x": x[at:at + n]}))
            at += n
    return (np.concatenate([a.label for a in out]), np.concatenate([a.exit_ramp for a in out]),
            np.concatenate([a.probs for a in out]))


def _check(got, ref):
    label, ramp, probs = got
    clear = ref.min_margin > 1e-5
    assert (~clear).sum() <= 2, f"{(~clear).sum()} inputs in the tie band"
    assert (label[clear] == ref.label[clear]).all()
    assert (ramp[clear] == ref.exit_ramp[clear]).all()
    np.testing.assert_allclose(probs[clear], ref.probs[clear], atol=1e-5)
    assert len(set(ramp.tolist())) >= 3, "inputs exit at several ramps"


def _plan(card, m, ranges, forms, enabled=None):
    plan = default_plan(m, card.num_blocks, ranges, exit_rule=card.exit_rule, ramp_blocks=card.ramp_blocks,
                        batch_size=8, slo_ms=10_000.0)
    return replace(plan, splits=tuple(replace(s, form=f, enabled_ramps=tuple(
        k for k in s.enabled_ramps if enabled is None or k in enabled)) for s, f in zip(plan.splits, forms)))


@pytest.mark.parametrize("model_name, m, ranges, forms, enabled", [
    (CUSTOM, "summit", [(1, 1), (2, 3), (4, 4)], [CONSTANT] * 3, None),        # E3's form: three split models
    (CUSTOM, "summit", [(1, 4)], [COMPACT], None),                              # the router's compact split
    (CUSTOM, "summit", [(1, 1), (2, 4)], [CONSTANT, COMPACT], (1, 3)),          # mixed, ramp 2 disabled
    (ENTROPY, "summit_entropy", [(1, 4)], [COMPACT], None),                     # composed into one graph
    (ENTROPY, "summit_entropy", [(1, 2), (3, 4)], [CONSTANT, CONSTANT], None),
    # the device form (docs/design.md §2b) on this CPU: the router runs the model it shipped (module + weights)
    (CUSTOM, "summit", [(1, 1), (2, 3), (4, 4)], [DEVICE] * 3, None),
    (CUSTOM, "summit", [(1, 2), (3, 4)], [DEVICE] * 2, (1, 3)),
    (ENTROPY, "summit_entropy", [(1, 4)], [DEVICE], None),
])
def test_the_router_answers_like_pytorch_in_every_form(summit_server, model_name, m, ranges, forms, enabled):
    server, repo = summit_server
    model = resolve_model(model_name)
    card = model.card
    plan = _plan(card, m, ranges, forms, enabled)
    with TritonControl(server.http_url) as control:
        for split in plan.triton_splits:
            control.load(split.model)
        control.switch_plan(f"{m}_router", plan)
    x = model.example_arrays(120, seed=5)["x"]
    ref = reference_answers(model, (x,), make_exit_rule(card.exit_rule), enabled_ramps=plan.enabled_ramps)
    _check(_ask(server.http_url, f"{m}_router", x, [1, 7, 16, 3, 32, 5, 24, 32]), ref)
    if plan.on_device:   # served by the device router, from the module and weights export shipped
        assert f"{m} device router: {len(ranges)} splits" in server.log_file.read_text()


@pytest.mark.parametrize("model_name, m, form", [(CUSTOM, "summit", "block by block"),
                                                  (ENTROPY, "summit_entropy", "composed")])
def test_the_in_process_baseline_answers_like_pytorch(summit_server, model_name, m, form):
    server, repo = summit_server
    model = resolve_model(model_name)
    x = model.example_arrays(120, seed=6)["x"]
    ref = reference_answers(model, (x,), make_exit_rule(model.card.exit_rule))
    _check(_ask(server.http_url, f"{m}_ee", x, [4, 16, 1, 32, 27, 8, 32]), ref)
    assert f"{m}_ee: blocks 1-4 run {form}" in server.log_file.read_text()


def test_export_recorded_what_each_part_reads_and_shipped_the_rule(summit_server):
    server, repo = summit_server
    io = read_manifest(repo)["deployments"]["summit"]["part_io"]
    assert io["block_2.onnx"]["reads"] == ["h", "summ"]              # scratch: overwritten, never read
    assert io["block_4.onnx"]["reads"] == ["h"]                      # summ and scratch: only ramps read them
    assert io["summit_split_4-4"]["reads"] == ["h"]
    assert sorted(io["summit_split_2-3"]["reads"]) == ["h", "summ"]
    assert (repo / "summit_router" / "1" / "e3_rules" / "custom_rule.py").is_file()
    # the device form's model: the user's module (the stub ignores PYTHONPATH) and the weights
    assert (repo / "summit_router" / "1" / "e3_models" / "custom_ee.py").is_file()
    assert (repo / "summit_router" / "1" / "weights.safetensors").is_file()
    assert (repo / "summit_ee" / "1" / "e3_rules" / "custom_rule.py").is_file()
    assert not (repo / "summit_entropy_router" / "1" / "e3_rules").exists()   # a built-in rule ships nothing
