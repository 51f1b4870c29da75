"""TensorRT path: optimisation profile, builder config, engine writing (with a recording stand-in for
the tensorrt module), tensorrt_plan configs, `e3 export --format tensorrt`; the real build needs a GPU."""

import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from e3.core.spec import TensorSpec
from e3.export import tensorrt as trt_path
from e3.export.repository import ExportError, ExportSettings, export_repository
from e3.export.tensorrt import EngineSettings, ShapeProfile, TensorRTError, build_engine, configure_builder, \
    optimisation_profile
from e3.export.triton_config import ModelDescription, parse_config, render_config


class FakeTensorRT:
    """Records what the builder is asked; ``fp16_flag=False`` behaves like TensorRT 11 (no BuilderFlag.FP16)."""

    def __init__(self, fp16_flag=True, inputs=("input_ids", "attention_mask"), parse_ok=True, build_ok=True):
        self.calls = []
        self.__version__ = "10.fake" if fp16_flag else "11.fake"
        self.MemoryPoolType = SimpleNamespace(WORKSPACE="WORKSPACE")
        self.BuilderFlag = SimpleNamespace(**({"FP16": "FP16"} if fp16_flag else {}))
        fake = self

        class Logger:
            WARNING = "WARNING"

            def __init__(self, level):
                fake.calls.append(("logger", level))

        class Config:
            def set_memory_pool_limit(self, pool, size):
                fake.calls.append(("pool", pool, size))

            def set_flag(self, flag):
                fake.calls.append(("flag", flag))

            def add_optimization_profile(self, profile):
                fake.calls.append(("add_profile", profile))

        class Profile:
            def set_shape(self, name, lo, opt, hi):
                fake.calls.append(("shape", name, lo, opt, hi))

        class Network:
            num_inputs = len(inputs)

            def get_input(self, i):
                return SimpleNamespace(name=inputs[i])

        class Builder:
            def __init__(self, logger):
                pass

            def create_network(self, flags):
                fake.calls.append(("network", flags))
                return Network()

            def create_builder_config(self):
                return Config()

            def create_optimization_profile(self):
                return Profile()

            def build_serialized_network(self, network, config):
                fake.calls.append(("build",))
                return b"ENGINE" if build_ok else None

        class OnnxParser:
            num_errors = 0 if parse_ok else 1

            def __init__(self, network, logger):
                pass

            def parse_from_file(self, path):
                fake.calls.append(("parse", path))
                return parse_ok

            def get_error(self, i):
                return "Unsupported operator FancyOp"

        self.Logger, self.Builder, self.OnnxParser = Logger, Builder, OnnxParser


def test_optimisation_profile_from_the_model_card(tiny_model):
    card = tiny_model.card
    shapes = optimisation_profile(card.inputs, EngineSettings(opt_batch=8, max_batch=card.max_batch_size))
    assert shapes == [ShapeProfile("input_ids", (1, 16), (8, 16), (64, 16)),
                      ShapeProfile("attention_mask", (1, 16), (8, 16), (64, 16))]
    state = optimisation_profile(card.state, EngineSettings(opt_batch=4, max_batch=32))
    assert state[0] == ShapeProfile("hidden", (1, 16, 32), (4, 16, 32), (32, 16, 32))
    with pytest.raises(TensorRTError, match="only the batch may vary"):
        optimisation_profile([TensorSpec("x", "FP32", (-1, 4))], EngineSettings(1, 1))
    for bad in ((0, 4), (8, 4)):
        with pytest.raises(TensorRTError, match="min <= opt <= max"):
            EngineSettings(opt_batch=bad[0], max_batch=bad[1])


def test_builder_config_sets_workspace_fp16_and_the_profile():
    trt = FakeTensorRT()
    shapes = [ShapeProfile("x", (1, 3), (8, 3), (64, 3))]
    configure_builder(trt, trt.Builder(None), shapes, settings=EngineSettings(8, 64, fp16=True, workspace_mb=256))
    assert ("pool", "WORKSPACE", 256 << 20) in trt.calls
    assert ("flag", "FP16") in trt.calls
    assert ("shape", "x", (1, 3), (8, 3), (64, 3)) in trt.calls
    assert [c[0] for c in trt.calls].count("add_profile") == 1
    fp32 = FakeTensorRT()
    configure_builder(fp32, fp32.Builder(None), shapes, settings=EngineSettings(8, 64))
    assert not [c for c in fp32.calls if c[0] == "flag"]


def test_fp16_on_tensorrt_11_is_refused_with_the_reason():
    trt = FakeTensorRT(fp16_flag=False)
    with pytest.raises(TensorRTError, match="removed in TensorRT 11"):
        configure_builder(trt, trt.Builder(None), [], settings=EngineSettings(1, 1, fp16=True))


def test_build_engine_writes_the_plan_and_reports_failures(tiny_model, tmp_path):
    inputs = tiny_model.card.inputs
    trt = FakeTensorRT()
    plan = build_engine(tmp_path / "model.onnx", tmp_path / "1" / "model.plan", inputs, settings=EngineSettings(8, 64), trt=trt)
    assert plan.read_bytes() == b"ENGINE" and not list((tmp_path / "1").glob(".*"))
    assert ("network", 0) in trt.calls and ("build",) in trt.calls
    with pytest.raises(TensorRTError, match="cannot parse .*FancyOp"):
        build_engine(tmp_path / "m.onnx", tmp_path / "x.plan", inputs, settings=EngineSettings(1, 1), trt=FakeTensorRT(parse_ok=False))
    with pytest.raises(TensorRTError, match="has inputs"):
        build_engine(tmp_path / "m.onnx", tmp_path / "x.plan", inputs, settings=EngineSettings(1, 1),
                     trt=FakeTensorRT(inputs=("hidden", "attention_mask")))
    with pytest.raises(TensorRTError, match="could not build"):
        build_engine(tmp_path / "m.onnx", tmp_path / "x.plan", inputs, settings=EngineSettings(1, 1), trt=FakeTensorRT(build_ok=False))
    assert not (tmp_path / "x.plan").exists()


def test_tensorrt_config_is_a_gpu_tensorrt_plan_on_ngc_only():
    desc = ModelDescription("m_split_1-2", "tensorrt", 64, (TensorSpec("x", "FP32", (4,)),),
                            (TensorSpec("y", "FP32", (2,)),), instance_kind="KIND_GPU", gpus=(0,))
    cfg = parse_config(render_config(desc, "ngc"))
    assert cfg.platform == "tensorrt_plan" and cfg.default_model_filename == "model.plan" and not cfg.backend
    assert cfg.instance_group[0].kind == cfg.instance_group[0].KIND_GPU and list(cfg.instance_group[0].gpus) == [0]
    assert "intra_op_thread_count" not in cfg.parameters
    with pytest.raises(ValueError, match="only an NGC Triton image"):
        render_config(desc, "embedded")
    with pytest.raises(ValueError, match="KIND_GPU"):
        render_config(ModelDescription("m", "tensorrt", 8, (), ()), "ngc")


def test_export_tensorrt_needs_ngc_and_tensorrt(tmp_path):
    with pytest.raises(ExportError, match="needs --target ngc"):
        export_repository("tiny-ee", "2", tmp_path, settings=ExportSettings(format="tensorrt"), progress=False)
    with pytest.raises(ExportError, match="unknown format"):
        export_repository("tiny-ee", "2", tmp_path, settings=ExportSettings(format="plan"), progress=False)
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        with pytest.raises(ExportError, match="optional `gpu` extra"):
            export_repository("tiny-ee", "2", tmp_path, settings=ExportSettings(target="ngc", format="tensorrt"),
                              progress=False)
    assert not list(tmp_path.iterdir())  # nothing written


def test_export_ngc_tensorrt_writes_plans_and_configs(tmp_path, monkeypatch):
    built = []

    def fake_build(onnx_path, plan_path, inputs, settings, trt=None):
        assert Path(onnx_path).exists()  # the parity-checked ONNX file is the source
        built.append((Path(plan_path).parent.parent.name, [t.name for t in inputs], settings))
        Path(plan_path).write_bytes(b"ENGINE")
        return Path(plan_path)

    monkeypatch.setattr(trt_path, "import_tensorrt", lambda: FakeTensorRT())
    monkeypatch.setattr(trt_path, "build_engine", fake_build)
    export_repository("tiny-ee", "2", tmp_path, settings=ExportSettings(target="ngc", format="tensorrt", batch_size=4,
                                                               fp16=True), progress=False)
    names = sorted(b[0] for b in built)
    assert len(names) == 3 and all(n.startswith(".tiny_ee_") for n in names)  # staged, then moved into place
    settings = {b[1][0]: b[2] for b in built}
    assert settings["hidden"] == EngineSettings(opt_batch=4, max_batch=64, fp16=True)
    for model in ("tiny_ee_split_1-2", "tiny_ee_split_3-4", "tiny_ee_stock"):
        cfg = parse_config((tmp_path / model / "config.pbtxt").read_text())
        assert cfg.platform == "tensorrt_plan" and cfg.instance_group[0].kind == cfg.instance_group[0].KIND_GPU
        assert sorted(p.name for p in (tmp_path / model / "1").iterdir()) == ["model.plan"]
    for model in ("tiny_ee_router", "tiny_ee_ee"):  # Python-backend models stay Python
        assert parse_config((tmp_path / model / "config.pbtxt").read_text()).backend == "python"


def _gpu_reason() -> str | None:
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        return "tensorrt is not installed (optional `gpu` extra); the engine build needs it and an NVIDIA GPU"
    if not (Path("/dev/nvidia0").exists() or shutil.which("nvidia-smi")):
        return "no NVIDIA GPU on this machine; TensorRT cannot build engines without one"
    return None


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_reason() is not None, reason=_gpu_reason() or "")
def test_real_engine_build_of_a_tiny_split(tiny_model, tmp_path):
    from e3.models.api import SplitModule
    from e3.export.onnx_export import export_onnx
    split = SplitModule(tiny_model, 1, 2, tiny_model.card.ramp_blocks)
    export_onnx(split, tmp_path / "model.onnx", max_batch_size=64)
    plan = build_engine(tmp_path / "model.onnx", tmp_path / "model.plan", split.input_specs,
                        settings=EngineSettings(opt_batch=8, max_batch=64))
    assert plan.stat().st_size > 0
    import tensorrt as trt
    engine = trt.Runtime(trt.Logger(trt.Logger.WARNING)).deserialize_cuda_engine(plan.read_bytes())
    assert engine is not None and engine.num_io_tensors == len(split.input_specs) + len(split.output_names)
    assert os.path.getsize(plan) > 1000
