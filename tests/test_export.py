"""Export: parity of every legal cut, disabled ramps, configs against Triton's schema, bad input."""

import itertools
import json
import os
from pathlib import Path

import numpy as np
import onnx
import pytest

from e3.core.names import CutError
from e3.models.api import SplitModule
from e3.export.onnx_export import ParityError, check_parity, export_onnx
from e3.core.manifest import MANIFEST
from e3.export.repository import ExportError, ExportSettings, export_repository
from e3.export.triton_config import parse_config, render_config
from e3.models.zoo import UnknownModelError

GOLDEN = Path(__file__).parent / "golden"


def _all_cut_sets(L):
    for r in range(L):
        yield from itertools.combinations(range(1, L), r)


def test_every_legal_cut_of_the_tiny_model_exports_with_parity(tiny_model, tmp_path):
    """Every contiguous block range exports (parity against its PyTorch split is checked on export), and
    for every legal cut set the exported ONNX files, chained in ONNX Runtime with each split's state
    outputs fed to the next, give every ramp's and the head's logits of the unsplit PyTorch model."""
    import onnxruntime as ort
    import torch
    from e3.core.names import ramp_output, state_output
    L, ramps = tiny_model.card.num_blocks, tiny_model.card.ramp_blocks
    for a in range(1, L + 1):
        for b in range(a, L + 1):
            export_onnx(SplitModule(tiny_model, a, b, ramps), tmp_path / f"{a}-{b}.onnx", max_batch_size=16)
    assert sorted(p.name for p in tmp_path.glob("*.onnx")) == sorted(
        f"{a}-{b}.onnx" for a in range(1, L + 1) for b in range(a, L + 1))
    x = tiny_model.example_inputs(5, seed=11)
    whole = SplitModule(tiny_model, 1, L, ramps)
    with torch.no_grad():
        expected = dict(zip(whole.output_names, (t.numpy() for t in whole(*x))))
    state_names = [t.name for t in tiny_model.card.state]
    for cuts in _all_cut_sets(L):
        edges = [0, *cuts, L]
        feed = {t.name: v.numpy() for t, v in zip(tiny_model.card.inputs, x)}
        logits = {}
        for a, b in zip(edges[:-1], edges[1:]):
            session = ort.InferenceSession(str(tmp_path / f"{a + 1}-{b}.onnx"), providers=["CPUExecutionProvider"])
            names = [o.name for o in session.get_outputs()]
            out = dict(zip(names, session.run(names, feed)))
            logits.update({k: v for k, v in out.items() if k.startswith("ramp_")})
            feed = {n: out[state_output(n)] for n in state_names} if b < L else None
        assert sorted(logits) == sorted(ramp_output(k) for k in (*ramps, L)), cuts
        for name, want in expected.items():
            if name.startswith("ramp_"):
                np.testing.assert_allclose(logits[name], want, rtol=1e-4, atol=1e-5, err_msg=f"cuts {cuts}: {name}")


def test_disabled_ramp_is_not_computed(tiny_model, tmp_path):
    split = SplitModule(tiny_model, 1, 3, ramps=(2,))
    export_onnx(split, tmp_path / "s.onnx", max_batch_size=4)
    graph = onnx.load(str(tmp_path / "s.onnx")).graph
    assert [o.name for o in graph.output] == ["hidden_out", "attention_mask_out", "ramp_2"]
    # Only one ramp's classifier weights are in the file.
    classifiers = [i.name for i in graph.initializer if "classifier.weight" in i.name]
    assert classifiers == ["model.ramps.2.classifier.weight"]


def test_parity_failure_is_loud(tiny_model, tmp_path):
    split = SplitModule(tiny_model, 1, 1, ramps=(1,))
    path = tmp_path / "s.onnx"
    export_onnx(split, path, max_batch_size=2)
    model = onnx.load(str(path))
    weight = next(i for i in model.graph.initializer if i.name == "model.ramps.1.classifier.weight")
    weight.raw_data = (np.frombuffer(weight.raw_data, np.float32) * 1.01).tobytes()
    onnx.save(model, str(path))
    with pytest.raises(ParityError, match="ramp_1 at batch 1 differs"):
        check_parity(split, path, split.output_names)


def test_repository_layout_and_manifest(tiny_repo):
    names = sorted(p.name for p in tiny_repo.iterdir() if p.is_dir())
    assert names == ["tiny_ee_ee", "tiny_ee_router", "tiny_ee_split_1-2", "tiny_ee_split_3-4", "tiny_ee_stock"]
    manifest = json.loads((tiny_repo / MANIFEST).read_text())
    assert set(manifest["models"]) == set(names)
    plan = manifest["deployments"]["tiny_ee"]["plan"]
    assert [s["model"] for s in plan["splits"]] == ["tiny_ee_split_1-2", "tiny_ee_split_3-4"]
    assert not [p for p in tiny_repo.iterdir() if p.name.startswith(".")]  # no staging leftovers


def test_every_rendered_config_parses_as_triton_modelconfig(tiny_repo):
    for config in tiny_repo.glob("*/config.pbtxt"):
        parsed = parse_config(config.read_text())
        assert parsed.name == config.parent.name
        assert parsed.max_batch_size == 64
        assert parsed.parameters["e3_owner"].string_value == "e3"
    router = parse_config((tiny_repo / "tiny_ee_router" / "config.pbtxt").read_text())
    assert [o.name for o in router.output] == ["label", "exit_ramp", "probs"]
    assert router.instance_group[0].count == 1   # one scheduler sees every request


@pytest.mark.parametrize("target", ["embedded", "ngc"])
def test_split_config_matches_golden(tiny_repo, target, tmp_path):
    if target == "embedded":
        text = (tiny_repo / "tiny_ee_split_1-2" / "config.pbtxt").read_text()
    else:
        export_repository("tiny-ee", "2", tmp_path, settings=ExportSettings(target="ngc"), progress=False)
        text = (tmp_path / "tiny_ee_split_1-2" / "config.pbtxt").read_text()
        assert not (tmp_path / "tiny_ee_split_1-2" / "1" / "model.py").exists()
    golden = GOLDEN / f"tiny_ee_split_1-2.{target}.pbtxt"
    if os.environ.get("E3_UPDATE_GOLDEN"):
        golden.write_text(text)
    assert text == golden.read_text()
    assert parse_config(text).name == "tiny_ee_split_1-2"


def test_render_rejects_unknown_target():
    from e3.export.triton_config import ModelDescription
    with pytest.raises(ValueError, match="unknown target"):
        render_config(ModelDescription("x", "onnx", 8, (), ()), target="k8s")


def test_bad_cuts_unknown_model_unowned_dir_and_unwritable_repo(tmp_path):
    with pytest.raises(CutError, match="out of range"):
        export_repository("tiny-ee", "7", tmp_path, progress=False)
    with pytest.raises(UnknownModelError, match="unknown model 'nope'"):
        export_repository("nope", "1", tmp_path, progress=False)
    (tmp_path / "tiny_ee_router").mkdir()  # someone else's model
    with pytest.raises(ExportError, match="not created by e3"):
        export_repository("tiny-ee", "2", tmp_path, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny_ee_router"]  # nothing written
    if os.geteuid() != 0:  # root can write anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(ExportError, match="cannot write"):
            export_repository("tiny-ee", "2", locked / "repo", progress=False)
    with pytest.raises(ExportError, match="cannot write"):
        export_repository("tiny-ee", "2", Path("/proc/e3-repo"), progress=False)


def test_user_model_by_module_factory(tmp_path):
    from e3.models.zoo import resolve_model
    model = resolve_model("e3.models.zoo.tiny:build_tiny_ee")
    assert model.card.num_blocks == 4
    with pytest.raises(UnknownModelError, match="cannot import"):
        resolve_model("no_such_pkg.mod:factory")


@pytest.mark.parametrize("family", ["minilm", "resnet"])
def test_zoo_architectures_export_a_few_cuts_with_parity(family, tmp_path):
    """bert-ee/pabee (MiniLM encoder, mean-pooled ramps) and resnet-ee (state shapes change per cut):
    a few splits each, random weights (parity does not depend on training)."""
    import torch
    torch.manual_seed(0)
    if family == "minilm":
        from e3.models.zoo.encoder import EncoderEE
        from e3.models.zoo.minilm import minilm_config
        model = EncoderEE("m", minilm_config(), exit_rule={"kind": "entropy", "tau_nats": 0.3}).eval()
    else:
        from e3.models.zoo.resnet import ResNetEE
        model = ResNetEE("r", {"kind": "entropy", "tau_nats": 0.3}).eval()
    for first, last in ((1, 2), (3, 5), (6, 6)):
        split = SplitModule(model, first, last, model.card.ramp_blocks)
        export_onnx(split, tmp_path / f"{first}-{last}.onnx", max_batch_size=8)
        graph = onnx.load(str(tmp_path / f"{first}-{last}.onnx")).graph
        assert [o.name for o in graph.output] == split.output_names
