"""E²bird's memory pool and its serving loop on the CPU: the ring's bookkeeping (slots, arrival order, no overwrite
while read, wrap-around), the copy events a worker waits on, and the engine driven against a device whose streams
finish when the test says (every copy once, in arrival order; a worker's stream waits for the copy covering its
rows; no slot written while a worker reads it; every request answered once with its own rows), then the same
engine on real torch CPU tensors and ONNX Runtime worker threads, in the continuous form (answers equal to the
stock model's), and, where CUDA is present, on the GPU."""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest

from e3.serving.ebird.policy import make_policy
from e3.serving.ebird.engine import AdmissionEngine, DeviceOps
from e3.serving.ebird.pool import CopyLog, PoolFull, SlotRing


# -- the ring -----------------------------------------------------------------------------------------------------
def test_rows_get_slots_in_arrival_order_and_wrap_past_the_last_slot():
    ring = SlotRing(8)
    a, b = ring.reserve(3), ring.reserve(4)
    assert (a.start, a.stop, a.segments) == (0, 3, ((0, 3),))
    assert (b.start, b.stop, b.segments) == (3, 7, ((3, 7),))
    assert ring.staged == 7 and ring.room == 1
    t = ring.take(5)
    assert t.segments == ((0, 5),) and ring.staged == 2 and ring.reading == 5
    ring.release(t)
    c = ring.reserve(4)                          # rows 7..10: slot 7, then slots 0..2
    assert c.segments == ((7, 8), (0, 3))
    t2 = ring.take(6)                            # rows 5..10: a worker's batch across the end
    assert t2.segments == ((5, 8), (0, 3))


def test_a_slot_is_never_written_while_a_worker_reads_it_and_release_out_of_order_waits_for_the_oldest():
    ring = SlotRing(8)
    ring.reserve(8)
    first, second = ring.take(4), ring.take(4)
    assert ring.room == 0
    with pytest.raises(PoolFull, match="1 rows asked, 0 slots free"):
        ring.reserve(1)
    ring.release(second)                         # the younger batch finishes first: its slots stay behind the older
    assert ring.room == 0
    ring.release(first)
    assert ring.room == 8
    with pytest.raises(ValueError, match="not held"):
        ring.release(first)
    with pytest.raises(ValueError, match="takes 1..0"):
        ring.take(1)


def test_a_worker_waits_on_the_first_copy_event_covering_its_last_row():
    log = CopyLog()
    log.record(3, "e1")
    log.record(7, "e2")
    assert log.covering(3) == "e1" and log.covering(4) == "e2" and log.covering(7) == "e2"
    with pytest.raises(ValueError, match="no copy event covers row 7"):
        log.covering(8)
    log.forget_before(3)
    assert len(log) == 1 and log.covering(4) == "e2"
    with pytest.raises(ValueError, match="new rows"):
        log.record(7, "e3")


# -- the engine against a device whose streams the test drives -----------------------------------------------------
class VirtualDevice(DeviceOps):
    """A device with a copy stream and one stream per worker, whose work completes only when ``finish`` says.
    It checks the engine's ordering as a GPU would punish it: a worker reading a slot whose copy is not covered by
    the event it waits on, or a copy into a slot a running worker reads, fails the test. The model doubles its
    input (so each answer names the rows it came from)."""

    def __init__(self, capacity: int, seed: int):
        self.capacity = capacity
        self.ring = np.full(capacity, -1.0)
        self.written_by: dict[int, int] = {}      # slot -> copy event id that wrote its current row
        self.events = 0
        self.copies_since_mark: list[int] = []
        self.running: dict[int, tuple[int, list[int], np.ndarray]] = {}   # event -> (worker, slots, output)
        self.fired: set[int] = set()
        self.copied_rows: list[float] = []
        self.rng = random.Random(seed)
        self.out: dict[int, np.ndarray] = {}

    def copy_in(self, segments, arrays):
        rows = arrays["x"][:, 0]
        at = 0
        for a, b in segments:
            for s in range(a, b):
                busy = [e for e, (_, slots, _) in self.running.items() if s in slots and e not in self.fired]
                assert not busy, f"slot {s} written while a worker reads it (events {busy})"
                self.ring[s] = rows[at]
                self.written_by[s] = -1              # not covered by any event yet
                self.copies_since_mark.append(s)
                self.copied_rows.append(float(rows[at]))
                at += 1

    def mark_copied(self):
        self.events += 1
        for s in self.copies_since_mark:
            self.written_by[s] = self.events
        self.copies_since_mark = []
        return self.events

    def launch(self, worker, taken, after):
        slots = [s for a, b in taken.segments for s in range(a, b)]
        for s in slots:   # the stream waits on `after`: every slot it reads must have been copied by then
            assert 0 < self.written_by.get(s, 0) <= after, f"slot {s} read before its copy (waits on {after})"
        self.events += 1
        self.running[self.events] = (worker, slots, 2 * self.ring[slots][:, None])
        return self.events

    def finish_some(self) -> None:
        """Complete a random subset of the running work, in any order (streams are independent)."""
        for e in list(self.running):
            if e not in self.fired and self.rng.random() < 0.5:
                self.fired.add(e)

    def ready(self, event):
        if event in self.fired:
            worker, _, out = self.running.pop(event)
            self.out[worker] = out
            return True
        return False

    def result(self, worker, rows):
        return {"y": self.out[worker][:rows].copy()}


def _drive(policy, *, capacity: int, requests: list[np.ndarray], seed: int):
    device = VirtualDevice(capacity, seed)
    answered = []
    engine = AdmissionEngine(policy, device, capacity=capacity, answer=answered.append)
    rng = random.Random(seed)
    pending = list(enumerate(requests))
    for _ in range(100_000):
        for _ in range(rng.randint(0, 3)):      # arrivals between rounds
            if pending:
                i, rows = pending.pop(0)
                engine.admit(i, {"x": rows[:, None].astype(np.float64)})
        left = engine.step()
        device.finish_some()
        if not pending and not left:
            break
    return engine, device, answered


@pytest.mark.parametrize("kind", ["n-ebird", "e-ebird"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_input_copied_once_in_arrival_order_and_every_request_answered_with_its_own_rows(kind, seed):
    rng = np.random.default_rng(seed)
    requests, at = [], 0.0
    for _ in range(120):                          # requests of 1..9 inputs, values = their serial numbers
        n = int(rng.integers(1, 10))
        requests.append(np.arange(at, at + n))
        at += n
    policy = make_policy(kind, engine=(8, 4, 2, 1, 1), max_inflight=12) if kind == "n-ebird" else \
        make_policy(kind, confs={4: (4,), 8: (4, 4), 16: (8, 8)}, max_inflight=16)
    capacity = 20                                 # small: requests wait for room and batches wrap
    engine, device, answered = _drive(policy, capacity=capacity, requests=requests, seed=seed)
    assert device.copied_rows == list(np.arange(at))       # each input copied exactly once, in arrival order
    assert sorted(r.handle for r in answered) == list(range(len(requests)))   # each request answered once
    for r in answered:
        assert r.failed is None
        np.testing.assert_array_equal(r.outputs["y"][:, 0], 2 * requests[r.handle])   # its own rows, in order
    assert engine.ring.reading == 0 and engine.ring.staged == 0 and not engine.running
    assert policy.inflight == 0 and max(engine.batches) <= max(policy.engine)
    assert sum(b * k for b, k in engine.batches.items()) == at


def test_a_request_larger_than_the_pool_is_refused_and_the_engine_goes_on():
    answered = []
    engine = AdmissionEngine(make_policy("n-ebird", engine=(2, 1), max_inflight=2), VirtualDevice(4, 0),
                             capacity=4, answer=answered.append)
    engine.admit("big", {"x": np.zeros((5, 1))})
    assert answered[0].handle == "big" and "does not fit the admission pool of 4 slots" in answered[0].failed
    engine.admit("ok", {"x": np.ones((3, 1))})
    for _ in range(50):
        engine.step()
        engine.ops.finish_some()
    assert [r.handle for r in answered] == ["big", "ok"] and answered[1].failed is None


def test_a_failing_batch_answers_its_requests_with_the_error_and_later_batches_still_run():
    class Failing(VirtualDevice):
        calls = 0

        def launch(self, worker, taken, after):
            Failing.calls += 1
            if Failing.calls == 1:
                raise RuntimeError("device lost")
            return super().launch(worker, taken, after)
    answered = []
    engine = AdmissionEngine(make_policy("n-ebird", engine=(1,), max_inflight=1), Failing(8, 0), capacity=8,
                             answer=answered.append)
    engine.admit("a", {"x": np.ones((1, 1))})
    engine.admit("b", {"x": np.ones((1, 1))})
    for _ in range(50):
        engine.step()
        engine.ops.finish_some()
    assert [(r.handle, r.failed is not None) for r in answered] == [("a", True), ("b", False)]
    assert "device lost" in answered[0].failed


# -- the same engine on real tensors ---------------------------------------------------------------------------------
def _tiny():
    import torch

    from e3.serving.device.executor import DeviceSettings, build_model, prepare_model
    torch.set_num_threads(1)
    settings = DeviceSettings(device="cpu", precision="fp32", max_batch=8)
    return prepare_model(build_model("tiny-ee", seed=0, trained=False), settings), settings


def serve_continuously(policy, ops, *, capacity: int, requests: list[dict], poll_s: float = 0.0,
                       timeout_s: float = 60.0) -> dict:
    """``requests`` submitted from this thread to the continuous form (ContinuousEngine's thread running the
    rounds, as the served stage does); returns each request's answer (outputs dict or error) by index."""
    from e3.serving.device.continuous import ContinuousEngine
    answers: dict = {}
    done = threading.Event()

    def send(i, what):
        answers[i] = what
        if len(answers) == len(requests):
            done.set()
    front = ContinuousEngine(send, poll_s=poll_s, name="test-ebird")
    engine = AdmissionEngine(policy, ops, capacity=capacity, answer=lambda r: front.failed(r.handle, r.failed)
                             if r.failed else front.answered(r.handle, r.outputs))
    if hasattr(ops, "on_done"):
        ops.on_done = front.wake
    front.bind(engine)
    for i, arrays in enumerate(requests):
        assert front.submit(i, arrays) is None
    done.wait(timeout_s)
    front.close(message="closing")
    engine.close()
    assert len(answers) == len(requests), f"{len(requests) - len(answers)} requests unanswered"
    assert front.counts == {"admitted": len(requests), "answered": len(requests), "failed": 0, "refused": 0}
    return answers


def _split(arrays: dict, sizes: list[int]) -> list[dict]:
    out, at = [], 0
    for n in sizes:
        out.append({k: v[at:at + n] for k, v in arrays.items()})
        at += n
    return out


def test_on_cpu_tensors_the_continuous_form_answers_as_the_stock_model():
    from e3.serving.device.pipeline import StockRunner, head_answer
    from e3.serving.ebird.torch_ops import LOGITS, TorchOps
    model, settings = _tiny()
    policy = make_policy("e-ebird", confs={4: (4,), 8: (8,)}, max_inflight=8)
    arrays = model.example_arrays(40, seed=3)
    sizes = [1, 3, 5, 2, 8, 1, 4, 6, 3, 7]
    answers = serve_continuously(policy, TorchOps(model, policy.engine, capacity=12, settings=settings), capacity=12,
                                 requests=_split(arrays, sizes))
    want = StockRunner(model, settings).run(arrays)
    got = [head_answer(answers[i][LOGITS], model.card) for i in range(len(sizes))]
    np.testing.assert_array_equal(np.concatenate([a.label for a in got]), want.label)
    np.testing.assert_allclose(np.concatenate([a.probs for a in got]), want.probs, atol=1e-5)


@pytest.mark.parametrize("kind", ["n-ebird", "e-ebird"])
def test_onnx_worker_threads_stage_arrivals_while_workers_compute_and_answer_each_request_with_its_rows(kind):
    """HostOps (the CPU stage's workers): the first batches hold their workers until the test opens a gate; while
    they hold, the engine must already have staged later arrivals into the pool (rows copied past those taken by
    the running workers), which an engine that ran one batch at a time would not; then every request is answered
    with its own rows."""
    from e3.core.spec import TensorSpec
    from e3.serving.ebird.host_ops import HostOps
    gate = threading.Event()
    staged_while_held: list = []

    def run(feed):
        if not gate.is_set():   # the first batches: what was staged beside them, once the arrivals settle
            time.sleep(0.1)
            staged_while_held.append(ops.staged_rows())
            gate.wait(10)
        return {"y": feed["x"] * 2.0, "n": feed["x"][:, :1].astype(np.int64)}
    policy = make_policy(kind, engine=(4, 2, 1), max_inflight=6) if kind == "n-ebird" else         make_policy(kind, confs={4: (2, 2), 8: (4, 2, 2)}, max_inflight=8)
    class Counting(HostOps):   # rows copied into the pool and rows handed to workers
        copied = launched = 0

        def copy_in(self, segments, arrays):
            self.copied += sum(b - a for a, b in segments)
            super().copy_in(segments, arrays)

        def launch(self, worker, taken, after):
            self.launched += taken.rows
            return super().launch(worker, taken, after)

        def staged_rows(self):
            return self.copied - self.launched

    ops = Counting((TensorSpec("x", "FP32", (3,)),), policy.engine, capacity=16, run=run)
    rng = np.random.default_rng(0)
    sizes = [int(n) for n in rng.integers(1, 4, 60)]
    x = rng.normal(size=(sum(sizes), 3)).astype(np.float32)
    requests = _split({"x": x}, sizes)
    threading.Timer(0.5, gate.set).start()
    answers = serve_continuously(policy, ops, capacity=16, requests=requests, poll_s=0.05)
    for i, r in enumerate(requests):
        np.testing.assert_array_equal(answers[i]["y"], 2 * r["x"])
    assert staged_while_held and max(staged_while_held) > 0, staged_while_held   # staged while workers computed


def test_onnx_worker_threads_answer_a_failing_batch_with_its_error_and_refuse_variable_shapes():
    from e3.core.spec import TensorSpec
    from e3.serving.ebird.host_ops import HostOps
    calls = []

    def run(feed):
        calls.append(len(feed["x"]))
        if len(calls) == 1:
            raise RuntimeError("session lost")
        return {"y": feed["x"]}
    policy = make_policy("n-ebird", engine=(1,), max_inflight=1)
    ops = HostOps((TensorSpec("x", "FP32", (2,)),), policy.engine, capacity=4, run=run)
    answered = []
    engine = AdmissionEngine(policy, ops, capacity=4, answer=answered.append)
    engine.admit("a", {"x": np.ones((1, 2), np.float32)})
    engine.admit("b", {"x": np.ones((1, 2), np.float32)})
    engine.drive(lambda: len(answered) == 2)
    engine.close()
    assert [(r.handle, r.failed is not None) for r in answered] == [("a", True), ("b", False)]
    assert "session lost" in answered[0].failed
    with pytest.raises(ValueError, match="input 'x' has a variable dimension"):
        HostOps((TensorSpec("x", "INT64", (-1,)),), (1,), capacity=4, run=run)


def test_the_inline_form_answers_every_request_of_the_call_in_the_callers_thread():
    from e3.serving.ebird.torch_ops import TorchOps
    from e3.serving.device.pipeline import StockRunner, head_answer
    model, settings = _tiny()
    policy = make_policy("n-ebird", engine=(8, 4, 1), max_inflight=8)
    answered, threads = {}, set()

    def answer(r):
        threads.add(threading.get_ident())
        answered[r.handle] = r

    engine = AdmissionEngine(policy, TorchOps(model, policy.engine, capacity=12, settings=settings), capacity=12,
                             answer=answer)
    arrays = model.example_arrays(40, seed=4)
    sizes = [1, 3, 5, 2, 8, 1, 4, 6, 3, 7]   # 40 rows through a pool of 12: the ring wraps while the call runs
    at = 0
    for i, n in enumerate(sizes):
        engine.admit(i, {k: v[at:at + n] for k, v in arrays.items()})
        at += n
    engine.drive(lambda: len(answered) == len(sizes))
    assert threads == {threading.get_ident()} and not any(r.failed for r in answered.values())
    want = StockRunner(model, settings).run(arrays)
    got = np.concatenate([head_answer(answered[i].outputs["logits"], model.card).label for i in range(len(sizes))])
    np.testing.assert_array_equal(got, want.label)
    # a device error answers what the engine holds, so the call returns instead of hanging
    answered.clear()
    engine.ops.launch = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("device lost"))
    engine.admit("x", {k: v[:3] for k, v in arrays.items()})
    engine.drive(lambda: "x" in answered)
    assert "device lost" in answered["x"].failed


def test_the_inline_form_blocks_on_the_oldest_running_worker_instead_of_polling():
    class Blocking(DeviceOps):
        """Workers finish only when the engine waits for them; ready() never fires by itself."""
        def __init__(self):
            self.waited, self.launched, self.unfired_checks = [], 0, 0

        def copy_in(self, segments, arrays):
            pass

        def mark_copied(self):
            return None

        def launch(self, worker, taken, after):
            self.launched += 1
            return {"id": self.launched, "fired": False, "rows": taken.rows}

        def ready(self, event):
            if not event["fired"]:
                self.unfired_checks += 1
                assert self.unfired_checks < 100, "the engine polls a worker that only finishes when waited for"
            return event["fired"]

        def wait(self, event):
            self.waited.append(event["id"])
            event["fired"] = True

        def result(self, worker, rows):
            return {"y": np.zeros((rows, 2))}

    answered = {}
    device = Blocking()
    engine = AdmissionEngine(make_policy("n-ebird", engine=(4, 2, 1), max_inflight=8), device, capacity=16,
                             answer=lambda r: answered.__setitem__(r.handle, r), poll_s=0.0)
    for i, n in enumerate([3, 4, 5]):
        engine.admit(i, {"x": np.ones((n, 1))})
    engine.drive(lambda: len(answered) == 3)   # a polling drive fails the device's assertion (answers failed)
    assert sorted(answered) == [0, 1, 2] and not any(r.failed for r in answered.values())
    assert device.waited == sorted(device.waited) and len(device.waited) == device.launched


def test_stopping_answers_what_the_engine_still_holds():
    answered = []
    device = VirtualDevice(8, 0)
    engine = AdmissionEngine(make_policy("n-ebird", engine=(2, 1), max_inflight=2), device, capacity=8,
                             answer=answered.append)
    engine.admit("a", {"x": np.ones((3, 1))})
    engine.step()                                  # launched, never finished
    engine.close("unloading")
    assert [(r.handle, r.failed) for r in answered] == [("a", "unloading")]
    engine.admit("late", {"x": np.ones((1, 1))})
    assert answered[-1].handle == "late" and "stopping" in answered[-1].failed


@pytest.mark.skipif(not __import__("torch").cuda.is_available(),
                    reason="needs an NVIDIA GPU that PyTorch can use (torch.cuda.is_available() is False here)")
def test_on_the_gpu_streams_and_events_answer_as_the_stock_model():
    import dataclasses

    from e3.serving.ebird.torch_ops import TorchOps
    from e3.serving.device.executor import DeviceSettings, build_model, prepare_model
    from e3.serving.device.pipeline import StockRunner, head_answer
    settings = DeviceSettings(device="cuda", precision="fp32", max_batch=8)
    model = prepare_model(build_model("tiny-ee", seed=0, trained=False), settings)
    policy = make_policy("e-ebird", confs={4: (4,), 8: (4, 4), 16: (8, 8)}, max_inflight=16)
    arrays = model.example_arrays(200, seed=5)
    cut, at = [], 0
    while at < 200:                              # requests of 1..7 inputs
        cut.append(min(1 + len(cut) % 7, 200 - at))
        at += cut[-1]
    answers = serve_continuously(policy, TorchOps(model, policy.engine, capacity=24, settings=settings), capacity=24,
                                 requests=_split(arrays, cut), poll_s=0.00005)
    want = StockRunner(model, dataclasses.replace(settings, graphs=False)).run(arrays)
    got = np.concatenate([head_answer(answers[j]["logits"], model.card).label for j in range(len(cut))])
    np.testing.assert_array_equal(got, want.label)


def test_the_engine_cost_benchmark_times_calls_that_answer_every_request():
    from e3.benchmarks.admission_engine_cost import POLICIES, engine_us_per_call
    for policy in POLICIES.values():
        assert 0 < engine_us_per_call(policy, 8, calls=20, repeats=1) < 1e5   # returns: every call answered
