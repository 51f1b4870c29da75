"""Does a Triton Python model that answers from a thread after ``execute`` returns survive load, unload and
shutdown here? One call probes every variant in about a minute.

``python3 benchmarks/threaded_answer_probe.py OUT_DIR [--kind cpu|gpu] [--rates 300,1000,3000] [--seconds 1.5]
[--variants execute-numpy,...] [--cycles 1] [--unload-under-load] [--no-shutdown-loaded]``

The CPU router and E²bird's threaded stage answered that way (one response thread, ``execute`` returning
``None``, a non-decoupled model). On the H200 host the stage's response thread died with a segmentation fault
inside ``InferenceResponseSender.send``, and on this CPU the router's stub was seen dying with "Fatal Python
error: Segmentation fault (Garbage-collecting)" at unload; both took ``request.get_response_sender()`` in the
answering thread, after ``execute`` had returned, keeping the request objects alive. Triton (>= 24.06; the
embedded server is 24.10) supports a non-decoupled model answering later when the sender is taken *inside*
``execute`` (its QA test ``test_non_decoupled_one_response_post_return``). The variants (:data:`VARIANTS`):

* **sender** ``execute``: ``execute`` keeps each request's sender and a copy of its input, no request object;
  the thread drops the sender once it has answered (``serving.triton_io.ResponseSender`` today). ``thread``:
  ``execute`` queues the request objects and the thread takes each sender when it answers (the router's
  pattern before, the last request staying bound while the thread waits for the next batch);
* **torch** or **numpy**: the torch variants import PyTorch in the stub and compute each batch's labels with
  it, on KIND_GPU on the instance's device (``cuda:<model_instance_device_id>``, a matmul, then ``.cpu()``);
  the numpy ones never import torch;
* **engine** (``engine-torch``, ``engine-sends-torch``, :data:`ENGINE_OF`): the device router's shape. An engine
  thread runs a device step and its sync every millisecond, busy or not (as the pipeline keeps the GPU fed),
  computes each batch's labels, and either hands the answers to a second thread that sends them (``split``:
  the router until the H100 run of 2026-11-27, whose stubs died in ``send`` under load) or sends them itself
  between its steps (``sends``). The other variants never run the device while a send is in progress.
  ``unrequested-torch`` is ``engine-sends-torch`` whose responses also carry an output (``probs``) the client
  did not ask for, as the device router's did (all three outputs, where the side-by-side's load asks for one).

Every model answers from one thread beside a second thread that polls every 50 us (as the stage's engine
did), enables ``faulthandler`` (a crash leaves every thread's stack in the log) and prints one ``PROBE`` line
(its Python, torch, CUDA, device) when it starts. One server serves them all, one model per variant, in
explicit model control. For each variant, ``cycles`` times: load it through the repository API, open-loop
Poisson load at each rate (``benchmarks/gpu_load.OpenLoop``), unload it, wait for its stub to exit, and read
the log written meanwhile for fatal lines (``Segmentation fault``, ``Fatal Python error``, ``terminate
called``); with ``--unload-under-load`` the unload comes while requests still arrive. A rate at which a request
fails ends that variant's load (a stuck model would cost the client's timeout at every rate). Then every variant
is loaded again, answers a few requests checked against numpy, and the server shuts down with them loaded: the
fatal lines of that shutdown are given to the variants whose model files appear in the stacks that follow them
(else kept as unattributed).

Writes ``OUT_DIR/threaded_answer_probe.json`` (``uname -a``, Python, torch and CUDA, one row per variant)
and ``OUT_DIR/threaded_answer_probe.log`` (the server's log), nothing else there (the model repository lives
in a temporary folder): a GPU host brings back only 8 files. The JSON is rewritten after each variant, so a
run cut short keeps what it measured. Exit 1 (``ok`` false) where any variant failed a request, answered
wrongly, failed a load or an unload, or left a fatal line.

On a bare GPU host it unpacks the server and client from ``.gpu_wheels/`` as the other GPU runners do
(``deploy/gpu_host_setup.py``); the stub is the one for the running interpreter.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

if __package__:
    from e3.deploy.gpu_host_setup import prepare_host
    from e3.benchmarks.gpu_load import REQUEST_TIMEOUT_S, OpenLoop
    from e3.benchmarks.threaded_answer_model import (DEFAULT_VARIANTS, ENGINE_OF, MODEL_PY, UNREQUESTED, VARIANTS,
                                                      WIDTH, model_name, write_probe_model)
else:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.path.append(str(Path(__file__).resolve().parents[1] / "deploy"))   # gpu_host_setup, standard library only
    from gpu_host_setup import prepare_host
    from gpu_load import REQUEST_TIMEOUT_S, OpenLoop
    from threaded_answer_model import (DEFAULT_VARIANTS, ENGINE_OF, MODEL_PY, UNREQUESTED, VARIANTS, WIDTH,
                                       model_name, write_probe_model)

# Deferred imports: this runs on a bare GPU host, where the project (`e3`) imports only once prepare_host has made
# its namespace and tritonclient only once it has unpacked the wheels; numpy and torch load with the step using them.
__all__ = ["VARIANTS", "DEFAULT_VARIANTS", "ENGINE_OF", "UNREQUESTED", "WIDTH", "MODEL_PY", "FATAL_PATTERNS",
           "write_probe_model", "model_name", "fatal_lines", "attribute_fatal",
           "run", "main"]

FATAL_PATTERNS = ("Segmentation fault", "Fatal Python error", "terminate called")
JSON_NAME = "threaded_answer_probe.json"
LOG_NAME = "threaded_answer_probe.log"
GONE = ("UNAVAILABLE", "absent")   # the repository index's word for an unloaded model
CALL_TIMEOUT_S = 90.0   # one repository call (a torch stub's load on a cold GPU host included)

# -- the server's log -------------------------------------------------------------------------------------------------
def fatal_lines(text: str) -> list[str]:
    """The lines of ``text`` showing a fatal error (any of :data:`FATAL_PATTERNS`), each once."""
    return [line.strip() for line in text.splitlines() if any(p in line for p in FATAL_PATTERNS)]


def attribute_fatal(text: str, models: dict[str, str], *, window: int = 80) -> dict[str, list[str]]:
    """Each fatal line of ``text`` given to the variants (``models``: variant -> model name) whose model files
    (``/<model>/``) appear within the ``window`` lines from it (faulthandler's stacks name them); lines naming
    none go under ``""``."""
    lines = text.splitlines()
    found: dict[str, list[str]] = {}
    for i, line in enumerate(lines):
        if not any(p in line for p in FATAL_PATTERNS):
            continue
        near = "\n".join(lines[i:i + window])
        owners = [v for v, m in models.items() if f"/{m}/" in near] or [""]
        for v in owners:
            found.setdefault(v, []).append(line.strip())
    return found


class _Log:
    """The server's log file read in segments (what was written since the last read)."""

    def __init__(self, path: Path):
        self.path, self.at = path, 0

    def since(self) -> str:
        time.sleep(0.3)   # the server's output reaches the file through a reader thread
        if not self.path.exists():
            return ""
        with self.path.open("rb") as f:
            f.seek(self.at)
            data = f.read()
        self.at += len(data)
        return data.decode(errors="replace")


def _probe_lines(text: str) -> dict[str, str]:
    """model name -> its latest ``PROBE`` line (what its stub runs: Python, torch, CUDA, device)."""
    out = {}
    for m in re.finditer(r"PROBE (\S+) (.*)", text):
        out[m.group(1)] = m.group(2).strip()
    return out


# -- the repository API -----------------------------------------------------------------------------------------------
def _call(server, path: str, timeout_s: float = CALL_TIMEOUT_S) -> tuple[bool, str]:
    request = urllib.request.Request(f"http://{server.http_url}{path}", data=b"{}", method="POST",
                                     headers={"Content-Type": "application/json", **server.http_headers()})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as r:
            return True, r.read().decode(errors="replace")
    except urllib.error.HTTPError as err:
        return False, f"HTTP {err.code}: {err.read().decode(errors='replace')[:300]}"
    except (urllib.error.URLError, OSError) as err:
        return False, f"{type(err).__name__}: {err}"[:300]


def _state(server, model: str) -> str:
    ok, text = _call(server, "/v2/repository/index", 10)
    if not ok:
        return "?"
    for m in json.loads(text):
        if m.get("name") == model:
            return m.get("state", "?")
    return "absent"


def _stub_pids(server, model: str) -> list[int]:
    """The server's processes running ``model`` (its stubs name the model's file)."""
    pids = []
    for pid in server.group_pids():
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if f"/{model}/" in cmd and "stub" in cmd:
            pids.append(pid)
    return pids


def _unload(server, model: str, timeout_s: float = 20.0) -> dict:
    """Unload ``model`` and wait until Triton reports it gone and its stub has exited."""
    start = time.monotonic()
    ok, text = _call(server, f"/v2/repository/models/{model}/unload")
    state = "?"
    while time.monotonic() - start < timeout_s:
        state = _state(server, model)
        if state in GONE and not _stub_pids(server, model):
            break
        time.sleep(0.1)
    left = _stub_pids(server, model)
    return {"ok": ok and state in GONE and not left, "state": state, "stubs_left": len(left),
            "s": round(time.monotonic() - start, 2), **({} if ok else {"error": text})}


# -- the host ---------------------------------------------------------------------------------------------------------
def host_facts() -> dict:
    """``uname -a``, this Python, torch and CUDA as the running interpreter sees them (the stubs print theirs)."""
    try:
        uname = subprocess.run(["uname", "-a"], capture_output=True, text=True, timeout=10).stdout.strip()
    except OSError:
        uname = " ".join(platform.uname())
    facts = {"uname": uname, "python": sys.version.split()[0], "cpus": os.cpu_count(), "torch": None,
             "cuda_available": None}
    if importlib.util.find_spec("torch") is not None:
        import torch
        facts.update(torch=torch.__version__, torch_cuda=torch.version.cuda,
                     cuda_available=bool(torch.cuda.is_available()))
        if facts["cuda_available"]:
            facts["gpu"] = torch.cuda.get_device_name(0)
    return facts


def _pct(ok, q: float):
    import numpy as np
    return round(float(np.percentile(ok, q)), 3) if len(ok) else None


def run(out: Path, *, kind: str = "cpu", seconds: float = 1.5, rates=(300.0, 1000.0, 3000.0),
        variants=None, wheels: Path | None = None, cycles: int = 1, shutdown_loaded: bool = True,
        unload_under_load: bool = False, per_request: int = 8, clients: int | None = None, echo=print) -> dict:
    """Probe ``variants`` (default :data:`DEFAULT_VARIANTS`) on one server: per variant ``cycles`` times load,
    open-loop load at each of ``rates`` for ``seconds`` each, a burst of answers checked against numpy,
    unload; then (``shutdown_loaded``) all loaded again, a checked burst each, and the server's shutdown with
    them loaded. ``unload_under_load``: each unload comes while requests still arrive (the last rate for
    ``2 * seconds``, the unload after ``seconds``); the requests it cuts off are counted apart, not as failed.
    Returns (and writes to ``out``) the document; ``doc["ok"]`` is the verdict. The defaults take about a minute
    on a GPU host, the server's start included."""
    import numpy as np

    variants = list(DEFAULT_VARIANTS) if variants is None else list(variants)
    rates = [float(r) for r in rates]
    for v in variants:
        model_name(v)   # unknown names fail before anything starts
    if kind not in ("cpu", "gpu"):
        raise ValueError(f"kind must be cpu or gpu, got {kind!r}")
    t_start = time.monotonic()
    cwd = os.getcwd()
    binary, out = prepare_host(out, cpu=kind == "cpu", wheels=wheels)
    from e3.deploy.server import TritonServer
    repo = Path(tempfile.mkdtemp(prefix="e3-probe-repo-"))   # not in out: only the JSON and the log come back
    models = {v: write_probe_model(repo, kind, v) for v in variants}
    log_path = out / LOG_NAME
    log_path.unlink(missing_ok=True)
    json_path = out / JSON_NAME
    doc = {"kind": "threaded-answer-probe", "instance_kind": kind, **host_facts(), "seconds": seconds,
           "rates": rates, "cycles": cycles, "unload_under_load": unload_under_load, "per_request": per_request,
           "variants": [], "server_starts": 0, "stray_fatal": []}
    has_torch = doc["torch"] is not None
    rows = {}

    def save():
        doc["elapsed_s"] = round(time.monotonic() - t_start, 1)
        json_path.write_text(json.dumps(doc, indent=1))

    server = TritonServer.on_free_ports(repo, [], tritonserver=binary, log_file=log_path)
    log = _Log(log_path)
    load = None
    pool = {"x": np.random.default_rng(0).random((4096, WIDTH), dtype=np.float32)}

    def between(text: str) -> None:
        """Fatal lines written outside a variant's own phases: given to the variants the stacks name."""
        for v, lines in attribute_fatal(text, models).items():
            (rows[v]["fatal_lines"] if v in rows else doc["stray_fatal"]).extend(lines)

    def ensure_server():
        if not server.alive():
            if doc["server_starts"]:
                echo("the server died; starting it again")
                server.stop()
            server.start(timeout_s=300)
            doc["server_starts"] += 1

    def cycle(v: str, c: int, row: dict) -> None:
        name = models[v]
        ensure_server()
        between(log.since())
        cyc = {"runs": []}
        row["cycles"].append(cyc)
        t0 = time.monotonic()
        loaded, text = _call(server, f"/v2/repository/models/{name}/load")
        cyc["load_s"] = round(time.monotonic() - t0, 2)
        if not loaded:
            cyc["load_error"] = text
        for i, rate in enumerate(rates if loaded else ()):
            rng = np.random.default_rng(1000 * c + i + 1)
            arrivals = np.cumsum(rng.exponential(1 / rate, max(1, int(rate * seconds))))
            # failed: answered with an error or not at all within the client's timeout (a late answer on an
            # overloaded machine is not what this probe looks for)
            res = load.run(name, arrivals, pool, per_request=per_request, drain_s=REQUEST_TIMEOUT_S)
            ok_ms = res["latency_ms"][~res["failed"]]
            r = {"offered_rps": float(rate), "requests": int(len(arrivals)), "failed": int(res["failed"].sum()),
                 "p50_ms": _pct(ok_ms, 50), "p99_ms": _pct(ok_ms, 99), "errors": res["errors"]}
            cyc["runs"].append(r)
            row["requests"] += r["requests"]
            row["failed"] += r["failed"]
            if r["failed"]:   # the verdict is made; a stuck model would cost the client's timeout at every rate
                cyc["rates_skipped"] = rates[i + 1:]
                break
        if loaded:
            cyc["answers"] = _burst(server.grpc_url, {v: name}, pool).get(v, {})
            _add(row["answers"], cyc["answers"])
        cyc["serve_fatal"] = fatal_lines(log.since())
        cyc["stubs_before_unload"] = len(_stub_pids(server, name))
        if not loaded:
            cyc["unload"] = {"ok": False, "error": "not loaded"}
        elif unload_under_load:
            rate = float(rates[-1])
            arrivals = np.cumsum(np.random.default_rng(1000 * c + 999).exponential(1 / rate, int(2 * rate * seconds)))
            res = {}
            sending = threading.Thread(target=lambda: res.update(load.run(name, arrivals, pool, per_request=per_request,
                                                                          drain_s=REQUEST_TIMEOUT_S)))
            sending.start()
            time.sleep(0.3 + seconds)   # OpenLoop starts its schedule 0.3 s after the call
            cyc["unload"] = _unload(server, name)
            sending.join()
            cyc["cut_by_unload"] = {"offered_rps": rate, "requests": len(arrivals),
                                    "answered": int((~res["failed"]).sum()) if res else 0,
                                    "errors": res.get("errors", [])}
        else:
            cyc["unload"] = _unload(server, name)
        cyc["unload_fatal"] = fatal_lines(log.since())
        row["fatal_lines"] += cyc["serve_fatal"] + cyc["unload_fatal"]
        runs = ", ".join(f"{r['offered_rps']:,.0f}/s: {r['failed']}/{r['requests']} failed"
                         + (f" p50 {r['p50_ms']:.2f} p99 {r['p99_ms']:.2f} ms" if r["p50_ms"] is not None else "")
                         for r in cyc["runs"])
        answers = cyc.get("answers", {})
        echo(f"{v} [{c + 1}/{cycles}] load {cyc['load_s']:.1f} s; {runs or cyc.get('load_error')}; "
             f"{answers.get('wrong', 0)} of {answers.get('checked', 0)} answers wrong; "
             f"unload {'ok' if cyc['unload']['ok'] else 'FAILED'} in {cyc['unload'].get('s', 0):.1f} s"
             + (f" (under load: {cyc['cut_by_unload']['answered']} of {cyc['cut_by_unload']['requests']} answered)"
                if "cut_by_unload" in cyc else "") + "; "
             f"{len(cyc['serve_fatal'])} fatal lines serving, {len(cyc['unload_fatal'])} at unload")

    try:
        ensure_server()
        load = OpenLoop(server.grpc_url, clients or (4 if kind == "gpu" else 2))
        echo(f"server up in {time.monotonic() - t_start:.1f} s ({doc['uname']}; Python {doc['python']}, "
             f"torch {doc['torch']}, CUDA available {doc['cuda_available']})")
        save()   # the host's facts, whatever happens next
        for v in variants:
            sender, torch = VARIANTS[v]
            row = rows[v] = {"variant": v, "model": models[v], "sender": sender, "torch": torch,
                             "instance_kind": kind, "cycles": [], "fatal_lines": [], "failed": 0, "requests": 0,
                             "answers": {"checked": 0, "wrong": 0, "failed": 0}}
            doc["variants"].append(row)
            if torch and not has_torch:
                row["skipped"] = "torch is not installed"
                echo(f"{v}: skipped (no torch)")
                continue
            try:
                for c in range(cycles):
                    cycle(v, c, row)
            except Exception as err:   # noqa: BLE001 - recorded, the next variant goes on
                row["error"] = f"{type(err).__name__}: {err}"[:500]
                echo(f"{v}: {row['error']}")
            row["unload_ok"] = len(row["cycles"]) == cycles and all(c.get("unload", {}).get("ok")
                                                                    for c in row["cycles"])
            save()

        # every variant loaded at once, a checked burst each, then the server's shutdown with them loaded
        live = [v for v in variants if "skipped" not in rows[v]] if shutdown_loaded else []
        doc["shutdown_loaded"] = live
        ensure_server()
        between(log.since())
        with concurrent.futures.ThreadPoolExecutor(max(1, len(live))) as ex:
            loaded = dict(zip(live, ex.map(lambda v: _call(server, f"/v2/repository/models/{models[v]}/load"),
                                           live)))
        burst = _burst(server.grpc_url, {v: models[v] for v in live if loaded[v][0]}, pool)
        between(log.since())
        t0 = time.monotonic()
        doc["shutdown_returncode"] = server.stop()
        doc["shutdown_s"] = round(time.monotonic() - t0, 2)
        found = attribute_fatal(log.since(), models)
        doc["shutdown_unattributed_fatal"] = found.get("", [])
        for v in live:
            row = rows[v]
            row["final_load_ok"] = loaded[v][0]
            if not loaded[v][0]:
                row["final_load_error"] = loaded[v][1]
            _add(row["answers"], burst.get(v, {}))
            row["shutdown_fatal"] = found.get(v, [])
            row["fatal_lines"] += row["shutdown_fatal"]
    except Exception as err:   # noqa: BLE001 - what was measured is kept, the verdict is a failure
        doc["error"] = f"{type(err).__name__}: {err}"[:1000]
        echo(f"the probe stopped: {doc['error']}")
    finally:
        if load is not None:
            load.close()
        server.stop()
        shutil.rmtree(repo, ignore_errors=True)
        os.chdir(cwd)
    doc["stubs"] = _probe_lines(log_path.read_text(errors="replace") if log_path.exists() else "")
    for row in doc["variants"]:
        answers = row["answers"]
        row["ok"] = "skipped" in row or bool(
            not row["fatal_lines"] and not row["failed"] and row.get("unload_ok") and "error" not in row
            and all("load_error" not in c for c in row["cycles"]) and row.get("final_load_ok", not shutdown_loaded)
            and answers["checked"] > 0 and not answers["wrong"] and not answers["failed"])
    doc["ok"] = bool(doc["variants"]) and all(r["ok"] for r in doc["variants"]) and "error" not in doc \
        and not doc.get("shutdown_unattributed_fatal") and not doc["stray_fatal"]
    save()
    for row in doc["variants"]:
        if "skipped" in row:
            echo(f"{row['variant']:>14}: skipped ({row['skipped']})")
            continue
        answers = row["answers"]
        echo(f"{row['variant']:>14}: {'ok' if row['ok'] else 'FAILED'}: {row['failed']} of {row['requests']} "
             f"requests failed, {answers['wrong']} of {answers['checked']} answers wrong, unloads "
             f"{'ok' if row.get('unload_ok') else 'FAILED'}, {len(row['fatal_lines'])} fatal lines "
             f"({len(row.get('shutdown_fatal', []))} at shutdown)")
    echo(f"{'survived' if doc['ok'] else 'FAILED'} in {doc['elapsed_s']:.0f} s (KIND_{kind.upper()}; "
         f"{len(doc.get('shutdown_unattributed_fatal', [])) + len(doc['stray_fatal'])} fatal lines no variant's "
         f"stack names); {json_path}")
    return doc


def _add(total: dict, part: dict) -> None:
    for k, n in part.items():
        total[k] = total.get(k, 0) + n


def _burst(url: str, models: dict[str, str], pool: dict, requests: int = 8, per_request: int = 4) -> dict:
    """A few requests to each model (variant -> name), each answer checked against numpy's argmax."""
    import numpy as np
    import tritonclient.grpc as grpcclient
    client = grpcclient.InferenceServerClient(url)
    out = {}
    try:
        for v, name in models.items():
            got = {"checked": 0, "wrong": 0, "failed": 0}
            for i in range(requests):
                x = pool["x"][i * per_request:(i + 1) * per_request]
                inp = grpcclient.InferInput("x", list(x.shape), "FP32")
                inp.set_data_from_numpy(x)
                try:
                    res = client.infer(name, [inp], outputs=[grpcclient.InferRequestedOutput("label")],
                                       client_timeout=10)
                except Exception:   # noqa: BLE001 - counted
                    got["failed"] += 1
                    break   # a stuck model would cost the client's timeout per request
                got["checked"] += 1
                got["wrong"] += int(not np.array_equal(res.as_numpy("label").reshape(-1), np.argmax(x, axis=1)))
            out[v] = got
    finally:
        client.close()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help=f"folder for {JSON_NAME} and {LOG_NAME}")
    p.add_argument("--kind", choices=["cpu", "gpu"], default="cpu", help="the models' instance kind (default cpu)")
    p.add_argument("--rates", default="300,1000,3000", help="offered requests/s, comma-separated")
    p.add_argument("--seconds", type=float, default=1.5, help="seconds per rate (default 1.5)")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                   help=f"comma-separated, of: {', '.join(VARIANTS)} (default {','.join(DEFAULT_VARIANTS)})")
    p.add_argument("--cycles", type=int, default=1, help="loads and unloads per variant (default 1)")
    p.add_argument("--unload-under-load", action="store_true",
                   help="unload each variant while requests still arrive (the last rate)")
    p.add_argument("--no-shutdown-loaded", action="store_true",
                   help="skip loading every variant again for the server's shutdown (a shorter run)")
    p.add_argument("--wheels", type=Path, default=None,
                   help="folder with the server and client to unpack (default .gpu_wheels/ for --kind gpu)")
    a = p.parse_args(argv)
    doc = run(a.out, kind=a.kind, rates=tuple(float(r) for r in a.rates.split(",") if r), seconds=a.seconds,
              variants=[v for v in a.variants.split(",") if v], cycles=a.cycles,
              shutdown_loaded=not a.no_shutdown_loaded, unload_under_load=a.unload_under_load, wheels=a.wheels)
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
