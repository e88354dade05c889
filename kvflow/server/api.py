"""The FastAPI application: routes, API-key check, x-request-id, error rendering.

`build_app(ctx)` returns an app bound to one `ServingContext` (no module-level state); the engine
thread starts with the app's lifespan and stops with it.
"""

from __future__ import annotations

import hmac
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from http import HTTPStatus
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvflow.errors import KVFlowError
from kvflow.server.errors import (
    CLIENT_CLOSED_REQUEST,
    APIError,
    error_response,
    to_api_error,
    validation_message,
)
from kvflow.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from kvflow.server.serving import ClientDisconnectedError, ServingContext
from kvflow.server.serving_chat import create_chat_completion, render_chat_prompt
from kvflow.server.serving_completion import create_completion
from kvflow.version import __version__

REQUEST_ID_HEADER = "x-request-id"
PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


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


def build_app(ctx: ServingContext) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        ctx.engine.start()
        try:
            yield
        finally:
            ctx.engine.shutdown()

    app = FastAPI(title="kvflow", lifespan=lifespan)
    app.add_middleware(RequestIdMiddleware)

    async def check_api_key(request: Request) -> None:
        if ctx.api_key is None:
            return
        given = request.headers.get("authorization", "")
        expected = f"Bearer {ctx.api_key}"
        if not hmac.compare_digest(given.encode(), expected.encode()):
            message = "missing API key" if not given else "invalid API key"
            raise APIError(
                HTTPStatus.UNAUTHORIZED,
                f"{message}: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
            )

    _install_error_handlers(app)
    protected = [Depends(check_api_key)]

    @app.post("/v1/completions", dependencies=protected)
    async def completions(body: CompletionRequest, raw: Request) -> Any:
        try:
            return await create_completion(ctx, body, raw)
        except ClientDisconnectedError:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        except Exception as exc:  # rendered inside the middlewares, so x-request-id is kept
            raise to_api_error(exc) from exc

    @app.post("/v1/chat/completions", dependencies=protected)
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Any:
        try:
            return await create_chat_completion(ctx, body, raw)
        except ClientDisconnectedError:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        except Exception as exc:
            raise to_api_error(exc) from exc

    @app.get("/v1/models", dependencies=protected)
    async def models() -> ModelList:
        card = ModelCard(id=ctx.served_model_name, root=ctx.model_dir, max_model_len=ctx.max_model_len)
        return ModelList(data=[card])

    @app.post("/tokenize", dependencies=protected)
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        ctx.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(HTTPStatus.BAD_REQUEST, "give exactly one of prompt and messages", param="prompt")
        if body.messages is not None:
            tokens = render_chat_prompt(ctx, body.messages, body.add_generation_prompt).token_ids
        else:
            tokens = ctx.tokenizer.encode(body.prompt or "", add_special_tokens=body.add_special_tokens)
        return {"count": len(tokens), "max_model_len": ctx.max_model_len, "tokens": tokens}

    @app.post("/detokenize", dependencies=protected)
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        ctx.check_model(body.model)
        vocab = ctx.engine.engine.arch.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(
                HTTPStatus.BAD_REQUEST, f"token ids must be in [0, {vocab}); got {bad[:5]}", "tokens"
            )
        return {"prompt": ctx.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    @app.get("/health")
    async def health() -> Response:
        if not ctx.engine.is_running:
            raise APIError(HTTPStatus.SERVICE_UNAVAILABLE, "the engine is not running")
        return Response(status_code=HTTPStatus.OK)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(ctx.metrics.render(), media_type=PROMETHEUS_CONTENT_TYPE)

    return app


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc.errors())
        return error_response(APIError(HTTPStatus.BAD_REQUEST, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        status = HTTPStatus(exc.status_code)
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return error_response(APIError(status, message, headers=dict(exc.headers or {})))

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(KVFlowError)
    async def on_kvflow_error(request: Request, exc: KVFlowError) -> JSONResponse:
        return error_response(to_api_error(exc))
