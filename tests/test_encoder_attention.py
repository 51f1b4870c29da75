"""The zoo encoder's attention through scaled_dot_product_attention: the same answers as the matmul-softmax-matmul it
replaced, the same parameters, ONNX export with parity, and PyTorch's nn.TransformerEncoderLayer of the same size as
the speed yardstick (the comparison itself needs a GPU)."""

from __future__ import annotations

import math

import pytest
import torch

from e3.profiling.cuda_profile import cuda_available
from e3.models.zoo.encoder import EncoderConfig, EncoderEE
from e3.serving.device import executor
from e3.serving.device.timing import compare_with_torch_layer, torch_layer_twin

NO_GPU = "needs an NVIDIA GPU that PyTorch can use (torch.cuda.is_available() is False here)"
CONFIG = EncoderConfig(vocab_size=50, hidden=32, layers=2, heads=4, ffn=48, max_seq_len=12, ramp_blocks=(1,))


def _model(seed: int = 0) -> EncoderEE:
    torch.manual_seed(seed)
    return EncoderEE("attn", CONFIG, exit_rule={"kind": "entropy", "tau_nats": 0.5}).eval()


def math_layer(layer, x, mask):
    """The layer as it was written before (matmul, softmax, matmul with a -10000 bias on padded keys)."""
    b, s, h = x.shape
    q, k, v = layer._heads(layer.query(x)), layer._heads(layer.key(x)), layer._heads(layer.value(x))
    bias = (1.0 - mask.to(x.dtype))[:, None, None, :] * -10000.0
    scores = q @ k.transpose(-1, -2) / math.sqrt(layer.head_dim) + bias
    ctx = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, h)
    x = layer.attn_norm(x + layer.attn_out(ctx))
    return layer.out_norm(x + layer.output(torch.nn.functional.gelu(layer.intermediate(x))))


def test_sdpa_layer_answers_as_the_math_layer_it_replaced_padding_included():
    model = _model()
    x = torch.randn(5, CONFIG.max_seq_len, CONFIG.hidden)
    mask = torch.zeros(5, CONFIG.max_seq_len, dtype=torch.long)
    for row, n in enumerate([12, 7, 2, 1, 0]):   # the last row is all padding, as a bucket's padding rows are
        mask[row, :n] = 1
    with torch.no_grad():
        for layer in model.layers:
            got, want = layer(x, mask), math_layer(layer, x, mask)
            assert torch.isfinite(got).all()
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), float((got - want).abs().max())
            # a padded key does not move a real row: change a padded token's state, row 1's answers stay
            moved = x.clone()
            moved[1, 10] += 100.0
            assert torch.allclose(layer(moved, mask)[1, :7], got[1, :7], atol=1e-5)


def test_the_layer_keeps_its_parameter_names_so_checkpoints_load():
    names = {k for k in _model().state_dict() if k.startswith("layers.0.")}
    assert names == {f"layers.0.{m}.{p}" for m in ("query", "key", "value", "attn_out", "attn_norm", "intermediate",
                                                     "output", "out_norm") for p in ("weight", "bias")}
    other = _model(seed=1)
    other.load_state_dict(_model().state_dict())   # strict: the same structure


def test_a_block_with_sdpa_exports_to_onnx_with_parity(tmp_path):
    import onnx

    from e3.models.api import SplitModule
    from e3.export.onnx_export import export_onnx
    path = tmp_path / "block_1.onnx"
    export_onnx(SplitModule(_model(), 1, 1, (1,)), path, max_batch_size=8)   # raises ParityError past 1e-4
    ops = {n.op_type for n in onnx.load(str(path)).graph.node}
    assert {"Softmax", "MatMul"} <= ops


def test_the_torch_layer_twin_is_the_same_size_and_computes_the_same_function(monkeypatch):
    model = _model()
    twin = torch_layer_twin(model)
    for layer in twin.layers:
        attn = layer.layer.self_attn
        assert (attn.embed_dim, attn.num_heads, layer.layer.linear1.out_features) == (32, 4, 48)
    count = lambda m: sum(p.numel() for p in m.parameters())   # noqa: E731
    assert count(twin) == count(model)
    fast = []
    fwd = torch._transformer_encoder_layer_fwd
    monkeypatch.setattr(torch, "_transformer_encoder_layer_fwd", lambda *a: fast.append(1) or fwd(*a))
    settings = executor.DeviceSettings(max_batch=6)
    x = model.example_inputs(6, seed=3)
    ours = executor.make_executor(model, 1, 2, ramps=(1,), settings=settings).run([x], 6)
    theirs = executor.make_executor(twin, 1, 2, ramps=(1,), settings=settings).run([x], 6)
    assert len(fast) == 2, "the twin must take PyTorch's fused fast path in every layer"
    assert [tuple(o.shape) for o in ours] == [tuple(o.shape) for o in theirs] == [(6, CONFIG.num_classes)] * 2
    for a, b in zip(ours, theirs):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5)


def test_the_comparison_runs_both_through_the_executor_on_the_cpu():
    config = EncoderConfig(hidden=32, layers=2, heads=2, ffn=64, max_seq_len=16, ramp_blocks=())
    r = compare_with_torch_layer(config, batch=4, settings=executor.DeviceSettings(), repeats=3, warmup=1)
    assert r.ours_ms > 0 and r.torch_layer_ms > 0 and r.ratio == pytest.approx(r.ours_ms / r.torch_layer_ms)
    assert (r.batch, r.seq_len) == (4, 16) and "EagerExecutor" in r.execution and "buckets [4]" in r.execution


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason=NO_GPU)
def test_the_encoder_runs_within_10_percent_of_pytorchs_fused_layer():   # pragma: no cover - GPU hosts only
    """BERT-base's shape, B = 32, 128 tokens, FP16, one CUDA graph each, padded keys masked in both."""
    r = compare_with_torch_layer(batch=32, repeats=50, warmup=10)
    assert "CudaGraphExecutor" in r.execution
    assert r.ratio <= 1.10, (f"encoder {r.ours_ms:.3f} ms vs nn.TransformerEncoderLayer {r.torch_layer_ms:.3f} ms "
                             f"({r.ratio:.2f}x)")
