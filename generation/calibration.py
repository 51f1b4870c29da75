"""A quality target instead of a raw threshold: calibrating CALM's exits to ``--min-agreement``, and measuring
the costs the never-slower rule decides with.

**What the target means.** ``min_agreement`` A is the bench's agreement: the share of generated positions
whose token equals the full model's greedy token at the same position, averaged over prompts.

**Method** (a simpler stand-in for CALM's Learn-then-Test, stated here): on calibration prompts (test-split
snippets 300.., disjoint from the bench's prompts and from the heads' training text)

1. the full model decodes greedily (the in-process engine over the exported splits);
2. one teacher-forced PyTorch pass over each prompt + continuation gives, at every decoded position and every
   exit e, the three confidence measures (softmax margin of head e, state saturation, the classifier's
   probability) and whether head e's top-1 equals the full model's token there;
3. for each measure, every combination of per-exit thresholds from a grid (quantiles of that measure's scores
   at that exit, plus "never") is replayed on those records: a position leaves at the first exit whose score
   reaches its threshold; a sequence is taken to agree with the full model up to its first position that
   leaves with a wrong token and **not after** (a continuation that diverged is assumed never to re-join:
   conservative), so its predicted agreement is (that position) / (tokens);
4. among combinations whose predicted agreement is >= A with 95% confidence (the mean over calibration
   prompts less 1.645 standard errors: a CLT bound standing in for CALM's Learn-then-Test), the one with the least predicted time per
   token under the measured cost table (:mod:`e3.generation.policy`) wins, over all measures; if even that
   is not faster than plain decoding, the target's entry is a **fallback** (no exits: plain decoding).

5. **validated by decoding**: the replay cannot see that after a token leaves with the right token its skipped
   layers' k/v are copied from the exit state, so later tokens' states differ from the full model's, and a
   continuation can diverge with no wrong exit at all (measured on SmolLM2: a choice replayed at 0.87
   agreement decoded at 0.39). So the replay's choices for a ladder of targets (0.8 .. 0.995) are decoded
   for real on the calibration prompts (the engine over the exported splits, KV copy as served), and each
   target gets the fastest decoded choice whose agreement holds at 95% confidence and which is predicted at
   least 1% faster than plain decoding (``MIN_GAIN``: within 1% the cost table cannot tell), or a fallback.

Speculation's per-position acceptance per draft depth is measured on the same records (head e's top-1
agreement with the full model on the full model's own continuation).
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from e3.generation.engine import GenerationEngine, GenRequest, OrtRunner, kvfill_name
from e3.generation.policy import MIN_GAIN, NEVER, Costs, SplitCost, calm_s_per_token

__all__ = ["profile_costs", "collect_records", "calibrate", "predict", "validate_by_decoding", "calibrate_model",
           "TARGETS"]

log = logging.getLogger(__name__)
TARGETS = (0.8, 0.9, 0.95, 0.99)
MEASURE_COLUMNS = ("softmax", "saturation", "classifier")
Z = 1.645       # one-sided 95%: a target must hold for the calibration's lower confidence bound


def _time(fn, repeats: int) -> float:
    fn()   # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def profile_costs(spec, run, *, rows: int = 16, past: int = 96, repeats: int = 7, hidden_size: int,
                  device: str = "cpu") -> Costs:
    """Measure the cost table of ``spec``'s stateless splits and kv-fill models through ``run`` (an
    :class:`e3.generation.engine.OrtRunner`): each split at 1 and ``rows`` rows of one position (fixed and
    per-position cost), the head's cost per call and per position (the last split with and without it at 1
    and ``rows`` rows), each exit's kv-fill model at 1 and ``rows`` rows. Medians of ``repeats`` timed calls.
    Served, every call also crosses a BLS hop: the router refits these from its own calls
    (:class:`e3.generation.policy.CostMeter`)."""
    kvh, d, L = spec.kv_heads, spec.head_dim, spec.num_layers
    rng = np.random.default_rng(0)

    def split_inputs(j, b, k):
        a, e = spec.ranges[j]
        x = (np.ones((b, 1), np.int64) if a == 1 else rng.standard_normal((b, 1, hidden_size)).astype(np.float32))
        return {"input_ids" if a == 1 else "hidden": x, "positions": np.full((b, 1), past, np.int64),
                "past_kv": np.zeros((b, e - a + 1, 2, kvh, past, d), np.float32),
                "key_valid": np.ones((b, past + 1), bool), "head_index": np.zeros((b, k), np.int64)}

    splits = []
    for j in range(len(spec.ranges)):
        name = spec.split(j)
        one = _time(lambda: run(name, split_inputs(j, 1, 0)), repeats)
        many = _time(lambda: run(name, split_inputs(j, rows, 0)), repeats)
        per = max(0.0, (many - one) / (rows - 1))
        splits.append(SplitCost(fixed_s=max(0.0, one - per), per_position_s=per))
    # the head: per call (its weights are read whatever the rows) and per row, from the last split's calls
    # with and without it at 1 and ``rows`` rows
    last = len(spec.ranges) - 1
    extra = {b: _time(lambda: run(spec.split(last), split_inputs(last, b, 1)), repeats)
             - _time(lambda: run(spec.split(last), split_inputs(last, b, 0)), repeats) for b in (1, rows)}
    head = max(0.0, (extra[rows] - extra[1]) / (rows - 1))
    head_fixed = max(0.0, extra[1] - head)
    fills = []
    for j, (_, e) in enumerate(spec.ranges[:-1]):   # each exit's kv fill: its own call, its own layers
        name = kvfill_name(spec.model, e + 1, L)
        fill = lambda b: run(name, {"hidden": rng.standard_normal((b, 1, hidden_size)).astype(np.float32),
                                    "positions": np.full((b, 1), past, np.int64),
                                    "head_index": np.zeros((b, 0), np.int64)})
        one, many = _time(lambda: fill(1), repeats), _time(lambda: fill(rows), repeats)
        fill_per = max(0.0, (many - one) / (rows - 1))
        fills.append(SplitCost(max(0.0, one - fill_per), fill_per))
    first = fills[0] if fills else SplitCost(0.0, 0.0)
    return Costs(splits=tuple(splits), head_s=head, fill_fixed_s=first.fixed_s, fill_per_row_s=first.per_position_s,
                 device=device, head_fixed_s=head_fixed, fills=tuple(fills))


def collect_records(model, spec, run, prompts: list[list[int]], *, new_tokens: int, progress: bool = True) -> dict:
    """Decode ``prompts`` with the full model (engine over ``run``), then score every decoded position at every
    exit (see the module docstring). Returns {"scores": {measure: [S_i x E] per sequence}, "correct": [S_i x
    E] bool per sequence, "tokens": full tokens per sequence}; S_i = tokens - 1 decoded positions of
    sequence i (the first token comes from prefill, never exits), E exits in split order."""
    # deferred: torch only to collect records (the replay and the cost profile load none)
    import torch
    from e3.generation.decoder import softmax_margin
    from e3.generation.training import collect_states
    engine = GenerationEngine(spec, run)
    for i, p in enumerate(prompts):
        engine.submit(GenRequest(i, p, new_tokens, mode="full"))
    done = {}
    with tqdm(total=len(prompts), desc="calibration: full-model continuations", unit="prompt",
              disable=not progress) as bar:
        while not engine.idle:
            for f in engine.step():
                done[f.request_id] = f
                bar.update(1)
    tokens = [done[i].tokens for i in range(len(prompts))]
    exits = [b for _, b in spec.ranges[:-1]]
    L = model.config.num_layers
    seqs = [p + t[:-1] for p, t in zip(prompts, tokens)]
    states = collect_states(model, seqs, sorted({L, *exits, *(e - 1 for e in exits)}), progress=progress,
                            desc="calibration: scoring decoded positions")
    scores = {m: [] for m in MEASURE_COLUMNS}
    correct = []
    at = 0
    with torch.no_grad():
        for p, t, seq in zip(prompts, tokens, seqs):
            sl = slice(at + len(p), at + len(seq))    # decoded positions: inputs tokens[0..-2]
            at += len(seq)
            full = model.head_logits(states[L][sl], L).argmax(-1)
            cols = {m: [] for m in MEASURE_COLUMNS}
            ok = []
            for e in exits:
                logits = model.head_logits(states[e][sl], e)
                cols["softmax"].append(softmax_margin(logits))
                sc = model.exit_scores(states[e][sl], states[e - 1][sl], e)
                cols["saturation"].append(sc[:, 0])
                cols["classifier"].append(sc[:, 1])
                ok.append(logits.argmax(-1) == full)
            for m in MEASURE_COLUMNS:
                scores[m].append(torch.stack(cols[m], 1).numpy().astype(np.float64) if exits
                                 else np.zeros((len(t) - 1, 0)))
            correct.append(torch.stack(ok, 1).numpy() if exits else np.zeros((len(t) - 1, 0), bool))
    return {"scores": scores, "correct": correct, "tokens": tokens}


def _pack(scores: list[np.ndarray], correct: list[np.ndarray]):
    """Records padded into S [N, T, E] scores (-inf past a sequence's end: never leaves), C [N, T, E], and
    tokens per sequence [N]."""
    N, E = len(scores), (scores[0].shape[1] if scores else 0)
    T = max((len(x) for x in scores), default=0)
    S = np.full((N, T, E), -np.inf)
    C = np.zeros((N, T, E), bool)
    for i, (sc, ok) in enumerate(zip(scores, correct)):
        S[i, :len(sc)] = sc
        C[i, :len(ok)] = ok
    return S, C, np.array([len(x) + 1 for x in scores])


def _replay(S, C, n_tokens, thr) -> tuple[np.ndarray, np.ndarray]:
    """Per sequence predicted agreement [N], and exits per exit index (E: the final head) [E + 1]."""
    N, T, E = S.shape
    hit = S >= np.asarray(thr, np.float64)[None, None, :]
    anyhit = hit.any(2)
    first = np.where(anyhit, hit.argmax(2), E)                       # [N, T]
    took = np.take_along_axis(C, np.minimum(first, max(E - 1, 0))[..., None], 2)[..., 0] if E else anyhit
    wrong = anyhit & ~took
    w = np.where(wrong.any(1), wrong.argmax(1), n_tokens - 1)        # first wrong row, else all agree
    agree = (w + 1) / n_tokens                                       # tokens 0..w agree (token 0: prefill)
    valid = np.arange(T)[None, :] < (n_tokens - 1)[:, None]
    counts = np.bincount(first[valid], minlength=E + 1)
    return agree, counts


def predict(scores: list[np.ndarray], correct: list[np.ndarray], thresholds, costs: Costs, *, measure: str,
            batch: int) -> dict:
    """Replay ``thresholds`` (one per exit) on the records: predicted agreement (mean over sequences, see the
    module docstring) and its lower confidence bound, exit rate per exit, and predicted seconds per token
    under ``costs`` with ``batch`` rows per step."""
    return _predict(_pack(scores, correct), thresholds, costs, measure=measure, batch=batch)


def _predict(packed, thresholds, costs: Costs, *, measure: str, batch: int) -> dict:
    S, C, n_tokens = packed
    agree, counts = _replay(S, C, n_tokens, thresholds)
    rates = counts / max(1, counts.sum())
    mean = float(agree.mean()) if len(agree) else 1.0
    se = float(agree.std(ddof=1) / np.sqrt(len(agree))) if len(agree) > 1 else 0.0
    return {"agreement": mean, "agreement_lower": mean - Z * se, "exit_rate": rates[:-1].tolist(),
            "s_per_token": calm_s_per_token(costs, rates, measure=measure, batch=batch)}


def raw_table(scores: list[np.ndarray], correct: list[np.ndarray], *, grid: int = 40) -> dict:
    """One measure's replay of a raw threshold (the same ``tau`` at every exit) on a grid of taus (quantiles of
    the measure's pooled scores, plus "never"): exit rate per exit and predicted agreement per tau. What a
    request's raw ``tau`` is predicted against (:func:`e3.generation.policy.predict_raw`)."""
    packed = _pack(scores, correct)
    E = packed[0].shape[2]
    pooled = np.concatenate([x.reshape(-1) for x in scores]) if scores else np.zeros(0)
    taus = sorted(set(np.quantile(pooled, np.linspace(0, 1, grid + 1)).round(6).tolist())) if len(pooled) else []
    rows = []
    for tau in [*taus, NEVER]:
        agree, counts = _replay(*packed, [tau] * E)
        rows.append(((counts / max(1, counts.sum()))[:E].tolist(), float(agree.mean()) if len(agree) else 1.0))
    return {"taus": [*taus, NEVER], "exit_rate": [r for r, _ in rows], "agreement": [a for _, a in rows]}


def calibrate(records: dict, costs: Costs, targets=TARGETS, *, batch: int = 16, grid: int = 40) -> dict:
    """The calibration document (see the module docstring): per target the chosen measure and thresholds,
    predicted agreement / exit rates / speed-up, or a fallback; speculation's acceptance per draft depth."""
    correct = records["correct"]
    n_exits = correct[0].shape[1] if correct else 0
    plain_s = calm_s_per_token(costs, np.eye(n_exits + 1)[n_exits], measure="classifier", batch=batch)
    candidates = {}
    for measure in MEASURE_COLUMNS:
        scores = records["scores"][measure]
        packed = _pack(scores, correct)
        pooled = np.concatenate(scores) if scores else np.zeros((0, n_exits))
        grids = [np.unique(np.quantile(pooled[:, j], np.linspace(0, 1, grid + 1))).tolist() + [NEVER]
                 if len(pooled) else [NEVER] for j in range(n_exits)]
        combos = np.array(np.meshgrid(*grids, indexing="ij")).reshape(n_exits, -1).T if n_exits else np.zeros((1, 0))
        candidates[measure] = [(c, _predict(packed, c, costs, measure=measure, batch=batch)) for c in combos]
    doc = {"method": "per-exit thresholds replayed on calibration records (generation/calibration.py)",
           "targets": [], "plain_s_per_token": plain_s, "batch": batch,
           "raw": {m: raw_table(records["scores"][m], correct) for m in MEASURE_COLUMNS} if correct else {},
           "z": Z, "acceptance": {str(j): float(np.mean(np.concatenate([c[:, j] for c in correct])))
                          for j in range(n_exits)} if correct else {},
           "prompts": len(correct), "positions": int(sum(len(c) for c in correct))}
    for target in targets:
        best = None
        for measure, rows in candidates.items():
            for thr, p in rows:
                if p["agreement_lower"] >= target and (best is None or p["s_per_token"] < best[2]["s_per_token"]):
                    best = (measure, thr, p)
        measure, thr, p = best if best else ("classifier", [NEVER] * n_exits, {"agreement": 1.0,
                                                                               "exit_rate": [0.0] * n_exits,
                                                                               "s_per_token": plain_s})
        speedup = float(plain_s / p["s_per_token"]) if p["s_per_token"] else 1.0
        fallback = bool(speedup < MIN_GAIN or not any(p["exit_rate"]))
        doc["targets"].append({"min_agreement": target, "measure": measure,
                               "thresholds": [NEVER] * n_exits if fallback else [float(x) for x in thr],
                               "predicted_agreement": 1.0 if fallback else p["agreement"],
                               "predicted_exit_rate": [0.0] * n_exits if fallback else p["exit_rate"],
                               "predicted_speedup": 1.0 if fallback else speedup, "fallback": fallback,
                               "best_replayed": {"thresholds": [float(x) for x in thr], **p, "speedup": speedup}})
    return doc


REPLAY_TARGETS = (0.8, 0.9, 0.95, 0.97, 0.99, 0.995)   # the ladder of replayed choices decoded for real


def validate_by_decoding(doc: dict, records: dict, costs: Costs, decode, *, batch: int,
                         replay_targets=REPLAY_TARGETS, progress: bool = True) -> dict:
    """Step 5 of the module docstring: the replay's choices for ``replay_targets`` (distinct measure and
    thresholds), each decoded for real on the calibration prompts by ``decode(measure, thresholds) -> (tokens
    per prompt, exit layers per prompt)``; per target of ``doc`` the fastest choice whose decoded agreement
    holds at 95% confidence, else a fallback. Returns ``doc`` with its targets replaced (the replay's own
    choice kept as ``replayed``)."""
    replay = calibrate(records, costs, replay_targets, batch=batch)
    seen, choices = set(), []
    for t in replay["targets"]:
        key = (t["measure"], tuple(t["thresholds"]))
        if not t["fallback"] and key not in seen:
            seen.add(key)
            choices.append(key)
    full = records["tokens"]
    E = len(records["correct"][0][0]) if records["correct"] and len(records["correct"][0]) else 0
    tried = []
    for measure, thr in tqdm(choices, desc="calibration: decoding the candidates", unit="candidate",
                             disable=not progress):
        tokens, exits = decode(measure, list(thr))
        agree = np.array([sum(a == b for a, b in zip(t, f)) / max(1, len(f)) for t, f in zip(tokens, full)])
        counts = np.zeros(E + 1)
        for ex in exits:
            for layer_index in ex[1:]:
                counts[layer_index] += 1
        rates = counts / max(1, counts.sum())
        se = float(agree.std(ddof=1) / np.sqrt(len(agree))) if len(agree) > 1 else 0.0
        tried.append({"measure": measure, "thresholds": list(thr), "agreement": float(agree.mean()),
                      "agreement_lower": float(agree.mean()) - Z * se, "exit_rate": rates[:E].tolist(),
                      "s_per_token": calm_s_per_token(costs, rates, measure=measure, batch=batch)})
    plain = doc["plain_s_per_token"]
    targets = []
    for t in doc["targets"]:
        ok = [c for c in tried if c["agreement_lower"] >= t["min_agreement"] and any(c["exit_rate"])
              and plain / c["s_per_token"] >= MIN_GAIN]
        best = min(ok, key=lambda c: c["s_per_token"]) if ok else None
        entry = {"min_agreement": t["min_agreement"], "replayed": {k: t[k] for k in (
            "measure", "thresholds", "predicted_agreement", "predicted_exit_rate", "predicted_speedup")}}
        if best is None:
            entry.update(measure="classifier", thresholds=[NEVER] * E, predicted_agreement=1.0,
                         predicted_exit_rate=[0.0] * E, predicted_speedup=1.0, fallback=True)
        else:
            entry.update(measure=best["measure"], thresholds=best["thresholds"],
                         predicted_agreement=best["agreement"], predicted_exit_rate=best["exit_rate"],
                         predicted_speedup=plain / best["s_per_token"], fallback=False)
        entry["best_replayed"] = t["best_replayed"]
        targets.append(entry)
    return {**doc, "targets": targets, "decoded_candidates": tried,
            "method": doc["method"] + "; candidates validated by decoding the calibration prompts"}


def _decoder(spec, run, prompts: list[list[int]], new_tokens: int):
    """``decode(measure, thresholds)`` for :func:`validate_by_decoding`: the engine over ``run`` (CALM exits with
    the KV copy, as served); exit layers as indices (0.. per exit, E for the final head)."""
    index = {b: j for j, (_, b) in enumerate(spec.ranges)}

    def decode(measure: str, thresholds: list[float]):
        engine = GenerationEngine(spec, run)
        for i, p in enumerate(prompts):
            engine.submit(GenRequest(i, p, new_tokens, mode="calm", measure=measure, thresholds=tuple(thresholds)))
        done = {}
        while not engine.idle:
            done.update({f.request_id: f for f in engine.step()})
        got = [done[i] for i in range(len(prompts))]
        return [f.tokens for f in got], [[index[e] for e in f.exit_layers] for f in got]
    return decode


def calibrate_model(model, spec, files: dict, prompts: list[list[int]], *, new_tokens: int = 32,
                    cache: Path | None = None, progress: bool = True) -> tuple[dict, dict]:
    """(costs, calibration) for an exported model: profile the splits, collect records on ``prompts``,
    calibrate every target in :data:`TARGETS`. Cached in ``cache`` (JSON) when given."""
    if cache is not None and cache.exists():
        saved = json.loads(cache.read_text())
        return saved["costs"], saved["calibration"]
    import torch   # deferred: a cached calibration loads no torch
    run = OrtRunner(files)
    started = time.perf_counter()
    costs = profile_costs(spec, run, hidden_size=model.config.hidden_size)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # pinned like the splits (one intra-op thread)
    try:
        records = collect_records(model, spec, run, prompts, new_tokens=new_tokens, progress=progress)
    finally:
        torch.set_num_threads(threads)
    doc = calibrate(records, costs, batch=spec.max_active)
    doc = validate_by_decoding(doc, records, costs, _decoder(spec, run, prompts, new_tokens), batch=spec.max_active,
                               progress=progress)
    doc["calibrate_s"] = time.perf_counter() - started
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps({"costs": costs.to_dict(), "calibration": doc}, indent=1))
    return costs.to_dict(), doc
