"""The controller's view of and hands on a running Triton, over its HTTP API and metrics port.

Decisions (where the paper and docs/design.md are silent)
-------------------------------------------------
* **Split configuration**: a split's instances, preferred batch size and queue
  delay are set with one load carrying a config override
  (:func:`with_split_settings`; skipped when the live config already matches);
  docs/design.md §3 asks for instance counts through
  ``POST v2/repository/models/<name>/load`` with a config override.
* **Missing split models** (not pre-exported with ``--all-ranges``) are
  exported with :func:`~e3.export.repository.export_repository` before any
  load, keeping the plan in force as the repository's plan.
* **Probes** (dead-stub check) send one input built from the model's live
  config with the project's one dtype map (:func:`e3.core.spec.dtype_from_config`,
  :data:`~e3.core.spec.NUMPY_DTYPES`): ones for integer and boolean inputs (an
  all-zero attention mask gives NaN softmaxes), zeros for floats.
* **Reloads** carry a new ``e3_reload`` parameter: Triton skips a load whose
  config and files are unchanged (measured: a dead stub stayed dead).
* **Durable plans**: with a repository, every split configuration and plan switch that holds is also
  written there (:mod:`e3.deploy.durable`: the model's ``config.pbtxt`` atomically, the plan and the
  models to serve in the manifest), so a restarted server loads what was applied, not what was
  exported. A repository this process cannot write is logged once per model and skipped (the plan
  then lives in memory only, as before).
"""

from __future__ import annotations

import copy
import logging
import threading
from pathlib import Path
from typing import Iterable

import numpy as np

from e3.controller.applier import ControlError, ServerControl, ServerView
from e3.controller.health import SplitStats, failed_requests
from e3.controller.telemetry import fetch_metrics_text
from e3.controller.triton_api import TritonControl
from e3.core.names import parse_split_name
from e3.core.plan import Plan, PlanError, SplitPlan
from e3.core.spec import NUMPY_DTYPES, dtype_from_config
from e3.deploy.durable import record_plan, write_config
from e3.deploy.stubs import with_reload_mark

__all__ = ["TritonApplier", "with_split_settings", "probe_inputs"]

log = logging.getLogger(__name__)


def with_split_settings(config: dict, split: SplitPlan, gpus: int = 0) -> dict:
    """``config`` (a Triton model config as JSON) with the split's instances and preferred batch, and no queue
    delay: the router's scheduler forms the split's batches (``queue_delay_us`` is its wait) and a delayed
    Triton batcher would merge them.

    ``gpus`` > 0 (a pod of a GPU pool): the instances become ``KIND_GPU`` groups, one per GPU, each naming its
    GPU (:func:`~e3.export.triton_config.gpu_instance_groups`): Triton would put a group's ``count`` on every
    GPU of the pod otherwise. A config already ``KIND_GPU`` (a TensorRT plan) is spread the same way, over
    GPU 0 when ``gpus`` is 0."""
    from e3.export.triton_config import gpu_instance_groups   # deferred: it loads tritonclient's gRPC protos (350 ms)
    out = copy.deepcopy(config)
    on_gpu = gpus > 0 or any(g.get("kind") == "KIND_GPU" for g in out.get("instance_group", []) or [])
    if on_gpu:
        out["instance_group"] = gpu_instance_groups(split.instances, max(gpus, 1))
    for group in ([] if on_gpu else out.get("instance_group", []) or [{}]):
        group["count"] = split.instances
    if not out.get("instance_group"):
        out["instance_group"] = [{"count": split.instances, "kind": "KIND_CPU"}]
    batching = out.setdefault("dynamic_batching", {})
    batching["preferred_batch_size"] = [min(split.batch_size, int(out.get("max_batch_size") or split.batch_size))]
    batching["max_queue_delay_microseconds"] = 0
    return out


def probe_inputs(config: dict) -> list[tuple[str, str, np.ndarray]] | None:
    """One input for every input of a model config: ``(name, protocol dtype, array [1, *dims])``.

    Variable dimensions (-1) become 1. None when an input has a datatype the
    project does not handle (then no probe can be built).
    """
    out = []
    for spec in config.get("input", []):
        try:
            dtype = dtype_from_config(spec.get("data_type", ""))
        except ValueError:
            return None
        dims = [1, *(max(1, int(d)) for d in spec.get("dims", []))]
        if dtype == "BYTES":
            data = np.full(dims, b"e3 probe", dtype=object)
        elif dtype.startswith(("INT", "UINT")) or dtype == "BOOL":
            data = np.ones(dims, dtype=NUMPY_DTYPES[dtype])
        else:
            data = np.zeros(dims, dtype=NUMPY_DTYPES[dtype])
        out.append((spec["name"], dtype, data))
    return out


class TritonApplier(ServerView, ServerControl):
    """A running Triton seen and changed through its HTTP API (:class:`~e3.controller.triton_api.TritonControl`).

    ``repo`` and ``zoo_model`` are needed only to export split models that are
    missing from the repository; ``metrics_url`` only for the failed-request
    counters; ``gpus`` (GPUs of the server's pod, 0 on a CPU) spreads split
    instances over them (:func:`with_split_settings`). ``durable`` (default: when ``repo`` is given)
    writes what holds into ``repo`` (see the module docstring).
    """

    def __init__(self, url: str, *, metrics_url: str | None = None, repo: Path | None = None,
                 zoo_model: str | None = None, probe_timeout_s: float = 10.0, gpus: int = 0,
                 durable: bool | None = None):
        self.url, self.metrics_url, self.repo, self.zoo_model = url, metrics_url, repo, zoo_model
        self.durable = repo is not None if durable is None else durable and repo is not None
        self._unwritable: set[str] = set()
        self.gpus = gpus
        self.probe_timeout_s = probe_timeout_s
        self._local = threading.local()

    @property
    def control(self):
        """This thread's :class:`TritonControl`: tritonclient's HTTP client (gevent) hangs when shared
        across threads, and the control loop usually runs in its own thread."""
        control = getattr(self._local, "control", None)
        if control is None:
            control = self._local.control = TritonControl(self.url)
        return control

    def close(self) -> None:
        """Closes this thread's client; clients of other threads are dropped with their threads."""
        control = getattr(self._local, "control", None)
        if control is not None:
            control.close()
            self._local.control = None

    # -- ServerView ----------------------------------------------------------------------------------
    def current_plan(self, router: str) -> Plan | None:
        try:
            if not self.control.is_ready(router):
                return None
        except ControlError:
            return None
        return self.control.current_plan(router)

    def loaded_splits(self, model: str) -> dict[str, int]:
        out = {}
        for name, state in self.control.loaded().items():
            if state != "READY":
                continue
            try:
                served, _, _ = parse_split_name(name)
            except ValueError:
                continue
            if served == model:
                groups = self.control.model_config(name).get("instance_group", [])
                out[name] = sum(int(g.get("count", 1)) for g in groups) or 1
        return out

    def exported(self, split: str) -> bool:
        if self.repo is None:
            return True   # no repository to check: let Triton's load say
        return (Path(self.repo) / split / "config.pbtxt").is_file()

    def split_stats(self, names: Iterable[str]) -> dict[str, SplitStats]:
        out = {}
        for name in names:
            try:
                stats = self.control.statistics(name)
            except ControlError as err:   # a model that is not loaded has no stats; never fatal
                log.debug("no statistics for %s: %s", name, err)
                continue
            for s in stats.get("model_stats", []):
                out[name] = SplitStats(int(s.get("execution_count", 0)), int(s.get("inference_count", 0)),
                                       int(s.get("inference_stats", {}).get("compute_infer", {}).get("ns", 0)))
        return out

    def failed_requests(self) -> dict[str, float]:
        if self.metrics_url is None:
            return {}
        return failed_requests(fetch_metrics_text(self.metrics_url))

    def probe(self, name: str) -> str | None:
        # deferred: tritonclient.http loads gevent (400 ms), only to probe a model
        import tritonclient.http as http
        from tritonclient.utils import InferenceServerException
        arrays = probe_inputs(self.control.model_config(name))
        if arrays is None:
            return None   # cannot build a probe for this model's inputs: no evidence either way
        inputs = []
        for input_name, dtype, data in arrays:
            tensor = http.InferInput(input_name, list(data.shape), dtype)
            tensor.set_data_from_numpy(data)
            inputs.append(tensor)
        try:
            with http.InferenceServerClient(self.url, network_timeout=self.probe_timeout_s) as client:
                client.infer(name, inputs)
        except InferenceServerException as err:
            return err.message()
        except Exception as err:  # noqa: BLE001 (connection trouble is a probe failure, with its message)
            return str(err)
        return None

    # -- ServerControl -------------------------------------------------------------------------------
    def export(self, splits: list[SplitPlan], plan_in_force: Plan | None) -> None:
        # deferred: the exporter loads torch, only when a plan needs a split the repository lacks
        from e3.export.repository import ExportError, ExportSettings, export_repository
        if self.repo is None or self.zoo_model is None:
            raise ControlError(f"split models {[s.model for s in splits]} are not in the repository and no "
                               "repository/model was given to export them; export with --all-ranges")
        try:
            export_repository(self.zoo_model, None, Path(self.repo), settings=ExportSettings(), plan=plan_in_force,
                              progress=False, extra_ranges=[(s.first_block, s.last_block) for s in splits])
        except (ExportError, PlanError, ValueError) as err:
            raise ControlError(f"export of {[s.model for s in splits]} failed: {err}") from None

    def configure_split(self, split: SplitPlan) -> None:
        state = self.control.loaded().get(split.model)
        config = self.control.model_config(split.model) if state == "READY" else None
        if config is None:
            self.control.load(split.model)            # first load: the repository's config
            config = self.control.model_config(split.model)
        want = with_split_settings(config, split, self.gpus)
        if want != config:
            self.control.load(split.model, want)
        if not self.control.is_ready(split.model):
            raise ControlError(f"{split.model} is not ready after its load")
        self._persist(split.model, lambda: write_config(self.repo, split.model, want))

    def switch_plan(self, router: str, plan: Plan) -> None:
        self.control.switch_plan(router, plan)
        config = self.control.model_config(router) if self.durable else None
        self._persist(router, lambda: write_config(self.repo, router, config) and
                      record_plan(self.repo, router, plan.to_dict()))

    def _persist(self, name: str, write) -> None:
        """Run ``write`` (a durable write of ``name``'s applied state) when durable; an unwritable repository
        is logged once per model, never fatal: the load itself held."""
        if not self.durable:
            return
        try:
            write()
            self._unwritable.discard(name)
        except Exception as err:  # noqa: BLE001 (a read-only mount, a config protobuf refuses: the load held)
            if name not in self._unwritable:
                log.warning("%s serves what was applied, but %s cannot record it (%s): a restarted server "
                            "will load the repository's older config", name, self.repo, err)
            self._unwritable.add(name)

    def unload(self, name: str) -> None:
        self.control.unload(name)

    def reload(self, name: str) -> None:
        """Reload ``name`` with fresh instances; the old version serves until the new one is ready."""
        self.control.load(name, with_reload_mark(self.control.model_config(name)))
