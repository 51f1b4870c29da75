"""``helios_generate``: HELIOS's front door, one Triton Python-backend instance over several early-exit LLMs.

Requests are those of ``<m>_generate`` (:mod:`e3.generation.generate_router`): ``input_ids`` INT64 [n] or
``text`` BYTES [1], optional ``max_new_tokens`` INT32 [1] (default 32); always CALM at the server's ``tau``
(the ``mode``/``tau`` inputs of ``<m>_generate`` are not accepted: the threshold is HELIOS's). Outputs: those of
``<m>_generate`` plus ``served_by`` BYTES [1], ``"<model>:<depth>"`` (the configuration the sequence ran on).
A request holding only ``status`` BYTES [1] gets the controller's table as JSON in ``text_out``
(``e3 helios-status``).

Decisions are :class:`e3.generation.helios.HeliosController`'s; this module applies them:

* **engines**: one :class:`~e3.generation.engine.GenerationEngine` per configuration in use, over the
  candidate's ``<m>_kv_split_*`` models truncated at the configuration's depth (continuous batching, exits per
  token, survivors re-batched between splits, as in ``<m>_generate``); one thread steps every busy engine;
* **partial loading**: the split models a configuration needs (its splits and its ramps' kv-fill models) are
  loaded through Triton's model-control API from inside this model (the Python backend's ``load_model``, so
  the server must run in explicit model-control mode; ``e3 serve`` does); models no configuration in use needs
  are unloaded once their last sequence finished. Decision: the controller runs inside the front door, not
  beside it in another process like E3's: the breach counter is per token and a decision must apply to the
  very next admitted sequence;
* **the memory budget** (``memory_mb``): a waiting request is admitted only while the weights of every loaded
  model plus the KV cache reserved by every running sequence (prompt + ``max_new_tokens`` positions, at its
  configuration's depth) stay within it. Partial loading leaves more of the budget to KV, so more sequences
  run together: the batch reached. A request that could not fit even alone gets an error naming the sizes.

Requests are admitted in arrival order; none is dropped: a failed split call fails that step's sequences with
an error naming the split (as ``<m>_generate``), a failed load fails the requests waiting on it, and the router
keeps serving.

Telemetry (Triton custom metrics): ``e3_helios_decisions_total{kind}``, ``e3_helios_tokens_total{model,
depth}``, ``e3_helios_breaches_total{model,depth}``, ``e3_helios_active_sequences`` and
``e3_helios_reserved_bytes`` (gauges).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import triton_python_backend_utils as pb_utils
from tokenizers import Tokenizer

from e3.generation.helios import Candidate, HeliosController, HeliosSettings
from e3.generation.engine import EngineSpec, GenerationEngine, GenRequest, kvfill_name
from e3.generation.generate_router import InboxFrontDoor, bls_runner, prompt_of, scalar_input
from e3.serving.triton_io import error_response, model_parameters, tensor_response

log = logging.getLogger(__name__)
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def config_models(spec: EngineSpec) -> list[str]:
    """The Triton models a (possibly truncated) kv-split engine spec calls."""
    L = spec.full_layers or spec.num_layers
    return ([spec.split(j) for j in range(len(spec.ranges))]
            + [kvfill_name(spec.model, b + 1, L) for _, b in spec.ranges[:-1]])


class TritonPythonModel(InboxFrontDoor):
    def initialize(self, args):
        _, params = model_parameters(args)
        doc = json.loads(params["helios"])
        self.specs = {c["candidate"]["name"]: EngineSpec.from_dict(c["engine"]) for c in doc["candidates"]}
        cands = tuple(Candidate(**{k: (tuple(v) if k == "exits" else v) for k, v in c["candidate"].items()})
                      for c in doc["candidates"])
        self.settings = HeliosSettings(candidates=cands, **doc["settings"])
        self.settings.validate()
        self.fixed = doc.get("fixed")                 # [model, depth]: one configuration, no controller
        self.controller = None if self.fixed else HeliosController(self.settings)
        self.tokenizer = None
        if params.get("tokenizer"):
            self.tokenizer = Tokenizer.from_file(os.path.join(args["model_repository"], params["tokenizer"]))
        self.cands = {c.name: c for c in cands}
        self.engines: dict[tuple, GenerationEngine] = {}
        self.evaluation: set[int] = set()             # ids of the evaluation requests (Triton request objects)
        self.reserved: dict[int, int] = {}            # id(Triton request) -> KV bytes reserved
        self.loaded: set[str] = set()
        self.waiting: deque = deque()
        self.inbox: queue.Queue = queue.Queue()
        self.stopping = threading.Event()
        self.peak_active = 0
        self._metrics()
        self.loop = threading.Thread(target=self._loop, name="e3-helios", daemon=True)
        self.loop.start()

    def _metrics(self) -> None:
        self._families = []

        def family(name, doc, kind=pb_utils.MetricFamily.COUNTER):
            self._families.append(pb_utils.MetricFamily(name=name, description=doc, kind=kind))
            return self._families[-1]
        self._metric_cache: dict = {}                 # a Metric lives as long as its Python object: keep them
        self.m_decisions = family("e3_helios_decisions_total", "HELIOS decisions, by kind")
        self.m_tokens = family("e3_helios_tokens_total", "tokens made, by configuration")
        self.m_breaches = family("e3_helios_breaches_total", "confidence breaches, by configuration")
        self.m_active = family("e3_helios_active_sequences", "sequences running", pb_utils.MetricFamily.GAUGE).Metric({})
        self.m_reserved = family("e3_helios_reserved_bytes", "loaded weights plus reserved KV",
                                 pb_utils.MetricFamily.GAUGE).Metric({})

    def _metric(self, family, **labels):
        key = (id(family), tuple(sorted(labels.items())))
        if key not in self._metric_cache:
            self._metric_cache[key] = family.Metric(labels)
        return self._metric_cache[key]

    def finalize(self):
        """Stop the engine thread, then answer whatever is still waiting or running with an error (an accepted
        request never goes unanswered)."""
        self.stop_loop()
        if self.loop.is_alive():
            return                                      # the thread still owns the requests
        handles = [r.request_id for r in self.waiting]
        for engine in self.engines.values():
            handles += [s.req.request_id for s in engine.active] + [r.request_id for r, _ in engine.waiting]
        while True:
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                handles.append(item)
        for handle in handles:
            try:
                handle.get_response_sender().send(error_response("helios_generate is unloading; send again"),
                                                  flags=FINAL)
            except Exception:
                log.exception("could not answer a request at unload")

    # -- parsing -------------------------------------------------------------------------------------
    def _parse(self, request) -> GenRequest | None:
        status = pb_utils.get_input_tensor_by_name(request, "status")
        if status is not None:
            table = self.controller.table() if self.controller else {"fixed": self.fixed}
            table.update(loaded=sorted(self.loaded), peak_active=self.peak_active, memory_bytes=self._memory())
            out = {"tokens": np.zeros(0, np.int64), "exit_layers": np.zeros(0, np.int32),
                   "text_out": np.array([json.dumps(table).encode()], dtype=object),
                   "ttft_ms": np.zeros(1, np.float32), "total_ms": np.zeros(1, np.float32),
                   "served_by": np.array([b""], dtype=object)}
            request.get_response_sender().send(tensor_response(out), flags=FINAL)
            return None
        for name in ("mode", "tau", "draft_tokens"):
            if pb_utils.get_input_tensor_by_name(request, name) is not None:
                raise ValueError(f"input {name} is not accepted: HELIOS serves CALM at its own tau "
                                 f"({self.settings.tau})")
        prompt = prompt_of(request, self.tokenizer)
        req = GenRequest(request_id=request, prompt=prompt, max_new_tokens=int(scalar_input(request, "max_new_tokens", 32)),
                         mode="calm", tau=self.settings.tau)
        req.check(next(iter(self.specs.values())))
        need = max(self._kv(req, c.name, c.num_layers) + c.weight_bytes(c.num_layers) for c in self.cands.values())
        if need > self.settings.memory_bytes:
            raise ValueError(f"this request needs {need / 2**20:.1f} MiB (weights and its KV cache of "
                             f"{len(prompt) + req.max_new_tokens} positions), more than the memory budget of "
                             f"{self.settings.memory_bytes / 2**20:.1f} MiB")
        return req

    # -- memory --------------------------------------------------------------------------------------
    def _kv(self, req: GenRequest, name: str, depth: int) -> int:
        return self.cands[name].sequence_bytes(len(req.prompt) + req.max_new_tokens, depth)

    def _weights(self, models: set[str]) -> int:
        """Weights of the candidates' models in ``models``: per candidate, the deepest loaded split counts."""
        total = 0
        for name, c in self.cands.items():
            depths = [d for d in c.depths if set(config_models(self._spec(name, d))) <= models]
            total += c.weight_bytes(max(depths)) if depths else 0
        return total

    def _memory(self, extra_models: set[str] = frozenset(), extra_kv: int = 0) -> int:
        return self._weights(self.loaded | set(extra_models)) + sum(self.reserved.values()) + extra_kv

    def _spec(self, name: str, depth: int) -> EngineSpec:
        return self.specs[name].truncated(depth)

    # -- the engine thread ---------------------------------------------------------------------------
    def _next_config(self):
        if self.fixed:
            return (self.fixed[0], int(self.fixed[1])), False
        return self.controller.peek()

    def _admit_waiting(self) -> None:
        while self.waiting:
            req = self.waiting[0]
            config, _ = self._next_config()
            models = set(config_models(self._spec(*config)))
            kv = self._kv(req, *config)
            if self._memory(models, kv) > self.settings.memory_bytes:
                self._unload_unused(force=True)         # models kept for later (evaluation) make room first
                if self._memory(models, kv) > self.settings.memory_bytes and self.reserved:
                    return                              # wait for running sequences to free memory
            self.waiting.popleft()
            if not self.fixed:
                config, is_eval = self.controller.route()
                if is_eval:
                    self.evaluation.add(id(req.request_id))
            try:
                self._ensure_loaded(set(config_models(self._spec(*config))))
            except Exception as err:
                self._forget(req.request_id, config)
                req.request_id.get_response_sender().send(error_response(f"HELIOS: {err}"), flags=FINAL)
                continue
            engine = self.engines.get(config)
            if engine is None:
                engine = self.engines[config] = GenerationEngine(self._spec(*config), bls_runner(True))
            self.reserved[id(req.request_id)] = kv
            engine.submit(req)

    def _ensure_loaded(self, models: set[str]) -> None:
        """Load ``models`` not yet loaded, all at once (Triton loads them in parallel: a switch to a whole model
        took 5 stub starts one after another before)."""
        missing = sorted(models - self.loaded)
        if not missing:
            return
        log.info("HELIOS: loading %s", ", ".join(missing))

        def load(name):
            pb_utils.load_model(model_name=name)
            return name, pb_utils.is_model_ready(model_name=name)
        with ThreadPoolExecutor(len(missing)) as pool:
            results = list(pool.map(load, missing))
        self.loaded |= {name for name, ready in results if ready}
        failed = [name for name, ready in results if not ready]
        if failed:
            raise RuntimeError(f"could not load {', '.join(failed)}")

    def _unload_unused(self, force: bool = False) -> None:
        """Unload the models no busy engine and no waiting request needs; while Step 2 runs, only when the
        memory budget asks for room (``force``): its candidates are likely chosen next."""
        if self.controller is not None and self.controller.evaluating and not force:
            return
        serving = (self.fixed[0], int(self.fixed[1])) if self.fixed else self.controller.chosen
        if force:
            serving = None                              # room first: an idle configuration reloads when asked
        for config in [c for c, e in self.engines.items() if e.idle]:
            if config != serving:                       # the configuration in force stays loaded when idle
                del self.engines[config]
        wanted: set[str] = set()
        for config in self.engines:
            wanted |= set(config_models(self._spec(*config)))
        if serving is not None:
            wanted |= set(config_models(self._spec(*serving)))
        if self.waiting:
            wanted |= set(config_models(self._spec(*self._next_config()[0])))
        gone = sorted(self.loaded - wanted)
        if not gone:
            return
        log.info("HELIOS: unloading %s", ", ".join(gone))

        def unload(name):
            try:
                pb_utils.unload_model(model_name=name)
            except Exception:
                log.exception("unloading %s failed", name)
        with ThreadPoolExecutor(len(gone)) as pool:
            list(pool.map(unload, gone))
        self.loaded -= set(gone)

    def _loop(self) -> None:
        while not self.stopping.is_set():
            busy = any(not e.idle for e in self.engines.values())
            block = not busy and not self.waiting
            try:
                while True:
                    item = self.inbox.get(block=block, timeout=None if block else 0)
                    block = False
                    if item is None:
                        return
                    try:
                        req = self._parse(item)
                        if req is not None:
                            self.waiting.append(req)
                    except (ValueError, TypeError) as err:
                        item.get_response_sender().send(error_response(str(err), client_error=True), flags=FINAL)
            except queue.Empty:
                pass
            try:
                self._admit_waiting()
                self._step_engines()
                self._unload_unused()
            except Exception:
                log.exception("HELIOS loop")

    def _step_engines(self) -> None:
        for config, engine in list(self.engines.items()):
            if engine.idle:
                continue
            before = sum(len(s.tokens) for s in engine.active)
            t0 = time.perf_counter()
            done = engine.step()
            dt = time.perf_counter() - t0
            self.peak_active = max(self.peak_active, len(engine.active) + len(done))
            made = sum(len(s.tokens) for s in engine.active) + sum(len(f.tokens) for f in done) - before
            if self.controller is not None:
                self.controller.observe_time(config, made, dt)
            for f in done:
                self._finish(config, f)
        self.m_active.set(sum(len(e.active) for e in self.engines.values()))
        self.m_reserved.set(self._memory())

    def _forget(self, handle, config) -> None:
        """Release a request's reservation; an evaluation request counts as finished for the controller."""
        self.reserved.pop(id(handle), None)
        if id(handle) in self.evaluation:
            self.evaluation.discard(id(handle))
            self._decided(self.controller.observe(config, [], [], evaluation=True))

    def _decided(self, decision) -> None:
        if decision is not None:
            log.info("HELIOS %s: %s -> %s (%s)", decision.kind, decision.before, decision.after, decision.reason)
            self._metric(self.m_decisions, kind=decision.kind).increment(1)

    def _finish(self, config, f) -> None:
        handle = f.request_id
        is_eval = id(handle) in self.evaluation
        self.reserved.pop(id(handle), None)
        self.evaluation.discard(id(handle))
        sender = handle.get_response_sender()
        if f.error:
            sender.send(error_response(f.error), flags=FINAL)
            if self.controller is not None and is_eval:
                self._decided(self.controller.observe(config, [], [], evaluation=True))
            return
        text = self.tokenizer.decode(f.tokens) if self.tokenizer is not None else ""
        out = {"tokens": np.array(f.tokens, np.int64), "exit_layers": np.array(f.exit_layers, np.int32),
               "text_out": np.array([text.encode("utf-8")], dtype=object),
               "ttft_ms": np.array([1e3 * f.ttft_s], np.float32), "total_ms": np.array([1e3 * f.total_s], np.float32),
               "served_by": np.array([f"{config[0]}:{config[1]}".encode()], dtype=object)}
        sender.send(tensor_response(out), flags=FINAL)
        labels = {"model": config[0], "depth": str(config[1])}
        self._metric(self.m_tokens, **labels).increment(len(f.tokens))
        partial = config[1] < self.cands[config[0]].num_layers
        breaches = partial * sum(e == config[1] and not c >= self.settings.tau
                                 for e, c in zip(f.exit_layers, f.confidences))
        self._metric(self.m_breaches, **labels).increment(breaches)
        if self.controller is not None:
            self._decided(self.controller.observe(config, f.exit_layers, f.confidences, evaluation=is_eval))
