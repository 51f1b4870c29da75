"""Profiler of the served decoder for the ExeGPT simulator: per-layer latency of prefill (by tokens) and of
one decode step (by batch), measured on one exported split with ONNX Runtime, one pinned intra-op thread
(the served runtime and the core budget of one Triton instance).

The split measured is the last one, which must not hold layer 1 (it takes ``hidden`` rather than token ids,
so no embedding lookup is counted). Layers: with no head read (``head_index`` with K = 0 costs nothing), its
latency divided by its layer count is the cost of one layer. The final head (norm, the tied 49,152 x 576 LM
head, argmax; about 8 layers' worth on SmolLM2): the same decode step reading one position per row, minus
the step without. Decision: the early-exit heads are left out, since the schedules simulated here run the
full model (their cost is measured by ``e3 bench generate``).

The result is cached as JSON (:meth:`LayerProfile.from_dict` reads it), keyed by the ONNX file's size and
modification time and the measurement settings, so a re-run with the same split is free.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from e3.core.session import make_session
from e3.generation.exegpt.workload import LayerProfile

__all__ = ["ProfileSettings", "profile_split", "cached_profile"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProfileSettings:
    """What is measured. Prefill chunks hold ``prefill_rows`` prompts of ``prompt_tokens`` tokens each
    (tokens = rows x prompt_tokens); decode steps attend to ``decode_context`` cached positions."""

    prompt_tokens: int = 32
    prefill_rows: tuple[int, ...] = (1, 2, 4, 8)
    decode_batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    decode_context: int = 64
    repeats: int = 9                 # timed runs per point (the fastest taken), after one warm-up
    intra_op_threads: int = 1


def _split_inputs(session, rows: int, chunk: int, past: int, rng: np.random.Generator, heads: int = 0) -> dict:
    shapes = {i.name: i.shape for i in session.get_inputs()}
    if "hidden" not in shapes:
        raise ValueError("profile a split that does not hold layer 1 (its input must be 'hidden', not token ids)")
    hidden = shapes["hidden"][2]
    _, n, two, kvh, _, d = shapes["past_kv"]
    return {"hidden": rng.standard_normal((rows, chunk, hidden), dtype=np.float32),
            "positions": np.broadcast_to(past + np.arange(chunk, dtype=np.int64), (rows, chunk)).copy(),
            "past_kv": rng.standard_normal((rows, n, two, kvh, past, d), dtype=np.float32),
            "key_valid": np.ones((rows, past + chunk), dtype=bool),
            "head_index": np.full((rows, heads), chunk - 1, dtype=np.int64)}


def _fastest_ms(session, inputs: dict, repeats: int) -> float:
    """The fastest of ``repeats`` runs: on a shared machine other processes only ever add time, and the
    median still carried it (head costs measured 12 to 141 ms at neighbouring batch sizes under load)."""
    session.run(None, inputs)                       # warm-up: allocations, first-run kernel choices
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        session.run(None, inputs)
        times.append((time.perf_counter() - t0) * 1000.0)
    return min(times)


def profile_split(onnx_path: str | Path, split_layers: int, num_layers: int,
                  *, settings: ProfileSettings = ProfileSettings(), progress: bool = True,
                  final_head: bool = False) -> LayerProfile:
    """Measure one split (``split_layers`` layers of a ``num_layers``-layer decoder) and return the per-layer
    profile; with ``final_head`` (the split holds layer L) also the final head's cost per decode batch, as the
    same step with and without reading the head. Takes seconds for SmolLM2 (a tqdm bar shows the points)."""
    import onnxruntime as ort   # deferred: only a measurement loads ONNX Runtime (a cached profile does not)
    ort.set_default_logger_severity(3)   # the unread head (K = 0) warns about its empty output's shape
    session = make_session(str(onnx_path), settings.intra_op_threads)
    rng = np.random.default_rng(0)
    points = [("prefill", r) for r in settings.prefill_rows] + [("decode", b) for b in settings.decode_batches]
    if final_head:
        points += [("head", b) for b in settings.decode_batches]
    prefill_ms, decode_ms, head_ms = [], [], []
    for kind, size in tqdm(points, desc="profiling layers", unit="point", disable=not progress):
        if kind == "prefill":
            inputs = _split_inputs(session, size, settings.prompt_tokens, 0, rng)
            prefill_ms.append(_fastest_ms(session, inputs, settings.repeats) / split_layers)
        elif kind == "decode":
            inputs = _split_inputs(session, size, 1, settings.decode_context, rng)
            decode_ms.append(_fastest_ms(session, inputs, settings.repeats) / split_layers)
        else:   # the same step reading the head: the difference is the head's cost
            inputs = _split_inputs(session, size, 1, settings.decode_context, rng, heads=1)
            with_head = _fastest_ms(session, inputs, settings.repeats)
            layers = decode_ms[settings.decode_batches.index(size)] * split_layers
            head_ms.append(max(with_head - layers, 0.0))
    tokens = [r * settings.prompt_tokens for r in settings.prefill_rows]
    batches = tuple(float(b) for b in settings.decode_batches)
    return LayerProfile(num_layers, tuple(float(t) for t in tokens), tuple(prefill_ms), batches,
                        tuple(decode_ms), 0.0, batches if final_head else (), tuple(head_ms))


def cached_profile(onnx_path: str | Path, split_layers: int, num_layers: int, *, cache: Path,
                   settings: ProfileSettings = ProfileSettings(), progress: bool = True,
                   final_head: bool = False) -> LayerProfile:
    """:func:`profile_split`, reusing ``cache`` when it was measured from the same file with the same settings.

    The cache is written atomically (a temporary file renamed over it)."""
    st = os.stat(onnx_path)
    key = {"onnx": str(Path(onnx_path).resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
           "split_layers": split_layers, "final_head": final_head, "settings": asdict(settings)}
    key["settings"] = json.loads(json.dumps(key["settings"]))   # tuples as lists, as they come back from JSON
    if cache.exists():
        try:
            doc = json.loads(cache.read_text())
            if doc.get("key") == key:
                return LayerProfile.from_dict(doc["profile"])
        except (ValueError, KeyError) as e:
            log.warning("ignoring unreadable profile cache %s (%s)", cache, e)
    profile = profile_split(onnx_path, split_layers, num_layers, settings=settings, progress=progress, final_head=final_head)
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(".tmp")
    tmp.write_text(json.dumps({"key": key, "profile": profile.to_dict()}, indent=1))
    tmp.replace(cache)
    return profile
