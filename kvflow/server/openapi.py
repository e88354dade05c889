"""The published schema (/openapi.json) made to say what the server does.

FastAPI documents a 422 for every route with a body, while kvflow answers bad input with 400 and an
OpenAI error body (errors.py); it knows nothing of the answers middlewares give (401, 408, 413, 503).
Routes declare their answers with `responses(...)`; `install_openapi` then drops the 422s and, when
the server has an API key, adds the bearer scheme to every route the key guards.
"""

from __future__ import annotations

from collections.abc import Callable
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from kvflow.server.middleware import PUBLIC_PATHS
from kvflow.server.protocol import ErrorResponse

_ERROR_DESCRIPTIONS = {
    HTTPStatus.BAD_REQUEST: "invalid request: malformed JSON, a wrong type or value (the field is named)",
    HTTPStatus.UNAUTHORIZED: "missing or invalid API key",
    HTTPStatus.NOT_FOUND: "unknown model",
    HTTPStatus.REQUEST_TIMEOUT: "the request body did not arrive in time",
    HTTPStatus.REQUEST_ENTITY_TOO_LARGE: "the request body is too large",
    HTTPStatus.TOO_MANY_REQUESTS: "the waiting queue is full (Retry-After says when to retry)",
    HTTPStatus.INTERNAL_SERVER_ERROR: "processing the request failed",
    HTTPStatus.SERVICE_UNAVAILABLE: "the engine has stopped or the server is shutting down",
}
# What every route behind the body limits and the drain may answer.
_ANY_ROUTE = (HTTPStatus.BAD_REQUEST, HTTPStatus.REQUEST_TIMEOUT, HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
_SECURITY_SCHEME = "bearerAuth"
# One server-sent event, as OpenAPI tools read a text/event-stream body: its `data` is a chunk's JSON
# (the endpoint's response object), an error body, or the final `[DONE]`.
SSE_EVENT_SCHEMA = {
    "type": "object",
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"}},
    "required": ["data"],
}


def responses(*statuses: HTTPStatus, ok: dict[str, Any] | None = None) -> dict[int | str, dict[str, Any]]:
    """A route's `responses=`: its 200 (`ok`, when FastAPI's own is not right) and its error answers,
    each with the OpenAI error body. 401, 500 and 503 are added to every route by `install_openapi`."""
    result: dict[int | str, dict[str, Any]] = {}
    if ok is not None:
        result[200] = ok
    for status in (*_ANY_ROUTE, *statuses):
        result[int(status)] = {"model": ErrorResponse, "description": _ERROR_DESCRIPTIONS[status]}
    return result


def streamed_or_json(model: type[Any], what: str) -> dict[str, Any]:
    """The 200 of a generation route: one JSON body, or server-sent events with `stream: true`."""
    return {
        "model": model,
        "description": f"{what}; with `stream: true`, server-sent events (`data: <chunk>`, `data: [DONE]`)",
        "content": {"text/event-stream": {"schema": SSE_EVENT_SCHEMA}},
    }


def install_openapi(app: FastAPI, protected: bool) -> None:
    """Replace app.openapi with the corrected schema (built once, on first request)."""
    app.openapi = _builder(app, protected)  # type: ignore[method-assign]


def _builder(app: FastAPI, protected: bool) -> Callable[[], dict[str, Any]]:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            _fix(schema, protected)
            app.openapi_schema = schema
        return app.openapi_schema

    return openapi


def _fix(schema: dict[str, Any], protected: bool) -> None:
    error_ref = {"$ref": "#/components/schemas/ErrorResponse"}
    for path, operations in schema.get("paths", {}).items():
        for operation in operations.values():
            answers = operation.setdefault("responses", {})
            answers.pop("422", None)
            statuses = [HTTPStatus.SERVICE_UNAVAILABLE]  # the drain answers every route
            if path not in PUBLIC_PATHS:
                statuses.append(HTTPStatus.INTERNAL_SERVER_ERROR)
                if protected:
                    statuses.append(HTTPStatus.UNAUTHORIZED)
                    operation["security"] = [{_SECURITY_SCHEME: []}]
            for status in statuses:
                answers.setdefault(
                    str(int(status)),
                    {
                        "description": _ERROR_DESCRIPTIONS[status],
                        "content": {"application/json": {"schema": error_ref}},
                    },
                )
    components = schema.setdefault("components", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.get("schemas", {}).pop(name, None)
    if protected:
        components.setdefault("securitySchemes", {})[_SECURITY_SCHEME] = {"type": "http", "scheme": "bearer"}
