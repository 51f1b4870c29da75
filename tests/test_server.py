"""The launcher refuses clearly before starting anything: missing binary, repository, model, busy port."""

import socket
import sys

import pytest

from e3.deploy.server import ServerError, TritonServer, find_tritonserver, free_port, prepare_backends


def test_explicit_binary_must_exist(tmp_path, monkeypatch):
    with pytest.raises(ServerError, match="not an executable file"):
        find_tritonserver(tmp_path / "tritonserver")
    monkeypatch.setenv("E3_TRITONSERVER", str(tmp_path / "nope"))
    with pytest.raises(ServerError, match="E3_TRITONSERVER"):
        find_tritonserver()


def test_wheel_binary_is_found_and_stub_put_in_place(tmp_path, monkeypatch):
    monkeypatch.delenv("E3_TRITONSERVER", raising=False)
    binary = find_tritonserver()
    assert binary.name == "tritonserver" and "pytriton" in str(binary)
    backends = prepare_backends(binary, tmp_path / "backends")
    stub = backends / "python" / "triton_python_backend_stub"
    assert stub.exists() and (backends / "python" / "libtriton_python.so").exists()
    wheel_stub = binary.parent.parent / "python_backend_stubs" / f"{sys.version_info.major}.{sys.version_info.minor}"
    assert stub.read_bytes() == (wheel_stub / "triton_python_backend_stub").read_bytes()


def test_missing_repository(tmp_path):
    with pytest.raises(ServerError, match="does not exist"):
        TritonServer(tmp_path / "none").command()


def test_repository_without_manifest_or_model(tmp_path, tiny_repo):
    with pytest.raises(ServerError, match="no e3_repository.json"):
        TritonServer(tmp_path).command()
    with pytest.raises(ServerError, match=r"model 'ghost' is not in .*models there: tiny_ee_ee, tiny_ee_router"):
        TritonServer(tiny_repo, ["ghost"]).command()


def test_default_models_are_the_plan_and_baselines(tiny_repo):
    cmd = TritonServer(tiny_repo).command()
    loads = [a.split("=", 1)[1] for a in cmd if a.startswith("--load-model=")]
    assert loads == ["tiny_ee_split_1-2", "tiny_ee_split_3-4", "tiny_ee_router", "tiny_ee_stock", "tiny_ee_ee"]
    assert "--model-control-mode=explicit" in cmd and "--http-address=127.0.0.1" in cmd


def test_busy_port_is_refused_before_starting(tiny_repo):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        server = TritonServer(tiny_repo, ["tiny_ee_stock"], http_port=free_port(), grpc_port=port,
                              metrics_port=free_port())
        with pytest.raises(ServerError, match=f"gRPC port {port} on 127.0.0.1 is already in use"):
            server.start()
        assert server.process is None


def test_metrics_url_for_the_same_host():
    from e3.deploy.server import metrics_url_for
    assert metrics_url_for("127.0.0.1:8000") == "http://127.0.0.1:8002/metrics"
    assert metrics_url_for("http://triton.local:9000/", 9002) == "http://triton.local:9002/metrics"
    assert metrics_url_for("[::1]:8000") == "http://[::1]:8002/metrics"
    assert metrics_url_for("localhost") == "http://localhost:8002/metrics"


def test_group_cpu_s_counts_each_process_of_the_group_and_no_other():
    """The one /proc reader of a group's CPU: this process's own figure is its CPU time (to a clock tick), and a
    busy child in a session of its own is counted in its group, not in ours."""
    import os
    import subprocess
    import sys
    import time

    from e3.deploy.server import group_cpu_s
    busy = subprocess.Popen([sys.executable, "-c", "import time\nt = time.process_time()\n"
                             "while time.process_time() - t < 0.3: pass\ntime.sleep(30)"], start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while group_cpu_s(busy.pid).get(busy.pid, 0.0) < 0.25 and time.monotonic() < deadline:
            time.sleep(0.05)
        theirs = group_cpu_s(busy.pid)
        ours = group_cpu_s(os.getpgid(0))
        tick = 1 / os.sysconf("SC_CLK_TCK")
        assert set(theirs) == {busy.pid} and 0.25 <= theirs[busy.pid] < 5.0
        assert busy.pid not in ours and os.getpid() in ours
        assert abs(ours[os.getpid()] - time.process_time()) < 0.5 + 2 * tick
    finally:
        busy.kill()
        busy.wait()
