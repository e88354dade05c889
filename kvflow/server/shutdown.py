"""Graceful shutdown: on SIGINT/SIGTERM, drain, then end what is left properly, then exit.

1. Drain: the listening socket stays open and every new request is answered 503 (`Connection:
   close`), so clients and load balancers see "shutting down", not a connection reset. Requests in
   flight keep running for `grace_s` (--shutdown-grace-seconds), or until none is left.
2. Cut: every engine request still unfinished is aborted. Their streams receive a final chunk with
   finish_reason "abort" and then `data: [DONE]` (a non-streamed request gets its response with
   finish_reason "abort"), and the log says how many were cut. At most CUT_FLUSH_S later, however
   far the responses got, the server exits as uvicorn does: sockets closed, lifespan (engine) stopped.

A second signal ends the grace period at once (the cut still happens); a third SIGINT forces exit as
uvicorn does. uvicorn's own handling would close the socket first (new clients: connection refused)
and cancel the streams still running after its timeout (no final event: "peer closed connection
without sending complete message body").
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from http import HTTPStatus
from types import FrameType

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from kvflow.engine.async_engine import AsyncLLMEngine
from kvflow.server.errors import APIError, error_response

logger = logging.getLogger(__name__)

# After the cut, how long the aborted requests' final chunks get to reach their clients.
CUT_FLUSH_S = 5.0


@dataclass
class DrainState:
    """Shared by the middleware (per request) and the server (per 0.1 s tick), both on the event loop."""

    draining: bool = False
    num_in_flight: int = 0  # HTTP requests inside the app (a stream counts until its last byte)


class DrainMiddleware:
    """Counts the requests in flight; answers 503 to new ones once the server drains."""

    def __init__(self, app: ASGIApp, state: DrainState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.state.draining:
            error = APIError(
                HTTPStatus.SERVICE_UNAVAILABLE,
                "the server is shutting down: retry on another replica or after it restarts",
                headers={"Connection": "close"},
            )
            await error_response(error, scope["path"])(scope, receive, send)
            return
        self.state.num_in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.num_in_flight -= 1


class DrainingServer(uvicorn.Server):
    """uvicorn's server with the shutdown sequence of the module docstring."""

    def __init__(
        self, config: uvicorn.Config, state: DrainState, engine: AsyncLLMEngine, grace_s: float
    ) -> None:
        super().__init__(config)
        self.drain = state
        self.engine = engine
        self.grace_s = grace_s
        self._signal: int | None = None  # the first signal, handed to uvicorn when the drain is over
        self._grace_ends = 0.0
        self._cut_at: float | None = None
        self._num_cut = 0
        self._failed_at: float | None = None  # when the engine was seen to have failed
        self.exit_code = 0  # the process's exit status once the server has stopped

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.started or self.should_exit or self._cut_at is not None:
            super().handle_exit(sig, frame)  # before serving, or past the cut: uvicorn's way
            return
        if self._signal is None:
            self._signal = sig
            self._grace_ends = time.monotonic() + self.grace_s
            self.drain.draining = True
        else:
            self._grace_ends = time.monotonic()  # a second signal: no more grace

    async def on_tick(self, counter: int) -> bool:
        if await super().on_tick(counter):
            return True
        if self._engine_failed():
            return True
        if self._signal is None or not self._drain_done():
            return False
        if self._num_cut:
            logger.warning(
                "shutdown: %d request(s) still running after the %.3g s grace period were ended "
                "(finish_reason abort)",
                self._num_cut,
                self.grace_s,
            )
        super().handle_exit(self._signal, None)
        return True

    def _engine_failed(self) -> bool:
        """The engine can serve no more (a tensor-parallel rank died): once the requests in flight
        have received their error (or CUT_FLUSH_S passed), exit with status 1 (`exit_code`)."""
        fatal = self.engine.fatal_error
        if fatal is None:
            return False
        now = time.monotonic()
        if self._failed_at is None:
            self._failed_at = now
            self.drain.draining = True  # new requests: 503
            logger.error("the engine stopped (%s): the server exits", fatal)
        if self.drain.num_in_flight and now - self._failed_at < CUT_FLUSH_S:
            return False
        self.exit_code = 1
        self.should_exit = True
        return True

    def _drain_done(self) -> bool:
        now = time.monotonic()
        if self.drain.num_in_flight == 0:
            return True
        if self._cut_at is None:
            if now < self._grace_ends:
                return False
            self._cut_at = now
            self._num_cut = self.drain.num_in_flight
            logger.info("shutdown: ending %d request(s) still in flight", self._num_cut)
            self.engine.abort_all()
            return False
        return now - self._cut_at >= CUT_FLUSH_S
