"""The gRPC guard's shared upstream streams: unary ``ModelInfer`` calls carried to Triton as messages of a few
long-lived ``ModelStreamInfer`` streams instead of one gRPC call each (:mod:`e3.deploy.grpc_guard`).

Why (issue 38, measured on the project's 2-core machine with perf_analyzer at a fixed 400 req/s, the guard
process's CPU over 4,000 calls, three runs each side, interleaved): the gRPC guard forwarding each call as a
new unary call to Triton cost 960-1,012 us of CPU per call, the same guard sending the calls as messages of two
open streams 845-900 us (-11%), a bare ``grpc.aio`` forwarder without checks 790 us: the client half of a unary
call in grpc's Python runtime pays the call's own setup (a call object, a task, the metadata and status round
trip), which a message of an open stream does not.

The price, and why :class:`~e3.deploy.grpc_guard.GrpcGuard` leaves it off unless asked (``stream_lanes``): an
error answered on a stream has no status code, so that call is asked again on its own call; a request the
model itself refuses (the router's "queue full") then runs twice and is counted twice by the model. A call's
cancellation does not reach Triton, and its deadline is kept by the guard.

How a call travels:

* The guard gives the checked request a guard-made ``id`` (the client's is put back on the answer) and writes it
  to one of ``lanes`` streams (round robin; one writer task per stream, since gRPC allows one write in flight per
  call). Triton answers every message of a stream with one ``ModelStreamInferResponse`` naming the request's id,
  errors included (verified on Triton 2.51: an unknown model, an unknown input and a wrong shape each came back
  as ``error_message`` with the id), and runs the messages of a stream concurrently.
* An answer with ``error_message`` carries no status code, so :meth:`Mux.call` returns None for it and the guard
  sends that request again as its own unary call, whose status is Triton's own (errors cost two calls; a
  request with sequence parameters never goes on a stream, so no sequence state can see a request twice).
* A stream that ends or breaks (Triton restarted) fails the calls waiting on it with :class:`LaneLost`; the guard
  sends those again on their own calls (a dead Triton: UNAVAILABLE as before), and the next call opens a new
  stream.
* Which calls go on a stream is the guard's choice (:meth:`e3.deploy.grpc_guard.GrpcGuard.unary`): ``ModelInfer``
  only, small messages only, no metadata to forward, no sequence parameters, and only to a model a unary call
  has answered within the last ``trust_s`` seconds (so a decoupled model, which Triton refuses on ``ModelInfer``,
  is never asked on a stream, where it would answer differently).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from typing import Any

import grpc

__all__ = ["Mux", "LaneLost"]


class LaneLost(Exception):
    """The stream a call was waiting on ended before its answer."""


class _Lane:
    """One open ``ModelStreamInfer`` stream, its writer task, its reader task and the calls waiting on it."""

    def __init__(self, mux: "Mux"):
        self.mux = mux
        self.pending: dict[str, asyncio.Future] = {}
        self.outbox: deque[bytes] = deque()
        self.wake = asyncio.Event()
        self.call = mux.channel.stream_stream(mux.path)()
        self.dead = False
        self.tasks = [asyncio.ensure_future(self._write()), asyncio.ensure_future(self._read())]

    async def _write(self) -> None:
        try:
            while True:
                while self.outbox:
                    await self.call.write(self.outbox.popleft())
                self.wake.clear()
                await self.wake.wait()
        except asyncio.CancelledError:
            raise
        except Exception:   # noqa: BLE001 - the stream broke: the reader sees it too
            self._end()

    async def _read(self) -> None:
        pb = self.mux.pb
        try:
            while True:
                data = await self.call.read()
                if data is grpc.aio.EOF:
                    break
                answer = pb.ModelStreamInferResponse.FromString(data)
                future = self.pending.pop(answer.infer_response.id, None)
                if future is not None and not future.done():
                    future.set_result(answer)
        except asyncio.CancelledError:
            raise
        except Exception:   # noqa: BLE001 - AioRpcError (Triton gone) or a message that does not parse
            pass
        self._end()

    def _end(self) -> None:
        if self.dead:
            return
        self.dead = True
        self.mux._forget(self)
        for future in self.pending.values():
            if not future.done():
                future.set_exception(LaneLost("Triton's stream ended"))
        self.pending.clear()
        self.call.cancel()
        for task in self.tasks:
            if task is not asyncio.current_task():
                task.cancel()

    def send(self, key: str, data: bytes) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        self.pending[key] = future
        self.outbox.append(data)
        self.wake.set()
        return future


class Mux:
    """``lanes`` shared streams to ``path`` on ``channel`` (a ``grpc.aio`` channel); use from its event loop."""

    def __init__(self, channel: grpc.aio.Channel, path: str, lanes: int = 2, trust_s: float = 2.0):
        from tritonclient.grpc import service_pb2   # deferred: protos load only with shared streams on
        self.pb = service_pb2
        self.channel, self.path, self.n, self.trust_s = channel, path, lanes, trust_s
        self._lanes: list[_Lane | None] = [None] * lanes
        self._next = itertools.count()
        self._ids = itertools.count()
        self._trusted: dict[str, float] = {}   # model -> when a unary call to it last succeeded
        self.sent = 0   # calls sent on the streams

    def trusted(self, model: str) -> bool:
        """Whether calls to ``model`` may go on a stream now (a unary call answered within ``trust_s``)."""
        seen = self._trusted.get(model)
        return seen is not None and time.monotonic() - seen < self.trust_s

    def trust(self, model: str) -> None:
        self._trusted[model] = time.monotonic()

    def forget(self, model: str | None = None) -> None:
        """Ask ``model`` (every model: None) by unary calls again until one answers (after a load or unload)."""
        if model is None:
            self._trusted.clear()
        else:
            self._trusted.pop(model, None)

    def _forget(self, lane: _Lane) -> None:
        self._lanes = [None if x is lane else x for x in self._lanes]

    async def call(self, req: Any, timeout: float | None) -> Any:
        """Triton's ``ModelInferResponse`` for ``req`` (a checked ``ModelInferRequest``, changed in place: its id
        is the guard's while on the stream and the client's again after), None where Triton answered with an
        error (ask again by a unary call for its status); raises :class:`LaneLost`, or
        :class:`asyncio.TimeoutError` past ``timeout`` seconds."""
        i = next(self._next) % self.n
        lane = self._lanes[i]
        if lane is None or lane.dead:
            lane = self._lanes[i] = _Lane(self)
        client_id = req.id
        key = req.id = f"e3g{next(self._ids)}"
        future = lane.send(key, req.SerializeToString())
        self.sent += 1
        req.id = client_id
        try:
            answer = await (future if timeout is None else asyncio.wait_for(future, timeout))
        finally:
            lane.pending.pop(key, None)
        if answer.error_message:
            return None
        response = answer.infer_response
        response.id = client_id
        return response

    async def close(self) -> None:
        for lane in self._lanes:
            if lane is not None:
                lane._end()
                await asyncio.gather(*lane.tasks, return_exceptions=True)
                try:   # let gRPC finish the cancelled call's status before the loop closes
                    await asyncio.wait_for(lane.call.code(), 1)
                except Exception:   # noqa: BLE001
                    pass
