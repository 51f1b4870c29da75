"""The simulator against measured runs: RRA executed by the generation engine in this process.

The engine (``e3.generation.engine``, unchanged) runs over the exported splits with ONNX Runtime, one
intra-op thread each, so the whole model runs on one core: one worker in the simulator's terms. RRA is
enforced from outside the engine: ``batch_size`` requests are submitted at the start of a phase (the
engine's next step admits and prefills them: the encode phase), then ``decode_iters`` steps run before the
next admissions. Output lengths are drawn from the distribution and set as ``max_new_tokens``; the end-of-
sequence token is switched off so that every sequence has the drawn length.

Measured over the phases after ``warmup_phases``: sequences finished per second, and the latency (admission
to last token) of the sequences admitted then whose length is the distribution's p99 length (their mean;
the run goes on, admitting as before, until they have all finished). The engine's
prefill emits a sequence's first token, so a sequence of S tokens needs S - 1 decode steps here against the
simulator's S (one iteration of pessimism in the prediction, see ``simulator``).
"""

from __future__ import annotations

import json
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from e3.generation.engine import EngineSpec, GenerationEngine, GenRequest, OrtRunner
from e3.generation.exegpt.simulator import Prediction, Workload, simulate_rra

__all__ = ["Measured", "measure_rra", "validate_rra"]


@dataclass(frozen=True)
class Measured:
    config: tuple                 # (batch_size, decode_iters)
    throughput_seq_s: float
    latency_ms: float             # mean latency of the p99-length sequences
    sequences: int                # finished in the measured phases
    seconds: float                # wall time of the measured phases


def measure_rra(repo: Path, model: str, workload: Workload, *, batch_size: int, decode_iters: int,
                phases: int, warmup_phases: int = 3, seed: int = 0) -> Measured:
    """Run RRA with the engine over ``repo``'s exported splits for ``phases`` phases (see module doc)."""
    from e3.generation.repository import onnx_files   # deferred: the exporter (torch) only for a measurement
    m = model.replace("-", "_")
    spec = EngineSpec.from_dict({**json.loads((repo / f"{m}_generation.json").read_text()),
                                 "eos_id": None, "max_active": 1 << 30, "kv_in_splits": False,
                                 "split_model": None})
    engine = GenerationEngine(spec, OrtRunner(onnx_files(repo, spec), intra_op_threads=1))
    rng = random.Random(seed)
    out, prompt_len = workload.output_lengths, round(workload.input_lengths.mean())
    s99 = out.quantile(workload.latency_quantile)
    vocab = spec.vocab_size or 1000
    finished, lat99, pending = 0, [], 0
    t_start = t_end = None
    phase = 0
    # after the measured phases, admissions go on (uncounted) until every p99-length sequence admitted in
    # them has finished, so that its latency is measured under the same load
    while phase < phases or pending:
        measuring = warmup_phases <= phase < phases
        if measuring and t_start is None:
            t_start = time.perf_counter()
        if phase == phases:
            t_end = time.perf_counter()
        for _ in range(batch_size):
            length = rng.choices(out.lengths, out.probs)[0]
            prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
            tracked = measuring and length == s99
            pending += tracked
            engine.submit(GenRequest((tracked, length), prompt, length, mode="full"))
        for _ in range(decode_iters):
            for f in engine.step():
                if f.error:
                    raise RuntimeError(f"generation failed during validation: {f.error}")
                tracked, _length = f.request_id
                finished += measuring
                if tracked:
                    lat99.append(f.total_s * 1000.0)
                    pending -= 1
        phase += 1
    seconds = (t_end or time.perf_counter()) - t_start
    return Measured((batch_size, decode_iters), finished / seconds,
                    statistics.mean(lat99) if lat99 else float("nan"), finished, seconds)


def validate_rra(repo: Path, model: str, workload: Workload, *, configs: list[tuple[int, int]], phases: int,
                 progress: bool = True) -> list[tuple[Prediction, Measured]]:
    """Predicted against measured for every ``(batch_size, decode_iters)`` of ``configs`` (workers must be 1)."""
    if workload.workers != 1:
        raise ValueError("the engine runs the model on one core: validate with workers=1")
    rows = []
    for b, nd in tqdm(configs, desc="RRA runs", unit="setting", disable=not progress):
        rows.append((simulate_rra(workload, b, nd), measure_rra(repo, model, workload, batch_size=b, decode_iters=nd, phases=phases)))
    return rows
