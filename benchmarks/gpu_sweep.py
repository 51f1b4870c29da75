"""The GPU side-by-side's through-Triton part (``benchmarks/gpu_side_by_side.py``, step 2): every system at its
best, measured by a client that is shown not to be the limit.

For one model and max batch B (:class:`Sweep`):

1. **The client's bound**: the same client processes and request shape against a null model (:func:`write_null_model`:
   a Python-backend model, KIND_CPU, that answers zeros of the answers' shapes at once), at the saturating
   concurrency, repeated as every point. It is printed beside every figure and stored; where it is below
   ``BOUND_FACTOR`` times the best system's rate the output says so loudly and ``client_bound_ok`` is false.
2. **Every system at each instance count** (1, 2, 4 by default; E3's router too), one p99-against-goodput
   curve each (closed loops at each concurrency; each point :func:`~gpu_load.measure_point`: repeated, windows
   ten times its p50 or more). Triton's dynamic batcher's max batch is B for the baselines; E3's splits run at B.
3. **The baselines' batcher delay** (``delays_us`` beyond 0, e.g. 500 and 2000 us) at each baseline's best
   instance count, where the time budget allows: those models are written and loaded then, and unloaded after.
4. **E3 answering inline** (the labelled fallback) at E3's best instance count, where the budget allows; E3's
   figure is its ``continuous`` form.

Rows (``side_by_side.json``'s ``rows``): per system, mix and SLO (``slo_ms`` null: saturating throughput) the
best of every configuration tried: goodput at a p99 SLO is the most inputs/s within it among the points whose
(median) p99 meets it (:func:`~gpu_load.slo_rows`); ``config`` says which configuration won, its spread, the
client bound and what the others reached. Heavy imports stay inside the functions (a bare host imports this
before the project's namespace exists).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

if __package__:
    from e3.benchmarks.gpu_load import MIN_REPS, measure_point, slo_rows
else:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_load import MIN_REPS, measure_point, slo_rows

# Deferred imports: this runs on a bare GPU host, where the project (`e3`) imports only once prepare_host has made
# its namespace and tritonclient only once it has unpacked the wheels; numpy and torch load with the step using them.
__all__ = ["Config", "Sweep", "device_model", "write_null_model", "has_answering", "BOUND_FACTOR", "NULL_MODEL"]

BOUND_FACTOR = 3.0          # the client's bound must be at least this many times the best system's rate
NULL_MODEL = "null_answers"
RUN_OVERHEAD_S = 0.3        # per run besides its warm-up and window (commands, results, client set-up)
LOAD_TIMEOUT_S = 300.0      # a model loaded during the sweep

NULL_MODEL_PY = '''"""Answers zeros of the answers' shapes at once: the client's bound (benchmarks/gpu_sweep.py)."""
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.first = config["input"][0]["name"]
        self.outputs = [(o["name"], pb_utils.triton_string_to_numpy(o["data_type"]), [int(d) for d in o["dims"]])
                        for o in config["output"]]

    def execute(self, requests):
        responses = []
        for request in requests:
            n = pb_utils.get_input_tensor_by_name(request, self.first).as_numpy().shape[0]
            responses.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor(name, np.zeros((n, *dims), dtype)) for name, dtype, dims in self.outputs]))
        return responses
'''


@dataclass(frozen=True)
class Config:
    """One served configuration of a system."""
    system: str                 # "e3" | "stock" | "ee"
    instances: int              # Triton instances
    queue_delay_us: int = 0     # the baselines' dynamic batcher delay (E3's router admits with none)
    answering: str = ""         # E3: "continuous" (its figure) or "inline" (the labelled fallback)

    @property
    def label(self) -> str:
        extra = f" {self.answering}" if self.answering else ""
        return f"x{self.instances} delay {self.queue_delay_us} us{extra}"

    def describe(self) -> dict:
        out = {"instances": self.instances, "queue_delay_us": self.queue_delay_us}
        if self.system == "e3":
            out["answering"] = self.answering or "inline"
        return out


def has_answering() -> bool:
    """Whether this checkout's :class:`DeviceModel` chooses E3's answering form (``answering``)."""

    from e3.export.device_repository import DeviceModel
    return "answering" in {f.name for f in dataclasses.fields(DeviceModel)}


def device_model(cfg: Config, *, B: int, mix: str | None, base: dict, cuts: tuple[int, ...] = ()):
    """The :class:`DeviceModel` serving ``cfg`` at max batch ``B`` (E3: planned for ``mix`` with ``cuts``);
    ``base``: the fields every model of the run shares (model, rule, ramps, gpu, seed). The name tells the
    configuration apart (the mix and ``_inline`` for E3, ``_d<us>`` for a delay)."""
    from e3.export.device_repository import DeviceModel
    if cfg.system == "e3":
        extra = {"answering": cfg.answering} if cfg.answering and has_answering() else {}
        variant = mix.replace("-", "_") + ("_inline" if cfg.answering == "inline" else "")
        return DeviceModel(system="e3", max_batch=B, cuts=tuple(cuts), slo_ms=1000.0, instances=cfg.instances,
                           variant=variant, **extra, **base)
    return DeviceModel(system=cfg.system, max_batch=B, instances=cfg.instances, queue_delay_us=cfg.queue_delay_us,
                       variant=f"d{cfg.queue_delay_us}" if cfg.queue_delay_us else "", **base)


def write_null_model(repo: Path, card, *, instances: int = 1) -> str:
    """The null model (module docstring) for ``card``'s inputs and answers, KIND_CPU, in ``repo``; its name."""
    from e3.core.spec import answer_specs
    from e3.export.device_repository import ROUTER_MAX_BATCH
    from e3.export.triton_config import DynamicBatching, ModelDescription, render_config
    text = render_config(ModelDescription(name=NULL_MODEL, kind="python", max_batch_size=ROUTER_MAX_BATCH,
                                          inputs=card.inputs, outputs=answer_specs(card), instances=instances,
                                          instance_kind="KIND_CPU", dynamic_batching=DynamicBatching()))
    out = Path(repo) / NULL_MODEL
    (out / "1").mkdir(parents=True, exist_ok=True)
    (out / "config.pbtxt").write_text(text)
    (out / "1" / "model.py").write_text(NULL_MODEL_PY)
    return NULL_MODEL


class Sweep:
    """One model's sweep at one max batch through one running server (module docstring)."""

    def __init__(self, *, reported: str, settings, results, load, url: str, repo: Path, card, base: dict,
                 plans: dict, names: dict, pools: dict, echo=print):
        self.reported, self.s, self.results, self.load, self.url = reported, settings, results, load, url
        self.repo, self.card, self.base, self.plans, self.names, self.pools = repo, card, base, plans, names, pools
        self.echo = echo
        self.bound: dict | None = None
        self.curves: dict[tuple, list[dict]] = {}   # (system, mix, B, Config) -> points
        self.e3_form = "continuous" if has_answering() else ""

    # -- helpers ---------------------------------------------------------------------------------------------
    def _point_s(self) -> float:
        return self.s.reps * (self.s.warmup_s + self.s.min_window_s + RUN_OVERHEAD_S)

    def _affordable(self, points: int, what: str) -> bool:
        need = points * self._point_s() + 5.0
        if self.s.left_s() >= need:
            return True
        self.echo(f"    {what}: skipped, {self.s.left_s():.0f} s of the budget left, about {need:.0f} s needed")
        self.results.doc.setdefault("skipped_configs", []).append(what)
        return False

    def _measure(self, model: str, c: int, pool: dict, hint_ms: float | None) -> dict:
        return measure_point(self.load, model, c, pool, warmup_s=self.s.warmup_s, min_window_s=self.s.min_window_s,
                             max_window_s=self.s.max_window_s, reps=self.s.reps, p50_hint_ms=hint_ms,
                             slos_ms=self.s.slos_ms)

    def _bound_text(self) -> str:
        return f"client bound {self.bound['inputs_per_s']:,.0f}/s" if self.bound else "client bound not measured"

    def served(self, cfg: Config, mix: str | None, B: int) -> str:
        """The served model of ``cfg`` (written and loaded now if the server does not hold it yet)."""
        return self.ensure([(cfg, mix, B)])[0]

    def ensure(self, wanted: list[tuple], *, load: bool = True) -> list[str]:
        """Served names of (config, mix, B); those not written yet are written and (``load``: the server runs)
        loaded together."""
        from e3.export.device_repository import write_device_model
        new = []
        for cfg, mix, B in wanted:
            key = (cfg, mix if cfg.system == "e3" else None, B)
            if key not in self.names:
                desc = device_model(cfg, B=B, mix=mix, base=self.base, cuts=self.plans.get((mix, B), ()))
                self.names[key] = write_device_model(self.repo, desc, self.card)
                new.append(self.names[key])
        if new and load:
            import tritonclient.grpc as grpcclient
            t = time.monotonic()
            client = grpcclient.InferenceServerClient(self.url)
            with ThreadPoolExecutor(len(new)) as pool:
                list(pool.map(lambda m: client.load_model(m, client_timeout=LOAD_TIMEOUT_S), new))
            client.close()
            self.echo(f"    loaded {', '.join(new)} in {time.monotonic() - t:.0f} s")
        return [self.names[(c, m if c.system == "e3" else None, B)] for c, m, B in wanted]

    def unload(self, names: list[str]) -> None:
        import tritonclient.grpc as grpcclient
        client = grpcclient.InferenceServerClient(self.url)
        for m in names:
            try:
                client.unload_model(m)
            except Exception as err:  # noqa: BLE001 - an unload that fails costs memory, not the run
                self.echo(f"    unloading {m} failed: {err}")
        client.close()

    # -- the steps -------------------------------------------------------------------------------------------
    def client_bound(self, B: int, pool: dict) -> dict:
        """Step 1: the null model at the saturating concurrency with the sweep's client processes."""
        c = max(self.s.concurrency)
        point = self._measure(NULL_MODEL, c, pool, None)
        self.bound = {"model": self.reported, "max_batch": B, "concurrency": c, "processes": self.load.processes,
                      "inputs_per_s": point["inputs_per_s"], "inputs_per_s_min": point["inputs_per_s_min"],
                      "inputs_per_s_max": point["inputs_per_s_max"], "p99_ms": point["p99_ms"],
                      "reps": point["reps"], "errors": point["errors"]}
        self.results.doc.setdefault("client_bound", []).append(self.bound)
        self.results.save()
        self.echo(f"    client bound (null model, {self.load.processes} client processes, c={c}): "
                  f"{point['inputs_per_s']:,.0f} inputs/s [{point['inputs_per_s_min']:,.0f}-"
                  f"{point['inputs_per_s_max']:,.0f}], p99 {point['p99_ms'] or float('nan'):.1f} ms")
        return self.bound

    def curve(self, cfg: Config, mix: str | None, B: int) -> list[dict] | None:
        """One configuration's p99-against-goodput curve (None: skipped for the budget)."""
        what = f"{self.reported} {cfg.system} {mix or ''} B={B} {cfg.label}"
        if not self._affordable(len(self.s.concurrency), what):
            return None
        model = self.served(cfg, mix, B)
        pool = self.pools[mix or self.s.mixes[0]]
        points, hint, prev_c = [], None, None
        for c in sorted(self.s.concurrency):
            p = self._measure(model, c, pool, hint * c / prev_c if hint and prev_c else None)
            hint, prev_c = p["p50_ms"], c
            p.update(model=self.reported, system=cfg.system, mix=mix, max_batch=B, served=model, **cfg.describe())
            points.append(p)
            dead = bool(p["errors"]) and not p["requests"]
            self.results.doc["runs"].append(p)
            self.results.save()
            ips = p["inputs_per_s"] or 0.0
            self.echo(f"    {cfg.system:5s} {mix or '':5s} B={B:<4d} {cfg.label:28s} c={c:<4d} {ips:>9,.0f} inputs/s "
                      f"[{p['inputs_per_s_min'] or 0:,.0f}-{p['inputs_per_s_max'] or 0:,.0f}] p99 "
                      f"{p['p99_ms'] or float('nan'):7.1f} ms, window {p['window_s']:.2f} s "
                      f"({p['window_over_p50'] or 0:.0f}x p50), errors {p['errors']}; {self._bound_text()}")
            if dead:
                self.echo(f"    {what}: nothing answered ({p['error_sample'][:1]}); the rest of its curve skipped")
                self.results.doc.setdefault("notes", []).append(f"{what}: nothing answered at {c} requests in "
                                                                f"flight: {p['error_sample'][:1]}")
                break
        self.curves[(cfg.system, mix, B, cfg)] = points
        return points

    def _best(self, system: str, mix: str | None, B: int) -> Config | None:
        """The configuration of ``system`` with the highest saturating rate so far."""
        tried = {cfg: slo_rows(pts, None) for (s, m, b, cfg), pts in self.curves.items()
                 if s == system and m == mix and b == B and cfg.answering != "inline"}
        tried = {cfg: r for cfg, r in tried.items() if r}
        return max(tried, key=lambda cfg: tried[cfg]["goodput"]) if tried else None

    def run(self, B: int) -> None:
        """Steps 1-4 at max batch ``B``, then the rows."""
        mixes = list(self.s.mixes)
        self.client_bound(B, self.pools[mixes[0]])
        systems = [("e3", m) for m in mixes] + [("stock", None)] + [("ee", m) for m in mixes]
        for k in self.s.instances:
            for system, mix in systems:
                self.curve(Config(system, k, 0, self.e3_form if system == "e3" else ""), mix, B)
        # steps 3 and 4: written and loaded together (loads overlap), measured, unloaded
        later = []
        for d in [d for d in self.s.delays_us if d]:
            for system, mix in systems:
                best = self._best(system, mix, B) if system != "e3" else None
                if best:
                    later.append((Config(system, best.instances, d), mix, B))
        if self.s.inline_extra and self.e3_form == "continuous":
            for mix in mixes:
                best = self._best("e3", mix, B)
                later.append((Config("e3", best.instances if best else 1, 0, "inline"), mix, B))
        self.rows(B, say=False)   # the rows of what is measured so far: a run cut short past here keeps them
        extra_s = 20.0 * (1 if later else 0)   # loading them
        while later and self.s.left_s() < len(later) * len(self.s.concurrency) * self._point_s() + extra_s + 5.0:
            dropped = later.pop()   # the budget decides: the inline row goes first, then the longest delays
            self.echo(f"    {dropped[0].system} {dropped[1] or ''} {dropped[0].label}: skipped for the time budget")
            self.results.doc.setdefault("skipped_configs", []).append(f"{self.reported} {dropped[0].system} "
                                                                      f"{dropped[1] or ''} B={B} {dropped[0].label}")
        if later:
            try:
                served = self.ensure(later)
                for cfg, mix, _ in later:
                    self.curve(cfg, mix, B)
                self.unload(served)
            except Exception as err:  # noqa: BLE001 - the main configurations' rows stand; say what failed
                self.echo(f"    the delays / inline configurations failed: {err}")
                self.results.doc.setdefault("notes", []).append(f"{self.reported} B={B}: the delays / inline "
                                                                f"configurations failed: {str(err)[:300]}")
        self.rows(B)

    # -- rows ------------------------------------------------------------------------------------------------
    def rows(self, B: int, *, say: bool = True) -> None:
        """Per system, mix and SLO the best configuration's figure (module docstring); the client bound's
        verdict and E3's through-Triton share of its in-process figure (``say``: printed)."""
        doc = self.results.doc
        echo = self.echo if say else (lambda _: None)
        mine = lambda r: r["model"] == self.reported and r["max_batch"] == B   # noqa: E731
        doc["rows"] = [r for r in doc["rows"] if not mine(r)]   # written again as the sweep goes on
        doc["e3_triton_over_in_process"] = [r for r in doc.get("e3_triton_over_in_process", []) if not mine(r)]
        from e3.core.names import SIDE_BY_SIDE
        best_rate = 0.0
        for mix in self.s.mixes:
            for system in SIDE_BY_SIDE:
                curve_mix = None if system == "stock" else mix
                curves = {cfg: pts for (s, m, b, cfg), pts in self.curves.items()
                          if s == system and m == curve_mix and b == B}
                main = {cfg: pts for cfg, pts in curves.items() if cfg.answering != "inline"}
                extra = {cfg: pts for cfg, pts in curves.items() if cfg.answering == "inline"}
                for group, label in ((main, None), (extra, "labelled fallback: E3's router answering inline")):
                    if not group:
                        continue
                    for slo in (None, *self.s.slos_ms):
                        row = self._row(system, mix, B, slo, group, label, echo)
                        doc["rows"].append(row)
                        if slo is None and label is None:
                            best_rate = max(best_rate, row["goodput"])
        if self.bound:
            ratio = self.bound["inputs_per_s"] / best_rate if best_rate else None
            ok = ratio is not None and ratio >= BOUND_FACTOR
            self.bound.update(best_system_ips=best_rate, ratio=ratio, ok=ok)
            doc["client_bound_ok"] = all(b.get("ok", True) for b in doc.get("client_bound", [self.bound]))
            if not ok:
                echo("!" * 100 + f"\n!!! THE CLIENT MAY BE THE LIMIT: its bound ({self.bound['inputs_per_s']:,.0f} "
                          f"inputs/s) is {ratio or 0:.1f}x the best system's rate ({best_rate:,.0f}), below "
                          f"{BOUND_FACTOR:.0f}x: use more client processes (--processes)\n" + "!" * 100)
            else:
                echo(f"    the client's bound is {ratio:.1f}x the best system's rate: the client is not the limit")
        for mix in self.s.mixes:
            limit = next((r for r in doc["limit"] if r["model"] == self.reported and r["mix"] == mix
                          and r["max_batch"] == B), None)
            sat = next((r for r in doc["rows"] if r["model"] == self.reported and r["mix"] == mix and r["max_batch"] == B
                        and r["system"] == "e3" and r["slo_ms"] is None and not r["config"].get("extra")), None)
            if limit and sat:
                ratio = sat["goodput"] / limit["e3"] if limit["e3"] else None
                doc.setdefault("e3_triton_over_in_process", []).append(
                    {"model": self.reported, "mix": mix, "max_batch": B, "through_triton": sat["goodput"],
                     "in_process": limit["e3"], "ratio": ratio})
                echo(f"    E3 through Triton / in process ({mix}, B={B}): {sat['goodput']:,.0f} / "
                          f"{limit['e3']:,.0f} = {ratio or 0:.2f}")
        self.results.save()

    def _row(self, system: str, mix: str, B: int, slo, group: dict, extra: str | None, echo) -> dict:
        found = {cfg: slo_rows(pts, slo) for cfg, pts in group.items()}
        won = [cfg for cfg, r in found.items() if r]
        cfg = max(won, key=lambda c: found[c]["goodput"]) if won else next(iter(group))
        r = found.get(cfg) or {}
        config = {**cfg.describe(), "concurrency": r.get("concurrency"), "reps": r.get("reps", MIN_REPS),
                  "goodput_min": r.get("goodput_min"), "goodput_max": r.get("goodput_max"),
                  "p99_ms_min": r.get("p99_ms_min"), "p99_ms_max": r.get("p99_ms_max"),
                  "window_s": r.get("window_s"), "errors": sum(p["errors"] for p in group[cfg]),
                  "client_bound_ips": self.bound["inputs_per_s"] if self.bound else None,
                  "tried": {c.label: (found[c]["goodput"] if found[c] else 0.0) for c in group}}
        if system == "e3":
            plan = next((p for p in self.results.doc["plans"] if p["model"] == self.reported and p["mix"] == mix
                         and p["max_batch"] == B), None)
            if plan:
                config.update(cuts=plan["cuts"], batch_sizes=plan["batch_sizes"])
        if extra:
            config["extra"] = extra
        row = {"model": self.reported, "mix": mix, "max_batch": B, "slo_ms": slo, "system": system,
               "goodput": r.get("goodput", 0.0), "p99_ms": r.get("p99_ms"), "config": config}
        spread = f"[{r['goodput_min']:,.0f}-{r['goodput_max']:,.0f}]" if r else ""
        echo(f"  {'saturating' if slo is None else f'p99 <= {slo} ms':>14s} {system:5s} {mix} B={B}"
                  f"{' (' + extra + ')' if extra else ''}: {row['goodput']:,.0f} inputs/s {spread} "
                  f"with {cfg.label}; {self._bound_text()}")
        return row
