"""The public gRPC port of `e3 serve`: the C++ gRPC front (``deploy/grpc_front/``, the binary ``e3-grpc-front``)
with the Python gRPC guard (:mod:`e3.deploy.grpc_guard`) behind it on a private Unix socket.

Why (measured on 2 cores, tiny-ee's router, perf_analyzer at 64 clients): the Python guard costs 0.74-0.96 ms of
CPU per call (grpc.aio; a bare grpc.aio forwarder without checks 0.79 ms, the checks 42 us), while tritonserver
itself uses 1.3-1.5 ms, so gRPC through it ran at 0.52-0.71x Triton's own port. A C++ forwarder costs
0.21-0.35 ms. So the front takes the hot path:

* ``ModelInfer`` and each message of ``ModelStreamInfer``: parsed, checked with the Python guard's rules
  (``deploy/grpc_front/check.cc``, a twin of :func:`e3.deploy.grpc_guard.check_infer_message`, compared on the
  fuzz corpus by ``tests/test_grpc_front.py``), re-serialised and sent to Triton's private gRPC socket;
* every other method, as it came, to the Python guard, which keeps the API key, the control API and its
  supervisor notifications, and the readiness faults;
* over ``max_message_bytes``: RESOURCE_EXHAUSTED from gRPC in the front, for every method.

The limits have one home: :func:`limit_args` writes them on the front's command line from
:mod:`e3.deploy.request_check` and :mod:`e3.deploy.grpc_guard` (no secret: the key's header name, never the
key). The front takes ``abort MODEL`` and ``stats`` on its stdin; it stops when its stdin closes or its parent
dies. :func:`grpc_port` gives `e3 serve` the front where the binary is built and the Python guard alone, with
one log line saying so, where it is not (no compiler: ``deploy/grpc_front/build.sh`` skips).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
import threading
from collections import Counter
from pathlib import Path
from typing import Callable

from e3.deploy.grpc_guard import DEFAULT_MAX_MESSAGE_BYTES, OUTPUT_PARAMETERS, GrpcGuard
from e3.deploy.guard import Control
from e3.deploy.request_check import DATATYPES, MAX_DIMS, MAX_ELEMENTS, MODEL_NAME, RESERVED_PARAMETERS
from e3.deploy.tools import tool_env

__all__ = ["GrpcFront", "front_binary", "grpc_port", "limit_args", "BINARY"]

log = logging.getLogger(__name__)
BINARY = "e3-grpc-front"
_BUILT = Path(__file__).resolve().parent / "grpc_front" / "build" / BINARY   # deploy/grpc_front/build.sh's output


def front_binary() -> Path | None:
    """The built front: ``deploy/grpc_front/build/e3-grpc-front`` (make setup), else ``e3-grpc-front`` on PATH
    (the chart's image), else None."""
    if _BUILT.is_file() and os.access(_BUILT, os.X_OK):
        return _BUILT
    found = shutil.which(BINARY)
    return Path(found) if found else None


def limit_args(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[str]:
    """The front's limits, from their Python home, as its command-line options."""
    args = ["--max-message-bytes", str(max_message_bytes), "--max-elements", str(MAX_ELEMENTS),
            "--max-dims", str(MAX_DIMS), "--model-name-pattern", MODEL_NAME.pattern]
    for name, (kind, low, high, size) in DATATYPES.items():
        args += ["--datatype", f"{name}={size}:{kind}:{low!r}:{high!r}"]
    args += [x for key, rule in RESERVED_PARAMETERS.items() for x in ("--reserved-parameter", f"{key}={rule}")]
    args += [x for key, rule in OUTPUT_PARAMETERS.items() for x in ("--output-parameter", f"{key}={rule}")]
    return args


class GrpcFront:
    """The C++ front on ``host:port`` in front of Triton's gRPC endpoint ``upstream``, and the Python guard it
    forwards every other method to (module docstring). The same surface as :class:`GrpcGuard` for `e3 serve`:
    ``start``/``stop`` (or ``with``), ``url``, ``abort``, ``metrics_text``, ``codes``; ``guard`` is the Python
    guard behind it. Arguments as :class:`GrpcGuard`'s; ``binary``: the front (default :func:`front_binary`)."""

    def __init__(self, upstream: str, host: str = "127.0.0.1", port: int = 8001, *,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, api_key: tuple[str, str] | None = None,
                 unhealthy: Callable[[], set[str]] | None = None, on_control: Control | None = None,
                 binary: str | os.PathLike | None = None):
        self.upstream, self.host, self.port = upstream, host, port
        self.max_message_bytes = max_message_bytes
        self.api_key = api_key
        self.binary = Path(binary) if binary else front_binary()
        self._guard_args = dict(max_message_bytes=max_message_bytes, api_key=api_key, unhealthy=unhealthy,
                                on_control=on_control)
        self.guard: GrpcGuard | None = None
        self.process: subprocess.Popen | None = None
        self._dir: str | None = None
        self._lock = threading.Lock()   # one control line and its answer at a time

    @property
    def url(self) -> str:
        return f"{self.host}:{self.port}"

    def command(self) -> list[str]:
        """The front's command line (no secret on it: the key's header name at most)."""
        cmd = [str(self.binary), "--listen", f"{self.host}:{self.port}", "--triton", self.upstream,
               "--guard", self.guard.url, *limit_args(self.max_message_bytes)]
        return cmd + (["--key-header", self.api_key[0]] if self.api_key else [])

    def start(self) -> "GrpcFront":
        if self.binary is None:
            raise FileNotFoundError(f"{BINARY} is not built: run `make setup` (deploy/grpc_front/build.sh)")
        self._dir = tempfile.mkdtemp(prefix="e3-grpc-guard-")   # 0700: only this user reaches the guard
        try:
            self.guard = GrpcGuard(self.upstream, host=f"unix:{self._dir}/guard", port=0, **self._guard_args).start()
            # the key is the guard's business: not in the front's environment
            env = {k: v for k, v in tool_env().items() if k not in ("E3_API_KEY", "E3_API_KEY_FILE")}
            self.process = subprocess.Popen(self.command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                            env=env, start_new_session=True)   # Ctrl-C: e3 serve stops it in order
            first = self.process.stdout.readline().split()
            if len(first) != 2 or first[0] != "listening":
                code = self.process.wait(timeout=10)
                raise OSError(f"the gRPC front cannot listen on {self.url} (exit code {code}; its reason is above)")
            self.port = int(first[1])
        except BaseException:
            self.stop()
            raise
        log.info("gRPC front on %s in front of %s (other methods through the guard on %s)", self.url, self.upstream,
                 self.guard.url)
        return self

    def _ask(self, line: str) -> str:
        """One control line and the front's answer ("" if the front has gone)."""
        with self._lock:
            proc = self.process
            if proc is None or proc.poll() is not None:
                return ""
            try:
                proc.stdin.write(line + "\n")
                proc.stdin.flush()
                return proc.stdout.readline().strip()
            except (BrokenPipeError, ValueError):
                return ""

    def abort(self, model: str) -> int:
        """End every call in flight to ``model`` with UNAVAILABLE now (from any thread); how many there were."""
        answer = self._ask(f"abort {model}").split()
        front = int(answer[1]) if len(answer) == 2 and answer[0] == "aborted" else 0
        return front + (self.guard.abort(model) if self.guard else 0)

    def _stats(self) -> tuple[Counter, int]:
        parts = self._ask("stats").split()
        codes: Counter = Counter()
        bad = 0
        for part in parts[1:]:
            name, _, n = part.partition("=")
            if name == "bad":
                bad = int(n)
            else:
                codes[name] = int(n)
        return codes, bad

    @property
    def codes(self) -> Counter:
        """Answers by status code name, the front's and the guard's together."""
        return self._stats()[0] + (self.guard.codes if self.guard else Counter())

    @property
    def bad_counts(self) -> Counter:
        """Refused messages by reason (the front refuses with INVALID_ARGUMENT only), with the guard's."""
        front = Counter({"INVALID_ARGUMENT": self._stats()[1]})
        return +(front + (self.guard.bad.counts if self.guard else Counter()))

    def metrics_text(self) -> str:
        """The gRPC port's counters in Prometheus' text format (served on the HTTP guard's ``/metrics``)."""
        lines = ["# HELP e3_guard_grpc_responses_total Answers of the gRPC guard, by status code.",
                 "# TYPE e3_guard_grpc_responses_total counter"]
        lines += [f'e3_guard_grpc_responses_total{{code="{c}"}} {n}' for c, n in sorted(self.codes.items())]
        lines += [f'e3_guard_bad_requests_total{{protocol="grpc",reason="{r}"}} {n}'
                  for r, n in sorted(self.bad_counts.items())]
        return "\n".join(lines) + "\n"

    def stop(self) -> None:
        proc, self.process = self.process, None
        if proc is not None:
            try:
                proc.stdin.close()   # the front stops at the end of its input (a second of grace)
            except OSError:
                pass
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
            proc.stdout.close()
        if self.guard is not None:
            self.guard.stop()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> "GrpcFront":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def grpc_port(upstream: str, host: str = "127.0.0.1", port: int = 8001, **kwargs) -> GrpcFront | GrpcGuard:
    """`e3 serve`'s public gRPC port, not started: the C++ front where it is built, else the Python guard alone
    (one log line says so). ``kwargs``: :class:`GrpcGuard`'s."""
    if front_binary() is not None:
        return GrpcFront(upstream, host, port, **kwargs)
    log.warning("the C++ gRPC front is not built (no %s; `make setup` builds it where g++ and libgrpc++-dev are "
                "installed): the Python gRPC guard alone serves gRPC, at about 0.5-0.7x Triton's own gRPC "
                "throughput on 2 cores", BINARY)
    return GrpcGuard(upstream, host=host, port=port, **kwargs)
