"""The Anthropic route: POST /v1/messages and /v1/messages/count_tokens (kvflow/server/serving_messages.py),
behind the same API key (also as `x-api-key`, the anthropic client's header). Errors on these paths
take Anthropic's error body (anthropic_protocol.py; errors.py picks the shape by path)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from kvflow.server.anthropic_protocol import CountTokensRequest, MessagesRequest
from kvflow.server.openapi import responses
from kvflow.server.routes_openai import GENERATION_ERRORS, answer
from kvflow.server.serving import ServingContext
from kvflow.server.serving_messages import count_message_tokens, create_message


def anthropic_router(ctx: ServingContext) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/messages", responses=responses(*GENERATION_ERRORS))
    async def messages(body: MessagesRequest, raw: Request) -> Any:
        return await answer(create_message(ctx, body, raw))

    @router.post("/v1/messages/count_tokens", responses=responses(*GENERATION_ERRORS))
    async def count_tokens(body: CountTokensRequest) -> dict[str, int]:
        return await count_message_tokens(ctx, body)

    return router
