"""What a request passes through before its route: the x-request-id every answer carries, and the
API-key check of every route but the public probes."""

from __future__ import annotations

import contextlib
import hmac
import uuid
from http import HTTPStatus
from http.cookies import CookieError, SimpleCookie
from urllib.parse import parse_qs

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvflow.server.errors import APIError, error_response

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


# Reached without the API key: liveness and metrics (load balancers and scrapers send none), and the
# API's own description.
PUBLIC_PATHS = frozenset({"/health", "/version", "/metrics", "/openapi.json", "/docs", "/redoc"})
# Under /dashboard the key may also come as a query parameter or a cookie: a browser's EventSource
# cannot send an Authorization header (server/dashboard/routes.py sets the cookie).
DASHBOARD_PREFIX = "/dashboard"
DASHBOARD_KEY_PARAM = "api_key"
DASHBOARD_COOKIE = "kvflow_dashboard_key"


class ApiKeyMiddleware:
    """401 unless `Authorization: Bearer <key>` matches the server's key, on every path but
    PUBLIC_PATHS. A middleware rather than a route dependency: it runs before the body is received
    or parsed, so a client without the key cannot make the server read megabytes first. The scheme
    is case-insensitive (RFC 7235: `bearer` is `Bearer`); a 401 says how to authenticate
    (`WWW-Authenticate: Bearer`, RFC 6750)."""

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.api_key is None or scope["path"] in PUBLIC_PATHS:
            await self.app(scope, receive, send)
            return
        given = _header(scope, b"authorization")
        if given is None and _header(scope, b"x-api-key") is not None:  # the anthropic client's header
            given = f"Bearer {_header(scope, b'x-api-key')}"
        if given is None and _is_dashboard(scope["path"]):
            dashboard_key = _dashboard_key(scope)
            given = None if dashboard_key is None else f"Bearer {dashboard_key}"
        if given is None:
            await _unauthorized("missing API key", 'Bearer realm="kvflow"', scope["path"])(
                scope, receive, send
            )
            return
        scheme, _, token = given.strip().partition(" ")
        # Constant-time comparison: the time taken must not tell how many leading characters matched.
        matches = hmac.compare_digest(token.strip().encode(), self.api_key.encode())
        if scheme.lower() != "bearer" or not matches:
            await _unauthorized("invalid API key", 'Bearer error="invalid_token"', scope["path"])(
                scope, receive, send
            )
            return
        await self.app(scope, receive, send)


def _is_dashboard(path: str) -> bool:
    return path == DASHBOARD_PREFIX or path.startswith(DASHBOARD_PREFIX + "/")


def _dashboard_key(scope: Scope) -> str | None:
    """The key of a dashboard request: its `api_key` query parameter, else its cookie."""
    query = parse_qs(bytes(scope.get("query_string", b"")).decode("latin-1"))
    if query.get(DASHBOARD_KEY_PARAM):
        return query[DASHBOARD_KEY_PARAM][0]
    cookies = SimpleCookie()
    with contextlib.suppress(CookieError):
        cookies.load(_header(scope, b"cookie") or "")
    morsel = cookies.get(DASHBOARD_COOKIE)
    return None if morsel is None else morsel.value


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key == name:
            return bytes(value).decode("latin-1")
    return None


def _unauthorized(what: str, challenge: str, path: str) -> JSONResponse:
    error = APIError(
        HTTPStatus.UNAUTHORIZED,
        f"{what}: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')",
        code="invalid_api_key",
        headers={"WWW-Authenticate": challenge},
    )
    return error_response(error, path)
