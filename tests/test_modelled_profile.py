"""e3 profile --modelled: reference curves from the public figures, the FLOP scaling, labels, merging."""

import pytest

from e3.core.profile import LatencyProfile, ProfileError
from e3.profiling.modelled_profile import (CHECK_FIXED_MS, CHECK_PER_ROW_MS, GPUS, PRICES_PER_HOUR, REF_LAYER_FLOPS,
                                        REF_LAYERS, SOURCE_PREFIX, Curve, default_data_file, load_reference_curves,
                                        model_modelled_profile, modelled_profile)
from e3.profiling.profiler import format_table, merge_profiles

needs_data = pytest.mark.skipif(not default_data_file().exists(),
                                reason=f"public GPU figures not found at {default_data_file()} (set E3_GPU_DATA)")


@needs_data
def test_reference_curves_come_from_the_public_figures():
    curves = load_reference_curves()
    assert sorted(curves) == sorted(GPUS)
    v100 = curves["v100"]
    assert v100.batches[:3] == (1, 2, 4) and v100.latency_ms[0] == 1.15 and v100.latency_ms[-1] == 43.13
    assert curves["t4"].latency_ms[0] == 2.02 and curves["a30"].latency_ms[0] == 1.00
    assert curves["a10"].batches == (1, 8, 32)  # FasterTransformer rows only
    # K80 = V100 x (K80 / V100 ResNet-50 latency at the same batch), MXNet images/s (S8)
    ratio_1 = (1 / 67.41) / (1 / 162.15)
    assert curves["k80"].latency_ms[0] == pytest.approx(1.15 * ratio_1)
    ratio_128 = (128 / 171.55) / (128 / 1233.15)
    assert curves["k80"].latency_ms[-1] == pytest.approx(43.13 * ratio_128)


def test_curve_interpolates_floors_and_extrapolates():
    c = Curve((1, 8), (12.0, 96.0), "")
    assert float(c(4)) == pytest.approx(48.0)
    assert float(c(0.01)) == 12.0  # below batch 1: the batch-1 time (launch-bound)
    assert float(c(16)) == pytest.approx(192.0)


def test_reference_layer_flops_match_a_counted_bert_base_layer():
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from e3.models.api import SplitModule
    from e3.export.onnx_export import split_inputs
    from e3.models.zoo.encoder import EncoderConfig, EncoderEE
    torch.manual_seed(0)
    bert = EncoderEE("bert-base-layer", EncoderConfig(hidden=768, heads=12, ffn=3072, layers=2, max_seq_len=128,
                                                      ramp_blocks=(), vocab_size=8), {"kind": "entropy"}).eval()
    split = SplitModule(bert, 1, 1, ())
    # the encoder's attention goes through scaled_dot_product_attention; its math form is what the counter
    # sees as matmuls (the CPU's fused kernel is not counted at all)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        split(*split_inputs(split, 1, 0))
    assert counter.get_total_flops() == REF_LAYER_FLOPS


def test_modelled_profile_scales_by_flops_as_an_equivalent_batch():
    curves = {"v100": Curve((1, 8), (12.0, 96.0), "test curve"), "t4": Curve((1, 8), (24.0, 192.0), "t4 curve")}
    flops = [REF_LAYER_FLOPS, REF_LAYER_FLOPS / 1000]  # one BERT-base layer; a tiny block
    p = modelled_profile("m", [1, 4, 8], flops, ramp_flops=[REF_LAYER_FLOPS / 10, 0.0], state_bytes=1000,
                         gpus=["V100", "t4"], curves=curves, tx_fixed_ms=0.2, tx_gbit_s=8.0)
    assert p.block_ms["v100"][0] == pytest.approx([12 / REF_LAYERS, 48 / REF_LAYERS, 96 / REF_LAYERS])
    assert p.block_ms["v100"][1] == pytest.approx([1.0, 1.0, 1.0])  # tiny: the flat (batch-1) region
    assert p.ramp_ms["v100"][0] == pytest.approx([0.1, 0.4, 0.8])  # its FLOP share of the block
    assert p.ramp_ms["v100"][1] == [0.0, 0.0, 0.0]
    assert p.block_ms["t4"][0][0] == pytest.approx(2.0)
    assert p.tx_ms["v100"] == pytest.approx([0.2 + 1e-3, 0.2 + 4e-3, 0.2 + 8e-3])  # 1000 B/input at 8 Gbit/s
    assert all(d.modelled for d in p.devices.values()) and p.modelled
    assert p.devices["v100"].price == PRICES_PER_HOUR["v100"] == 3.06
    assert p.source.startswith(SOURCE_PREFIX) and "NOT measured" in p.source
    # the exit check is modelled (a sync and a gather); without inputs' bytes or a router curve: none
    assert p.check_ms["v100"] == pytest.approx([CHECK_FIXED_MS + CHECK_PER_ROW_MS * b for b in (1, 4, 8)])
    assert "exit check MODELLED" in p.source and "router work not included" in p.source
    assert p.tx_in_ms == {} and p.router_ms == {}


def test_modelled_profile_has_the_inputs_hop_and_the_routers_cpu_work():
    curves = {"v100": Curve((1, 8), (12.0, 96.0), "test curve")}
    p = modelled_profile("m", [1, 4, 8], [REF_LAYER_FLOPS], ramp_flops=[0.0], state_bytes=1000, gpus=["v100"], curves=curves,
                         tx_fixed_ms=0.2, tx_gbit_s=8.0, input_bytes=100, router_ms=[0.1, 0.2, 0.3])
    assert p.tx_in_ms["v100"] == pytest.approx([0.2 + 1e-4, 0.2 + 4e-4, 0.2 + 8e-4])   # 100 B/input at 8 Gbit/s
    assert p.router_ms["v100"] == [0.1, 0.2, 0.3]
    assert "router work measured on this host CPU" in p.source
    with pytest.raises(ProfileError, match="router_ms must hold one latency per batch size"):
        modelled_profile("m", [1, 4, 8], [REF_LAYER_FLOPS], ramp_flops=[0.0], state_bytes=1000, gpus=["v100"], curves=curves, router_ms=[0.1])


def test_modelled_profile_rejects_unknown_gpus_and_missing_prices():
    curves = load_reference_curves() if default_data_file().exists() else {}
    with pytest.raises(ProfileError, match="modelled GPUs are"):
        modelled_profile("m", [1], [1.0], ramp_flops=[0.0], state_bytes=0, gpus=["p100"], curves=curves)
    with pytest.raises(ProfileError, match="no price for a30"):
        modelled_profile("m", [1], [1.0], ramp_flops=[0.0], state_bytes=0, gpus=["a30"], curves={"a30": Curve((1,), (1.0,), "")})
    p = modelled_profile("m", [1], [1.0], ramp_flops=[0.0], state_bytes=0, gpus=["a30"], curves={"a30": Curve((1,), (1.0,), "")}, prices={"a30": 1.5})
    assert p.devices["a30"].price == 1.5


@needs_data
def test_tiny_ee_modelled_profile_on_three_gpus_loads_merges_and_says_modelled(tmp_path, capsys):
    p = model_modelled_profile("tiny-ee", ["v100", "t4", "k80"], [1, 8, 64])
    path = tmp_path / "p.json"
    p.save(path)
    q = LatencyProfile.load(path)
    assert list(q.devices) == ["v100", "t4", "k80"] and q.modelled and q.num_blocks == 4
    # tiny-ee is far smaller than a BERT-base layer: every block sits in the GPU's flat region
    assert q.block(2, "k80", 64, with_ramp=False) > q.block(2, "t4", 64, with_ramp=False) > \
        q.block(2, "v100", 64, with_ramp=False) > 0
    assert 0 < q.ramp_ms["v100"][0][0] < q.block_ms["v100"][0][0]
    # the inputs' hop (token ids and mask, lighter than the hidden state), the modelled exit check, and the
    # router's work measured here (the same curve on every GPU: it is CPU work)
    assert q.tx_in("v100", 64) < q.tx("v100", 64)
    assert q.check_ms["t4"] == pytest.approx([CHECK_FIXED_MS + CHECK_PER_ROW_MS * b for b in (1, 8, 64)])
    assert len(q.router_ms["v100"]) == 3 and all(v > 0 for v in q.router_ms["v100"])
    assert q.router_ms["v100"] == q.router_ms["k80"]
    table = format_table(q)
    assert table.count("MODELLED from public figures") == 3
    from e3.profiling.profiler import assemble_profile
    cpu = assemble_profile("tiny_ee", [1, 8, 64], [[[1.0]] * 3] * 4, with_ramp=[None] * 4, tx=[[0.5]] * 3)
    both = merge_profiles([cpu, q])
    assert list(both.devices) == ["cpu", "v100", "t4", "k80"] and not both.devices["cpu"].modelled

    from e3.cli import main
    out = tmp_path / "cli.json"
    assert main(["profile", "tiny-ee", "--modelled", "v100,t4,k80", "--batch-sizes", "1,8", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "MODELLED" in printed and "not measured" in printed
    assert LatencyProfile.load(out).modelled
    assert main(["profile", "tiny-ee", "--modelled", "p100", "--out", str(out)]) == 2


def test_parse_prices():
    from e3.profiling.modelled_profile import parse_prices
    assert parse_prices(["a30=1.5", "T4=0.6"]) == {"a30": 1.5, "t4": 0.6}
    assert parse_prices([]) == {}
    for bad in ("a30", "a30=cheap", "=1", "a30=-1", "a30=nan"):
        with pytest.raises(ProfileError, match="GPU=USD_PER_HOUR"):
            parse_prices([bad])
