"""The Responses API routes: POST /v1/responses, GET and DELETE /v1/responses/{id}
(kvflow/server/serving_responses.py), behind the API key; errors in OpenAI's shape."""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from fastapi import APIRouter, Request

from kvflow.server.errors import APIError
from kvflow.server.openapi import responses
from kvflow.server.response_store import ResponseStore
from kvflow.server.responses_protocol import ResponsesRequest
from kvflow.server.routes_openai import GENERATION_ERRORS, answer
from kvflow.server.serving import ServingContext
from kvflow.server.serving_responses import create_response


def responses_router(ctx: ServingContext) -> APIRouter:
    router = APIRouter()
    store = ResponseStore()

    def stored(response_id: str) -> APIError:
        return APIError(
            HTTPStatus.NOT_FOUND, f"response {response_id!r} is not stored here", param="response_id"
        )

    @router.post("/v1/responses", responses=responses(*GENERATION_ERRORS))
    async def create(body: ResponsesRequest, raw: Request) -> Any:
        if body.model is not None:
            ctx.check_model(body.model)
        return await answer(create_response(ctx, store, body, raw))

    @router.get("/v1/responses/{response_id}", responses=responses(HTTPStatus.NOT_FOUND))
    async def retrieve(response_id: str) -> dict[str, Any]:
        item = store.get(response_id)
        if item is None:
            raise stored(response_id)
        return item.response

    @router.delete("/v1/responses/{response_id}", responses=responses(HTTPStatus.NOT_FOUND))
    async def delete(response_id: str) -> dict[str, Any]:
        if not store.delete(response_id):
            raise stored(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    return router
