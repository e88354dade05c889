"""The routes beside the OpenAI API (vLLM's names): /tokenize and /detokenize (behind the API key),
and /health, /version, /metrics, which probes and scrapers reach without one."""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from fastapi import APIRouter
from fastapi.params import Depends
from fastapi.responses import Response

from kvflow.server.errors import APIError
from kvflow.server.protocol import DetokenizeRequest, TokenizeRequest
from kvflow.server.serving import ServingContext
from kvflow.server.serving_chat import render_chat_prompt
from kvflow.version import __version__

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def tokenizer_router(ctx: ServingContext, protected: list[Depends]) -> APIRouter:
    router = APIRouter()

    @router.post("/tokenize", dependencies=protected)
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        ctx.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(HTTPStatus.BAD_REQUEST, "give exactly one of prompt and messages", param="prompt")
        if body.messages is not None:
            tokens = render_chat_prompt(ctx, body.messages, body.add_generation_prompt).token_ids
        else:
            tokens = ctx.tokenizer.encode(body.prompt or "", add_special_tokens=body.add_special_tokens)
        return {"count": len(tokens), "max_model_len": ctx.max_model_len, "tokens": tokens}

    @router.post("/detokenize", dependencies=protected)
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        ctx.check_model(body.model)
        vocab = ctx.engine.engine.arch.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(
                HTTPStatus.BAD_REQUEST, f"token ids must be in [0, {vocab}); got {bad[:5]}", "tokens"
            )
        return {"prompt": ctx.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    return router


def probe_router(ctx: ServingContext) -> APIRouter:
    """Liveness, version and Prometheus metrics: no API key, as load balancers and scrapers send none."""
    router = APIRouter()

    @router.get("/health")
    async def health() -> Response:
        if not ctx.engine.is_running:
            raise APIError(HTTPStatus.SERVICE_UNAVAILABLE, "the engine is not running")
        return Response(status_code=HTTPStatus.OK)

    @router.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @router.get("/metrics")
    async def metrics() -> Response:
        return Response(ctx.metrics.render(), media_type=PROMETHEUS_CONTENT_TYPE)

    return router
