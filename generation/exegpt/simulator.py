"""ExeGPT's simulator (XSimulator, §6) for one decoder model: throughput and p99-length latency of RRA and
WAA schedules from a per-layer profile and the input/output length distributions. Pure Python.

The machine is ``workers`` identical workers (a GPU each in the paper; a pinned core, or a Triton instance
with one intra-op thread, here). Both schedules are expected-value models of a steady state: batch sizes are
expectations (fractional), as in the paper.

**RRA** (round-robin allocation, §4.1): every worker holds ``L / workers`` consecutive layers (a pipeline of
``workers`` stages). The schedule repeats one encode phase (``batch_size`` new prompts, prefilled together)
and ``decode_iters`` (the paper's N_D; the encoding frequency is 1/N_D) decode iterations over every live
sequence. Each phase is cut into ``workers`` micro-batches so that the pipeline is full: a decode iteration
of ``n`` rows takes ``L * decode(n / workers)``, and an encode phase adds the pipeline fill, ``(2 workers -
1) / workers * L * prefill(tokens / workers)``; the final head (profiled apart, it sits on the last stage)
is added once per micro-batch. Decisions where §6 is ambiguous or wrong:

* §6 sets B_D = B_E / Σ_U P_D(U) with P_D(U) = Σ_S P_D(U|S) P_D(S), which weights lengths by how many
  *queries* have them, while a live decode batch holds long queries for more phases. We use Little's law
  instead: with ``B_E`` admissions per phase and a query of length S staying ceil(S / N_D) phases, the batch at
  the start of a phase holds ``B_E * E[ceil(S / N_D)]`` rows, and ``B_E * P_last(U)`` of them finish at its
  U-th iteration, where P_last(U) = P(1 + (S - 1) mod N_D = U) (the paper's P_D(U|S) without the 1/ceil
  weight, which the length bias already accounts for). Every phase then admits exactly what the last one
  finished, the paper's consistency condition.
* A sequence of S output tokens needs S decode iterations after its encode phase (the token a prefill emits
  is not counted as one: one iteration of pessimism).
* **Latency** is that of a sequence at the 99th percentile of output length, from the start of the encode
  phase that admits it to its last token: ceil(S/N_D) encode phases, the full decode phases between them and
  the iterations of its last phase. Queueing before admission is not part of it (the paper's latency bound is
  on generating a sequence; waiting for admission depends on the offered load, not on the schedule).

**WAA** (workload-aware allocation, §4.1, WAA-C): ``workers`` are split into encode workers and decode
workers in proportion to their per-iteration work (``round(workers * C_E / (C_E + C_D))``, at least one of
each, so WAA needs two workers; the decoder model is held twice, as the paper says for decoder-only models).
Every decode iteration the encoders hand over ``batch_size`` new prompts, so the decode batch holds
``B_D = batch_size * mean(S_D)`` rows (§4.1). The decode batch is cut into ``micro_batches`` micro-batches
flowing through the decode workers' pipeline: an iteration (one token for every row) takes
``max(micro_batches, decode workers)`` stage times, each of ``L / decode workers * decode(B_D /
micro_batches)``. Decision: ``micro_batches`` ranges over 1..decode workers: beyond that a decode stage holds
several micro-batches and in this model only loses (smaller batches, same number of rounds), while up to it
more micro-batches shorten an iteration (Fig. 4c) and raise throughput. The period is the slower of the
decode iteration and one encode stage; throughput is ``batch_size`` per period; latency is the encode
pipeline's traversal, one period of hand-over (worst case) and S99 periods.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from e3.generation.exegpt.workload import LayerProfile, LengthDistribution

__all__ = ["Workload", "Prediction", "simulate_rra", "simulate_waa", "simulate", "SCHEDULES"]

SCHEDULES = ("rra", "waa")


@dataclass(frozen=True)
class Workload:
    """What the simulator reasons about: the model's profile, the length distributions and the workers."""

    profile: LayerProfile
    input_lengths: LengthDistribution    # prompt tokens per query
    output_lengths: LengthDistribution   # generated tokens per query
    workers: int = 1                     # identical workers (pipeline stages available)
    latency_quantile: float = 0.99       # the length whose latency is bounded

    def __post_init__(self):
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if not 0.0 < self.latency_quantile <= 1.0:
            raise ValueError(f"latency_quantile must be in (0, 1], got {self.latency_quantile}")


@dataclass(frozen=True)
class Prediction:
    """The simulator's answer for one schedule and its control variables."""

    schedule: str                 # "rra" or "waa"
    config: tuple                 # the control variables, as the search space orders them
    throughput_seq_s: float       # finished sequences per second
    throughput_tok_s: float       # generated tokens per second (sequences/s x mean output length)
    latency_ms: float             # latency of the sequence at latency_quantile of output length
    detail: dict = field(default_factory=dict, compare=False)   # batch sizes, phase times, allocation

    def meets(self, latency_bound_ms: float) -> bool:
        return self.latency_ms <= latency_bound_ms


def simulate_rra(w: Workload, batch_size: int, decode_iters: int) -> Prediction:
    """RRA with ``batch_size`` (B_E, prompts per encode phase) and ``decode_iters`` (N_D) (see module doc)."""
    if batch_size < 1 or decode_iters < 1:
        raise ValueError(f"RRA needs batch_size >= 1 and decode_iters >= 1, got {batch_size}, {decode_iters}")
    p, n, nd = w.profile, w.workers, decode_iters
    out = w.output_lengths
    phases_mean = sum(pr * math.ceil(s / nd) for s, pr in zip(out.lengths, out.probs))
    p_last = [0.0] * (nd + 1)
    for s, pr in zip(out.lengths, out.probs):
        p_last[1 + (s - 1) % nd] += pr
    rows0 = batch_size * phases_mean
    iter_ms, alive, done = [], rows0, 0.0
    for u in range(1, nd + 1):
        alive = rows0 - batch_size * done
        iter_ms.append(p.num_layers * p.decode_layer_ms(alive / n) + n * p.head_call_ms(alive / n) + p.overhead_ms
                       if alive > 1e-9 else 0.0)
        done += p_last[u]
    tokens = batch_size * w.input_lengths.mean()
    enc_ms = ((2 * n - 1) / n * p.num_layers * p.prefill_layer_ms(tokens / n) + n * p.head_call_ms(batch_size / n)
              + p.overhead_ms)
    dec_ms = sum(iter_ms)
    cycle_ms = enc_ms + dec_ms
    s99 = out.quantile(w.latency_quantile)
    k, u_last = math.ceil(s99 / nd), 1 + (s99 - 1) % nd
    latency = k * enc_ms + (k - 1) * dec_ms + sum(iter_ms[:u_last])
    thr = batch_size / cycle_ms * 1000.0
    return Prediction("rra", (batch_size, decode_iters), thr, thr * out.mean(), latency,
                      {"decode_batch": rows0, "encode_ms": enc_ms, "decode_phase_ms": dec_ms,
                       "cycle_ms": cycle_ms, "p99_length": s99})


def waa_allocation(w: Workload, batch_size: int) -> tuple[int, int]:
    """WAA-C's split of the workers: (encode workers, decode workers), proportional to one iteration's work."""
    if w.workers < 2:
        raise ValueError("WAA needs at least 2 workers (one to encode, one to decode)")
    p = w.profile
    c_enc = p.num_layers * p.prefill_layer_ms(batch_size * w.input_lengths.mean())
    c_dec = p.num_layers * p.decode_layer_ms(batch_size * w.output_lengths.mean())
    n_enc = round(w.workers * c_enc / (c_enc + c_dec)) if c_enc + c_dec > 0 else 1
    n_enc = min(max(n_enc, 1), w.workers - 1)
    return n_enc, w.workers - n_enc


def simulate_waa(w: Workload, batch_size: int, micro_batches: int) -> Prediction:
    """WAA-C with ``batch_size`` (B_E, prompts handed over per decode iteration) and ``micro_batches`` (B_m).

    ``micro_batches`` above the number of decode workers is clamped to it (module doc)."""
    if batch_size < 1 or micro_batches < 1:
        raise ValueError(f"WAA needs batch_size >= 1 and micro_batches >= 1, got {batch_size}, {micro_batches}")
    p, out = w.profile, w.output_lengths
    n_enc, n_dec = waa_allocation(w, batch_size)
    bm = min(micro_batches, n_dec)
    rows = batch_size * out.mean()
    enc_pass = (p.num_layers * p.prefill_layer_ms(batch_size * w.input_lengths.mean()) + p.overhead_ms
                + p.head_call_ms(batch_size))
    enc_stage = enc_pass / n_enc
    # the final head sits on the last decode stage: the slowest one sets the pipeline's pace
    dec_stage = (p.num_layers * p.decode_layer_ms(rows / bm) + p.overhead_ms) / n_dec + p.head_call_ms(rows / bm)
    dec_iter = max(bm, n_dec) * dec_stage
    period = max(dec_iter, enc_stage)
    s99 = out.quantile(w.latency_quantile)
    latency = enc_pass + period + s99 * period
    thr = batch_size / period * 1000.0
    return Prediction("waa", (batch_size, micro_batches), thr, thr * out.mean(), latency,
                      {"decode_batch": rows, "encode_workers": n_enc, "decode_workers": n_dec,
                       "period_ms": period, "encode_stage_ms": enc_stage, "p99_length": s99})


def simulate(w: Workload, schedule: str, config: tuple) -> Prediction:
    """Dispatch by schedule name: ``("rra", (batch_size, decode_iters))`` or ``("waa", (batch_size,
    micro_batches))``."""
    if schedule == "rra":
        return simulate_rra(w, *config)
    if schedule == "waa":
        return simulate_waa(w, *config)
    raise ValueError(f"unknown schedule {schedule!r}; choose one of {SCHEDULES}")
