"""Keep a tritonserver serving: restart it when it dies, reload a model whose Python stub died (``e3 serve``).

Triton does not restart a dead Python-backend stub (2.51; its model may even
stay "ready"), and nothing restarts tritonserver itself. The supervisor, run
in ``e3 serve``'s main thread, polls once per ``poll_s``:

* **Snapshot.** While the server is ready, every ``snapshot_s`` it records
  the READY models, each one's live config (instance counts, the router's
  plan parameter: whatever the controller changed through the repository API
  is there, not in the files) and how many stub processes each one runs.
* **Server death** (the process exited, or its live endpoint failed for
  ``hang_s``): it stops what is left (process group killed, the Python
  backend's /dev/shm files removed), starts tritonserver again with no
  model, and loads the snapshot's models with their snapshot configs as
  overrides: ordinary models first, then routers, then ensembles (which
  call them). A model whose ``config.pbtxt`` in the repository is newer than
  the snapshot (the controller's applier wrote what it applied there,
  :mod:`e3.deploy.durable`) loads from its file instead, and the splits a
  restored router's plan names are loaded too (:func:`restore_set`): a plan
  switched just before the death comes back whole. Requests in flight got
  connection errors from the dying server; none waits for the new one.
* **Readiness against the plan.** A READY router whose plan names a split of this server that is not
  READY is in :meth:`Supervisor.down` (:func:`e3.deploy.durable.plan_gaps`), so the guard's readiness
  answers 503 until the plan is served whole.
* **Stub death.** When a stub process of a snapshot model is gone (a
  controller's reload or scale-down also ends stubs, so that alone decides
  nothing) and the model now runs fewer stubs than its live config has
  instances, or a probe of one request of zeros is answered "Stub process ...
  is not healthy" (:func:`e3.deploy.stubs.is_dead_stub`), the model is
  reloaded with its live config (Triton starts new stubs;
  requests to the dead one had already failed with that error). Until the
  reload is done the model is in :attr:`Supervisor.unhealthy`, which the HTTP
  guard turns into 503 on the readiness endpoints (Triton's own still say 200).

* **Deliberate changes.** A load or unload through the control API (the guards, HTTP and gRPC, call
  :meth:`Supervisor.control` around it) is the user's decision, not a death: while it runs the model's
  stubs are not watched; a model unloaded so is dropped from the snapshot (and not restored after a
  restart) until a load brings it back; a load is followed by a new snapshot. Only deaths are repaired.
* **Never gives up.** A server that dies is restarted for as long as ``e3 serve`` runs (before, the sixth
  death within five minutes ended ``e3 serve``: seven small requests took the service down until a person
  acted). The restart waits a bounded backoff that grows with the deaths of the last ``stable_s``
  (:func:`backoff_s`: 0, 0.5, 1, 2, 4, then ``max_backoff_s`` = 5 s), so a server that dies at once on
  every start costs a start every few seconds, not a busy loop, and one that was killed once comes back
  at once. A start that fails counts as a death and is retried the same way. Meanwhile
  :meth:`Supervisor.down` names ``"tritonserver"`` and the guard answers 503 on readiness.
* **Cause.** Each death is logged with its cause (the signal, e.g. SIGKILL or SIGABRT, the exit code,
  "hung", or "start failed") and the server's last log lines, and counted in
  ``e3_tritonserver_restarts_total{cause=...}`` on the guard's ``/metrics`` page
  (:meth:`Supervisor.metrics_text`), beside ``e3_tritonserver_up`` and ``e3_model_reloads_total``.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
import urllib.error
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

from e3.deploy.durable import plan_gaps, plan_splits
from e3.deploy.stubs import is_dead_stub, with_reload_mark
from e3.deploy.server import ServerError, TritonServer

__all__ = ["Supervisor", "Snapshot", "load_order", "lost_stubs", "probe_request", "orphan_regions", "backoff_s",
           "death_cause", "restore_set"]

log = logging.getLogger(__name__)


def backoff_s(recent_deaths: int, *, base_s: float = 0.5, max_backoff_s: float = 5.0) -> float:
    """Seconds to wait before the next start, after ``recent_deaths`` deaths (this one included) within the
    stable window: 0 for the first, then ``base_s`` doubling, never more than ``max_backoff_s``."""
    if recent_deaths <= 1:
        return 0.0
    return min(max_backoff_s, base_s * 2 ** min(recent_deaths - 2, 30))


def death_cause(returncode: int | None) -> str:
    """A short label for how tritonserver ended: the signal's name (``SIGKILL``), ``exit_<code>``, or
    ``hung`` (still running, but its live endpoint failed)."""
    if returncode is None:
        return "hung"
    if returncode < 0:
        try:
            return signal.Signals(-returncode).name
        except ValueError:
            return f"signal_{-returncode}"
    return f"exit_{returncode}"


@dataclass
class Snapshot:
    configs: dict[str, dict] = field(default_factory=dict)   # READY model -> its live config (JSON)
    stubs: dict[str, set[int]] = field(default_factory=dict)  # model -> pids of the stubs running it
    taken_at: float = 0.0                                    # time.monotonic() of the snapshot
    taken_wall: float = 0.0                                  # time.time() of the snapshot (file times' clock)


def load_order(configs: Mapping[str, dict]) -> list[str]:
    """Models in the order to load them after a restart: plain models, then routers (their splits must be
    there to answer), then ensembles (which call both)."""
    def rank(name: str) -> tuple[int, str]:
        config = configs[name]
        if config.get("platform") == "ensemble" or "ensemble_scheduling" in config:
            return 2, name
        return (1 if name.endswith("_router") else 0), name
    return sorted(configs, key=rank)


def _file_newer(repo: Path | None, name: str, than: float) -> bool:
    try:
        return repo is not None and (Path(repo) / name / "config.pbtxt").stat().st_mtime > than
    except OSError:
        return False


def restore_set(snapshot: Snapshot, repo: str | Path | None) -> dict[str, dict | None]:
    """Model -> the config override to load it with after a restart (None: its repository file): the
    snapshot's models with their snapshot configs, except those whose file the applier wrote after the
    snapshot (the file is newer), plus the splits each restored router's plan names that the snapshot
    lacks (loaded from their files)."""
    repo = Path(repo) if repo is not None else None
    out: dict[str, dict | None] = {}
    for name, config in snapshot.configs.items():
        out[name] = None if _file_newer(repo, name, snapshot.taken_wall) else config
    for name in list(out):
        if not name.endswith("_router"):
            continue
        config = out[name]
        try:
            if config is None:
                # deferred: tritonclient's gRPC protos (350 ms) load only where a config file is read
                from google.protobuf import json_format, text_format
                from tritonclient.grpc import model_config_pb2 as mc
                text = (Path(repo) / name / "config.pbtxt").read_text()
                config = json_format.MessageToDict(text_format.Parse(text, mc.ModelConfig()),
                                                   preserving_proto_field_name=True)
            plan = json.loads(config.get("parameters", {}).get("plan", {}).get("string_value", "{}"))
        except Exception as err:  # noqa: BLE001 (an unreadable file: restore what the snapshot knows)
            log.warning("cannot read %s's plan from the repository (%s)", name, err)
            continue
        for split in plan_splits(plan):
            out.setdefault(split, None)
    return out


def lost_stubs(before: Mapping[str, set[int]], now: Mapping[str, set[int]]) -> list[str]:
    """Models one of whose stub processes ``before`` is gone ``now`` (sorted): candidates for a probe."""
    return sorted(m for m, pids in before.items() if pids - now.get(m, set()))


def orphan_regions(server: TritonServer, min_age_s: float = 10.0) -> list[Path]:
    """``server``'s Python-backend shared-memory files that no stub maps any more, older than ``min_age_s``
    (a region is created before its stub maps it). A stub killed outright never unlinks its region, and
    Triton unlinks it only when it tears the instance down itself (measured: after a stub of a 2-instance
    split was killed and the model reloaded, both old regions stayed)."""
    stubs = [pid for pid in server.group_pids() if pid != (server.process.pid if server.process else None)]
    mapped: set[str] = set()
    for pid in stubs:
        try:
            with open(f"/proc/{pid}/maps") as maps:
                mapped.update(line.split()[-1] for line in maps if "/dev/shm/" in line)
        except OSError:
            continue
    now = time.time()
    old = []
    for region in server.shm_regions():
        try:
            if str(region) not in mapped and now - region.stat().st_mtime > min_age_s:
                old.append(region)
        except OSError:
            continue
    return old


def probe_request(config: Mapping) -> dict:
    """A KServe v2 JSON request of one row of zeros for a model of ``config`` (Triton's JSON config)."""
    batched = int(config.get("max_batch_size", 0)) > 0
    inputs = []
    for t in config.get("input", []):
        dtype = t["data_type"].removeprefix("TYPE_").replace("STRING", "BYTES")
        shape = [1] * batched + [max(int(d), 1) for d in t.get("dims", [])]
        count = 1
        for d in shape:
            count *= d
        inputs.append({"name": t["name"], "datatype": dtype, "shape": shape,
                       "data": ["" if dtype == "BYTES" else False if dtype == "BOOL" else 0] * count})
    return {"inputs": inputs}


def _stub_cmdlines(server: TritonServer) -> dict[int, str]:
    """pid -> command line of every Python-backend stub of ``server``."""
    found = {}
    if not server.alive():
        return found
    for pid in server.group_pids():
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "triton_python_backend_stub" in cmd:
            found[pid] = cmd
    return found


def _match_stubs(stubs: Mapping[int, str], models) -> dict[str, set[int]]:
    """Per model, the pids among ``stubs`` running it (a stub's command line names the model's folder)."""
    return {m: {pid for pid, cmd in stubs.items() if f"/{m}/" in cmd} for m in models}


def _stub_pids(server: TritonServer, models) -> dict[str, set[int]]:
    """Stub processes per model of ``server``."""
    return _match_stubs(_stub_cmdlines(server), models)


class Supervisor:
    """Watches ``server`` (already started) from the calling thread; see the module docstring."""

    def __init__(self, server: TritonServer, *, poll_s: float = 0.5, snapshot_s: float = 2.0, hang_s: float = 15.0,
                 stable_s: float = 60.0, max_backoff_s: float = 5.0, headers: dict[str, str] | None = None,
                 start_timeout_s: float = 180.0, on_stub_death: Callable[[str], object] | None = None):
        self.server = server
        self.poll_s, self.snapshot_s, self.hang_s = poll_s, snapshot_s, hang_s
        self.stable_s, self.max_backoff_s = stable_s, max_backoff_s
        self.headers = dict(headers or {})
        self.start_timeout_s = start_timeout_s
        self.on_stub_death = on_stub_death   # called with a model's name before it is reloaded (the guard's abort)
        self.snapshot = Snapshot()
        self.unhealthy: set[str] = set()     # models known broken (dead stub, being reloaded)
        self.restarting = False              # the server is down or coming back
        self.restarts: deque[float] = deque()   # when each death of the last stable_s was seen
        self.causes: Counter = Counter()         # cause of death -> count (e3_tritonserver_restarts_total)
        self.reloads: Counter = Counter()        # model -> reloads after a stub died (e3_model_reloads_total)
        self._stop = None
        self.events: list[str] = []          # what the supervisor did, for logs and tests
        self.stale: dict[int, float] = {}    # pid of an old version's stub -> when its model was reloaded
        self.changing: Counter = Counter()   # model -> control-API loads/unloads in flight (stubs not watched)
        self.unloaded: set[str] = set()      # models unloaded through the control API (not restored)
        self._resnap = False                 # a control call ended: take a snapshot at the next poll
        self.gaps: dict[str, list[str]] = {} # READY router -> its plan's splits not READY (last snapshot)
        self._last_live = time.monotonic()

    # -- the user's own loads and unloads (called from the guards' threads) ------------------------------------
    def control(self, model: str, action: str) -> Callable[[bool], None]:
        """A load or unload (``action``) of ``model`` through the control API begins; call what this returns
        with whether Triton accepted it, when it ends."""
        self.changing[model] += 1

        def done(ok: bool) -> None:
            if ok and action == "unload":
                self.unloaded.add(model)
                self.snapshot.configs.pop(model, None)
                self.snapshot.stubs.pop(model, None)
            elif ok:
                self.unloaded.discard(model)
            self._resnap = True
            self.changing[model] -= 1
            if self.changing[model] <= 0:
                del self.changing[model]
        return done

    # -- Triton's HTTP API ---------------------------------------------------------------------------------
    def _call(self, method: str, path: str, body: dict | None = None, timeout_s: float = 30.0):
        data = json.dumps(body).encode() if body is not None else None
        text = self.server.call(method, path, data, {"Content-Type": "application/json", **self.headers},
                                timeout_s=timeout_s)
        return json.loads(text) if text else None

    def take_snapshot(self) -> Snapshot:
        """Record the READY models, their live configs and stub counts (the server must be up)."""
        # Stubs first: the API calls may take seconds under load, and a stub that dies meanwhile must
        # still be in the snapshot, or its death would go unseen.
        stubs = _stub_cmdlines(self.server)
        index = self._call("POST", "/v2/repository/index", {})
        ready = [m["name"] for m in index if m.get("state") == "READY" and m["name"] not in self.unloaded]
        configs = {m: self._call("GET", f"/v2/models/{m}/config") for m in ready}
        self.snapshot = Snapshot(configs, _match_stubs(stubs, ready), time.monotonic(), time.time())
        gaps = plan_gaps(configs, ready)
        for router, missing in gaps.items():
            if self.gaps.get(router) != missing:
                log.warning("%s is not ready: its plan names %s, not loaded", router, ", ".join(missing))
        self.gaps = gaps
        return self.snapshot

    def _load(self, name: str, config: dict | None) -> None:
        """Load ``name`` with ``config`` as its override (None: its repository file)."""
        body = {"parameters": {"config": json.dumps(config)}} if config is not None else {}
        self._call("POST", f"/v2/repository/models/{name}/load", body, timeout_s=self.start_timeout_s)

    # -- the loop --------------------------------------------------------------------------------------------
    def run(self, stop) -> None:
        """Poll until ``stop`` (a threading.Event) is set, restarting the server whenever it dies."""
        self._stop = stop
        try:
            self.take_snapshot()
        except (urllib.error.URLError, OSError, ValueError) as err:
            log.warning("supervisor: no first snapshot (%s)", err)
        next_snapshot = time.monotonic() + self.snapshot_s
        while not stop.wait(self.poll_s):
            now = time.monotonic()
            if not self.server.alive() or self._hung(now):
                self.restart()
                if stop.is_set():
                    return
                next_snapshot = time.monotonic() + self.snapshot_s
                continue
            now_pids = _stub_pids(self.server, self.snapshot.stubs)
            lost = [m for m in lost_stubs(self.snapshot.stubs, now_pids)
                    if m not in self.changing and m not in self.unloaded]
            dead = [m for m in lost if self.short_of_stubs(m, len(now_pids[m])) or self.stub_is_dead(m)]
            if dead:
                self.reload(dead)
            elif lost or self._resnap or now >= next_snapshot:
                self._resnap = False
                try:
                    self.take_snapshot()
                except (urllib.error.URLError, OSError, ValueError) as err:
                    log.debug("supervisor: snapshot skipped (%s)", err)
                next_snapshot = now + self.snapshot_s
                self.end_stale_stubs()
                self.remove_orphan_regions()

    def end_stale_stubs(self, grace_s: float = 10.0) -> None:
        """Kill stubs of a reloaded model's old version still running ``grace_s`` after the reload.

        Measured: when one stub of a 2-instance split is killed and the model reloaded, Triton never
        finishes unloading the old version; its surviving stub (and its shared memory) stays. The new
        version serves by then, and nothing is left in flight on the old one after ``grace_s``.
        """
        group = set(self.server.group_pids())
        for pid, since in list(self.stale.items()):
            if pid not in group:
                del self.stale[pid]
            elif time.monotonic() - since > grace_s:
                log.warning("ending stub %d of a reloaded model's old version", pid)
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
                del self.stale[pid]

    def remove_orphan_regions(self) -> None:
        """Unlink the shared-memory files of stubs that are gone (:func:`orphan_regions`)."""
        for region in orphan_regions(self.server):
            try:
                region.unlink()
                log.warning("removed %s: its stub is gone", region)
            except OSError:
                pass

    def _hung(self, now: float) -> bool:
        try:
            self.server.call("GET", "/v2/health/live", timeout_s=2)
            self._last_live = now
        except OSError:   # URLError and HTTPError included
            pass
        return now - self._last_live > self.hang_s

    def down(self) -> set[str]:
        """What is known broken now: models being reloaded, routers whose plan is not served whole, and
        ``"tritonserver"`` while it restarts."""
        return set(self.unhealthy) | set(self.gaps) | ({"tritonserver"} if self.restarting else set())

    def _died(self, cause: str) -> float:
        """Record a death of cause ``cause``; the backoff before the next start."""
        now = time.monotonic()
        self.restarts.append(now)
        while self.restarts and now - self.restarts[0] > self.stable_s:
            self.restarts.popleft()
        self.causes[cause] += 1
        return backoff_s(len(self.restarts), max_backoff_s=self.max_backoff_s)

    def restart(self) -> float:
        """Stop what is left of the server, start it again (after the backoff; again until a start holds),
        restore the snapshot's models; seconds it took."""
        began = time.monotonic()
        code = self.server.process.poll() if self.server.process else None
        cause = death_cause(code)
        self.restarting = True
        self.unhealthy = set(self.snapshot.configs)
        delay = self._died(cause)
        log.error("tritonserver died (%s); restarting it in %.1f s (%d deaths in the last %.0f s). Last log "
                  "lines:\n%s", cause, delay, len(self.restarts), self.stable_s, self.server.log_tail(10))
        while True:
            self.server.stop(timeout_s=5)
            self.server.models = []
            if self._stop is not None and self._stop.wait(delay):
                return time.monotonic() - began
            try:
                self.server.start(timeout_s=self.start_timeout_s)
                break
            except ServerError as err:
                delay = self._died("start_failed")
                log.error("tritonserver did not start again (%s); retrying in %.1f s", str(err)[:2000], delay)
        restore = restore_set(self.snapshot, self.server.repo)
        fromfile = sorted(n for n, c in restore.items() if c is None)
        if fromfile:
            log.warning("restoring %s from the repository (applied after the last snapshot)", ", ".join(fromfile))
        for name in load_order({n: c or {} for n, c in restore.items()}):
            try:
                self._load(name, restore[name])
            except (urllib.error.URLError, OSError) as err:
                log.error("after the restart, %s did not load: %s", name, err)
        self.unhealthy.clear()
        self.restarting = False
        self._last_live = time.monotonic()
        took = time.monotonic() - began
        self.events.append(f"restart {took:.1f}s")
        log.warning("tritonserver restarted with %d models in %.1f s", len(self.snapshot.configs), took)
        try:
            self.take_snapshot()
        except (urllib.error.URLError, OSError, ValueError):
            pass
        return took

    def metrics_text(self) -> str:
        """The supervisor's counters in Prometheus' text format (served on the guard's ``/metrics``)."""
        lines = ["# HELP e3_tritonserver_restarts_total Deaths of tritonserver that e3 serve restarted it "
                 "after, by cause (signal, exit_<code>, hung, start_failed).",
                 "# TYPE e3_tritonserver_restarts_total counter"]
        lines += [f'e3_tritonserver_restarts_total{{cause="{c}"}} {n}' for c, n in sorted(self.causes.items())]
        lines += ["# HELP e3_tritonserver_up 1 while tritonserver runs and is not being restarted.",
                  "# TYPE e3_tritonserver_up gauge",
                  f"e3_tritonserver_up {int(self.server.alive() and not self.restarting)}",
                  "# HELP e3_model_reloads_total Reloads of a model after one of its Python stubs died.",
                  "# TYPE e3_model_reloads_total counter"]
        lines += [f'e3_model_reloads_total{{model="{m}"}} {n}' for m, n in sorted(self.reloads.items())]
        return "\n".join(lines)

    def short_of_stubs(self, model: str, running: int) -> bool:
        """Does ``model`` run fewer stubs than its snapshot config has instances (a dead one among several,
        which a probe may miss by reaching a live one)?

        The snapshot's config, not a fresh call: under load every HTTP thread of Triton may be held by
        requests to the dead stub (each waits ~2 s for its error; measured with 8 clients), and the answer
        must not wait for them. A controller's scale-down between two snapshots (2 s) can make this a
        false alarm; the price is one reload, which Triton serves through."""
        config = self.snapshot.configs.get(model, {})
        if config.get("backend") != "python":
            return False
        return running < sum(int(g.get("count", 1)) for g in config.get("instance_group", [{"count": 1}]))

    def stub_is_dead(self, model: str) -> bool:
        """Does ``model`` answer a probe with the Python backend's dead-stub error?"""
        try:
            self._call("POST", f"/v2/models/{model}/infer", probe_request(self.snapshot.configs[model]), timeout_s=30)
        except urllib.error.HTTPError as err:
            try:
                message = json.loads(err.read() or b"{}").get("error", "")
            except ValueError:
                message = ""
            return is_dead_stub(message)
        except (urllib.error.URLError, OSError):
            return False
        return False

    def reload(self, models: list[str]) -> None:
        """Reload ``models`` (a stub died) with their snapshot configs."""
        self.unhealthy.update(models)
        for name in load_order({m: self.snapshot.configs[m] for m in models}):
            began = time.monotonic()
            log.error("a Python stub of %s died; reloading the model", name)
            if self.on_stub_death:
                self.on_stub_death(name)   # requests it held will never be answered by Triton
            config = with_reload_mark(self.snapshot.configs[name])   # at most snapshot_s old; see short_of_stubs
            try:
                self._load(name, config)
            except (urllib.error.URLError, OSError) as err:
                log.error("reloading %s failed: %s", name, err)
                continue
            self.unhealthy.discard(name)
            self.reloads[name] += 1
            self.stale.update(dict.fromkeys(self.snapshot.stubs.get(name, ()), time.monotonic()))
            self.events.append(f"reload {name} {time.monotonic() - began:.1f}s")
        try:
            self.take_snapshot()
        except (urllib.error.URLError, OSError, ValueError):
            pass
