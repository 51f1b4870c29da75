"""The cross-pool gRPC hop carries a state larger than gRPC's 4 MiB default message limit: two embedded
tritonservers on loopback act as two pools; the router on A runs split 1-1 and 3-3 by BLS and reaches split
2-2 on B over gRPC, named ``dns:///127.0.0.1:<port>`` as the Helm chart names a pool (the balanced channel,
whose options used to replace tritonclient's unlimited message sizes with gRPC's 4 MiB receive limit). One
request of 40 inputs of the wide test model (tests/wide_model.py: 128 KiB of state per input, no exits) sends
5.1 MiB to B and gets 5.1 MiB back in one call; every answer equals the PyTorch reference."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from e3.core.exits import make_exit_rule
from e3.core.plan import default_plan
from e3.serving.remote import KEEPALIVE_TIME_MS, channel_args

pytestmark = pytest.mark.e2e
BATCH = 40
MIB = 1 << 20


def test_channel_args_keep_tritonclients_unlimited_sizes_and_add_keepalive():
    from tritonclient.grpc import MAX_GRPC_MESSAGE_SIZE
    balanced, plain = dict(channel_args("dns:///pool-pods:8001")), dict(channel_args("10.0.0.1:8001"))
    for args in (balanced, plain):
        assert args["grpc.max_send_message_length"] == args["grpc.max_receive_message_length"] == MAX_GRPC_MESSAGE_SIZE
        assert MAX_GRPC_MESSAGE_SIZE >= 2**31 - 1
        assert args["grpc.keepalive_time_ms"] == KEEPALIVE_TIME_MS and args["grpc.keepalive_timeout_ms"] > 0
        assert args["grpc.keepalive_permit_without_calls"] == 0   # Triton refuses idle pings more often than 5 min
    assert balanced["grpc.lb_policy_name"] == "round_robin" and "grpc.lb_policy_name" not in plain


def test_a_state_over_4_mib_crosses_the_hop_between_two_servers(tmp_path_factory, capsys):
    import tritonclient.http as http
    from e3.controller.triton_api import TritonControl
    from e3.deploy.server import TritonServer
    from e3.models.reference import reference_answers
    from e3.export.repository import ExportSettings, export_repository
    from e3.paths import artifacts_dir
    from wide_model import STATE_BYTES_PER_INPUT, wide_ee

    model = wide_ee()
    card = model.card
    assert BATCH * STATE_BYTES_PER_INPUT > 4 * MIB
    repo = tmp_path_factory.mktemp("hop-repo")
    export_repository("wide_model:wide_ee", "1,2", repo, settings=ExportSettings(baselines=False), progress=False)
    logs = Path(artifacts_dir()) / "logs"
    a = TritonServer.on_free_ports(repo, ["wide_ee_router", "wide_ee_split_1-1", "wide_ee_split_3-3"],
                                   exit_timeout_s=3, log_file=logs / f"test-tritonserver-hop-a-{os.getpid()}.log")
    b = TritonServer.on_free_ports(repo, ["wide_ee_split_2-2"], exit_timeout_s=3,
                                   log_file=logs / f"test-tritonserver-hop-b-{os.getpid()}.log")
    with a, b:
        plan = default_plan("wide_ee", 3, [(1, 1), (2, 2), (3, 3)], exit_rule=card.exit_rule,
                            ramp_blocks=card.ramp_blocks, batch_size=BATCH, slo_ms=60_000)
        remote = f"dns:///127.0.0.1:{b.grpc_port}"
        splits = tuple(s if s.first_block != 2 else type(s)(**{**s.__dict__, "server": remote}) for s in plan.splits)
        plan = type(plan)(**{**plan.__dict__, "splits": splits})
        with TritonControl(a.http_url) as control:
            control.switch_plan("wide_ee_router", plan)
            assert control.current_plan("wide_ee_router").splits[1].server == remote
        ids, mask = (x.numpy() for x in model.example_inputs(BATCH, seed=4))
        inputs = []
        for name, value in (("input_ids", ids), ("attention_mask", mask)):
            t = http.InferInput(name, list(value.shape), "INT64")
            t.set_data_from_numpy(value)
            inputs.append(t)
        with http.InferenceServerClient(a.http_url, network_timeout=120) as client:
            result = client.infer("wide_ee_router", inputs)
        stats = b.model_statistics("wide_ee_split_2-2")["model_stats"][0]
    label, exit_ramp = result.as_numpy("label").reshape(-1), result.as_numpy("exit_ramp").reshape(-1)
    probs = result.as_numpy("probs").reshape(BATCH, -1)
    ref = reference_answers(model, (ids, mask), make_exit_rule(card.exit_rule))
    with capsys.disabled():
        print(f"\ncross-pool hop: {BATCH} inputs, {BATCH * STATE_BYTES_PER_INPUT / MIB:.2f} MiB of state each way "
              f"in {stats['execution_count']} call(s) to B; answered {len(label)}")
    assert (exit_ramp == 3).all()                      # tau 0: nobody exits, the whole batch crossed the hop
    assert (label == ref.label).all() and (exit_ramp == ref.exit_ramp).all()
    # the head's probabilities too: the state that crossed twice is the reference's, to float tolerance
    np.testing.assert_allclose(probs, ref.probs, atol=1e-4)
    # B ran the 40 inputs as one batch: one gRPC request of > 4 MiB in, one of > 4 MiB out
    assert stats["inference_count"] == BATCH and stats["execution_count"] == 1
