"""serving/triton_io.py's answering after ``execute``: a :class:`Reply` sends only the outputs its client asked for,
and a :class:`ResponseSender` without a thread sends in the thread that drains it, waking its owner on every put.

Triton's ``triton_python_backend_utils`` exists only inside a stub, so these run in a child interpreter with a
small stand-in for the three names the module's responses use (Tensor, InferenceResponse, TritonError); the
router through the real tritonserver is tests/test_device_continuous.py's."""

from __future__ import annotations

import subprocess
import sys
import textwrap

CHILD = textwrap.dedent('''
    import sys, threading, types
    import numpy as np

    pb = types.ModuleType("triton_python_backend_utils")
    class Tensor:
        def __init__(self, name, array):
            self.name, self.array = name, array
    class InferenceResponse:
        def __init__(self, output_tensors=(), error=None):
            self.outputs, self.error = list(output_tensors), error
    class TritonError:
        def __init__(self, message, code=None):
            self.message, self.code = message, code
        UNAVAILABLE = INVALID_ARG = INTERNAL = 0
    class Logger:
        @staticmethod
        def log_warn(message):
            print("WARN", message)
    pb.Tensor, pb.InferenceResponse, pb.TritonError, pb.Logger = Tensor, InferenceResponse, TritonError, Logger
    pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
    sys.modules["triton_python_backend_utils"] = pb

    from e3.serving.triton_io import Reply, ResponseSender

    class Sender:   # what request.get_response_sender() gives: one send, with the FINAL flag
        def __init__(self):
            self.sent, self.threads = [], []
        def send(self, response, flags=0):
            assert flags == 1
            self.sent.append(response)
            self.threads.append(threading.get_ident())

    outputs = {"label": np.zeros((2, 1), np.int64), "exit_ramp": np.ones((2, 1), np.int32),
               "probs": np.full((2, 3), 0.5, np.float32)}
    woken = []
    outbox = ResponseSender("test", thread=False)
    outbox.wake = lambda: woken.append(1)
    one, every, raw = Sender(), Sender(), Sender()
    outbox.put(Reply(one, ["exit_ramp"]), dict(outputs))
    outbox.put(Reply(every, []), dict(outputs))          # a request naming no output: Triton asks for all
    outbox.put(raw, dict(outputs))                       # a bare sender (tests' fakes): sent as given
    assert len(woken) == 3 and not one.sent, "put only queues, and wakes the owner"
    assert outbox.drain() == 3 and outbox.drain() == 0
    me = threading.get_ident()
    assert [t.name for t in one.sent[0].outputs] == ["exit_ramp"], [t.name for t in one.sent[0].outputs]
    assert sorted(t.name for t in every.sent[0].outputs) == ["exit_ramp", "label", "probs"]
    assert sorted(t.name for t in raw.sent[0].outputs) == ["exit_ramp", "label", "probs"]
    assert one.threads == every.threads == raw.threads == [me], "sent in the thread that drained"
    try:
        outbox.put(object(), {})
        raise SystemExit("a request object was accepted")
    except TypeError as err:
        assert "sender_of" in str(err)
    # with its own thread: sent there, not here
    threaded, late = ResponseSender("test"), Sender()
    threaded.put(Reply(late, ["label"]), dict(outputs))
    threaded.close()
    assert [t.name for t in late.sent[0].outputs] == ["label"] and late.threads != [me]
    print("ok")
''')


def test_a_reply_sends_only_the_requested_outputs_from_the_thread_that_drains():
    run = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout[-2000:] + run.stderr[-3000:]
