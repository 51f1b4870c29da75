"""The applied plan made durable, and what readiness checks against it.

A plan switch and a split's instance count are loads with a config override (:mod:`e3.controller.triton_api`):
Triton keeps them in memory only. After a tritonserver restart or a pod restart the repository's files come
back, and a router whose plan names a split the new server did not load fails most requests while
Triton's readiness says 200 (issue 39). So the controller's applier, once a load holds, writes the same
config into the repository (:func:`write_config`: ``<repo>/<model>/config.pbtxt``, atomically) and records the
plan and the models it serves in the manifest (:func:`record_plan`): a restarted server (``e3 serve``, its
supervisor, a new pod on the same repository) loads exactly what was applied before it serves.

Readiness against the plan (:func:`plan_gaps`): a router whose plan names a split of this server that is not
READY is not ready, whatever Triton says; the guard answers 503 for it (:class:`PlanWatch` in a pod, the
supervisor under ``e3 serve``).
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Callable, Iterable, Mapping

from e3.core.files import write_atomic
from e3.core.manifest import read_manifest, write_manifest
from e3.deploy.server import http_request

__all__ = ["config_text", "write_config", "record_plan", "plan_gaps", "plan_splits", "PlanWatch"]

log = logging.getLogger(__name__)

TRANSIENT_PARAMETERS = ("e3_reload",)   # marks of one load, never part of the durable config


def config_text(config: Mapping) -> str:
    """A Triton model config as JSON (the repository API's form) -> ``config.pbtxt`` text."""
    # deferred: tritonclient's gRPC protos (350 ms) load only where a config is written
    from google.protobuf import json_format, text_format
    from tritonclient.grpc import model_config_pb2 as mc
    clean = dict(config)
    clean["parameters"] = {k: v for k, v in (config.get("parameters") or {}).items() if k not in TRANSIENT_PARAMETERS}
    message = json_format.ParseDict(clean, mc.ModelConfig(), ignore_unknown_fields=True)
    return text_format.MessageToString(message)


def write_config(repo: str | Path, name: str, config: Mapping) -> bool:
    """Write ``config`` as ``<repo>/<name>/config.pbtxt`` (atomically); False when the model has no folder
    there (the repository holds another server's models)."""
    folder = Path(repo) / name
    if not (folder / "config.pbtxt").is_file():
        return False
    write_atomic(folder / "config.pbtxt", config_text(config))
    return True


def plan_splits(plan: Mapping) -> list[str]:
    """The split models ``plan`` (a plan document) has this server run: its constant splits without a
    ``server`` (those with one run on another pool's server)."""
    return [s["model"] for s in plan.get("splits", []) if s.get("form", "constant") == "constant"
            and not s.get("server")]


def record_plan(repo: str | Path, router: str, plan: Mapping) -> bool:
    """Record ``plan`` (a plan document) as the plan in force of the deployment whose router is ``router``, and
    its splits as the models to serve (in place of the old plan's; baselines and other models stay, in
    order). False when the manifest has no such deployment."""
    manifest = read_manifest(repo)
    for deployment in manifest.get("deployments", {}).values():
        if deployment.get("router") != router:
            continue
        old = set(plan_splits(deployment.get("plan") or {}))
        split_prefix = router.removesuffix("_router") + "_split_"
        rest = [m for m in deployment.get("serve", []) if m not in old and not m.startswith(split_prefix)]
        at = rest.index(router) if router in rest else 0
        deployment["plan"] = dict(plan)
        deployment["serve"] = rest[:at] + plan_splits(plan) + rest[at:]
        write_manifest(repo, manifest)
        return True
    return False


def plan_gaps(configs: Mapping[str, Mapping], ready: Iterable[str]) -> dict[str, list[str]]:
    """Router -> the splits its plan has this server run that are not READY, for every READY router
    (a model whose config carries a ``plan`` parameter) in ``configs`` with such a gap."""
    ready = set(ready)
    gaps = {}
    for name, config in configs.items():
        text = ((config.get("parameters") or {}).get("plan") or {}).get("string_value")
        if name not in ready or not text:
            continue
        try:
            missing = [s for s in plan_splits(json.loads(text)) if s not in ready]
        except (ValueError, AttributeError):
            continue
        if missing:
            gaps[name] = missing
    return gaps


class PlanWatch:
    """Polls a server (``states()``: model -> state, e.g. "READY"; ``config(name)``: a model's live config) every
    ``period_s`` on a thread of its own and keeps :meth:`down`: the routers whose plan this server does
    not serve (:func:`plan_gaps`). The guard's readiness asks it without waiting on Triton."""

    def __init__(self, states: Callable[[], Mapping[str, str]], config: Callable[[str], dict], period_s: float = 2.0):
        self.states, self.config, self.period_s = states, config, period_s
        self._down: set[str] = set()
        self._said: dict[str, list[str]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="e3-plan-watch", daemon=True)

    @classmethod
    def over_http(cls, address: str, period_s: float = 2.0) -> "PlanWatch":
        """A watch of the Triton at ``address`` (``host:port`` or ``unix:/path``, its HTTP API)."""
        def states() -> dict[str, str]:
            index = json.loads(http_request(address, "POST", "/v2/repository/index", b"{}",
                                            {"Content-Type": "application/json"}, timeout_s=10))
            return {m["name"]: m.get("state", "") for m in index}
        return cls(states, lambda name: json.loads(http_request(address, "GET", f"/v2/models/{name}/config",
                                                                timeout_s=10)), period_s)

    def start(self) -> "PlanWatch":
        self.check()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def down(self) -> set[str]:
        """Routers whose plan names a split this server does not serve (READY) now."""
        return set(self._down)

    def check(self) -> None:
        """Look once; a server that cannot be asked keeps the last answer (its own readiness says the rest)."""
        try:
            ready = [name for name, state in self.states().items() if state == "READY"]
            routers = {m: self.config(m) for m in ready if m.endswith("_router")}
        except Exception as err:  # noqa: BLE001 (Triton starting or gone: its own probes tell)
            log.debug("plan watch: %s", err)
            return
        gaps = plan_gaps(routers, ready)
        if gaps != self._said:
            for router, missing in gaps.items():
                log.warning("%s is not ready: its plan names %s, not loaded here", router, ", ".join(missing))
            self._said = gaps
        self._down = set(gaps)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.check()
