"""Graceful shutdown: on SIGTERM (or Ctrl-C) the server stops admitting work (503 with
``Retry-After``), lets the requests in flight finish for up to ``--shutdown-timeout`` seconds,
aborts the rest (their streams end with finish reason "abort"), then exits with status 0.

uvicorn's own shutdown closes the listening socket at once, so a client would only see a
refused connection, and cuts the streams still running after its graceful timeout. Here the
socket stays open while draining, so that a client is told why and when to come back.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

import uvicorn
from starlette.responses import JSONResponse

from kvserve.server.errors import RETRY_AFTER_SECONDS, error_body

logger = logging.getLogger("kvserve")

# How long aborted streams get to send their last chunk before uvicorn closes connections.
_ABORT_FLUSH_S = 5.0


class DrainState:
    """HTTP requests in flight under /v1/ and /tokenize, and whether the server is draining."""

    def __init__(self) -> None:
        self.draining = False
        self.in_flight = 0


class DrainMiddleware:
    """Counts the work requests in flight (a streamed answer until its last byte) and, while
    draining, answers new ones 503 with ``Retry-After``. Plain ASGI: it must not wrap
    ``receive``, which streaming responses use to notice a client going away."""

    def __init__(self, app, state: DrainState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS" \
                or not scope["path"].startswith(("/v1/", "/tokenize", "/detokenize")):
            return await self.app(scope, receive, send)
        if self.state.draining:
            response = JSONResponse(
                error_body("the server is shutting down; retry on another instance or later",
                           type="server_error", code="shutting_down"),
                status_code=503, headers={"Retry-After": str(RETRY_AFTER_SECONDS),
                                          "Connection": "close"})
            return await response(scope, receive, send)
        self.state.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.in_flight -= 1


class DrainingServer(uvicorn.Server):
    """uvicorn whose first exit signal drains (see the module docstring); a second one
    exits at once, as uvicorn's own second Ctrl-C does."""

    def __init__(self, config: uvicorn.Config, state: DrainState, timeout_s: float,
                 abort_all: Callable[[], list]) -> None:
        super().__init__(config)
        self._state = state
        self._timeout_s = timeout_s
        self._abort_all = abort_all
        self._drainer: Optional[threading.Thread] = None

    def handle_exit(self, sig, frame) -> None:
        # Not recorded in _captured_signals: uvicorn would re-raise it after serving, and the
        # process would die of the signal instead of exiting 0 after a clean drain.
        if self._drainer is not None or self.should_exit:
            self.should_exit = True
            self.force_exit = True
            return
        self._state.draining = True
        logger.info("shutting down: refusing new requests; waiting up to %.0f s for %d in flight",
                    self._timeout_s, self._state.in_flight)
        self._drainer = threading.Thread(target=self._drain, name="kvserve-drain", daemon=True)
        self._drainer.start()

    def _drain(self) -> None:
        if not _wait_for(lambda: self._state.in_flight == 0, self._timeout_s):
            ids = self._abort_all()
            logger.warning("shutdown timeout (%.0f s) reached: aborted %d request(s)",
                           self._timeout_s, len(ids))
            _wait_for(lambda: self._state.in_flight == 0, _ABORT_FLUSH_S)
        self.should_exit = True


def _wait_for(predicate: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True
