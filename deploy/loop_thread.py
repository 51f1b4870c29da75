"""The lifecycle both guards share (:class:`~e3.deploy.guard.Guard` for HTTP, :class:`~e3.deploy.grpc_guard.
GrpcGuard` for gRPC): an asyncio event loop on a thread of its own, started and stopped from any thread, and
the calls in flight per model, which the supervisor may end at once (a model whose stub died).

A subclass provides ``_new_loop()`` (which loop), ``async _start()`` (listen; runs before ``start`` returns,
its exception raised to ``start``'s caller) and ``async _close()`` (after the loop stops), and registers each
call's task under its model in ``_inflight`` while it runs.
"""

from __future__ import annotations

import asyncio
import threading

__all__ = ["LoopThread"]


class LoopThread:
    """An event loop on its own thread, and the calls in flight per model (module docstring)."""

    thread_name = "e3-loop"

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._inflight: dict[str, set[asyncio.Task]] = {}   # model -> calls in flight
        self._aborted: set[asyncio.Task] = set()            # calls ended by abort(), not by their client

    def _new_loop(self) -> asyncio.AbstractEventLoop:
        return asyncio.new_event_loop()

    async def _start(self) -> None:
        raise NotImplementedError

    async def _close(self) -> None:
        raise NotImplementedError

    def start(self):
        """Start the loop's thread and wait until ``_start`` has run (its exception is raised here)."""
        started = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = self._new_loop()
            self._loop = loop
            try:
                loop.run_until_complete(self._start())
            except BaseException as err:  # noqa: BLE001 - reported to start()'s caller
                failure.append(err)
                started.set()
                loop.close()
                return
            started.set()
            loop.run_forever()
            loop.run_until_complete(self._close())
            loop.close()

        self._thread = threading.Thread(target=run, name=self.thread_name, daemon=True)
        self._thread.start()
        started.wait()
        if failure:
            raise failure[0]
        return self

    def stop(self) -> None:
        """Stop the loop (``_close`` runs on its thread) and wait for the thread."""
        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
        self._loop = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def abort(self, model: str) -> int:
        """End every call in flight to ``model`` now (from any thread): each is answered as the subclass answers an
        aborted call (HTTP 503, gRPC UNAVAILABLE). Returns how many there were."""
        if self._loop is None:
            return 0

        async def cancel() -> int:
            tasks = list(self._inflight.get(model, ()))
            for task in tasks:
                self._aborted.add(task)
                task.cancel()
            return len(tasks)

        return asyncio.run_coroutine_threadsafe(cancel(), self._loop).result(timeout=10)
