"""The routes beside the OpenAI API (vLLM's names): /tokenize and /detokenize (behind the API key),
and /health, /version, /metrics, which probes and scrapers reach without one."""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response

from kvflow.server.chat_content import template_messages
from kvflow.server.errors import APIError, to_api_error
from kvflow.server.openapi import responses
from kvflow.server.protocol import DetokenizeRequest, TokenizeRequest
from kvflow.server.serving import ServingContext, off_loop
from kvflow.server.serving_chat import render_chat_prompt
from kvflow.version import __version__

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class PrometheusResponse(Response):
    """Prometheus' text exposition format (the class also tells /openapi.json the content type)."""

    media_type = PROMETHEUS_CONTENT_TYPE


def tokenizer_router(ctx: ServingContext) -> APIRouter:
    router = APIRouter()

    @router.post("/tokenize", responses=responses(HTTPStatus.NOT_FOUND))
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        ctx.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(HTTPStatus.BAD_REQUEST, "give exactly one of prompt and messages", param="prompt")
        try:
            tokens = await off_loop(lambda: _tokenize(ctx, body))
        except Exception as exc:  # rendered as the OpenAI error body, never as plain text
            raise to_api_error(exc) from exc
        return {"count": len(tokens), "max_model_len": ctx.max_model_len, "tokens": tokens}

    @router.post("/detokenize", responses=responses(HTTPStatus.NOT_FOUND))
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        ctx.check_model(body.model)
        vocab = ctx.engine.engine.arch.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(
                HTTPStatus.BAD_REQUEST, f"token ids must be in [0, {vocab}); got {bad[:5]}", "tokens"
            )
        try:
            text = await off_loop(lambda: ctx.tokenizer.decode(body.tokens, skip_special_tokens=False))
        except Exception as exc:
            raise to_api_error(exc) from exc
        return {"prompt": text}

    return router


def _tokenize(ctx: ServingContext, body: TokenizeRequest) -> list[int]:
    if body.messages is not None:
        messages = template_messages(body.messages)
        return render_chat_prompt(ctx, messages, body.add_generation_prompt).token_ids
    return ctx.tokenizer.encode(body.prompt or "", add_special_tokens=body.add_special_tokens)


def probe_router(ctx: ServingContext) -> APIRouter:
    """Liveness, version and Prometheus metrics: no API key, as load balancers and scrapers send none."""
    router = APIRouter()

    @router.get(
        "/health",
        response_class=Response,
        responses={200: {"description": "the engine is running (empty body)", "content": None}},
    )
    async def health() -> Response:
        if not ctx.engine.is_running:
            raise APIError(HTTPStatus.SERVICE_UNAVAILABLE, "the engine is not running")
        return Response(status_code=HTTPStatus.OK)

    @router.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @router.get(
        "/metrics",
        response_class=PrometheusResponse,
        responses={200: {"description": "Prometheus text exposition format"}},
    )
    async def metrics() -> Response:
        return PrometheusResponse(ctx.metrics.render())

    return router
