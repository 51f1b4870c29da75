"""GPU pools use their GPUs: split configs carry KIND_GPU instance groups that each name one GPU, at export
(`e3 export --target ngc --gpus N`, TensorRT plans on GPU 0 by default) and when the controller sets a split's
instances on a GPU pod (a pool's ``gpus_per_pod``, from the chart's ``gpu.count``). Triton puts a KIND_GPU
group's count on every GPU it names, and on every visible GPU when it names none: without ``gpus`` a 2-GPU pod
would run twice the plan's instances. Every config is parsed as Triton's ModelConfig."""

from __future__ import annotations

from dataclasses import replace

import pytest

from e3.controller.planner.placement import place
from e3.controller.pooled_applier import PooledApplier
from e3.controller.triton_applier import TritonApplier, with_split_settings
from e3.core.plan import SplitPlan
from e3.deploy.pools import load_pools
from e3.export.triton_config import ModelDescription, gpu_instance_groups, parse_config, render_config
from e3.core.spec import TensorSpec
from helpers import make_plan, make_pools


def test_instances_are_spread_one_group_per_gpu():
    assert gpu_instance_groups(1, 2) == [{"count": 1, "kind": "KIND_GPU", "gpus": [0]}]
    assert gpu_instance_groups(3, 2) == [{"count": 2, "kind": "KIND_GPU", "gpus": [0]},
                                         {"count": 1, "kind": "KIND_GPU", "gpus": [1]}]
    assert gpu_instance_groups(4, (2, 5)) == [{"count": 2, "kind": "KIND_GPU", "gpus": [2]},
                                              {"count": 2, "kind": "KIND_GPU", "gpus": [5]}]
    assert sum(g["count"] for g in gpu_instance_groups(7, 4)) == 7   # never count x GPUs
    for bad in ((0, 2), (2, 0), (2, (1, 1)), (2, (-1,))):
        with pytest.raises(ValueError):
            gpu_instance_groups(*bad)


def test_a_gpu_config_renders_explicit_gpus():
    desc = ModelDescription(name="m_split_1-2", kind="onnx", max_batch_size=8, instances=3,
                            inputs=(TensorSpec("x", "FP32", (4,)),), outputs=(TensorSpec("y", "FP32", (4,)),),
                            instance_kind="KIND_GPU", gpus=(0, 1))
    cfg = parse_config(render_config(desc, "ngc"))
    assert cfg.platform == "onnxruntime_onnx"
    assert [(g.count, g.kind, list(g.gpus)) for g in cfg.instance_group] == [(2, 1, [0]), (1, 1, [1])]  # 1: KIND_GPU
    plan = parse_config(render_config(replace(desc, kind="tensorrt", gpus=()), "ngc"))
    assert [(g.count, list(g.gpus)) for g in plan.instance_group] == [(3, [0])]   # no gpus given: GPU 0, not all


def test_export_for_a_gpu_pool_writes_kind_gpu_with_gpus(tmp_path):
    from e3.export.repository import ExportError, ExportSettings, export_repository
    export_repository("tiny-ee", "2", tmp_path, settings=ExportSettings(target="ngc", gpus=2, split_instances=3,
                                                                         baselines=False), progress=False)
    for split in ("tiny_ee_split_1-2", "tiny_ee_split_3-4"):
        cfg = parse_config((tmp_path / split / "config.pbtxt").read_text())
        assert [(g.count, list(g.gpus)) for g in cfg.instance_group] == [(2, [0]), (1, [1])]
        assert all(g.kind == g.KIND_GPU for g in cfg.instance_group)
    router = parse_config((tmp_path / "tiny_ee_router" / "config.pbtxt").read_text())
    assert router.backend == "python" and all(g.kind == g.KIND_CPU for g in router.instance_group)
    with pytest.raises(ExportError, match="needs --target ngc"):
        export_repository("tiny-ee", "2", tmp_path / "e", settings=ExportSettings(gpus=1), progress=False)


def test_the_controller_sets_gpu_instances_with_gpus():
    cpu = {"name": "s", "max_batch_size": 8, "instance_group": [{"count": 1, "kind": "KIND_CPU"}]}
    split = SplitPlan(model="s", first_block=1, last_block=2, batch_size=4, instances=3)
    assert with_split_settings(cpu, split)["instance_group"] == [{"count": 3, "kind": "KIND_CPU"}]
    on_gpu = with_split_settings(cpu, split, gpus=2)
    assert on_gpu["instance_group"] == [{"count": 2, "kind": "KIND_GPU", "gpus": [0]},
                                        {"count": 1, "kind": "KIND_GPU", "gpus": [1]}]
    # a TensorRT plan (KIND_GPU, Triton filled in every GPU) on a pod the controller was not told about: GPU 0
    trt = {**cpu, "instance_group": [{"count": 1, "kind": "KIND_GPU", "gpus": [0, 1]}]}
    assert with_split_settings(trt, split)["instance_group"] == [{"count": 3, "kind": "KIND_GPU", "gpus": [0]}]


class _FakeTriton:
    """The part of TritonControl that TritonApplier.configure_split calls, over a dict of live configs."""

    def __init__(self):
        self.configs: dict[str, dict] = {}
        self.loads: list[tuple[str, dict | None]] = []

    def loaded(self):
        return {name: "READY" for name in self.configs}

    def model_config(self, name):
        return self.configs[name]

    def load(self, name, config=None):
        self.loads.append((name, config))
        self.configs[name] = config or {"name": name, "max_batch_size": 8,
                                        "instance_group": [{"count": 1, "kind": "KIND_CPU"}]}

    def is_ready(self, name):
        return name in self.configs


class _Pod(TritonApplier):
    def __init__(self, url):
        super().__init__(url)
        self.fake = _FakeTriton()

    @property
    def control(self):
        return self.fake


def test_a_gpu_pools_pods_get_their_gpus_from_pools_json():
    doc = make_pools()
    doc["pools"][2].update(pods_host="demo-e3-triton-t4b-pods", gpus_per_pod=2)   # 2 devices (GPUs) per pod
    pools = load_pools(doc)
    assert pools.named("t4b").gpus_per_pod == 2 and pools.named("t4").gpus_per_pod == 0
    plan = place(make_plan(devices_=("cpu", "t4", "t4"), instances=(1, 1, 4)), pools, pin={"bert_ee_split_5-6": "t4b"})
    pods: dict[str, _Pod] = {}
    applier = PooledApplier("bert_ee_router", _Pod("router:8000"), {}, pools=pools,
                            resolve=lambda host, port: ["10.0.0.1:8000", "10.0.0.2:8000"],
                            make_applier=lambda url: pods.setdefault(url, _Pod(url)))
    applier.configure_split(plan.splits[2])          # 4 instances over 2 pods of 2 GPUs: 1 per GPU
    for pod in pods.values():
        assert pod.gpus == 2
        assert pod.fake.configs["bert_ee_split_5-6"]["instance_group"] == [
            {"count": 1, "kind": "KIND_GPU", "gpus": [0]}, {"count": 1, "kind": "KIND_GPU", "gpus": [1]}]
