"""`e3 workload MODEL`: easy/hard workload mixes from the test split (E3 §5, §5.4).

Binning: an input is **easy** if the model, under its default exit rule,
answers it at a ramp in the first half of the blocks (exit block <= L/2),
and **hard** otherwise (a later ramp or the final head). E3 does not define
its bins beyond "easy inputs exit early"; this split makes both bins
non-empty for every zoo model and is written into every workload file.

Mixes 80:20, 50:50 and 20:80 (easy:hard) draw ``count`` inputs from the bins
(with replacement, seeded: a bin may be smaller than its share). The stream
concatenates the three mixes in that order (E3 §5.4 switches 80:20 -> 50:50 ->
20:80 at fixed times); its phase table gives where each mix starts, by input
index and by time at a nominal arrival rate.

Files (under ``artifacts/workloads/<model>/``): ``<name>.npz`` holds the model
inputs (arrays named like the model's inputs) plus ``exit_ramp``, ``label``
and ``hard`` per input, in arrival order; ``<name>.json`` holds the metadata,
the phase table and the per-input exit ramps (for forecaster replays);
``<name>.batch-profile.json`` is the batch profile the mix implies (the planner's
``--batch-profile`` input), with the reach measured for every set of enabled ramps (the rule replayed on
the mix's recorded ramp logits, :func:`reach_by_ramps`), so that the planner's exit-wrapper prices a
dependent rule's ramps exactly.

``--data FILE`` (:mod:`e3.models.user_data`) bins the file's inputs instead of a zoo model's test split,
for any model, and also writes ``data.npz``: every input of the file in its order (the distribution
``e3 plan --data FILE`` plans for), to replay with ``e3 load --workload``.
"""

from __future__ import annotations

import json
from itertools import combinations
from pathlib import Path

import numpy as np

from e3.core.cost import ramps_key
from e3.core.exits import make_exit_rule
from e3.core.files import atomic_path, write_json_atomic
from e3.core.names import served_name
from e3.core.profile import BatchProfile
from e3.models.evaluate import test_split_logits
from e3.models.training import all_exit_logits, simulate_exits
from e3.models.user_data import load_data
from e3.models.zoo import resolve_model

__all__ = ["MIXES", "build_workloads", "load_workload", "batch_profile_of", "reach_by_ramps", "data_batch_profile"]

MIXES = ((80, 20), (50, 50), (20, 80))
MAX_RAMP_SETS = 1024   # beyond this many sets of ramps (11+ ramps) the reach is not measured per set


def reach_by_ramps(logits: dict[int, np.ndarray], rule, num_blocks: int,
                   ramps: tuple[int, ...]) -> dict[str, list[float]]:
    """The share of inputs entering every block with each subset of ``ramps`` enabled, the rule replayed on
    the recorded ``logits`` (block -> [N, C], every ramp and the head), keyed by
    :func:`e3.core.cost.ramps_key`; {} when there are more than :data:`MAX_RAMP_SETS` subsets."""
    ramps = tuple(sorted(ramps))
    if 2 ** len(ramps) > MAX_RAMP_SETS:
        return {}
    out = {}
    for size in range(len(ramps) + 1):
        for subset in combinations(ramps, size):
            exits = simulate_exits(logits, rule, num_blocks, enabled=subset).exit_ramp
            out[ramps_key(subset)] = [float((exits >= k).mean()) for k in range(1, num_blocks + 1)]
    return out


def data_batch_profile(name: str, data, *, batch_size: int = 8, limit: int | None = None,
                       progress: bool = True) -> BatchProfile:
    """The batch profile of model ``name`` on the inputs of ``data`` (a ``.npz``, :mod:`e3.models.user_data`)
    under its own exit rule, with the reach of every set of ramps (:func:`reach_by_ramps`)."""
    model = resolve_model(name)
    card = model.card
    inputs, _ = load_data(data, card, limit=limit)
    logits = all_exit_logits(model, inputs, progress=progress, desc=f"exits of {name} on {Path(data).name}")
    rule = make_exit_rule(card.exit_rule)
    exit_ramp = simulate_exits(logits, rule, card.num_blocks).exit_ramp
    return batch_profile_of(exit_ramp, card.num_blocks, served_name(name), batch_size=batch_size,
                            source=f"{Path(data).name} ({len(exit_ramp)} inputs) of {name}",
                            exact=reach_by_ramps(logits, rule, card.num_blocks, card.ramp_blocks),
                            exit_rule=card.exit_rule)


def _mix_name(easy: int, hard: int) -> str:
    return f"mix-{easy}-{hard}"


def build_workloads(name: str, out_dir: Path, count: int = 1000, *, rate_rps: float = 50.0, seed: int = 0,
                    progress: bool = True, data: str | Path | None = None) -> list[Path]:
    """Write the three mixes and the switching stream for model ``name`` (its zoo test split, or the inputs
    of ``data``); returns the .npz paths."""
    model, inputs, labels, logits = test_split_logits(name, progress, desc="bin test inputs of", data=data)
    card = model.card
    L = card.num_blocks
    rule = make_exit_rule(card.exit_rule)
    exit_ramp = simulate_exits(logits, rule, L).exit_ramp
    hard = exit_ramp > L // 2
    bins = {False: np.flatnonzero(~hard), True: np.flatnonzero(hard)}
    if not len(bins[False]) or not len(bins[True]):
        raise ValueError(f"{name}: one bin is empty ({len(bins[False])} easy, {len(bins[True])} hard); "
                         "cannot build mixes")
    rng = np.random.default_rng(seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    names = [t.name for t in card.inputs]
    # enabled_ramps: the reference exits are recorded with every ramp on (what `e3 load` compares served exits with)
    common = {"model": name, "exit_rule": card.exit_rule, "num_blocks": L, "inputs": names,
              "enabled_ramps": list(card.ramp_blocks),
              "easy_rule": f"exit block <= {L // 2}", "test_easy": int(len(bins[False])),
              "test_hard": int(len(bins[True])), "seed": seed}
    picks, paths = {}, []
    for easy, hard_share in MIXES:
        n_easy = round(count * easy / 100)
        idx = np.concatenate([rng.choice(bins[False], n_easy), rng.choice(bins[True], count - n_easy)])
        picks[(easy, hard_share)] = rng.permutation(idx)
        paths.append(_write(out_dir / _mix_name(easy, hard_share), picks[(easy, hard_share)], inputs, names,
                            exit_ramp, labels, hard, (logits, rule, card),
                            {**common, "mix": f"{easy}:{hard_share}", "phases": [_phase(easy, hard_share, 0, count,
                                                                                        rate_rps)]}))
    stream = np.concatenate([picks[m] for m in MIXES])
    phases = [_phase(e, h, i * count, count, rate_rps) for i, (e, h) in enumerate(MIXES)]
    paths.append(_write(out_dir / "stream", stream, inputs, names, exit_ramp, labels, hard, (logits, rule, card),
                        {**common, "mix": "stream", "rate_rps": rate_rps, "phases": phases}))
    if data is not None:   # the file itself, in its order: what `e3 plan --data` plans for, to replay with e3 load
        every = np.arange(len(exit_ramp))
        paths.append(_write(out_dir / "data", every, inputs, names, exit_ramp, labels, hard, (logits, rule, card),
                            {**common, "mix": "data", "phases": [{"mix": "data", "start_index": 0,
                                                                  "count": int(len(every)), "start_s": 0.0}]}))
    return paths


def _phase(easy, hard, start, count, rate_rps):
    return {"mix": f"{easy}:{hard}", "start_index": start, "count": count, "start_s": start / rate_rps}


def batch_profile_of(exit_ramps: np.ndarray, num_blocks: int, model: str, *, batch_size: int = 8,
                     source: str = "", exact: dict | None = None, exit_rule: dict | None = None) -> BatchProfile:
    """The batch profile a stream of exit ramps implies: reach[k-1] = share of inputs entering block k
    (``exact``: the reach per set of enabled ramps, :func:`reach_by_ramps`; ``exit_rule``: the rule)."""
    reach = [float((exit_ramps >= k).mean()) for k in range(1, num_blocks + 1)]
    return BatchProfile(model=model, batch_size=batch_size, reach=reach, source=source,
                        reach_by_ramps=dict(exact or {}), exit_rule=dict(exit_rule or {}))


def _write(stem: Path, idx, inputs, names, exit_ramp, labels, hard, replay, meta) -> Path:
    logits, rule, card = replay
    exact = reach_by_ramps({k: v[idx] for k, v in logits.items()}, rule, card.num_blocks, card.ramp_blocks)
    batch_profile_of(exit_ramp[idx], meta["num_blocks"], served_name(meta["model"]),
                     source=f"{stem.name} of {meta['model']} (e3 workload)", exact=exact,
                     exit_rule=card.exit_rule).save(stem.with_suffix(".batch-profile.json"))
    arrays = {n: x[idx] for n, x in zip(names, inputs)}
    with atomic_path(stem.with_suffix(".npz")) as tmp:
        np.savez_compressed(tmp, **arrays, exit_ramp=exit_ramp[idx], label=labels[idx], hard=hard[idx])
    write_json_atomic(stem.with_suffix(".json"), {**meta, "count": int(len(idx)), "exit_ramp": exit_ramp[idx].tolist()},
                      sort_keys=False)
    return stem.with_suffix(".npz")


def load_workload(path: str | Path) -> tuple[dict[str, np.ndarray], dict]:
    """(model inputs by name, metadata incl. expected exit_ramp/label/hard arrays) of a workload file."""
    path = Path(path)
    meta = json.loads(path.with_suffix(".json").read_text())
    with np.load(path.with_suffix(".npz")) as data:
        inputs = {n: data[n] for n in meta["inputs"]}
        meta.update(exit_ramp=data["exit_ramp"], label=data["label"], hard=data["hard"])
    return inputs, meta
