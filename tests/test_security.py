"""Security (reliability, item 10): with a key, model repository, model config, shared-memory, trace and
logging APIs answer only calls that carry it ("This API is restricted"; on HTTP the guard checks it, on gRPC
Triton, under the metadata name ``triton-grpc-protocol-<header>``), inference stays open; traversal-style
model names and file overrides are refused and the server keeps serving. (SIGTERM leaving no shared memory:
tests/test_e2e.py::test_e3_serve_stops_cleanly_on_sigterm.)"""

from __future__ import annotations

import base64
import json

import pytest

from e3.deploy.guard import Guard
from helpers import http_call, serving

pytestmark = pytest.mark.e2e
KEY = ("e3-api-key", "s3cret-for-tests")
SPLIT = "tiny_ee_split_1-2"


def _call(server, method: str, path: str, body: dict | None = None, key: bool = False) -> tuple[int, str]:
    """Through the guard (``server.guard``), as `e3 serve` exposes the server."""
    return http_call((server.guard.host, server.guard.port), method, path,
                     json.dumps(body) if body is not None else None, dict([KEY]) if key else {})


@pytest.fixture(scope="module")
def locked(tiny_repo):
    """A server with the key, behind the guard (as `e3 serve` runs it off loopback)."""
    with serving(tiny_repo, [SPLIT], name="security", api_key=KEY, guard_secret=True) as server, \
            Guard(server.http_url, port=0, upstream_headers=server.http_headers, api_key=KEY) as guard:
        server.guard = guard
        yield server


def test_restricted_apis_need_the_key_inference_does_not(locked, tiny_model):
    calls = [("POST", "/v2/repository/index", {}), ("GET", f"/v2/models/{SPLIT}/config", None),
             ("GET", "/v2/systemsharedmemory/status", None), ("POST", f"/v2/repository/models/{SPLIT}/load", {}),
             ("GET", "/v2/logging", None), ("POST", "/v2/trace/setting", {})]
    refused = 0
    for method, path, body in calls:
        status, text = _call(locked, method, path, body)
        assert status in (401, 403) or 400 <= status < 500, (path, status, text)
        assert "This API is restricted" in text, (path, text)
        refused += 1
        status, text = _call(locked, method, path, body, key=True)
        assert status == 200, (path, status, text)
    ids, mask = (x.numpy() for x in tiny_model.example_inputs(2, seed=1))
    status, text = _call(locked, "POST", f"/v2/models/{SPLIT}/infer", {"inputs": [
        {"name": "input_ids", "shape": [2, 16], "datatype": "INT64", "data": ids.reshape(-1).tolist()},
        {"name": "attention_mask", "shape": [2, 16], "datatype": "INT64", "data": mask.reshape(-1).tolist()}]})
    assert status == 200, text
    import tritonclient.grpc as grpc
    client = grpc.InferenceServerClient(locked.grpc_url)
    for call in (client.get_model_repository_index, client.get_log_settings, client.get_trace_settings):
        with pytest.raises(Exception, match="This protocol is restricted"):
            call(headers=dict([KEY]))   # the bare header name is not what Triton's gRPC reads
        call(headers={f"triton-grpc-protocol-{KEY[0]}": KEY[1]})
        refused += 1
    print(f"security: {refused} restricted calls (HTTP and gRPC, logging and trace included) refused without the "
          "key, accepted with it; inference open")


@pytest.mark.parametrize("name", ["..%2F..%2Fetc", "..", "%2Ftmp%2Fx", "tiny_ee_split_1-2%2F..%2F..%2Fsecret"])
def test_traversal_model_names_are_refused(locked, name):
    status, text = _call(locked, "POST", f"/v2/repository/models/{name}/load", {}, key=True)
    assert status == 400 and ("is not allowed" in text or "percent-encoded" in text or "dot segments" in text), \
        (name, status, text)
    assert locked.alive() and locked.ready()


def test_file_overrides_cannot_leave_the_model_folder(locked, tmp_path):
    target = tmp_path / "escaped.txt"
    payload = base64.b64encode(b"not a model").decode()
    config = json.dumps({"name": "evil", "backend": "python", "max_batch_size": 0})
    for path in (f"file:../../../../../../{target}", f"file:{target}", "file:1/../../../escaped.txt"):
        status, text = _call(locked, "POST", "/v2/repository/models/evil/load",
                             {"parameters": {"config": config, path: payload}}, key=True)
        assert status == 400 and "must stay inside the model folder" in text, (path, status, text)
    assert not target.exists()
    assert locked.alive() and locked.ready()
