"""`e3 export tiny-ee --cuts 3 --target ngc --format onnx`: every config parses as Triton's ModelConfig
and matches its golden file (regenerate with E3_UPDATE_GOLDEN=1); the NGC Dockerfile names no registry."""

import json
import os
import re
from pathlib import Path

from google.protobuf import text_format

from e3.export.triton_config import parse_config

GOLDEN = Path(__file__).parent / "golden" / "ngc_cuts3"
ROOT = Path(__file__).resolve().parent.parent
MODELS = ("tiny_ee_split_1-3", "tiny_ee_split_4-4", "tiny_ee_router", "tiny_ee_stock", "tiny_ee_ee")


def _normalised(text: str) -> str:
    """The config with the plan's random plan_id and the model card (checked apart, against the
    model's own card, so that new card fields do not churn the goldens) replaced."""
    cfg = parse_config(text)
    if "model_card" in cfg.parameters:
        from e3.models.zoo import resolve_model
        assert json.loads(cfg.parameters["model_card"].string_value) == resolve_model("tiny-ee").card.to_dict()
        cfg.parameters["model_card"].string_value = "<model card>"
    if "plan" in cfg.parameters:
        plan = json.loads(cfg.parameters["plan"].string_value)
        plan["plan_id"] = "<plan_id>"
        cfg.parameters["plan"].string_value = json.dumps(plan, sort_keys=True)
    return text_format.MessageToString(cfg)


def test_ngc_onnx_export_of_cut_3_matches_golden_configs(tmp_path, capsys):
    from e3.cli import main
    assert main(["export", "tiny-ee", "--cuts", "3", "--target", "ngc", "--format", "onnx",
                 "--repo", str(tmp_path)]) == 0
    written = sorted(p.parent.name for p in tmp_path.glob("*/config.pbtxt"))
    assert written == sorted(MODELS)
    for name in MODELS:
        text = _normalised((tmp_path / name / "config.pbtxt").read_text())
        golden = GOLDEN / f"{name}.pbtxt"
        if os.environ.get("E3_UPDATE_GOLDEN"):
            golden.write_text(text)
        assert text == golden.read_text(), f"{name}: config differs from {golden}"
        cfg = parse_config(text)
        assert cfg.name == name and cfg.max_batch_size == 64
    for split in ("tiny_ee_split_1-3", "tiny_ee_split_4-4", "tiny_ee_stock"):
        cfg = parse_config((tmp_path / split / "config.pbtxt").read_text())
        assert cfg.platform == "onnxruntime_onnx" and not cfg.backend
        assert sorted(p.name for p in (tmp_path / split / "1").iterdir()) == ["model.onnx"]
    for python_model in ("tiny_ee_router", "tiny_ee_ee"):
        assert parse_config((tmp_path / python_model / "config.pbtxt").read_text()).backend == "python"
        assert (tmp_path / python_model / "1" / "model.py").exists()


def test_ngc_dockerfile_takes_the_image_as_an_argument_and_names_no_registry():
    text = (ROOT / "deploy" / "ngc" / "Dockerfile").read_text()
    assert re.search(r"^ARG TRITON_IMAGE=tritonserver$", text, re.M)
    assert re.search(r"^ARG TRITON_TAG=\d\d\.\d\d-py3$", text, re.M)
    assert "FROM ${TRITON_IMAGE}:${TRITON_TAG}" in text
    assert not re.search(r"\b[\w-]+\.(io|com|org)/", text)  # no registry host in the file
    assert "numpy==1.26.4" in text and "onnx==" in text and "onnxruntime==" in text   # tests/test_image_imports.py imports with them
