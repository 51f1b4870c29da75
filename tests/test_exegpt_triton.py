"""ExeGPT's front door on the real tritonserver (tiny-gen, random weights): RRA enforced around the generation
engine, or WAA over an encode worker and a decode worker, chosen by branch-and-bound from the door's own timed
steps.

Must show (issue 17): under a latency bound, the schedule the door chose has a measured p99 latency within the
bound and a throughput at least the best static batch's under the same bound (the baseline
``e3 plan-generate --validate`` defines: admit B, decode until all finished). Also: the door answers as the
reference model does under either schedule, re-plans when the output lengths shift, and names bad requests.
"""

from __future__ import annotations

import math
import random

import pytest

from helpers import serving

PROMPT = 8
BATCHES = tuple(range(1, 17))


@pytest.fixture(scope="module")
def door(tmp_path_factory):
    from e3.generation.exegpt.door import door_models, export_exegpt_door
    from e3.generation.exegpt.scheduler import ReplanPolicy
    from e3.generation.exegpt.workload import LayerProfile, LengthDistribution
    from e3.generation.repository import export_generation_repository
    repo = tmp_path_factory.mktemp("exegpt-repo")
    export_generation_repository("tiny-gen", repo, progress=False)
    # where plans start before the door has timed its steps (replaced by the served profile after calibration)
    start = LayerProfile.from_dict({"num_layers": 1, "prefill": {"tokens": [8, 128], "ms": [5, 8]},
                                    "decode": {"batch": [1, 16], "ms": [5, 7]}})
    lengths = LengthDistribution.from_samples(list(range(2, 17)))
    name = export_exegpt_door(repo, "tiny-gen", start, lengths=lengths, prompt_tokens=PROMPT, batch_sizes=BATCHES, stop_at_eos=False,
                              policy=ReplanPolicy(window=60, min_samples=30, threshold=0.25))
    with serving(repo, door_models(repo, "tiny-gen"), name="exegpt") as server:
        yield server, name, lengths


@pytest.mark.serial
def test_the_chosen_schedule_meets_the_bound_and_beats_the_best_static_batch(door):
    from e3.generation.exegpt.drive import control
    from e3.generation.exegpt.scheduler import RraSchedule, best_static, predict
    from e3.benchmarks.exegpt import calibrate, chosen_of, measure
    server, name, lengths = door
    cal = calibrate(server.http_url, server.grpc_url, name, lengths=lengths, prompt_tokens=PROMPT, vocab=64, batches=(16, 8, 4), phases=3)
    served, tail = cal.rra, cal.rra_tail
    # a bound loose enough that refilling the batch between decode steps can pay (tighter, the best RRA schedule
    # is the static batch itself and the two runs would measure one schedule twice)
    bound = 5 * predict(served, PROMPT, lengths, schedule=(1, 16), latency_profile=tail).latency_ms
    status = control(server.http_url, name, {"bound_ms": bound})
    assert status["profile"] == "served" and status["waa_profile"] == "served-waa"
    assert status["feasible"] and not status["pinned"]
    chosen = chosen_of(status)     # RRA or WAA, whichever B&B found faster
    p_chosen = cal.predict(chosen, PROMPT, lengths)
    p_static = best_static(served, PROMPT, lengths, bound_ms=0.8 * bound, batch_sizes=BATCHES, latency_profile=tail)
    assert p_chosen.latency_ms <= 0.8 * bound * 1.05   # B&B's latency tolerance
    assert chosen != RraSchedule(p_static.config[0], 16) and p_chosen.throughput_seq_s > p_static.throughput_seq_s
    static = RraSchedule(*p_static.config)
    # interleaved, twice each; per schedule the faster run counts (with its p99): other processes on a shared
    # machine only ever add time, and the load they add changes between runs (the profiler takes the fastest
    # of its repeats for the same reason)
    runs = {"chosen": [], "static": []}
    for _ in range(2):
        for key, sched, pred in (("chosen", chosen, p_chosen), ("static", static, p_static)):
            runs[key].append(measure(server.http_url, server.grpc_url, name, schedule=sched, predicted_decode_batch=pred.detail["decode_batch"],
                                     lengths=lengths, prompt_tokens=PROMPT, vocab=64, phases=2))
    run_chosen, run_static = (max(runs[k], key=lambda r: r.seq_s) for k in ("chosen", "static"))
    report = (f"bound {bound:.0f} ms: chosen {chosen} {run_chosen}; predicted {p_chosen.throughput_seq_s:.1f} "
              f"seq/s, {p_chosen.latency_ms:.0f} ms | static {static} {run_static}; predicted "
              f"{p_static.throughput_seq_s:.1f} seq/s; all runs (seq/s, p99 ms): "
              f"{[(k, round(r.seq_s), round(r.p99_ms)) for k, v in runs.items() for r in v]}")
    print(report)
    assert not any(r.errors for r in runs["chosen"] + runs["static"]), report
    assert run_chosen.sequences >= 60 and run_static.sequences >= 30, report
    assert run_chosen.p99_ms <= bound, report
    assert run_chosen.seq_s >= run_static.seq_s, report


def test_answers_equal_the_reference_model(door):
    from e3.generation.client import generate
    from e3.generation.models import load_generation_model
    from e3.generation.reference import generate_full
    server, name, _ = door
    model = load_generation_model("tiny-gen").decoder
    for seed in range(4):
        r = random.Random(seed)
        prompt = [r.randrange(64) for _ in range(r.randint(1, 10))]
        got = generate(server.http_url, name, prompt, max_new_tokens=6, mode="full")
        assert got.tokens == generate_full(model, prompt, 6).tokens, f"prompt {prompt}"
        assert got.total_ms > 0


def test_waa_runs_on_two_workers_and_answers_as_the_reference(door):
    """Pinned WAA: the encode worker (<m>_enc_split_*) prefills, the decode worker (<m>_kv_split_*) decodes
    the handed-over sequences; every answer is the reference model's, under concurrency (several hand-overs
    of B_E = 3 while earlier sequences decode), and the door times both workers."""
    import concurrent.futures as cf
    import urllib.request

    from e3.generation.client import generate
    from e3.generation.exegpt.drive import control
    from e3.generation.models import load_generation_model
    from e3.generation.reference import generate_early_exit, generate_full
    server, name, _ = door
    status = control(server.http_url, name, {"schedule": ["waa", 3, 1]})
    assert status["kind"] == "waa" and status["schedule"] == {"batch_size": 3, "micro_batches": 1}
    model = load_generation_model("tiny-gen").decoder
    jobs = []
    for seed in range(12):
        r = random.Random(100 + seed)
        jobs.append(([r.randrange(64) for _ in range(r.randint(1, 10))], r.randint(1, 9),
                     "calm" if seed % 3 == 0 else "full"))
    with cf.ThreadPoolExecutor(12) as pool:
        got = list(pool.map(lambda j: generate(server.http_url, name, j[0], max_new_tokens=j[1], mode=j[2], tau=0.3), jobs))
    for (prompt, n, mode), g in zip(jobs, got):
        ref = generate_early_exit(model, prompt, n, tau=0.3) if mode == "calm" else generate_full(model, prompt, n)
        assert g.tokens == ref.tokens and g.exit_layers == ref.exit_layers, (prompt, n, mode)
    after = control(server.http_url, name, {})
    assert after["waa_served_points"]["prefill"] and after["waa_served_points"]["decode"]
    page = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    assert "e3_exegpt_waa 1" in page and "e3_exegpt_decode_iters 1" in page
    with pytest.raises(ValueError, match="micro_batches must be <= 1"):
        control(server.http_url, name, {"schedule": ["waa", 3, 2]})


def test_the_door_re_plans_when_the_output_lengths_shift(door):
    from e3.generation.exegpt.drive import control, drive
    from e3.generation.exegpt.workload import LengthDistribution
    server, name, lengths = door
    before = control(server.http_url, name, {"bound_ms": None})    # planned for lengths 2..16, unpinned
    assert before["planned_lengths"]["p99"] == 16 and not before["pinned"]
    run = drive(server.grpc_url, name, LengthDistribution.fixed(40), prompt_tokens=PROMPT, requests=40, concurrency=16, vocab=64)
    assert run.errors == 0
    after = control(server.http_url, name, {})
    assert after["replans"] > before["replans"]
    assert after["planned_lengths"]["p99"] == 40
    assert any(h["reason"].startswith("lengths shifted") for h in after["history"])
    # the schedule in force is also a Triton metric
    import urllib.request
    page = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    assert f"e3_exegpt_decode_iters {after['schedule'].get('decode_iters', 1)}" in page
    assert 'e3_exegpt_replans_total{reason="lengths"}' in page


def test_bad_requests_are_named_and_the_door_keeps_serving(door):
    from e3.generation.client import GenerationError, generate
    from e3.generation.exegpt.drive import control
    server, name, _ = door
    with pytest.raises(ValueError, match="control takes"):
        control(server.http_url, name, {"bound": 5})
    with pytest.raises(ValueError, match="bound_ms must be"):
        control(server.http_url, name, {"bound_ms": -1})
    with pytest.raises(ValueError, match="schedule must be"):
        control(server.http_url, name, {"schedule": [0.5, 2]})
    with pytest.raises(ValueError, match="batch_size >= 1"):
        control(server.http_url, name, {"schedule": [0, 2]})
    with pytest.raises(GenerationError, match="empty prompt"):
        generate(server.http_url, name, [], max_new_tokens=4, mode="full")
    with pytest.raises(GenerationError, match="out of the vocabulary"):
        generate(server.http_url, name, [1, 10_000], max_new_tokens=4, mode="full")
    assert len(generate(server.http_url, name, [1, 2, 3], max_new_tokens=4, mode="full").tokens) == 4
    assert math.isfinite(control(server.http_url, name, {})["schedule"]["batch_size"])
