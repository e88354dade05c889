"""What one HTTP request may ask of the server, enforced before any of its work starts.

- Its body: at most `max_body_bytes` (413), fully received within `client_timeout_s` (408). The
  body is read here, before the route parses it: a declared Content-Length over the limit is refused
  before a byte of the body is stored, and an undeclared (chunked) one as soon as it passes the limit.
  A parsed JSON body costs tens of times its size in memory, so this bound is a memory bound too.
- Its fan-out: prompts x n engine requests, at most `max_choices` (400, stated in the error): one
  request of 100 prompts x n=128 would otherwise queue 12,800 engine requests ahead of everyone.

The request's headers have their own deadline at the connection level (connections.py).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from http import HTTPStatus

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvflow.config import ServerConfig
from kvflow.server.errors import APIError, error_response

# A body refused for its size is still read (and dropped, never stored) for at most this many bytes
# before the 413 is sent: a client that is still uploading when the server answers and closes sees a
# broken pipe instead of the 413 (httpx and requests only read the answer after sending everything).
MAX_DISCARDED_BODY_BYTES = 256 * 1024**2


@dataclass(frozen=True)
class RequestLimits:
    max_body_bytes: int = ServerConfig.max_request_body_bytes
    client_timeout_s: float = ServerConfig.client_timeout_s
    max_choices: int = ServerConfig.max_choices_per_request

    @classmethod
    def from_config(cls, config: ServerConfig) -> RequestLimits:
        return cls(config.max_request_body_bytes, config.client_timeout_s, config.max_choices_per_request)

    def check_choices(self, num_prompts: int, n: int) -> None:
        """400 when prompts x n engine requests are more than one request may ask for."""
        if num_prompts * n > self.max_choices:
            raise APIError(
                HTTPStatus.BAD_REQUEST,
                f"this request asks for {num_prompts * n} completions ({num_prompts} prompt(s) x n={n}); "
                f"one request may ask for at most {self.max_choices} (--max-choices-per-request): "
                "split it into several requests",
                param="n" if num_prompts == 1 else "prompt",
            )


class BodyLimitMiddleware:
    """Receives the whole body within the limits, then hands the app a `receive` that replays it
    (and afterwards passes the client's later messages through: the disconnect a route waits for)."""

    def __init__(self, app: ASGIApp, limits: RequestLimits) -> None:
        self.app = app
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _header_int(scope, b"content-length")
        if declared is not None and declared > self.limits.max_body_bytes:
            # A client that asked `Expect: 100-continue` (curl does past 1 MB) waits for our go-ahead
            # before uploading: answer at once. Receiving would send the "100 Continue".
            if _header(scope, b"expect") != b"100-continue":
                await _discard_body(receive, time.monotonic() + self.limits.client_timeout_s)
            await self._too_large(scope, receive, send, f" ({declared} bytes)")
            return
        try:
            body = await self._read_body(receive)
        except _BodyTooLarge:
            await self._too_large(scope, receive, send, "")
            return
        except _ClientGone:
            return
        except asyncio.TimeoutError:  # TimeoutError itself only from Python 3.11
            message = f"the request body did not arrive within {self.limits.client_timeout_s:g} s"
            await error_response(APIError(HTTPStatus.REQUEST_TIMEOUT, message), scope["path"])(
                scope, receive, send
            )
            return
        await self.app(scope, _replay(body, receive), send)

    async def _read_body(self, receive: Receive) -> bytes:
        deadline = time.monotonic() + self.limits.client_timeout_s
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await _receive_before(receive, deadline)
            if message["type"] == "http.disconnect":
                raise _ClientGone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limits.max_body_bytes:
                await _discard_body(receive, deadline, size)
                raise _BodyTooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send, size: str) -> None:
        message = (
            f"the request body{size} is larger than this server accepts ({self.limits.max_body_bytes} "
            "bytes, --max-request-body-bytes): send fewer or shorter prompts"
        )
        response = error_response(APIError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, message), scope["path"])
        response.headers["connection"] = "close"
        await response(scope, receive, send)


class _BodyTooLarge(Exception):
    pass


class _ClientGone(Exception):
    pass


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", []):
        if key == name:
            return bytes(value).lower()
    return None


def _header_int(scope: Scope, name: bytes) -> int | None:
    value = _header(scope, name)
    try:
        return None if value is None else int(value)
    except ValueError:
        return None  # the HTTP parser has already refused a malformed Content-Length


async def _receive_before(receive: Receive, deadline: float) -> Message:
    return await asyncio.wait_for(receive(), timeout=max(0.0, deadline - time.monotonic()))


async def _discard_body(receive: Receive, deadline: float, size: int = 0) -> None:
    """Read and drop the rest of a refused body (see MAX_DISCARDED_BODY_BYTES), within the deadline."""
    try:
        while size <= MAX_DISCARDED_BODY_BYTES:
            message = await _receive_before(receive, deadline)
            size += len(message.get("body", b""))
            if message["type"] == "http.disconnect" or not message.get("more_body", False):
                return
    except asyncio.TimeoutError:  # TimeoutError itself only from Python 3.11
        return


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
