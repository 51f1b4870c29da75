"""The generation engine: continuous batching across sequences with per-token exits, over split models.

Pure numpy and bookkeeping; it computes nothing itself. Every model call goes through ``run(model_name,
inputs) -> outputs`` (tensors as in :mod:`e3.generation.onnx_splits`), so the same engine drives the served
splits by BLS inside Triton (``generation/generate_router.py``), or ONNX Runtime sessions in-process
(:class:`OrtRunner`: tests without a server, and the benchmark's single-process form).

One :meth:`GenerationEngine.step`:

1. **admit** waiting sequences up to ``max_active`` and prefill them together (prompts right-padded into one
   chunk, every split, the final head read at each prompt's last position: no exits in prefill);
2. **decode** one token for every active CALM/full sequence: the batch enters split 1; after each split,
   rows whose confidence there is >= their threshold leave, their skipped layers' k/v filled from the exit
   layer's state by the kv-fill model (CALM); the **survivors are re-batched** and go on to the next split
   (E3 for generation: the batch shrinks between splits, never inside one). The confidence is the request's
   ``measure``: ``softmax`` (CALM's softmax response: the split reads its exit head for every row, and a
   leaving row takes that head's token) or a cheap one the split computes without the head, ``saturation``
   or ``classifier`` (then only a leaving row pays for the head, in the kv-fill call that fills its cache
   anyway). A request gives ``min_agreement`` instead, resolved against the spec's calibration (measure and
   thresholds per exit, :func:`e3.generation.policy.resolve_target`); a calibration whose exits did not pay
   has no exits (plain decoding). Sequences in ``full`` mode never read a ramp's head;
3. **speculate** for sequences in ``speculative`` mode (LayerSkip, lossless): draft up to ``draft_tokens``
   tokens with the splits up to a ramp and its exit head, verify them with the remaining splits in one pass
   over the drafted positions, keep the agreed prefix plus the full model's correction, truncate the rest of
   the cache. With measured costs in the spec, :class:`e3.generation.policy.SpeculationPolicy` chooses each
   step's draft depth and length from the acceptance measured so far, and decodes the rows plainly when no
   draft pays (never slower than the full model, and the same tokens either way);
4. return the sequences that finished (``eos_id`` produced, or ``max_new_tokens`` reached).

With ``max_active = 1`` sequences run one after another, whole: the naive form (no batching across
sequences, nothing to re-batch). With ``kv_in_splits`` the splits keep the cache
(:mod:`e3.generation.kv_store`): calls carry sequence ids and lengths instead of cache slices, and kv fills
travel to a split with the sequence's next call there.

Two engines can share the work of one sequence (ExeGPT's WAA: an encode worker and a decode worker, each
with its own split models): :meth:`GenerationEngine.encode` on the first (its splits stateless, the cache
kept here) admits and prefills without decoding and hands the prefilled sequences out, caches included;
:meth:`GenerationEngine.adopt` on the second makes them active there. When the second engine's splits keep
the cache, the prompt's k/v travel as appends with each split's next call for the sequence (the same path as
CALM's fills), so the hand-over is one copy of the prompt's k/v per split, and no split recomputes it.

The KV cache of each sequence lives here, as ``[L, 2, kv_heads, capacity, head_dim]`` float32, grown by
doubling; each split call gets its rows' cache slice, right-padded to the longest (``key_valid`` marks it).
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np

from e3.core.names import split_name
from e3.core.session import make_session
from e3.generation.policy import (MIN_GAIN, NEVER, CostMeter, Costs, SpeculationPolicy, predict_raw,
                                  resolve_entry, speedup)
from e3.generation.spec import MEASURES, MODES, EngineSpec, Finished, GenRequest, kvfill_name   # re-exported

# The engine's inputs and outputs live in spec.py; they are re-exported here, where most callers import them.
__all__ = ["GenerationEngine", "OrtRunner", "REFRESH_STEPS", "EngineSpec", "GenRequest", "Finished", "MODES",
           "MEASURES", "split_name", "kvfill_name"]

log = logging.getLogger(__name__)
REFRESH_STEPS = 32                            # steps between refits of the served costs
Runner = Callable[[str, dict], dict]


@dataclass
class _Seq:
    req: GenRequest
    kv: np.ndarray                      # [L, 2, kvh, capacity, d]
    lengths: list[int]                  # cached positions per split (differ only while drafting)
    admitted: float
    sid: int = 0                        # sequence id (the splits' key when they keep the cache)
    tokens: list[int] = field(default_factory=list)
    exits: list[int] = field(default_factory=list)
    confs: list[float] = field(default_factory=list)
    first_token_s: float = 0.0
    pending: dict = field(default_factory=dict)   # kv_in_splits: split -> fills [n, 2, kvh, 1, d] to append

    @property
    def position(self) -> int:          # position of the next input token (= its last token's)
        return len(self.req.prompt) + len(self.tokens) - 1


class GenerationEngine:
    """See the module docstring. Not thread-safe: one thread calls :meth:`submit` and :meth:`step`
    (or guard them with one lock)."""

    def __init__(self, spec: EngineSpec, run: Runner, admit_ok: Callable[[GenRequest], bool] | None = None):
        """``admit_ok(request)``: whether a waiting request may start now (a memory budget, HELIOS); checked in
        arrival order after ``max_active``, and a refused request keeps its place at the head of the queue."""
        self.spec, self.run, self.admit_ok = spec, run, admit_ok
        self.waiting: deque[tuple[GenRequest, float]] = deque()
        self.active: list[_Seq] = []
        self.steps = 0
        self.split_rows: list[list[int]] = [[] for _ in spec.ranges]   # rows per decode call, per split
        # Sequence ids are keys in the splits' caches, which several routers may share: start at random.
        self.next_sid = int.from_bytes(os.urandom(5), "little") << 20
        self.kv_gather_s = 0.0     # time spent assembling and storing cache slices (the price of passing KV)
        self.call_s = 0.0          # time spent in model calls
        self.decide_s = 0.0        # time spent deciding exits (reading scores, comparing, re-batching)
        self.exit_head_rows = 0    # rows whose exit head was computed only because they left (cheap measures)
        self.ramp_head_rows = 0    # rows whose exit head was read at a ramp to decide (softmax measure)
        self.drafted = 0           # speculative positions drafted ...
        self.accepted = 0          # ... and accepted
        # the costs as served: the export's profile, refitted from this engine's own timed calls
        self.meter = CostMeter(Costs.from_dict(spec.costs)) if spec.costs else None
        self._served_costs: Costs | None = None
        self._costs_at: int | None = None
        self.policy = (SpeculationPolicy(Costs.from_dict(spec.costs), {
            int(d): a for d, a in (spec.calibration or {}).get("acceptance", {}).items()})
            if spec.costs and (spec.calibration or {}).get("acceptance")
            and len(spec.costs["splits"]) == len(spec.ranges) else None)   # a partial model (HELIOS) drafts as asked

    # -- public --------------------------------------------------------------------------------------
    def submit(self, req: GenRequest) -> None:
        """Queue a request (checked first: ValueError on a bad one); a ``min_agreement`` is resolved here, and a
        CALM request predicted slower than plain decoding is served plainly (or refused: ``on_slower``)."""
        req = self._plan(req)
        req.check(self.spec)
        self.waiting.append((req, time.perf_counter()))

    def costs(self) -> Costs | None:
        """The cost table the decisions read: the profile, with each kind of call as served once timed (refitted
        every ``REFRESH_STEPS`` steps; the speculation policy reads the same table); None without a profile."""
        if self.meter is None:
            return None
        if self._costs_at is None or self.steps - self._costs_at >= REFRESH_STEPS:
            self._served_costs, self._costs_at = self.meter.costs(), self.steps
            if self.policy is not None:
                self.policy.costs = self._served_costs
        return self._served_costs

    def _plan(self, req: GenRequest) -> GenRequest:
        """Never slower: resolve a CALM request's exits and predict them under the served costs at the batch it
        joins; exits predicted below ``MIN_GAIN`` x plain decoding become plain decoding (the same calls as
        ``full``), or a ValueError with the reason when the request says ``on_slower="refuse"``. The outcome is
        written into ``req.note`` (the router returns it as ``served_as``)."""
        if req.mode != "calm":
            return replace(req, note={"e3_mode": req.mode})
        E = len(self.spec.ranges) - 1
        rows = max(1, min(self.spec.max_active, len(self.active) + len(self.waiting) + 1))
        costs = self.costs()
        if req.min_agreement is not None:
            entry = resolve_entry(self.spec.calibration, req.min_agreement)
            req = replace(req, measure=entry["measure"], thresholds=tuple(float(x) for x in entry["thresholds"]))
            what = f"min_agreement {req.min_agreement:g} (calibrated target {entry['min_agreement']:g})"
            if entry.get("fallback"):
                return replace(req, note={"e3_mode": "full", "e3_fallback": True, "e3_reason": (
                    f"{what}: no exits are predicted to pay at calibration; decoded plainly")})
            if costs is None or "predicted_exit_rate" not in entry:   # nothing to re-predict with: as calibrated
                return replace(req, note={"e3_mode": "calm", "e3_reason": f"{what}: as calibrated"})
            pred = {"speedup": speedup(costs, entry["predicted_exit_rate"], measure=req.measure, batch=rows)}
        elif req.thresholds is None:
            if req.tau > 1.0:
                return replace(req, note={"e3_mode": "full", "e3_reason": f"tau {req.tau:g} > 1: no exits"})
            what = f"tau {req.tau:g} ({req.measure})"
            pred = (predict_raw(self.spec.calibration, costs, measure=req.measure, tau=req.tau, batch=rows)
                    if costs is not None else None)
            if pred is None:
                return replace(req, note={"e3_mode": "calm", "e3_reason": "not predicted: the model has no "
                                                                           "calibration or cost profile"})
        else:
            return replace(req, note={"e3_mode": "calm"})   # explicit thresholds (in-process callers)
        gain = float(pred["speedup"])
        note = {"e3_predicted_speedup": f"{gain:.3f}", "e3_rows": rows}
        if gain >= MIN_GAIN or req.on_slower == "serve":
            return replace(req, note={**note, "e3_mode": "calm"})
        reason = (f"{what} is predicted at {gain:.2f}x plain decoding's speed at {rows} rows under the served "
                  f"costs (exits must be predicted >= {MIN_GAIN:g}x)")
        if req.on_slower == "refuse":
            raise ValueError(f"refused (on_slower=refuse): {reason}")
        return replace(req, thresholds=(NEVER,) * E,
                       note={**note, "e3_mode": "full", "e3_fallback": True, "e3_reason": reason + "; decoded plainly"})

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.active

    def step(self) -> list[Finished]:
        """Admit, decode one token (or one speculative round) per active sequence; the finished ones."""
        self.steps += 1
        done: list[Finished] = []
        fresh = self._admit()
        try:
            if fresh:
                self._prefill(fresh)
            old = [s for s in self.active if s not in fresh and not self._finished(s)]
            plain = [s for s in old if s.req.mode != "speculative"]
            spec = [s for s in old if s.req.mode == "speculative"]
            depth, k_max = 0, None
            if spec and self.policy is not None:
                self.costs()   # the policy drafts under the costs as served
                depth, k_max = self.policy.choose(len(spec), max(s.req.draft_tokens for s in spec))
                if k_max == 0:               # no draft pays now: these rows decode plainly (same tokens)
                    plain, spec = plain + spec, []
            if plain:
                self._decode(plain)
            lengths = {id(s): self._draft_len(s) if k_max is None else min(k_max, self._draft_len(s)) for s in spec}
            for k in sorted(set(lengths.values())):
                self._speculate([s for s in spec if lengths[id(s)] == k], k, depth)
        except Exception as e:   # a failed model call fails the sequences of this step, not the engine
            log.exception("generation step failed")
            now = time.perf_counter()
            done = [Finished(s.req.request_id, s.tokens, s.exits, s.first_token_s, now - s.admitted,
                             error=f"generation failed: {e}", confidences=s.confs, note=s.req.note)
                    for s in self.active]
            gone, self.active = self.active, []
            self._release(gone)
            return done
        now = time.perf_counter()
        gone = [s for s in self.active if self._finished(s)]
        for s in gone:
            self.active.remove(s)
            done.append(Finished(s.req.request_id, s.tokens, s.exits, s.first_token_s, now - s.admitted,
                                 confidences=s.confs, note=s.req.note))
        self._release(gone)
        return done

    def encode(self) -> tuple[list[_Seq], list[Finished]]:
        """Admit the waiting requests (up to ``max_active``) and prefill them together, then hand them out: the
        prefilled sequences (first token chosen, cache filled) leave this engine for another's :meth:`adopt`.
        Returns (prefilled sequences, failures). The caller must not also :meth:`step` this engine while
        sequences it should keep are active. Needs ``kv_in_splits`` False (the cache must travel with the
        sequence)."""
        if self.spec.kv_in_splits:
            raise ValueError("encode() hands sequences over with their cache: it needs kv_in_splits False")
        fresh = self._admit()
        if not fresh:
            return [], []
        self.steps += 1
        ids = {id(s) for s in fresh}
        self.active = [s for s in self.active if id(s) not in ids]
        try:
            self._prefill(fresh)
        except Exception as e:   # the batch fails, the engine lives on
            log.exception("prefill for hand-over failed")
            now = time.perf_counter()
            return [], [Finished(s.req.request_id, s.tokens, s.exits, s.first_token_s, now - s.admitted,
                                 error=f"generation failed: {e}", confidences=s.confs) for s in fresh]
        return fresh, []

    def adopt(self, seqs: list[_Seq]) -> None:
        """Make ``seqs``, prefilled by another engine's :meth:`encode`, active here (past ``max_active``: the
        caller decides admissions); the next :meth:`step` decodes them (or reports those already finished).
        Each gets a sequence id of this engine. When this engine's splits keep the cache, the prompt's k/v are
        queued as appends for each split (written at positions [0, prompt) on its next call); otherwise the
        cache stays with the sequence, as handed over."""
        L, kvh, d = self.spec.num_layers, self.spec.kv_heads, self.spec.head_dim
        for s in seqs:
            if s.kv.shape[3] < max(s.lengths):
                raise ValueError("adopt() needs sequences whose cache travelled with them (encode() of an "
                                 "engine whose splits do not keep the cache)")
            self.next_sid += 1
            s.sid = self.next_sid
            s.pending = {}
            if self.spec.kv_in_splits:
                for j, (a, b) in enumerate(self.spec.ranges):
                    if s.lengths[j]:
                        s.pending[j] = [s.kv[a - 1:b, :, :, :s.lengths[j]].copy()]
                s.kv = np.zeros((L, 2, kvh, 0, d), np.float32)
            self.active.append(s)

    def _release(self, seqs: list[_Seq]) -> None:
        """Splits that keep caches drop those of finished sequences (best effort: a failure is logged)."""
        if not self.spec.kv_in_splits or not seqs:
            return
        ids = np.array([s.sid for s in seqs], np.int64)
        for j in range(len(self.spec.ranges)):
            try:
                self.run(self.spec.split(j), {"release_ids": ids})
            except Exception:
                log.exception("releasing caches in %s failed", self.spec.split(j))

    # -- phases --------------------------------------------------------------------------------------
    def _admit(self) -> list[_Seq]:
        fresh = []
        while self.waiting and len(self.active) < self.spec.max_active:
            if self.admit_ok is not None and not self.admit_ok(self.waiting[0][0]):
                break
            req, t = self.waiting.popleft()
            cap = 0 if self.spec.kv_in_splits else 1 << max(4, (len(req.prompt) + 8).bit_length())
            kv = np.zeros((self.spec.num_layers, 2, self.spec.kv_heads, cap, self.spec.head_dim), np.float32)
            self.next_sid += 1
            s = _Seq(req, kv, [0] * len(self.spec.ranges), t, sid=self.next_sid)
            self.active.append(s)
            fresh.append(s)
        return fresh

    def _prefill(self, seqs: list[_Seq]) -> None:
        chunk = max(len(s.req.prompt) for s in seqs)
        ids = np.zeros((len(seqs), chunk), np.int64)
        valid = np.zeros((len(seqs), chunk), bool)
        for i, s in enumerate(seqs):
            ids[i, :len(s.req.prompt)] = s.req.prompt
            valid[i, :len(s.req.prompt)] = True
        last = np.array([[len(s.req.prompt) - 1] for s in seqs], np.int64)
        positions = np.broadcast_to(np.arange(chunk, dtype=np.int64), ids.shape).copy()
        x = ids
        L = self.spec.num_layers
        for j, (a, b) in enumerate(self.spec.ranges):
            heads = last if b == L else np.zeros((len(seqs), 0), np.int64)
            out = self._call_split(j, seqs, x, positions, valid, heads, [len(s.req.prompt) for s in seqs])
            x = out["hidden_out"]
        now = time.perf_counter()
        for i, s in enumerate(seqs):
            s.tokens.append(int(out["token"][i, 0]))
            s.exits.append(L)
            s.confs.append(float(out["confidence"][i, 0]))
            s.first_token_s = now - s.admitted

    def _decode(self, seqs: list[_Seq]) -> None:
        L = self.spec.num_layers
        live = list(range(len(seqs)))
        x = np.array([[s.tokens[-1]] for s in seqs], np.int64)
        positions = np.array([[s.position] for s in seqs], np.int64)
        for j, (a, b) in enumerate(self.spec.ranges):
            rows = [seqs[i] for i in live]
            self.split_rows[j].append(len(rows))
            # rows that may leave after this split, and whether any decides on the head's softmax
            may = [r for r, s in enumerate(rows) if b != L and s.req.mode == "calm" and s.req.threshold(j) <= 1.0]
            ramp = any(rows[r].req.measure == "softmax" for r in may)
            heads = np.zeros((len(rows), 1 if (ramp or b == L) else 0), np.int64)
            out = self._call_split(j, rows, x, positions[live], np.ones((len(rows), 1), bool), heads,
                                   [1] * len(rows))
            if b == L:
                for r, s in enumerate(rows):
                    s.tokens.append(int(out["token"][r, 0]))
                    s.exits.append(L)
                    s.confs.append(float(out["confidence"][r, 0]))
                return
            t0 = time.perf_counter()
            if ramp:
                self.ramp_head_rows += len(rows)
            leave = [r for r in may if self._score(rows[r], out, r) >= rows[r].req.threshold(j)]
            self.decide_s += time.perf_counter() - t0
            if leave:
                cheap = [r for r in leave if rows[r].req.measure != "softmax"]
                fill = self._fill(b, [rows[r] for r in leave], out["hidden_out"][leave],
                                  positions[[live[r] for r in leave]], head=bool(cheap))
                self.exit_head_rows += len(leave) if cheap else 0
                for i, r in enumerate(leave):
                    src, at = (fill, i) if rows[r].req.measure != "softmax" else (out, r)
                    rows[r].tokens.append(int(src["token"][at, 0]))
                    rows[r].exits.append(b)
                    rows[r].confs.append(float(src["confidence"][at, 0]))
            t0 = time.perf_counter()
            gone = set(leave)
            stay = [r for r in range(len(rows)) if r not in gone]
            if not stay:
                return
            live = [live[r] for r in stay]
            x = out["hidden_out"][stay]
            self.decide_s += time.perf_counter() - t0

    @staticmethod
    def _score(s: _Seq, out: dict, r: int) -> float:
        """Row r's confidence under its request's measure (see the module docstring)."""
        if s.req.measure == "softmax":
            return float(out["confidence"][r, 0])
        return float(out["exit_scores"][r, 0, MEASURES.index(s.req.measure) - 1])

    def _speculate(self, seqs: list[_Seq], k: int, depth: int = 0) -> None:
        """One round for ``seqs``: draft k tokens with splits 0..depth and the exit head after split ``depth``,
        verify with the later splits over the k positions."""
        L = self.spec.num_layers
        e = self.spec.ranges[depth][1]
        start = [s.position for s in seqs]
        inputs = np.array([[s.tokens[-1]] for s in seqs], np.int64)
        hidden, drafts = [], []
        ones = np.ones((len(seqs), 1), bool)
        for i in range(k):
            pos = np.array([[p + i] for p in start], np.int64)
            x = inputs
            for j in range(depth + 1):
                heads = np.zeros((len(seqs), 1 if j == depth else 0), np.int64)
                out = self._call_split(j, seqs, x, pos, ones, heads, [1] * len(seqs))
                x = out["hidden_out"]
            hidden.append(x)
            inputs = out["token"][:, :1].astype(np.int64)
            drafts.append(inputs[:, 0])
        x = np.concatenate(hidden, axis=1)
        positions = np.array([[p + i for i in range(k)] for p in start], np.int64)
        valid = np.ones((len(seqs), k), bool)
        for j in range(depth + 1, len(self.spec.ranges)):
            b = self.spec.ranges[j][1]
            heads = (np.broadcast_to(np.arange(k, dtype=np.int64), (len(seqs), k)).copy() if b == L
                     else np.zeros((len(seqs), 0), np.int64))
            out = self._call_split(j, seqs, x, positions, valid, heads, [k] * len(seqs))
            x = out["hidden_out"]
        full = out["token"]
        draft = np.stack(drafts, axis=1)
        for r, s in enumerate(seqs):
            accepted = 0
            while accepted < k and draft[r, accepted] == full[r, accepted]:
                accepted += 1
            self.drafted += k
            self.accepted += accepted
            if self.policy is not None:
                self.policy.observe(depth, accepted, k)
            new = list(draft[r]) if accepted == k else [*draft[r, :accepted], full[r, accepted]]
            kept = k if accepted == k else accepted + 1
            s.lengths = [start[r] + kept] * len(self.spec.ranges)
            for i, t in enumerate(new):
                if self._finished(s):
                    break
                s.tokens.append(int(t))
                s.exits.append(e if i < accepted else L)
                s.confs.append(float("nan"))   # verified, not confidence-gated

    # -- helpers -------------------------------------------------------------------------------------
    def _draft_len(self, s: _Seq) -> int:
        return max(1, min(s.req.draft_tokens, s.req.max_new_tokens - len(s.tokens)))

    def _finished(self, s: _Seq) -> bool:
        return len(s.tokens) >= s.req.max_new_tokens or (
            self.spec.eos_id is not None and bool(s.tokens) and s.tokens[-1] == self.spec.eos_id)

    def _call_split(self, j: int, seqs: list[_Seq], x: np.ndarray, positions: np.ndarray, chunk_valid: np.ndarray,
                    heads: np.ndarray, new_counts: list[int]) -> dict:
        """Run split j for ``seqs`` on chunk x; store the first ``new_counts[i]`` new k/v of row i."""
        if self.spec.kv_in_splits:
            return self._call_stateful(j, seqs, x, positions, chunk_valid, heads, new_counts)
        t0 = time.perf_counter()
        a, b = self.spec.ranges[j]
        past = max(s.lengths[j] for s in seqs)
        n = b - a + 1
        kv = np.zeros((len(seqs), n, 2, self.spec.kv_heads, past, self.spec.head_dim), np.float32)
        key_valid = np.zeros((len(seqs), past + x.shape[1]), bool)
        for i, s in enumerate(seqs):
            t = s.lengths[j]
            kv[i, :, :, :, :t] = s.kv[a - 1:b, :, :, :t]
            key_valid[i, :t] = True
        key_valid[:, past:] = chunk_valid
        name = self.spec.split(j)
        t1 = time.perf_counter()
        out = self.run(name, {"input_ids" if a == 1 else "hidden": x, "positions": positions, "past_kv": kv,
                              "key_valid": key_valid, "head_index": heads})
        t2 = time.perf_counter()
        self._observe("split", j, heads, x, t2 - t1)
        new = out["new_kv"]
        for i, s in enumerate(seqs):
            self._store(s, a, b, j, new[i, :, :, :, :new_counts[i]])
        self.kv_gather_s += (t1 - t0) + (time.perf_counter() - t2)
        self.call_s += t2 - t1
        return out

    def _call_stateful(self, j: int, seqs: list[_Seq], x, positions, chunk_valid, heads, new_counts) -> dict:
        """Split j keeps the cache: send ids, lengths and pending fills (see e3.generation.kv_store)."""
        t0 = time.perf_counter()
        a, b = self.spec.ranges[j]
        inputs = {"input_ids" if a == 1 else "hidden": x, "positions": positions, "head_index": heads,
                  "chunk_valid": np.ascontiguousarray(chunk_valid),
                  "seq_id": np.array([s.sid for s in seqs], np.int64),
                  "past_len": np.array([s.lengths[j] for s in seqs], np.int64),
                  "new_count": np.array(new_counts, np.int64)}
        # pending entries are [n, 2, kvh, c, d]: one position per CALM fill, a whole prompt per hand-over
        counts = [sum(kv.shape[3] for kv in s.pending.get(j, ())) for s in seqs]
        width = max(counts)
        if width:
            append = np.zeros((len(seqs), b - a + 1, 2, self.spec.kv_heads, width, self.spec.head_dim), np.float32)
            for i, s in enumerate(seqs):
                p = 0
                for kv in s.pending.get(j, ()):
                    append[i, :, :, :, p:p + kv.shape[3]] = kv
                    p += kv.shape[3]
            inputs["append_kv"] = append
            inputs["append_count"] = np.array(counts, np.int64)
        t1 = time.perf_counter()
        out = self.run(self.spec.split(j), inputs)
        t2 = time.perf_counter()
        self._observe("split", j, heads, x, t2 - t1)
        for s, c in zip(seqs, new_counts):
            s.lengths[j] += c
            s.pending.pop(j, None)
        self.kv_gather_s += t1 - t0
        self.call_s += t2 - t1
        return out

    def _observe(self, kind: str, j: int, heads: np.ndarray, x: np.ndarray, seconds: float) -> None:
        """A timed call for the served cost table: decode calls only (one position per row)."""
        if self.meter is not None and x.ndim >= 2 and x.shape[1] == 1:
            self.meter.observe(kind, j, heads.shape[1] > 0, x.shape[0], seconds)

    def _store(self, s: _Seq, a: int, b: int, j: int, new: np.ndarray) -> None:
        """Append new [n, 2, kvh, c, d] at split j's length (layers a..b); queued for the split itself
        when it keeps the cache."""
        t, c = s.lengths[j], new.shape[3]
        if self.spec.kv_in_splits:
            s.pending.setdefault(j, []).append(new)
            s.lengths[j] = t + c
            return
        if t + c > s.kv.shape[3]:
            grown = np.zeros((*s.kv.shape[:3], max(2 * s.kv.shape[3], t + c), s.kv.shape[4]), np.float32)
            grown[:, :, :, :s.kv.shape[3]] = s.kv
            s.kv = grown
        s.kv[a - 1:b, :, :, t:t + c] = new
        s.lengths[j] = t + c

    def _fill(self, exit_layer: int, seqs: list[_Seq], hidden: np.ndarray, positions: np.ndarray, *,
              head: bool = False) -> dict:
        """CALM: k/v of layers exit_layer+1..L for tokens that left after exit_layer, from their exit state (a
        partial model stores only its own layers' share of the fill); with ``head`` also the exit head's token
        and confidence per row (``token``/``confidence`` [B, 1]), for rows that left on a cheap measure."""
        L = self.spec.full_layers or self.spec.num_layers
        heads = np.zeros((len(seqs), 1 if head else 0), np.int64)
        t0 = time.perf_counter()
        out = self.run(kvfill_name(self.spec.model, exit_layer + 1, L),
                       {"hidden": np.ascontiguousarray(hidden), "positions": positions, "head_index": heads})
        ramp = next(j for j, (_, b) in enumerate(self.spec.ranges) if b == exit_layer)
        self._observe("fill", ramp, heads, hidden, time.perf_counter() - t0)
        new = out["new_kv"]
        for i, s in enumerate(seqs):
            for j, (a, b) in enumerate(self.spec.ranges):
                if a > exit_layer:
                    self._store(s, a, b, j, new[i, a - exit_layer - 1:b - exit_layer])
        return out


class OrtRunner:
    """``run`` for the engine from ONNX Runtime sessions in this process: ``{model name: model.onnx path}``,
    one session each with ``intra_op_threads`` threads."""

    def __init__(self, files: dict[str, str], intra_op_threads: int = 1):
        import onnxruntime as ort   # deferred: the served routers run their splits over BLS, without ONNX Runtime
        ort.set_default_logger_severity(3)   # empty heads (K = 0) warn about the argmax's shape; unused
        self.sessions = {name: make_session(path, intra_op_threads) for name, path in files.items()}

    def __call__(self, name: str, inputs: dict) -> dict:
        session = self.sessions[name]
        wanted = [i.name for i in session.get_inputs()]
        names = [o.name for o in session.get_outputs()]
        return dict(zip(names, session.run(names, {k: inputs[k] for k in wanted})))
