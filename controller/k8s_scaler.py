"""Pod replicas of a pool's Triton Deployment, through the Kubernetes API (the ``kubernetes`` client).

Inside a pod the controller changes instance counts with Triton's load API; where a plan needs more
split instances than a pool's pods hold (:func:`e3.deploy.pools.replicas_needed`), it scales the
pool's Deployment first, and scales it back down once the plan that needed the pods is gone.

Two implementations of :class:`PoolScaler`: :class:`KubernetesScaler` (the ``scale`` subresource of
the Deployment, the only write the chart's Role allows: ``deployments/scale`` get and patch, and a
``get`` of the Deployment to see its ready pods) and :class:`RecordingScaler` (in memory, for tests
of the controller). Decisions:
* The patch is a merge patch of a ``V1Scale`` with only ``spec.replicas`` (built with the client's
  own models), so it never touches the rest of the Deployment the chart owns.
* Scaling up waits until the Deployment reports the pods ready (their readiness probe: Triton and
  its start-up models ready) before the controller loads splits on them; a timeout is a
  :class:`~e3.controller.applier.ControlError`, and the loop retries the plan with backoff.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from typing import Any

from e3.controller.applier import ControlError
from e3.deploy.pools import Pool, Pools

__all__ = ["PoolScaler", "KubernetesScaler", "AutoscaledPools", "RecordingScaler", "scale_request"]

log = logging.getLogger(__name__)


class PoolScaler(ABC):
    """Pods of a pool. Methods raise :class:`ControlError` when the cluster refuses or cannot be reached."""

    poll_s: float = 2.0   # how often wait_ready reads the pods' readiness (s)
    owns_replicas: bool = True   # False: an autoscaler (HPA/KEDA) sets spec.replicas; this only reads

    @abstractmethod
    def replicas(self, pool: Pool) -> int:
        """Pods the pool's Deployment asks for now (``spec.replicas``)."""

    @abstractmethod
    def scale(self, pool: Pool, replicas: int) -> None:
        """Ask for ``replicas`` pods in the pool's Deployment."""

    @abstractmethod
    def ready(self, pool: Pool) -> int:
        """Pods of the pool that pass their readiness probe."""

    def wait_ready(self, pool: Pool, replicas: int, timeout_s: float) -> None:
        """Return once ``replicas`` pods of the pool are ready; :class:`ControlError` after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            have = self.ready(pool)
            if have >= replicas:
                return
            if time.monotonic() >= deadline:
                raise ControlError(f"pool {pool.name!r}: {have} of {replicas} pods ready after {timeout_s:g} s "
                                   f"(Deployment {pool.deployment})")
            time.sleep(self.poll_s)


def scale_request(pool: Pool, namespace: str, replicas: int) -> Any:
    """The merge patch that sets the pool's Deployment to ``replicas`` pods: a ``V1Scale`` with its
    name, namespace and ``spec.replicas`` only."""
    from kubernetes import client   # deferred: kubernetes (1.4 s) only where pools are scaled
    if replicas < 0:
        raise ControlError(f"pool {pool.name!r}: replicas must be >= 0, got {replicas}")
    return client.V1Scale(api_version="autoscaling/v1", kind="Scale",
                          metadata=client.V1ObjectMeta(name=pool.deployment, namespace=namespace),
                          spec=client.V1ScaleSpec(replicas=int(replicas)))


class KubernetesScaler(PoolScaler):
    """The pools' Deployments in namespace ``pools.namespace``, through ``apps`` (an ``AppsV1Api``;
    default: one on the in-cluster service account, else the local kubeconfig)."""

    def __init__(self, pools: Pools, apps: Any = None):
        self.namespace = pools.namespace
        if apps is None:
            from kubernetes import client, config   # deferred: kubernetes (1.4 s) only where pools are scaled
            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            apps = client.AppsV1Api()
        self.apps = apps

    def _call(self, what: str, fn, *args, **kwargs):
        # deferred: kubernetes (1.4 s) only where pools are scaled
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError
        try:
            return fn(*args, **kwargs)
        except ApiException as err:
            raise ControlError(f"{what}: Kubernetes answered {err.status} {err.reason}: {err.body}") from None
        except (HTTPError, OSError) as err:   # urllib3's retries exhausted, a refused connection
            raise ControlError(f"{what}: cannot reach the Kubernetes API: {err}") from None

    def replicas(self, pool: Pool) -> int:
        scale = self._call(f"read scale of {pool.deployment}", self.apps.read_namespaced_deployment_scale,
                           pool.deployment, self.namespace)
        return int(scale.spec.replicas or 0)

    def scale(self, pool: Pool, replicas: int) -> None:
        body = scale_request(pool, self.namespace, replicas)
        self._call(f"scale {pool.deployment} to {replicas}", self.apps.patch_namespaced_deployment_scale,
                   pool.deployment, self.namespace, body)
        log.info("pool %s: asked Deployment %s for %d pods", pool.name, pool.deployment, replicas)

    def ready(self, pool: Pool) -> int:
        deployment = self._call(f"read {pool.deployment}", self.apps.read_namespaced_deployment,
                                pool.deployment, self.namespace)
        return int((deployment.status.ready_replicas if deployment.status else 0) or 0)


class AutoscaledPools(KubernetesScaler):
    """Pools whose replicas an autoscaler owns (the chart's ``autoscaling.enabled``: an HPA or a KEDA
    ScaledObject on ``e3_controller_desired_replicas``). One owner of ``spec.replicas``: this never patches
    the scale; it reads the Deployments, and the controller waits (retrying the plan with backoff while the
    published signal asks for the pods) until the autoscaler's pods are ready. The chart's Role then grants
    no ``patch``."""

    owns_replicas = False

    def scale(self, pool: Pool, replicas: int) -> None:
        log.info("pool %s: the autoscaler owns its replicas; %d pods published as desired, not patched",
                 pool.name, replicas)


class RecordingScaler(PoolScaler):
    """Pools held in memory (pool name -> pods, all ready at once); ``calls`` lists every scale."""

    def __init__(self, replicas: dict[str, int]):
        self.pods = dict(replicas)
        self.calls: list[tuple[str, int]] = []

    def replicas(self, pool: Pool) -> int:
        return self.pods[pool.name]

    def scale(self, pool: Pool, replicas: int) -> None:
        self.calls.append((pool.name, replicas))
        self.pods[pool.name] = replicas

    def ready(self, pool: Pool) -> int:
        return self.pods[pool.name]
