"""Start and stop a real ``tritonserver`` for a model repository.

By default the binary comes from the ``nvidia-pytriton`` wheel (Triton 2.51,
CPU, Python backend only); ``--tritonserver PATH`` or ``E3_TRITONSERVER``
select a system install such as an NGC image. The server runs in explicit
model-control mode on loopback, in its own process group, and
:meth:`TritonServer.stop` escalates from SIGTERM to killing that group, then
removes the Python backend's shared-memory regions (docs/design.md §4: shutdown is not
always clean).

    with TritonServer(repo, models=["tiny_ee_router", ...]) as server:
        ...  # server.http_url, server.grpc_url, server.metrics_url

**Private endpoints** (``private=True``, what ``e3 serve`` runs behind its guard): Triton's HTTP and gRPC
endpoints listen on Unix sockets in a folder of their own (mode 0700, made by ``mkdtemp``), not on TCP ports.
Decision (issue 38): no secret at all stands between the guard and Triton. Before, Triton's private HTTP port
was a loopback TCP port locked by a per-start secret header, and Triton 2.51 takes such a secret only on its
command line (``--http-restricted-api=...:header=secret``), which every local user reads in
``/proc/<pid>/cmdline`` (scrubbing it after the start left it readable for about 0.2 s); likewise the user's
API key (``--grpc-restricted-protocol``) for the life of the process. A Unix socket in a 0700 folder is
reached only by the user who runs ``e3 serve`` (who can read the guard's memory anyway) and by root; so the
command line carries no secret, and the user's key never goes to Triton: the guards (HTTP,
:mod:`e3.deploy.guard`; gRPC, :mod:`e3.deploy.grpc_guard`) check it themselves. Triton 2.51 binds Unix
sockets through ``--http-address=unix:PATH`` (libevhtp) and ``--grpc-address=unix:PATH`` (the gRPC socket's
path gets ``:<grpc-port>`` appended: :attr:`TritonServer.grpc_socket`). The metrics port stays a loopback TCP
port (read-only; the guard's ``/metrics`` is the public page).
"""

from __future__ import annotations

import ctypes
import http.client
import importlib.util
import io
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
from collections import deque
from pathlib import Path

from e3.core.files import copy_atomic
from e3.core.manifest import ManifestError
from e3.core.manifest import models_to_serve as manifest_models
from e3.paths import artifacts_dir

__all__ = ["ServerError", "TritonServer", "find_tritonserver", "free_port", "port_taken", "models_to_serve",
           "ENV_BINARY", "DEFAULT_METRICS_PORT", "metrics_url_for", "http_request", "group_cpu_s"]

log = logging.getLogger(__name__)
ENV_BINARY = "E3_TRITONSERVER"
SHM_DIR = Path("/dev/shm")
DEFAULT_METRICS_PORT = 8002   # tritonserver's own default, and `e3 serve`'s
# The APIs a user's key restricts (Triton's names): what changes the server, reads its memory or its
# configuration, or changes what it logs and traces.
RESTRICTED_APIS = "model-repository,model-config,shared-memory,trace,logging"


class _UnixHTTPConnection(http.client.HTTPConnection):
    """An HTTP/1.1 connection over a Unix socket (Triton's private endpoint)."""

    def __init__(self, path: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.path)


def http_request(address: str, method: str, path: str, body: bytes | None = None,
                 headers: dict[str, str] | None = None, timeout_s: float = 30.0) -> bytes:
    """One HTTP call to ``address`` (``host:port`` or ``unix:/path``); the answer's body. An answer of 400 or
    more raises ``urllib.error.HTTPError`` (its ``read()`` gives the body); a connection that fails raises
    ``OSError`` (``urllib.error.URLError`` for an answer that is not HTTP), as ``urllib`` would."""
    if address.startswith("unix:"):
        conn: http.client.HTTPConnection = _UnixHTTPConnection(address[len("unix:"):], timeout_s)
    else:
        host, _, port = address.rpartition(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        response = conn.getresponse()
        data = response.read()
    except http.client.HTTPException as err:
        raise urllib.error.URLError(f"{address}{path}: {err!r}") from None
    finally:
        conn.close()
    if response.status >= 400:
        raise urllib.error.HTTPError(f"http://{address}{path}", response.status, response.reason,
                                     response.headers, io.BytesIO(data))
    return data


def metrics_url_for(http_url: str, metrics_port: int = DEFAULT_METRICS_PORT) -> str:
    """The metrics page of the server whose HTTP address is ``http_url`` (``host:port`` or a URL), when its
    metrics listen on ``metrics_port`` of the same host: ``127.0.0.1:8000`` -> ``http://127.0.0.1:8002/metrics``."""
    scheme, sep, rest = http_url.partition("://")
    host_port = (rest if sep else http_url).split("/", 1)[0]
    host = host_port.rsplit(":", 1)[0] if ":" in host_port and not host_port.endswith("]") else host_port
    return f"{scheme if sep else 'http'}://{host}:{metrics_port}/metrics"


class ServerError(RuntimeError):
    """The server cannot be started (or stopped) as asked; the message says why and what to do."""


def _wheel_root() -> Path | None:
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(list(spec.submodule_search_locations)[0]) / "tritonserver"
    return root if (root / "bin" / "tritonserver").exists() else None


def find_tritonserver(explicit: str | os.PathLike | None = None) -> Path:
    """The tritonserver binary: ``explicit``, else $E3_TRITONSERVER, else the wheel's, else PATH."""
    tried = []
    for source, candidate in (("--tritonserver", explicit), (ENV_BINARY, os.environ.get(ENV_BINARY))):
        if candidate:
            path = Path(candidate)
            if path.is_file() and os.access(path, os.X_OK):
                return path
            raise ServerError(f"tritonserver given by {source} is not an executable file: {path}")
    root = _wheel_root()
    if root is not None:
        return root / "bin" / "tritonserver"
    tried.append("the nvidia-pytriton wheel (not installed: run `make setup`)")
    found = shutil.which("tritonserver")
    if found:
        return Path(found)
    tried.append("tritonserver on PATH")
    raise ServerError("cannot find tritonserver; tried " + ", ".join(tried) +
                      f". Pass --tritonserver PATH or set {ENV_BINARY}.")


def prepare_backends(binary: Path, dest: Path | None = None) -> Path:
    """Backend directory for ``binary``.

    For the wheel's server, a project-local copy of its Python backend with the
    stub built for the running interpreter put in place (the wheel ships one
    stub per Python version). For another install, its own ``backends/``.
    """
    root = binary.resolve().parent.parent
    stubs = root / "python_backend_stubs"
    if not stubs.is_dir():
        backends = root / "backends"
        if not backends.is_dir():
            raise ServerError(f"no backends/ folder beside {binary}; pass the server's backend directory")
        return backends
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = stubs / version / "triton_python_backend_stub"
    if not stub.exists():
        raise ServerError(f"the Triton wheel has no Python-backend stub for Python {version} "
                          f"(it has {sorted(p.name for p in stubs.iterdir())})")
    dest = dest or artifacts_dir() / "triton" / f"backends-py{version}"
    python_dir = dest / "python"
    python_dir.mkdir(parents=True, exist_ok=True)
    for src in (root / "backends" / "python" / "libtriton_python.so",
                root / "backends" / "python" / "triton_python_backend_utils.py", stub):
        target = python_dir / src.name
        if not target.exists() or target.stat().st_size != src.stat().st_size:
            copy_atomic(src, target)
    return dest


def binary_libs(binary: Path) -> Path | None:
    """The wheel's bundled shared libraries (nvidia_pytriton.libs), if ``binary`` is the wheel's."""
    libs = binary.resolve().parent.parent.parent.parent / "nvidia_pytriton.libs"
    return libs if libs.is_dir() else None


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM the server if the process that started it dies.

    The server runs in its own session (so Ctrl-C reaches only the launcher, which
    stops it in order); without this a launcher killed outright (a test runner's
    timeout, kill -9) would leave tritonserver running. Linux only; Linux ties the
    signal to the launching thread, so start servers from a thread that outlives them.
    """
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (for tests and ephemeral servers)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_taken(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def models_to_serve(repo: Path) -> list[str]:
    """Models of the current plan and the baselines, from the repository's e3 manifest."""
    try:
        return manifest_models(repo)
    except ManifestError as err:
        raise ServerError(str(err)) from None


def _group_stats(pgid: int):
    """(``/proc/<pid>`` folder, its ``stat`` fields after "pid (comm) ": state ppid pgrp ...) of every process in
    process group ``pgid`` (Linux /proc); a process that ends while being read is left out."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()
        except (OSError, ValueError):
            continue
        if int(fields[2]) == pgid:
            yield proc, fields


def group_cpu_s(pgid: int) -> dict[int, float]:
    """CPU seconds (user + system) each process of process group ``pgid`` has used, by pid: a tritonserver
    started here (its own session: pgid = its pid) and its Python stubs. The one reader of it: the profiler's
    foreign-load count, the benches' CPU splits."""
    tick = os.sysconf("SC_CLK_TCK")
    return {int(proc.name): (int(f[11]) + int(f[12])) / tick for proc, f in _group_stats(pgid)}   # utime, stime


def _group_rss(pgid: int) -> list[tuple[int, int]]:
    """(pid, RSS bytes) of every live process in process group ``pgid``; a zombie (killed, not yet reaped)
    holds nothing and is left out."""
    found = []
    for proc, fields in _group_stats(pgid):
        if fields[0] == "Z":
            continue
        try:
            rss_pages = int((proc / "statm").read_text().split()[1])
        except (OSError, ValueError, IndexError):
            continue
        found.append((int(proc.name), rss_pages * os.sysconf("SC_PAGE_SIZE")))
    return found


class TritonServer:
    """A tritonserver process serving ``repo`` (explicit model control, loopback by default)."""

    def __init__(self, repo: str | os.PathLike, models: list[str] | None = None, *, host: str = "127.0.0.1",
                 http_port: int = 8000, grpc_port: int = 8001, metrics_port: int = DEFAULT_METRICS_PORT,
                 tritonserver: str | os.PathLike | None = None, log_file: str | os.PathLike | None = None,
                 echo_logs: bool = False, exit_timeout_s: int = 10, extra_args: list[str] | None = None,
                 http_host: str | None = None, api_key: tuple[str, str] | None = None,
                 private: bool = False):
        self.repo = Path(repo).resolve()
        self.models = models
        self.host, self.http_port, self.grpc_port, self.metrics_port = host, http_port, grpc_port, metrics_port
        self.http_host = http_host or host
        # (header, key) that unlocks the restricted APIs, or None; with ``private`` the guards check it and
        # Triton never sees it
        self.api_key = api_key
        # behind the guards: HTTP and gRPC on Unix sockets in a 0700 folder of this object's life (module doc)
        self.private = private
        self.socket_dir: Path | None = Path(tempfile.mkdtemp(prefix="e3-triton-")) if private else None
        self.binary_arg = tritonserver
        self.log_file = Path(log_file) if log_file else None
        self.echo_logs = echo_logs
        self.exit_timeout_s = exit_timeout_s
        self.extra_args = list(extra_args or [])
        self.process: subprocess.Popen | None = None
        self.shm_prefix = f"e3_{os.getpid()}_{http_port}_"
        self._log_tail: deque[str] = deque(maxlen=60)
        self._lines_read = 0   # log lines read from the current process
        self._reader: threading.Thread | None = None

    @classmethod
    def on_free_ports(cls, repo: str | os.PathLike, models: list[str] | None = None, **kwargs) -> "TritonServer":
        """A server on three loopback ports nobody listens on (tests, benchmarks, probes)."""
        return cls(repo, models, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(), **kwargs)

    # -- addresses -------------------------------------------------------------
    @property
    def http_url(self) -> str:
        """``host:port``, or ``unix:/path`` for private endpoints (:func:`http_request` takes both)."""
        if self.socket_dir is not None:
            return f"unix:{self.socket_dir / 'http'}"
        return f"{self.http_host}:{self.http_port}"

    def http_headers(self) -> dict[str, str]:
        """Headers every call to this server's HTTP port needs: the user's key where Triton checks it (not
        with private endpoints, where only the guards see it)."""
        return dict([self.api_key]) if self.api_key and not self.private else {}

    def call(self, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None,
             timeout_s: float = 30.0) -> bytes:
        """One call to this server's own HTTP endpoint (:func:`http_request`), with :meth:`http_headers`."""
        return http_request(self.http_url, method, path, body, {**(headers or {}), **self.http_headers()},
                            timeout_s)

    @property
    def grpc_socket(self) -> Path | None:
        """The private gRPC endpoint's socket (Triton appends ``:<grpc-port>`` to a ``unix:`` address)."""
        return None if self.socket_dir is None else self.socket_dir / f"grpc:{self.grpc_port}"

    @property
    def grpc_url(self) -> str:
        """``host:port``, or ``unix:/path`` for private endpoints (what ``grpc`` channels take)."""
        if self.socket_dir is not None:
            return f"unix:{self.grpc_socket}"
        return f"{self.host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    # -- lifecycle -------------------------------------------------------------
    def command(self) -> list[str]:
        """The tritonserver command line (also validates the repository and the binary)."""
        binary = find_tritonserver(self.binary_arg)
        if not self.repo.is_dir():
            raise ServerError(f"model repository {self.repo} does not exist; run `e3 export MODEL` first")
        models = self.models if self.models is not None else models_to_serve(self.repo)
        for name in models:
            config = self.repo / name / "config.pbtxt"
            if not config.is_file():
                known = sorted(p.name for p in self.repo.iterdir() if (p / "config.pbtxt").is_file())
                raise ServerError(f"model {name!r} is not in {self.repo} (no {name}/config.pbtxt); "
                                  f"models there: {', '.join(known) or 'none'}")
        backends = prepare_backends(binary)
        if self.socket_dir is not None:
            endpoints = [f"--http-address=unix:{self.socket_dir / 'http'}", "--http-port=0",
                         f"--grpc-address=unix:{self.socket_dir / 'grpc'}", f"--grpc-port={self.grpc_port}"]
        else:
            endpoints = [f"--http-address={self.http_host}", f"--http-port={self.http_port}",
                         f"--grpc-address={self.host}", f"--grpc-port={self.grpc_port}"]
        cmd = [str(binary), f"--model-repository={self.repo}", f"--backend-directory={backends}",
               "--model-control-mode=explicit", *endpoints,
               f"--metrics-address={self.host}", f"--metrics-port={self.metrics_port}", "--allow-metrics=true",
               f"--exit-timeout-secs={self.exit_timeout_s}",
               f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
               *[f"--load-model={m}" for m in models], *self.restriction_args(), *self.extra_args]
        return cmd

    def restriction_args(self) -> list[str]:
        """Triton's restrictions (calls without the header get "This API is restricted"): with ``api_key`` and
        public endpoints, model repository, model config, shared memory, trace and logging need the key.
        With private endpoints none: Triton's command line carries no key (the guards check it)."""
        if self.api_key is None or self.private:
            return []
        header, key = self.api_key
        if not header or not key or any(c in header + key for c in ",:= "):
            raise ServerError("the API key header and key must be non-empty and free of ',', ':', '=' and spaces")
        apis = f"{RESTRICTED_APIS}:{header}={key}"
        return [f"--grpc-restricted-protocol={apis}", f"--http-restricted-api={apis}"]

    def start(self, timeout_s: float = 180.0) -> "TritonServer":
        if self.process is not None:
            raise ServerError("server already started")
        cmd = self.command()
        tcp = [("metrics", self.host, self.metrics_port)]
        if self.socket_dir is None:
            tcp += [("HTTP", self.http_host, self.http_port), ("gRPC", self.host, self.grpc_port)]
        else:
            self._remove_sockets()   # a killed server leaves its sockets, and binding over one fails
        for what, host, port in tcp:
            if port_taken(host, port):
                raise ServerError(f"{what} port {port} on {host} is already in use; "
                                  f"choose another with --{what.lower()}-port")
        # the user's key is the guards' business: not in the environment of Triton and its stubs
        env = {k: v for k, v in os.environ.items() if k not in ("E3_API_KEY", "E3_API_KEY_FILE")}
        # The Python-backend stub runs model code with the python3 first on PATH.
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        env.setdefault("OMP_NUM_THREADS", "1")
        # The wheel's binaries find their libraries through an RPATH relative to
        # their own folder; the stub copied beside our backends needs them named.
        libs = binary_libs(find_tritonserver(self.binary_arg))
        if libs:
            env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(libs), env.get("LD_LIBRARY_PATH")]))
        self._lines_read = 0
        self.process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        start_new_session=True, env=env, text=True, errors="replace",
                                        preexec_fn=_die_with_parent)
        self._reader = threading.Thread(target=self._pump_logs, daemon=True)
        self._reader.start()
        threading.Thread(target=self._end_group_on_exit, args=(self.process,), daemon=True).start()
        log.info("starting %s", " ".join(cmd))
        try:
            self._wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    @staticmethod
    def _end_group_on_exit(proc: subprocess.Popen) -> None:
        """When tritonserver exits (killed, crashed), kill its Python stubs at once.

        Measured in a crash loop: a stub outlives a killed server (re-parented to init) and holds the
        server's HTTP sockets it inherited, the listening one included, so a call in flight to the dead
        server, and every new connection to its port, hung until its timeout (the supervisor's model loads
        wait 180 s) instead of failing, and the supervisor stalled for minutes. The group id cannot be reused
        while its stubs live, so the kill reaches only them."""
        proc.wait()
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def _pump_logs(self) -> None:
        sink = None
        if self.log_file:
            self.log_file.parent.mkdir(parents=True, exist_ok=True)
            sink = self.log_file.open("a")
        try:
            proc = self.process
            for line in proc.stdout:
                self._log_tail.append(line.rstrip())
                if proc is self.process:
                    self._lines_read += 1
                if sink:
                    sink.write(line)
                    sink.flush()
                if self.echo_logs:
                    sys.stderr.write(line)
        finally:
            if sink:
                sink.close()

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(list(self._log_tail)[-lines:])

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerError(f"tritonserver exited with code {self.process.returncode} while starting; "
                                  f"last log lines:\n{self.log_tail()}")
            if self.ready():
                return
            time.sleep(0.2)
        raise ServerError(f"tritonserver was not ready after {timeout_s:.0f} s; last log lines:\n{self.log_tail()}")

    def ready(self) -> bool:
        try:
            self.call("GET", "/v2/health/ready", timeout_s=2)
            return True
        except OSError:   # URLError and HTTPError included
            return False

    def stop(self, timeout_s: float = 20.0) -> int | None:
        """SIGTERM, wait, then SIGKILL the whole process group; remove our shm regions."""
        proc = self.process
        if proc is None:
            return None
        if proc.poll() is None:
            try:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("tritonserver did not stop within %.0f s; killing its process group", timeout_s)
            except ProcessLookupError:
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # also any stub left behind
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            raise ServerError(f"tritonserver (pid {proc.pid}) survived SIGKILL") from None
        if self._reader:
            self._reader.join(timeout=5)
        for region in SHM_DIR.glob(f"{self.shm_prefix}*"):
            try:
                region.unlink()
            except OSError:
                pass
        self.process = None
        self._remove_sockets()
        return proc.returncode

    def _remove_sockets(self) -> None:
        if self.socket_dir is not None:
            for sock in self.socket_dir.glob("*"):
                try:
                    sock.unlink()
                except OSError:
                    pass

    def close(self) -> None:
        """Stop the server and remove its private socket folder (the object is done with)."""
        self.stop()
        if self.socket_dir is not None:
            shutil.rmtree(self.socket_dir, ignore_errors=True)

    def __enter__(self) -> "TritonServer":
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc) -> None:
        self.close()

    def alive(self) -> bool:
        """The tritonserver process is running (it may not be ready yet)."""
        return self.process is not None and self.process.poll() is None

    def group_pids(self) -> list[int]:
        """tritonserver and its Python-backend stubs (its process group)."""
        return [pid for pid, _ in _group_rss(self.process.pid)] if self.alive() else []

    def cpu_s(self) -> float:
        """CPU seconds tritonserver and its live Python-backend stubs have used so far (:func:`group_cpu_s`)."""
        return sum(group_cpu_s(self.process.pid).values()) if self.process else 0.0

    def rss_bytes(self) -> int:
        """Resident memory of tritonserver and its Python-backend stubs (its process group), in bytes."""
        if not self.alive():
            return 0
        return sum(rss for _, rss in _group_rss(self.process.pid))

    def shm_regions(self) -> list[Path]:
        """This server's Python-backend shared-memory files in /dev/shm."""
        return sorted(SHM_DIR.glob(f"{self.shm_prefix}*"))

    # -- small helpers over the HTTP API ----------------------------------------
    def model_statistics(self, model: str = "") -> dict:
        return json.loads(self.call("GET", f"/v2/models/{model}/stats" if model else "/v2/models/stats",
                                    timeout_s=10))
