"""What a request passes through before its route: the x-request-id every answer carries, and the
API-key check of the protected routes."""

from __future__ import annotations

import hmac
import uuid
from collections.abc import Awaitable, Callable
from http import HTTPStatus

from fastapi import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvflow.server.errors import APIError
from kvflow.server.serving import ServingContext

REQUEST_ID_HEADER = "x-request-id"


class RequestIdMiddleware:
    """Every response carries `x-request-id`: the client's, or a fresh one. A plain ASGI middleware
    (not BaseHTTPMiddleware) so that streaming responses and disconnects pass through untouched."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers", []))
        given = headers.get(REQUEST_ID_HEADER.encode(), b"").decode("latin-1")
        request_id = given or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                message["headers"] = [
                    *message["headers"],
                    (REQUEST_ID_HEADER.encode(), request_id.encode("latin-1")),
                ]
            await send(message)

        await self.app(scope, receive, send_with_id)


def api_key_check(ctx: ServingContext) -> Callable[[Request], Awaitable[None]]:
    """The FastAPI dependency of protected routes: 401 unless `Authorization: Bearer <key>` matches the
    server's key (everything passes when the server has none)."""

    async def check_api_key(request: Request) -> None:
        if ctx.api_key is None:
            return
        given = request.headers.get("authorization", "")
        expected = f"Bearer {ctx.api_key}"
        # Constant-time comparison: the time taken must not tell how many leading characters matched.
        if not hmac.compare_digest(given.encode(), expected.encode()):
            message = "missing API key" if not given else "invalid API key"
            raise APIError(
                HTTPStatus.UNAUTHORIZED,
                f"{message}: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
            )

    return check_api_key
