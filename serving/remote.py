"""A constant split served by another Triton (another pool), reached over gRPC with tritonclient.

The router reaches a split on its own server by BLS (:func:`e3.serving.triton_io.bls`); a plan may
place a split on another server (:attr:`e3.core.plan.SplitPlan.server`, the gRPC address of that
pool's Triton, e.g. its Kubernetes Service). :class:`RemoteSplit` is the same call over the network,
with the same typed errors, so the router's scheduler treats both alike.

Decisions:
* One gRPC client per calling thread (the router's split workers): a channel per worker keeps calls
  independent. A server named ``dns:///host:port`` (the Helm chart names a pool's headless Service
  so) gets gRPC's round-robin balancing over every address the name resolves to, one per ready pod:
  kube-proxy behind a plain Service balances connections, not calls.
* A call answered UNAVAILABLE (a pod that left, a channel still connecting) is tried once more
  within the deadline; inference is idempotent. Any other failure is final.
* The batch's remaining SLO goes twice: as Triton's request ``timeout`` (the split's queue rejects
  it once expired, as for BLS) and as the client's deadline (a lost server cannot hold a batch).
* Channel arguments (:func:`channel_args`): tritonclient replaces *all* its own channel options when
  it is given any, so the balanced channel keeps what tritonclient sets by default -- unlimited send
  and receive message sizes (gRPC's default receive limit is 4 MiB; bert-ee's hidden state at batch
  64 is 4.7 MB) -- and adds keepalive pings: after ``KEEPALIVE.keepalive_time_ms`` without a frame
  on a connection with a call in flight, a ping; no answer within ``keepalive_timeout_ms`` closes the
  connection (a node that vanished without closing its sockets), and the call fails with UNAVAILABLE
  and is tried once more on another pod. Pings are sent only while calls are in flight
  (``keepalive_permit_without_calls`` off): Triton's server refuses pings on idle connections more
  often than every 5 minutes (its ``--grpc-http2-min-recv-ping-interval-without-data``) and answers
  repeated ones by closing the connection.
"""

from __future__ import annotations

import threading
import time

import numpy as np

__all__ = ["RemoteSplit", "channel_args", "KEEPALIVE_TIME_MS", "KEEPALIVE_TIMEOUT_MS"]

# Extra client-side wait past the batch's deadline (s): the server answers an expired request itself.
CLIENT_GRACE_S = 1.0
# Calls answered UNAVAILABLE (no connection) are tried this many times in all, within the batch's deadline.
UNAVAILABLE_TRIES = 2
# A server address resolved by gRPC itself, every address balanced round-robin (e.g. a headless Service).
DNS_SCHEME = "dns:///"
# Keepalive (ms): a ping after this long without a frame while a call is in flight, and the wait for its answer.
KEEPALIVE_TIME_MS = 30_000
KEEPALIVE_TIMEOUT_MS = 10_000


def channel_args(server: str) -> list[tuple[str, object]]:
    """The gRPC channel options for ``server``: tritonclient's defaults (unlimited message sizes, its
    keepalive option names) with keepalive pings on, and round-robin balancing for a ``dns:///`` name."""
    from tritonclient.grpc import MAX_GRPC_MESSAGE_SIZE, KeepAliveOptions   # tritonclient's "unlimited": INT32_MAX
    keep = KeepAliveOptions(keepalive_time_ms=KEEPALIVE_TIME_MS, keepalive_timeout_ms=KEEPALIVE_TIMEOUT_MS,
                            keepalive_permit_without_calls=False)
    args: list[tuple[str, object]] = [
        ("grpc.max_send_message_length", MAX_GRPC_MESSAGE_SIZE),
        ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_SIZE),
        ("grpc.keepalive_time_ms", keep.keepalive_time_ms),
        ("grpc.keepalive_timeout_ms", keep.keepalive_timeout_ms),
        ("grpc.keepalive_permit_without_calls", int(keep.keepalive_permit_without_calls)),
        ("grpc.http2.max_pings_without_data", keep.http2_max_pings_without_data),
    ]
    if server.startswith(DNS_SCHEME):
        args.append(("grpc.lb_policy_name", "round_robin"))
    return args


class RemoteSplit:
    """Calls to split ``model`` on the Triton at ``server`` (gRPC host:port)."""

    def __init__(self, server: str, model: str):
        self.server, self.model = server, model
        self._local = threading.local()
        self._lock = threading.Lock()
        self._clients: list = []

    def _client(self):
        client = getattr(self._local, "client", None)
        if client is None:
            import tritonclient.grpc as grpc   # deferred: only a split on another server needs the client (220 ms)
            client = self._local.client = grpc.InferenceServerClient(self.server,
                                                                     channel_args=channel_args(self.server))
            with self._lock:
                self._clients.append(client)
        return client

    def infer(self, inputs: dict[str, np.ndarray], outputs: list[str], timeout_us: int = 0) -> dict[str, np.ndarray]:
        """Run the split on ``inputs`` (name -> array [batch, ...]) and return ``outputs`` (name -> array).

        Raises :class:`BlsTimeout` when the deadline passed (in the split's queue or on the way),
        :class:`BlsError` for any other failure; both name the split and its server.
        """
        # deferred: only a split on another server needs the client (220 ms at load)
        import tritonclient.grpc as grpc
        from tritonclient.utils import InferenceServerException, np_to_triton_dtype

        # Imported here: triton_io needs the Python backend's module, and channel_args is tested without it.
        from e3.serving.triton_io import BlsError, BlsTimeout, bls_error
        tensors = []
        for name, value in inputs.items():
            value = np.ascontiguousarray(value)
            tensor = grpc.InferInput(name, list(value.shape), np_to_triton_dtype(value.dtype))
            tensor.set_data_from_numpy(value)
            tensors.append(tensor)
        where = f"{self.model} on {self.server}"
        deadline = time.monotonic() + timeout_us / 1e6 if timeout_us else None
        for attempt in range(UNAVAILABLE_TRIES):
            left_us = int((deadline - time.monotonic()) * 1e6) if deadline is not None else 0
            if deadline is not None and left_us <= 0:
                raise BlsTimeout(f"{where}: the deadline passed before it answered")
            try:
                result = self._client().infer(
                    self.model, tensors, outputs=[grpc.InferRequestedOutput(n) for n in outputs],
                    **({"timeout": left_us, "client_timeout": left_us / 1e6 + CLIENT_GRACE_S} if left_us else {}))
                break
            except InferenceServerException as err:
                status = str(err.status() or "")
                if "DEADLINE_EXCEEDED" in status:
                    raise BlsTimeout(f"{where}: the deadline passed before it answered") from None
                if "UNAVAILABLE" in status and attempt + 1 < UNAVAILABLE_TRIES:
                    continue   # a pod that went away (or a channel not connected yet): inference is idempotent
                raise bls_error(where, err.message() or str(err)) from None
            except Exception as err:  # noqa: BLE001 - connection trouble: the batch's requests get this error
                raise BlsError(f"{where}: {err}") from None
        out = {}
        for name in outputs:
            value = result.as_numpy(name)
            if value is None:
                raise BlsError(f"{where}: response lacks output '{name}'")
            out[name] = value
        return out

    def close(self) -> None:
        """Close every thread's client."""
        with self._lock:
            clients, self._clients = self._clients, []
        for client in clients:
            try:
                client.close()
            except Exception:  # noqa: BLE001 - closing at unload; nothing left to answer
                pass
