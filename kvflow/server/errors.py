"""OpenAI-style error bodies and the mapping from kvflow's exceptions to HTTP status codes.

Every error answer is `{"error": {"message", "type", "param", "code"}}` with the status below:
    400  malformed JSON, a wrong type or value (the field is named), prompt + max_tokens > context,
         more work than one request may ask for (prompts x n)
    401  missing or wrong API key (when the server has one), with `WWW-Authenticate: Bearer`
    404  unknown model name, unknown route
    405  a known route with the wrong method
    408  the client did not send its request body in time (`--client-timeout-seconds`)
    413  the request body is larger than `--max-request-body-bytes`
    429  the waiting queue is full (`--max-waiting`), with a Retry-After header
    500  one request's processing failed inside the engine (the others keep being served)
    503  the engine has stopped, or the server is shutting down
    499  (nginx's "client closed request") the client left before a non-streamed answer was ready;
         nobody receives it, but access logs show it for what it was
Bodies are written with every non-ASCII character escaped, so that a message quoting the request
(a model name holding a lone surrogate) can always be encoded.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from http import HTTPStatus
from typing import Any

from fastapi.responses import JSONResponse

from kvflow.engine.async_engine import EngineDeadError
from kvflow.errors import EngineOverloadedError, InvalidRequestError, RequestFailedError
from kvflow.server.anthropic_protocol import ANTHROPIC_PATH_PREFIX, anthropic_error_body

logger = logging.getLogger(__name__)

# Seconds a client told 429 should wait: about one engine step's worth of queue drain on small
# models; clients (the openai library included) back off exponentially from it.
RETRY_AFTER_S = 1
CLIENT_CLOSED_REQUEST = 499

_ERROR_TYPES = {
    HTTPStatus.BAD_REQUEST: "invalid_request_error",
    HTTPStatus.UNAUTHORIZED: "authentication_error",
    HTTPStatus.NOT_FOUND: "invalid_request_error",
    HTTPStatus.METHOD_NOT_ALLOWED: "invalid_request_error",
    HTTPStatus.REQUEST_TIMEOUT: "invalid_request_error",
    HTTPStatus.REQUEST_ENTITY_TOO_LARGE: "invalid_request_error",
    HTTPStatus.TOO_MANY_REQUESTS: "rate_limit_error",
    HTTPStatus.INTERNAL_SERVER_ERROR: "server_error",
    HTTPStatus.SERVICE_UNAVAILABLE: "service_unavailable",
}
# Parts of a pydantic error location that name a member of a union, not a field: "str",
# "list[int]", "function-after[_unicode(), str]", "constrained-int".
_UNION_TAG_NAMES = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "json-or-python"})
_UNION_TAG_PREFIXES = ("function-", "constrained-", "tagged-union")


class APIError(Exception):
    """An error with its HTTP status, raised by the serving layer and rendered by `error_response`."""

    def __init__(
        self,
        status: HTTPStatus,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}


def error_body(
    status: HTTPStatus, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": _ERROR_TYPES.get(status, "server_error"),
            "param": param,
            "code": code if code is not None else int(status),
        }
    }


class ErrorJSONResponse(JSONResponse):
    """JSONResponse with non-ASCII escaped: Starlette's writes raw UTF-8, which fails (a 500 from the
    error handler itself) when the message quotes a lone surrogate from the request."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, allow_nan=False, separators=(",", ":")).encode("ascii")


def error_response(error: APIError, path: str = "") -> JSONResponse:
    """The error in the shape of the API `path` belongs to: Anthropic's for /v1/messages, else OpenAI's."""
    if path.startswith(ANTHROPIC_PATH_PREFIX):
        body = anthropic_error_body(error.status, error.message)
    else:
        body = error_body(error.status, error.message, error.param, error.code)
    return ErrorJSONResponse(body, status_code=int(error.status), headers=error.headers)


def sse_error(error: APIError) -> str:
    """An error after a stream has started (the status line is already sent): one `data:` event."""
    return f"data: {json.dumps(error_body(error.status, error.message, error.param, error.code))}\n\n"


def to_api_error(exc: BaseException) -> APIError:
    """Map any exception raised while serving a request to its HTTP error."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return APIError(HTTPStatus.BAD_REQUEST, str(exc))
    if isinstance(exc, EngineOverloadedError):
        return APIError(
            HTTPStatus.TOO_MANY_REQUESTS,
            str(exc),
            code="rate_limit_exceeded",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )
    if isinstance(exc, RequestFailedError):
        return APIError(HTTPStatus.INTERNAL_SERVER_ERROR, f"processing the request failed: {exc}")
    if isinstance(exc, EngineDeadError):
        return APIError(HTTPStatus.SERVICE_UNAVAILABLE, str(exc))
    logger.error("unexpected error while serving a request", exc_info=exc)
    return APIError(HTTPStatus.INTERNAL_SERVER_ERROR, f"internal error: {type(exc).__name__}: {exc}")


def validation_message(errors: Sequence[Any]) -> tuple[str, str | None]:
    """pydantic/FastAPI validation errors -> (message naming the field, the field's dotted path)."""
    if not errors:
        return "invalid request body", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}", None
    if tuple(first.get("loc", ())) == ("body",):
        return "the request body must be a JSON object (send Content-Type: application/json)", None
    # A value that fits no member of a union gets one error per member; the ones about its value
    # (out of range, not valid Unicode) say more than "should be a valid list", so they come first.
    ordered = sorted(errors, key=lambda e: str(e.get("type", "")).endswith("_type"))
    described: list[tuple[str, str]] = []
    for err in ordered:
        entry = (_field_path(err.get("loc", ())), str(err.get("msg")))
        if entry not in described:
            described.append(entry)
    messages = [f"{where or 'body'}: {msg}" for where, msg in described[:3]]
    more = f" (and {len(described) - 3} more)" if len(described) > 3 else ""
    return "invalid request: " + "; ".join(messages) + more, described[0][0] or None


def _field_path(loc: Sequence[Any]) -> str:
    """("body", "prompt", "list[function-after[...]]", 1) -> "prompt.1": fields and indices only."""
    return ".".join(str(part) for part in loc if part != "body" and not _is_union_tag(part))


def _is_union_tag(part: Any) -> bool:
    if not isinstance(part, str):
        return False
    return "[" in part or part in _UNION_TAG_NAMES or part.startswith(_UNION_TAG_PREFIXES)
