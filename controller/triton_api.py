"""The controller's hands on a running Triton: load, unload, instance counts, plan switch.

Everything goes through Triton's model-repository API (explicit model-control
mode), never through files on Triton's disk, so it works the same when
Triton runs in another pod.

Switching the router's plan is a load of ``<m>_router`` with a config override
whose ``plan`` parameter carries the new plan: Triton loads the new router
instances and swaps them in once they are ready; requests in flight finish
on the old ones, so no request fails across the switch (tested under load in
tests/test_plan_switch.py). A malformed plan is refused here before any call,
and if the router itself refuses it at load, Triton keeps the running
version serving.
"""

from __future__ import annotations

import copy
import json
import logging
import os

from e3.controller.applier import ControlError
from e3.core.closing import ClosingClient
from e3.core.plan import Plan, PlanError

__all__ = ["TritonControl", "ControlError", "api_key_headers"]

log = logging.getLogger(__name__)


def api_key_headers() -> dict[str, str] | None:
    """The header that unlocks a restricted model-control API (Triton's ``--http-restricted-api``), from
    the environment: ``E3_API_HEADER`` (name) and ``E3_API_KEY`` (value), as the Helm chart sets them
    from its Secret. None when either is unset (a server on loopback needs none)."""
    name, key = os.environ.get("E3_API_HEADER"), os.environ.get("E3_API_KEY")
    return {name: key} if name and key else None


class TritonControl(ClosingClient):
    """Model-control calls on one Triton server (HTTP API); ``headers`` go with every call (default:
    :func:`api_key_headers`)."""

    def __init__(self, url: str, timeout_s: float = 300.0, headers: dict[str, str] | None = None):
        import tritonclient.http as http   # deferred: it loads gevent (400 ms); `e3 serve` reads api_key_headers alone
        self._client = http.InferenceServerClient(url, connection_timeout=timeout_s, network_timeout=timeout_s)
        self._headers = headers if headers is not None else api_key_headers()

    def _call(self, what: str, fn, *args, **kwargs):
        from tritonclient.utils import InferenceServerException   # deferred with tritonclient.http (above)
        if self._headers:
            kwargs["headers"] = self._headers
        try:
            return fn(*args, **kwargs)
        except InferenceServerException as err:
            raise ControlError(f"{what}: {err.message()}") from None

    def model_config(self, name: str) -> dict:
        """The live config of ``name`` as JSON (Triton's, with every default filled in)."""
        return self._call(f"config of {name}", self._client.get_model_config, name)

    def loaded(self) -> dict[str, str]:
        """Model name -> state ("READY", "UNAVAILABLE", ...) for every model in the repository index."""
        index = self._call("repository index", self._client.get_model_repository_index)
        return {m["name"]: m.get("state", "") for m in index}

    def statistics(self, name: str) -> dict:
        """Triton's cumulative inference statistics of ``name`` (``GET v2/models/<name>/stats``)."""
        return self._call(f"statistics of {name}", self._client.get_inference_statistics, name)

    def is_ready(self, name: str) -> bool:
        """Is ``name`` loaded and ready to serve?"""
        return bool(self._call(f"readiness of {name}", self._client.is_model_ready, name))

    def load(self, name: str, config: dict | None = None) -> None:
        """Load (or reload) ``name``, optionally with a full config override."""
        kwargs = {"config": json.dumps(config)} if config is not None else {}
        self._call(f"load {name}", self._client.load_model, name, **kwargs)
        log.info("loaded %s%s", name, " (config override)" if config is not None else "")

    def unload(self, name: str) -> None:
        """Unload ``name`` (requests in flight finish first)."""
        self._call(f"unload {name}", self._client.unload_model, name)
        log.info("unloaded %s", name)

    def set_instances(self, name: str, count: int) -> None:
        """Change the instance count of ``name`` (every instance group gets ``count``)."""
        if count < 1:
            raise ControlError(f"{name}: instance count must be >= 1, got {count}")
        config = copy.deepcopy(self.model_config(name))
        for group in config.get("instance_group", []):
            group["count"] = count
        self.load(name, config)

    def switch_plan(self, router: str, plan: Plan) -> None:
        """Hand ``plan`` to ``router`` (a reload with a config override); the splits it places on this
        server must already be loaded (those on other servers are checked there, by the caller)."""
        try:
            plan = Plan.from_dict(json.loads(plan.to_json()))
        except PlanError as err:
            raise ControlError(f"refusing to switch {router} to a malformed plan: {err}") from None
        not_ready = [s.model for s in plan.triton_splits if not s.server and not self.is_ready(s.model)]
        if not_ready:
            raise ControlError(f"load the plan's splits before switching {router}: {', '.join(not_ready)} not ready")
        config = copy.deepcopy(self.model_config(router))
        config.setdefault("parameters", {})["plan"] = {"string_value": json.dumps(plan.to_dict(), sort_keys=True)}
        # One instance admits every request at once (delay 0); several answer inline, and requests gather in
        # Triton's queue meanwhile (Plan.router_queue_delay_us).
        config.setdefault("dynamic_batching", {}).update(max_queue_delay_microseconds=plan.router_queue_delay_us)
        groups = config.get("instance_group") or [{"kind": "KIND_CPU"}]
        config["instance_group"] = [dict(groups[0], count=plan.router_instances)]
        self.load(router, config)

    def current_plan(self, router: str) -> Plan:
        """The plan in the router's live config."""
        params = self.model_config(router).get("parameters", {})
        return Plan.from_json(params["plan"]["string_value"])
