"""The HTTP connection protocol: uvicorn's h11 protocol plus a deadline on each request's headers.

uvicorn times out a connection only while it idles between two requests (keep-alive). A client that
connects and sends nothing, or half its headers and then nothing (slowloris), holds its connection,
and one of `--max-connections`, forever. Here every connection must deliver a complete request head
within `client_timeout_s` of connecting, or of its previous response; otherwise it is closed (no
response is possible before a request head). The body's own deadline is enforced by limits.py.

Pinned to h11 (uvicorn's pure-Python protocol, always installed) rather than `http="auto"`, which
would pick httptools when present: the deadline hooks into h11_impl's event handling.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)


class HeaderDeadlineH11Protocol(H11Protocol):
    """Subclassed per server by `header_deadline_protocol` (the timeout is a class attribute)."""

    header_timeout_s: float = 30.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_deadline()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        if self._awaiting_request_head():
            return
        self._disarm_header_deadline()  # a request head arrived: its body has limits.py's deadline

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_header_deadline()  # the next request on this connection gets its own deadline

    def _awaiting_request_head(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm_header_deadline(self) -> None:
        self._disarm_header_deadline()
        self._header_deadline = self.loop.call_later(self.header_timeout_s, self._on_header_deadline)

    def _disarm_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _on_header_deadline(self) -> None:
        self._header_deadline = None
        if self._awaiting_request_head() and not self.transport.is_closing():
            logger.info("closing a connection that sent no complete request in %g s", self.header_timeout_s)
            self.transport.close()


def header_deadline_protocol(timeout_s: float) -> type[HeaderDeadlineH11Protocol]:
    """The protocol class to give uvicorn.Config(http=...), with this server's deadline."""
    return type("HeaderDeadlineH11Protocol", (HeaderDeadlineH11Protocol,), {"header_timeout_s": timeout_s})
