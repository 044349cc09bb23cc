"""Async front of the engine used by the server: one engine thread steps the engine while
there is work; each request has its own asyncio queue of outputs.

The engine itself is single-threaded, and a step can take long (a prefill, a real model).
So the event loop never waits for it: adds and aborts are queued (a thread-safe queue) and
the engine thread applies them at the next step boundary, where an abort frees the request's
blocks (a closed stream runs at most the one step in flight); an embedding is computed there
too, so the model only ever runs on the engine thread. What the server reads while
the engine steps (/metrics, the admission gate) is a snapshot of ``engine.stats()`` the engine
thread takes after applying commands and after each step. The lock serialises the engine
thread with ``call`` (tokenizing from worker threads), never with the event loop.
"""
from __future__ import annotations

import asyncio
import logging
import queue as queue_module
import threading
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Optional, Union

from kvserve.engine import LLMEngine
from kvserve.pooling import EmbeddingOutput
from kvserve.executor.base import ExecutorError
from kvserve.request import RequestOutput, SamplingParams

logger = logging.getLogger("kvserve")


class EngineDeadError(RuntimeError):
    pass


@dataclass
class _Add:
    request_id: str
    prompt: Union[str, list[int]]
    params: SamplingParams


@dataclass
class _Embed:
    prompt: Union[str, list[int]]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future


@dataclass
class _Abort:
    request_id: str
    flush: bool = False  # a server-side abort: deliver the aborted output to its stream


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
        # Commands from the event loop, applied by the engine thread between steps.
        self._commands: "queue_module.SimpleQueue[Union[_Add, _Abort, _Embed]]" = queue_module.SimpleQueue()
        # Sequences queued to be added: the admission gate counts them as waiting until a
        # snapshot that includes them is taken.
        self._pending_sequences = 0
        self._pending_lock = threading.Lock()  # both threads update the count; held for an add
        self._snapshot: dict = engine.stats()

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
            try:
                self._apply_commands()
                with self._lock:
                    busy = self.engine.has_unfinished_requests()
                if not busy:
                    self._wakeup.wait(timeout=0.5)
                    self._wakeup.clear()
                    continue
                self._step()
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

    def _step(self) -> None:
        with self._lock:
            outputs = self.engine.step()
            # Before delivering: a client that has its last output sees it counted.
            self._snapshot = self.engine.stats()
        for out in outputs:
            self._deliver(out.request_id, out)

    def _apply_commands(self) -> None:
        """Apply the queued adds and aborts (in their order); a refused add is delivered to
        its stream as the exception."""
        added = applied = 0
        flush = False
        with self._lock:
            while True:
                try:
                    command = self._commands.get_nowait()
                except queue_module.Empty:
                    break
                applied += 1
                if isinstance(command, _Abort):
                    self.engine.abort_request(command.request_id)
                    flush |= command.flush
                    continue
                if isinstance(command, _Embed):
                    self._embed(command)
                    continue
                added += command.params.n
                try:
                    self.engine.add_request(command.request_id, command.prompt, command.params)
                except Exception as exc:
                    self._deliver(command.request_id, exc)
            if applied:  # a scrape sees an aborted request gone (and its blocks back) at once
                self._snapshot = self.engine.stats()
        with self._pending_lock:
            self._pending_sequences -= added
        if flush:  # the aborted outputs come out of the next step
            self._step()

    def _embed(self, command: _Embed) -> None:
        """Compute an embedding here, on the engine thread between steps (the model runs on
        one thread), and resolve the caller's future with it or with the refusal."""
        try:
            result: Union[EmbeddingOutput, Exception] = self.engine.embed(command.prompt)
        except Exception as exc:  # RequestRejected: the caller's 400; anything else its 500
            result = exc

        def resolve() -> None:
            if command.future.done():  # the caller went away
                return
            if isinstance(result, Exception):
                command.future.set_exception(result)
            else:
                command.future.set_result(result)
        try:
            command.loop.call_soon_threadsafe(resolve)
        except RuntimeError:  # the caller's loop is gone
            pass

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
            self._snapshot = self.engine.stats()
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
        # (a C-level counter: safe without the engine lock)
        request_id = request_id or self.engine.new_request_id()
        self._queues[request_id] = (loop, queue)
        with self._pending_lock:
            self._pending_sequences += params.n
        self._commands.put(_Add(request_id, prompt, params))
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

    async def embed(self, prompt: Union[str, list[int]]) -> EmbeddingOutput:
        """The prompt's embedding (``LLMEngine.embed``), computed by the engine thread at its
        next step boundary: the event loop never waits for the model. Raises RequestRejected
        for a prompt the model cannot take."""
        if self.dead_reason is not None:
            raise EngineDeadError(f"engine stopped: {self.dead_reason}")
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._commands.put(_Embed(prompt, loop, future))
        self._wakeup.set()
        return await future

    def abort(self, request_id: str, flush: bool = False) -> None:
        """Queue an abort; the engine thread applies it (and frees the blocks) at the next
        step boundary. ``flush``: the request's stream still listens and gets its final
        (aborted) output."""
        self._commands.put(_Abort(request_id, flush))
        self._wakeup.set()

    def abort_all(self) -> list[str]:
        """Abort every request in flight (graceful shutdown past its timeout); their streams
        end with finish reason "abort"."""
        ids = list(self._queues)
        for request_id in ids:
            self.abort(request_id, flush=True)
        return ids

    @property
    def num_in_flight(self) -> int:
        """Requests with a listening stream (added, not yet finished)."""
        return len(self._queues)

    def stats(self) -> dict:
        """``engine.stats()`` as of the last step boundary: read without the lock, so that
        /metrics never waits for a step. The KV transfer figures are read live (they change on
        the connector's threads, also while no step runs)."""
        return {**self._snapshot, **self.engine.transfer_stats_now()}

    @property
    def num_waiting(self) -> int:
        """Sequences waiting to run, counting those queued but not added yet."""
        return self._snapshot["num_waiting"] + self._pending_sequences

    def call(self, fn, *args, **kwargs):
        """Run ``fn(engine, ...)`` under the engine lock (tokenize, detokenize...)."""
        with self._lock:
            return fn(self.engine, *args, **kwargs)
