"""The FastAPI application: middlewares, error rendering, the route groups and their schema.

`build_app(ctx)` returns an app bound to one `ServingContext` (no module-level state); the engine
thread starts with the app's lifespan and stops with it. The routes live in route groups:
routes_openai.py (the OpenAI API), routes_utility.py (tokenizer, health, version, metrics).

A request passes, outermost first: RequestIdMiddleware (every answer carries x-request-id),
DrainMiddleware (503 while shutting down; counts requests in flight), ApiKeyMiddleware (401 before
a byte of the body is read), BodyLimitMiddleware (413 / 408: the body is received whole, within
limits, before it is parsed), then FastAPI's validation and the route.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvflow.errors import KVFlowError
from kvflow.server.errors import APIError, error_response, to_api_error, validation_message
from kvflow.server.limits import BodyLimitMiddleware
from kvflow.server.middleware import ApiKeyMiddleware, RequestIdMiddleware
from kvflow.server.openapi import install_openapi
from kvflow.server.routes_anthropic import anthropic_router
from kvflow.server.routes_openai import openai_router
from kvflow.server.routes_responses import responses_router
from kvflow.server.routes_utility import probe_router, tokenizer_router
from kvflow.server.serving import ServingContext
from kvflow.server.shutdown import DrainMiddleware
from kvflow.version import __version__


def build_app(ctx: ServingContext) -> FastAPI:
    app = FastAPI(title="kvflow", version=__version__, lifespan=_engine_lifespan(ctx))
    # add_middleware wraps the app built so far: the last one added is the outermost.
    app.add_middleware(BodyLimitMiddleware, limits=ctx.limits)
    app.add_middleware(ApiKeyMiddleware, api_key=ctx.api_key)
    app.add_middleware(DrainMiddleware, state=ctx.drain)
    app.add_middleware(RequestIdMiddleware)
    _install_error_handlers(app)
    app.include_router(openai_router(ctx))
    app.include_router(anthropic_router(ctx))
    app.include_router(responses_router(ctx))
    app.include_router(tokenizer_router(ctx))
    app.include_router(probe_router(ctx))
    if ctx.dashboard is not None:
        ctx.dashboard.install(app, ctx.drain)
    install_openapi(app, protected=ctx.api_key is not None)
    return app


def _engine_lifespan(ctx: ServingContext) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """The engine thread runs exactly while the app serves (uvicorn's startup to shutdown)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if ctx.dashboard is not None:
            ctx.dashboard.start()
        ctx.engine.start()
        try:
            yield
        finally:
            ctx.engine.shutdown()
            if ctx.dashboard is not None:
                ctx.dashboard.stop()

    return lifespan


def _install_error_handlers(app: FastAPI) -> None:
    """Every error answer has the OpenAI body (errors.py), whoever raised it: request validation,
    Starlette (unknown route, wrong method), the serving layer, or the engine."""

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc.errors())
        return error_response(APIError(HTTPStatus.BAD_REQUEST, message, param=param), request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        status = HTTPStatus(exc.status_code)
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return error_response(APIError(status, message, headers=dict(exc.headers or {})), request.url.path)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc, request.url.path)

    @app.exception_handler(KVFlowError)
    async def on_kvflow_error(request: Request, exc: KVFlowError) -> JSONResponse:
        return error_response(to_api_error(exc), request.url.path)

    # The last resort (Starlette calls it from its outermost middleware, so without x-request-id):
    # even a bug answers with the OpenAI error body, never with Starlette's plain-text 500.
    @app.exception_handler(Exception)
    async def on_unexpected_error(request: Request, exc: Exception) -> JSONResponse:
        return error_response(to_api_error(exc), request.url.path)
