"""Async front of the engine used by the server: one engine thread steps the engine while
there is work; each request has its own asyncio queue of outputs.

The engine itself is single-threaded; a lock serialises add/abort (from the event loop) with
step (from the engine thread). Abort takes effect at once: blocks are freed before it returns.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from typing import AsyncIterator, Callable, Optional, Union

from kvserve.engine import LLMEngine
from kvserve.executor.base import ExecutorError
from kvserve.request import RequestOutput, SamplingParams

logger = logging.getLogger("kvserve")


class EngineDeadError(RuntimeError):
    pass


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine,
                 on_dead: Optional[Callable[[str], None]] = None) -> None:
        self.engine = engine
        # Set when the model can no longer run (a parallel worker died or hung): requests
        # in flight fail, new ones are refused, and ``on_dead(reason)`` lets the server exit.
        self.dead_reason: Optional[str] = None
        self._on_dead = on_dead
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread: Optional[threading.Thread] = None
        self._stopping = False

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self._thread is not None:
            return
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="kvserve-engine", daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        """Whether the engine loop thread is alive (the server's /health reads this)."""
        return self._thread is not None and self._thread.is_alive()

    def shutdown(self) -> None:
        self._stopping = True
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def _loop(self) -> None:
        while not self._stopping:
            with self._lock:
                busy = self.engine.has_unfinished_requests()
            if not busy:
                self._wakeup.wait(timeout=0.5)
                self._wakeup.clear()
                continue
            try:
                with self._lock:
                    outputs = self.engine.step()
            except ExecutorError as exc:  # the model is gone: no later step can succeed
                logger.error("engine stopped: %s", exc)
                self.dead_reason = str(exc)
                self._fail_all(exc)
                if self._on_dead is not None:
                    self._on_dead(self.dead_reason)
                return
            except Exception as exc:  # one failing step must not kill the server
                logger.exception("engine step failed; aborting the requests in flight")
                self._fail_all(exc)
                continue
            for out in outputs:
                self._deliver(out.request_id, out)

    def _deliver(self, request_id: str, item: Union[RequestOutput, Exception]) -> None:
        entry = self._queues.get(request_id)
        if entry is None:
            return
        loop, queue = entry
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the client's loop is gone
            pass

    def _fail_all(self, exc: Exception) -> None:
        with self._lock:
            ids = list(self._queues)
            self.engine.abort_request(ids)
            self.engine.step()  # flush the aborted outputs out of the engine
        for rid in ids:
            self._deliver(rid, EngineDeadError(f"engine step failed: {exc}"))

    def shutdown_engine(self) -> None:
        """Stop the loop and the engine's worker processes."""
        self.shutdown()
        self.engine.shutdown()

    # ------------------------------------------------------------------ requests
    async def generate(self, prompt: Union[str, list[int]], params: SamplingParams,
                       request_id: Optional[str] = None) -> AsyncIterator[RequestOutput]:
        """Stream outputs of one request. Raises RequestRejected before the first output if
        the request can't be served. Leaving the iterator early aborts the request."""
        if self.dead_reason is not None:
            raise EngineDeadError(f"engine stopped: {self.dead_reason}")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            request_id = request_id or self.engine.new_request_id()
            self._queues[request_id] = (loop, queue)
            try:
                self.engine.add_request(request_id, prompt, params)
            except Exception:
                self._queues.pop(request_id, None)
                raise
        self._wakeup.set()
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                if item.finished:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self.engine.abort_request(request_id)
        self._wakeup.set()

    def stats(self) -> dict:
        with self._lock:
            return self.engine.stats()

    def call(self, fn, *args, **kwargs):
        """Run ``fn(engine, ...)`` under the engine lock (tokenize, detokenize...)."""
        with self._lock:
            return fn(self.engine, *args, **kwargs)
