"""Start and stop a real ``tritonserver`` for a model repository.

By default the binary comes from the ``nvidia-pytriton`` wheel (Triton 2.51,
CPU, Python backend only); ``--tritonserver PATH`` or ``E3_TRITONSERVER``
select a system install such as an NGC image. The server runs in explicit
model-control mode on loopback, in its own process group, and
:meth:`TritonServer.stop` escalates from SIGTERM to killing that group, then
removes the Python backend's shared-memory regions (DESIGN §4: shutdown is not
always clean).

    with TritonServer(repo, models=["tiny_ee_router", ...]) as server:
        ...  # server.http_url, server.grpc_url, server.metrics_url
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from pathlib import Path

from e3.core.files import copy_atomic
from e3.core.manifest import ManifestError
from e3.core.manifest import models_to_serve as manifest_models
from e3.paths import artifacts_dir

__all__ = ["ServerError", "TritonServer", "GUARD_HEADER", "scrub_argument", "find_tritonserver", "free_port",
           "port_taken", "models_to_serve", "ENV_BINARY",
           "DEFAULT_METRICS_PORT", "metrics_url_for"]

log = logging.getLogger(__name__)
ENV_BINARY = "E3_TRITONSERVER"
SHM_DIR = Path("/dev/shm")
DEFAULT_METRICS_PORT = 8002   # tritonserver's own default, and `e3 serve`'s
# The APIs a user's key restricts (Triton's names): what changes the server, reads its memory or its
# configuration, or changes what it logs and traces.
RESTRICTED_APIS = "model-repository,model-config,shared-memory,trace,logging"
# Every API category Triton 2.51 can restrict (tritonserver --help): behind the guard, all of them need the
# guard's per-start secret, so Triton's own HTTP port answers nothing that did not come through the guard.
ALL_APIS = "health,metadata,inference,shared-memory,model-config,model-repository,statistics,trace,logging"
GUARD_HEADER = "e3-guard-secret"


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
        import ctypes
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


def scrub_argument(pid: int, secret: str) -> bool:
    """Overwrite ``secret`` in process ``pid``'s argument memory (what ``/proc/<pid>/cmdline`` shows every local
    user) with 'x'; True if done. Triton copies its options at start, so the running server keeps the
    secret; only its public trace goes. Best effort: needs ptrace rights over ``pid`` (our own child, the
    same user: the default), else the secret stays readable there and a warning says so."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        fields = stat[stat.rindex(")") + 2:].split()
        start, end = int(fields[45]), int(fields[46])   # arg_start, arg_end (proc(5), fields 48 and 49)
        with open(f"/proc/{pid}/mem", "r+b", buffering=0) as mem:
            mem.seek(start)
            args = mem.read(end - start)
            found = args.find(secret.encode())
            while found >= 0:
                mem.seek(start + found)
                mem.write(b"x" * len(secret))
                found = args.find(secret.encode(), found + 1)
        return secret.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError, IndexError) as err:
        log.warning("could not hide the guard's secret from tritonserver's command line (%s): local users who "
                    "can read /proc/%d/cmdline can call Triton's HTTP port past the guard", err, pid)
        return False


def models_to_serve(repo: Path) -> list[str]:
    """Models of the current plan and the baselines, from the repository's e3 manifest."""
    try:
        return manifest_models(repo)
    except ManifestError as err:
        raise ServerError(str(err)) from None


def _group_rss(pgid: int) -> list[tuple[int, int]]:
    """(pid, RSS bytes) of every process in process group ``pgid`` (Linux /proc)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()   # after "pid (comm) ": state ppid pgrp ...
            if int(fields[2]) != pgid or fields[0] == "Z":   # a zombie (killed, not yet reaped) holds nothing
                continue
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
                 guard_secret: bool = False):
        self.repo = Path(repo).resolve()
        self.models = models
        self.host, self.http_port, self.grpc_port, self.metrics_port = host, http_port, grpc_port, metrics_port
        self.http_host = http_host or host   # e3 serve's guard: Triton's HTTP stays on loopback behind it
        self.api_key = api_key               # (header, key) that unlocks the restricted APIs, or None
        # behind the guard: Triton's HTTP answers only requests carrying GUARD_HEADER with this start's secret
        self.guard_secret = guard_secret
        self._secret = secrets.token_hex(24) if guard_secret else None
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
        return f"{self.http_host}:{self.http_port}"

    def http_headers(self) -> dict[str, str]:
        """Headers every call to this server's HTTP port needs: the guard's secret of the current start (it
        changes at every start) and the user's key, where set."""
        headers = dict([self.api_key]) if self.api_key else {}
        if self._secret:
            headers[GUARD_HEADER] = self._secret
        return headers

    @property
    def grpc_url(self) -> str:
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
        cmd = [str(binary), f"--model-repository={self.repo}", f"--backend-directory={backends}",
               "--model-control-mode=explicit", f"--http-address={self.http_host}", f"--http-port={self.http_port}",
               f"--grpc-address={self.host}", f"--grpc-port={self.grpc_port}",
               f"--metrics-address={self.host}", f"--metrics-port={self.metrics_port}", "--allow-metrics=true",
               f"--exit-timeout-secs={self.exit_timeout_s}",
               f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
               *[f"--load-model={m}" for m in models], *self.restriction_args(), *self.extra_args]
        return cmd

    def restriction_args(self) -> list[str]:
        """Triton's restrictions (calls without the header get "This API is restricted").

        With ``api_key``: model repository, model config, shared memory, trace and logging need the key
        over gRPC, and over HTTP unless ``guard_secret`` (then the guard checks the key). With
        ``guard_secret``: every HTTP API category, inference and health included, needs the guard's
        secret (Triton takes one key per category, so the user's key cannot also be Triton's there)."""
        args = []
        if self.api_key is not None:
            header, key = self.api_key
            if not header or not key or any(c in header + key for c in ",:= "):
                raise ServerError("the API key header and key must be non-empty and free of ',', ':', '=' and "
                                  "spaces")
            apis = f"{RESTRICTED_APIS}:{header}={key}"
            args.append(f"--grpc-restricted-protocol={apis}")
            if not self._secret:
                args.append(f"--http-restricted-api={apis}")
        if self._secret:
            args.append(f"--http-restricted-api={ALL_APIS}:{GUARD_HEADER}={self._secret}")
        return args

    def start(self, timeout_s: float = 180.0) -> "TritonServer":
        if self.process is not None:
            raise ServerError("server already started")
        if self.guard_secret:
            self._secret = secrets.token_hex(24)   # a new one each start: an old one opens nothing
        cmd = self.command()
        for what, host, port in (("HTTP", self.http_host, self.http_port), ("gRPC", self.host, self.grpc_port),
                                 ("metrics", self.host, self.metrics_port)):
            if port_taken(host, port):
                raise ServerError(f"{what} port {port} on {host} is already in use; "
                                  f"choose another with --{what.lower()}-port")
        env = dict(os.environ)
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
        log.info("starting %s", " ".join(cmd).replace(self._secret or "\0", "<secret>"))
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
        scrubbed = not self._secret
        while time.monotonic() < deadline:
            if not scrubbed and self._lines_read:   # its first line comes after it parsed its options
                scrubbed = True
                scrub_argument(self.process.pid, self._secret)
            if self.process.poll() is not None:
                raise ServerError(f"tritonserver exited with code {self.process.returncode} while starting; "
                                  f"last log lines:\n{self.log_tail()}")
            if self.ready():
                return
            time.sleep(0.2)
        raise ServerError(f"tritonserver was not ready after {timeout_s:.0f} s; last log lines:\n{self.log_tail()}")

    def ready(self) -> bool:
        try:
            request = urllib.request.Request(f"http://{self.http_url}/v2/health/ready", headers=self.http_headers())
            with urllib.request.urlopen(request, timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
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
        return proc.returncode

    def __enter__(self) -> "TritonServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def alive(self) -> bool:
        """The tritonserver process is running (it may not be ready yet)."""
        return self.process is not None and self.process.poll() is None

    def group_pids(self) -> list[int]:
        """tritonserver and its Python-backend stubs (its process group)."""
        return [pid for pid, _ in _group_rss(self.process.pid)] if self.alive() else []

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
        url = f"http://{self.http_url}/v2/models/{model}/stats" if model else f"http://{self.http_url}/v2/models/stats"
        with urllib.request.urlopen(urllib.request.Request(url, headers=self.http_headers()), timeout=10) as r:
            return json.loads(r.read())
