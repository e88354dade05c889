"""The OpenAI routes: /v1/completions, /v1/chat/completions, /v1/models (all behind the API key,
which middleware.py checks before the body is read)."""

from __future__ import annotations

from collections.abc import Awaitable
from http import HTTPStatus
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from kvflow.server.errors import CLIENT_CLOSED_REQUEST, to_api_error
from kvflow.server.openapi import responses, streamed_or_json
from kvflow.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
)
from kvflow.server.serving import ServingContext
from kvflow.server.serving_chat import create_chat_completion
from kvflow.server.serving_completion import create_completion
from kvflow.server.serving_response import ClientDisconnectedError

# What a generation route may answer besides its 200 (401, 500 and 503 are added to every route).
GENERATION_ERRORS = (HTTPStatus.NOT_FOUND, HTTPStatus.TOO_MANY_REQUESTS)


def openai_router(ctx: ServingContext) -> APIRouter:
    router = APIRouter()

    @router.post(
        "/v1/completions",
        responses=responses(*GENERATION_ERRORS, ok=streamed_or_json(CompletionResponse, "the completion")),
    )
    async def completions(body: CompletionRequest, raw: Request) -> Any:
        return await answer(create_completion(ctx, body, raw))

    @router.post(
        "/v1/chat/completions",
        responses=responses(
            *GENERATION_ERRORS, ok=streamed_or_json(ChatCompletionResponse, "the chat completion")
        ),
    )
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Any:
        return await answer(create_chat_completion(ctx, body, raw))

    @router.get("/v1/models", responses=responses())
    async def models() -> ModelList:
        card = ModelCard(id=ctx.served_model_name, root=ctx.model_dir, max_model_len=ctx.max_model_len)
        return ModelList(data=[card])

    return router


async def answer(handler: Awaitable[Response]) -> Response:
    """Awaits a generation handler. A client gone before its non-streamed answer gets 499; any other
    failure is raised as its APIError here, so that it is rendered inside the middlewares (an exception
    left to Starlette's outermost handler would lose x-request-id)."""
    try:
        return await handler
    except ClientDisconnectedError:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    except Exception as exc:
        raise to_api_error(exc) from exc
