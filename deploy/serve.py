"""`e3 serve`'s loop: a tritonserver on a repository, guarded and supervised, until ``stop`` is set.

The supervisor (:mod:`e3.deploy.supervisor`) restarts the server whenever it dies (for as long as this runs)
and reloads a model whose stub died; the guards (:mod:`e3.deploy.guard`, :mod:`e3.deploy.grpc_guard`) are
the public HTTP and gRPC ports in front of it; gRPC's is the C++ front with the gRPC guard behind it
(:mod:`e3.deploy.grpc_front_process`; the guard alone where the front is not built). Guarded, Triton's own HTTP and gRPC endpoints are Unix sockets
in a private folder (:class:`~e3.deploy.server.TritonServer`'s ``private``: no secret on a command line, see
its module docstring); the user's API key, where set, is checked by the guards only and never given to Triton.
``restart=False`` only watches the server until it exits.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Callable, Mapping, Sequence

from e3.deploy.durable import PlanWatch
from e3.deploy.grpc_front_process import grpc_port as public_grpc
from e3.deploy.guard import Guard, tune_gc
from e3.deploy.server import ServerError, TritonServer, models_to_serve, port_taken
from e3.deploy.supervisor import Supervisor

__all__ = ["serve_until_stopped", "guard_until_stopped", "KEEP_SERVING_ARGS", "models_not_loaded"]

LOOPBACK = ("127.0.0.1", "localhost", "::1")
# A model that fails to load does not stop the others: tritonserver keeps running (it exits on the first
# failed --load-model by default) and reports ready while what loaded serves; e3 serve names what did not.
KEEP_SERVING_ARGS = ("--exit-on-error=false", "--strict-readiness=false")


def models_not_loaded(server: TritonServer, wanted: Sequence[str] | None = None) -> list[tuple[str, str]]:
    """(name, Triton's reason) of every model of ``wanted`` (default: every model the server was asked to
    load) that is not READY, from the repository index."""
    text = server.call("POST", "/v2/repository/index", b"{}", {"Content-Type": "application/json"}, timeout_s=30)
    index = {m["name"]: m for m in json.loads(text)}
    names = list(wanted) if wanted is not None else _asked(server)
    return [(n, index.get(n, {}).get("reason") or index.get(n, {}).get("state") or "not in the repository")
            for n in names if index.get(n, {}).get("state") != "READY"]


def _asked(server: TritonServer) -> list[str]:
    return list(server.models) if server.models is not None else models_to_serve(server.repo)


def _name_failed(server: TritonServer, complain: Callable[[str], None]) -> None:
    """Say which models did not load and why; ServerError when none did."""
    asked = _asked(server)
    failed = models_not_loaded(server, asked)
    for name, reason in failed:
        complain(f"e3 serve: {name} did not load and is not served: {reason}")
    if failed and len(failed) == len(asked):
        raise ServerError("no model loaded; see the reasons above")


def serve_until_stopped(repo: str | Path, models: Sequence[str] | None, stop: threading.Event, *, host: str,
                        http_port: int, grpc_port: int, metrics_port: int, tritonserver: str | None,
                        timeout_s: float, headers: Mapping[str, str] | None, guarded: bool = True,
                        restart: bool = True, echo: Callable[[str], None] = print,
                        complain: Callable[[str], None] = print) -> int:
    """Serve ``repo`` (``models``; None: its manifest's) until ``stop`` is set; 0 (the supervisor never gives
    up). ``headers``: the API key header every control call must carry (None: none, loopback only)."""
    if headers is None and host not in LOOPBACK:
        raise ServerError(f"--host {host} makes the server reachable by others: set E3_API_HEADER and "
                          "E3_API_KEY so that model control, model configs and shared memory need the key")
    if not models and not models_to_serve(repo):   # a manifest without a deployment: an export that never finished
        raise ServerError(f"{repo} has no model to load: its manifest lists no deployment (an export that did not "
                          "finish writes none); run `e3 export MODEL` again, or name the models with --models")
    for what, port in (("HTTP", http_port), ("gRPC", grpc_port)):
        if guarded and port_taken(host, port):
            raise ServerError(f"{what} port {port} on {host} is already in use; choose another with "
                              f"--{what.lower()}-port")
    server = TritonServer(repo, list(models) if models else None, host=host, http_port=http_port,
                          grpc_port=grpc_port, metrics_port=metrics_port, tritonserver=tritonserver, echo_logs=True,
                          api_key=next(iter(headers.items())) if headers else None, private=guarded,
                          extra_args=list(KEEP_SERVING_ARGS))
    supervisor = Supervisor(server, headers=headers, start_timeout_s=timeout_s)
    try:
        server.start(timeout_s=timeout_s)
        _name_failed(server, complain)
    except BaseException:
        server.close()
        raise
    guard = grpc_guard = None
    code = 0
    try:
        if guarded:
            grpc_guard = public_grpc(server.grpc_url, host=host, port=grpc_port, api_key=server.api_key,
                                     unhealthy=supervisor.down, on_control=supervisor.control).start()
            guard = Guard(server.http_url, host=host, port=http_port, unhealthy=supervisor.down,
                          metrics=lambda: supervisor.metrics_text() + grpc_guard.metrics_text(),
                          api_key=server.api_key, on_control=supervisor.control).start()
            supervisor.on_stub_death = lambda model: guard.abort(model) + grpc_guard.abort(model)
            tune_gc()
        if restart:   # before "serving": a death right after it must find the models to restore
            supervisor.take_snapshot()
        http = guard.url if guard else server.http_url
        grpc_url = grpc_guard.url if grpc_guard else server.grpc_url
        guarded_note = " (guarded)" if guard else ""
        echo(f"serving {repo}: HTTP {http}{guarded_note}, gRPC {grpc_url}{guarded_note}, "
             f"metrics {server.metrics_url}{', restarted if it dies' if restart else ''} (Ctrl-C stops)")
        if restart:
            supervisor.run(stop)
        else:
            while not stop.is_set() and server.alive():
                stop.wait(0.5)
    finally:
        if guard:
            guard.stop()
        if grpc_guard:
            grpc_guard.stop()
        exit_code = server.stop()
        server.close()
    echo(f"tritonserver stopped (exit code {exit_code})")
    return code


def guard_until_stopped(triton_http: str, triton_grpc: str, stop: threading.Event, *, host: str, http_port: int,
                        grpc_port: int, headers: Mapping[str, str] | None, echo: Callable[[str], None] = print) -> int:
    """Only the guards (``e3 serve --guard-only``), in front of a tritonserver someone else runs: the Helm chart's
    ``guard`` container, beside Triton's in the same pod, whose HTTP and gRPC endpoints are Unix sockets on a
    volume the two containers share (``triton_http``, ``triton_grpc``: ``unix:/path``). No supervisor (the
    kubelet restarts containers), but readiness answers 503 while the router's plan names a split this server
    does not serve (:class:`~e3.deploy.durable.PlanWatch`); until ``stop`` is set; 0."""
    if headers is None and host not in LOOPBACK:
        raise ServerError(f"--host {host} makes the guards reachable by others: set E3_API_HEADER and "
                          "E3_API_KEY_FILE (or E3_API_KEY) so that model control needs the key")
    api_key = next(iter(headers.items())) if headers else None
    watch = PlanWatch.over_http(triton_http).start()
    grpc_guard = public_grpc(triton_grpc, host=host, port=grpc_port, api_key=api_key, unhealthy=watch.down).start()
    try:
        guard = Guard(triton_http, host=host, port=http_port, api_key=api_key, unhealthy=watch.down,
                      metrics=grpc_guard.metrics_text).start()
        try:
            tune_gc()
            echo(f"guarding {triton_http} on HTTP {guard.url} and {triton_grpc} on gRPC {grpc_guard.url} "
                 "(Ctrl-C stops)")
            stop.wait()
        finally:
            guard.stop()
    finally:
        grpc_guard.stop()
        watch.stop()
    return 0
