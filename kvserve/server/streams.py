"""One HTTP request may be several engine requests (a batch of prompts). ``EngineStreams``
runs them as one: all admitted or none, their outputs merged as they arrive, and every one
aborted (its KV blocks freed) at the engine's next step boundary once the HTTP request is abandoned.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Optional, Union

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from kvserve.request import EngineBusy, RequestOutput, SamplingParams
from kvserve.server.errors import from_rejection

_DONE = object()


class AdmissionGate:
    """Server-side back-pressure: refuse new requests while ``limit`` sequences wait.

    Jobs handed to a pump that has not run yet have not reached the engine's queue; they
    are counted too, so a burst of requests within one event-loop turn cannot overshoot."""

    def __init__(self, limit: int, engine_waiting: Callable[[], int]) -> None:
        self.limit = limit
        self._engine_waiting = engine_waiting
        self.in_transit = 0

    def admit(self, num_sequences: int) -> None:
        waiting = self._engine_waiting() + self.in_transit
        if waiting >= self.limit:
            # An APIError, not EngineBusy: the server refuses it, so the server counts it.
            raise from_rejection(EngineBusy(f"too many waiting requests ({waiting} waiting, "
                                            f"max_waiting_requests={self.limit}); retry later"))
        self.in_transit += num_sequences

    def arrived(self, num_sequences: int) -> None:
        self.in_transit -= num_sequences


class ClientDisconnected(Exception):
    pass


@dataclass
class EngineJob:
    prompt: Union[str, list[int]]
    params: SamplingParams
    request_id: str


async def wait_for_disconnect(request: Request) -> None:
    """Return once the client has gone away. Only for requests whose body has been read and
    whose response is not a StreamingResponse (which listens for the disconnect itself)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class EngineStreams:
    def __init__(self, async_engine, jobs: list[EngineJob],
                 raw_request: Optional[Request] = None,
                 gate: Optional[AdmissionGate] = None) -> None:
        self._engine = async_engine
        self._jobs = jobs
        self._raw_request = raw_request
        self._gate = gate
        self._in_transit: set[int] = set()  # jobs admitted by the gate, not yet submitted
        self._queue: asyncio.Queue = asyncio.Queue()
        self._pumps: list[asyncio.Task] = []
        self._watcher: Optional[asyncio.Task] = None
        self._primed: list[tuple[int, RequestOutput]] = []
        self._open = len(jobs)
        self._closed = False

    # ------------------------------------------------------------------ admission
    async def start(self) -> None:
        """Submit every job and wait for each one's first output. The engine refuses a
        request (RequestRejected / EngineBusy) before its first output, so once this returns
        all were admitted, and a refusal surfaces here, before any response is sent; the
        jobs already admitted are then aborted."""
        if self._gate is not None:
            self._gate.admit(sum(job.params.n for job in self._jobs))
            self._in_transit = set(range(len(self._jobs)))
        if self._raw_request is not None:
            self._watcher = asyncio.ensure_future(wait_for_disconnect(self._raw_request))
        for index, job in enumerate(self._jobs):
            self._pumps.append(asyncio.ensure_future(self._pump(index, job)))
        waiting = set(range(len(self._jobs)))
        try:
            while waiting:
                index, item = await self._next()
                if isinstance(item, BaseException):
                    raise item
                if item is _DONE:  # finished without any output: nothing to wait for
                    waiting.discard(index)
                    self._open -= 1
                    continue
                waiting.discard(index)
                self._primed.append((index, item))
        except BaseException:
            await self.close()
            raise

    def stop_watching_disconnect(self) -> None:
        """Hand disconnect detection over to the StreamingResponse (two readers of the ASGI
        receive channel would steal each other's messages)."""
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None

    # ------------------------------------------------------------------ outputs
    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(job index, output) in arrival order until every job has finished."""
        try:
            while self._primed:
                yield self._primed.pop(0)
            while self._open > 0:
                index, item = await self._next()
                if item is _DONE:
                    self._open -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield index, item
        finally:
            await self.close()

    def _arrived(self, index: int) -> None:
        if index in self._in_transit:
            self._in_transit.discard(index)
            self._gate.arrived(self._jobs[index].params.n)

    async def _pump(self, index: int, job: EngineJob) -> None:
        # No await between here and the engine's add_request (the generator's first step).
        self._arrived(index)
        try:
            async for output in self._engine.generate(job.prompt, job.params, job.request_id):
                self._queue.put_nowait((index, output))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._queue.put_nowait((index, exc))
            return
        self._queue.put_nowait((index, _DONE))

    async def _next(self) -> tuple[int, object]:
        if self._watcher is None:
            return await self._queue.get()
        getter = asyncio.ensure_future(self._queue.get())
        done, _ = await asyncio.wait({getter, self._watcher}, return_when=asyncio.FIRST_COMPLETED)
        if getter in done:
            return getter.result()
        getter.cancel()
        raise ClientDisconnected()

    async def close(self) -> None:
        """Abort whatever is still running: cancelling a pump closes its engine generator,
        whose clean-up queues the abort (blocks freed at the next step boundary)."""
        if self._closed:
            return
        self._closed = True
        self.stop_watching_disconnect()
        for index in list(self._in_transit):  # pumps cancelled before they ever ran
            self._arrived(index)
        pending = [t for t in self._pumps if not t.done()]
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)


class SSEResponse(StreamingResponse):
    """Server-sent events whose engine requests are aborted however the response ends,
    even when the client is gone before the body iterator first runs."""

    def __init__(self, streams: EngineStreams, events: AsyncIterator[str]) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._streams = streams

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._streams.close()


async def respond(streams: EngineStreams, writer, stream: bool) -> Response:
    """Start the engine requests, then answer as an SSE stream or one JSON body (``writer``
    has ``events(streams)`` and ``collect(streams)``). A client gone before the answer gets
    499, "client closed request": its requests are already aborted."""
    try:
        await streams.start()
        if stream:
            streams.stop_watching_disconnect()
            return SSEResponse(streams, writer.events(streams))
        return await writer.collect(streams)
    except ClientDisconnected:
        return Response(status_code=499)
