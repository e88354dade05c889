"""The request side that completions and chat completions share: the serving context, validation of
what kvflow cannot honour, request -> SamplingParams, the context-length check, fan-out of `n` choices.

Tokenizing and templating are CPU work proportional to the prompt (seconds for megabytes): each
endpoint runs them with `off_loop`, in a worker thread, so that one large prompt never stalls the
event loop that streams everyone else's tokens (the tokenizer releases the GIL for long texts).

The response side (SSE, usage, disconnects, aggregation) is in serving_response.py."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import TypeVar

from fastapi import Request as HTTPRequest

from kvflow.engine.async_engine import AsyncLLMEngine
from kvflow.errors import InvalidRequestError, PromptTooLongError
from kvflow.request import Request
from kvflow.sampling_params import MAX_ABS_LOGIT_BIAS, SamplingParams, StructuredOutputsParams
from kvflow.server.dashboard.setup import Dashboard
from kvflow.server.errors import APIError
from kvflow.server.limits import RequestLimits
from kvflow.server.metrics import EngineMetrics
from kvflow.server.protocol import _SamplingFields
from kvflow.server.shutdown import DrainState
from kvflow.tokenizer import Tokenizer

TIMING_HEADER = "x-kvflow-timing"
T = TypeVar("T")


@dataclass(frozen=True)
class ServingContext:
    """Everything a request handler needs; built once per server, passed (never global)."""

    engine: AsyncLLMEngine
    served_model_name: str
    model_dir: str
    max_model_len: int
    tokenizer: Tokenizer
    metrics: EngineMetrics
    api_key: str | None = None
    limits: RequestLimits = field(default_factory=RequestLimits)
    drain: DrainState = field(default_factory=DrainState)  # shared by the drain middleware and server
    dashboard: Dashboard | None = None  # /dashboard (server/dashboard/); None with --no-dashboard
    tool_call_parser: str = "auto"  # --tool-call-parser: hermes | llama3_json | auto (from the template)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.served_model_name:
            raise APIError(
                HTTPStatus.NOT_FOUND,
                f"the model `{model}` does not exist; this server serves `{self.served_model_name}`",
                param="model",
                code="model_not_found",
            )


@dataclass(frozen=True)
class PromptInput:
    """One prompt, tokenized: `text` is None when the client sent token ids."""

    text: str | None
    token_ids: list[int]


def unsupported_fields(body: _SamplingFields) -> None:
    """Refuse what kvflow cannot honour instead of silently ignoring it."""
    if body.best_of is not None and body.best_of != body.n:
        raise APIError(HTTPStatus.BAD_REQUEST, "best_of other than n is not supported", param="best_of")
    if body.stream_options is not None and not body.stream:
        raise APIError(
            HTTPStatus.BAD_REQUEST, "stream_options is only allowed with stream=true", "stream_options"
        )


def resolve_max_tokens(requested: int | None, num_prompt_tokens: int, max_model_len: int) -> int:
    """The output budget; None means "the rest of the context" (vLLM's chat default)."""
    if requested is None:
        return max_model_len - num_prompt_tokens
    if num_prompt_tokens + requested > max_model_len:
        raise PromptTooLongError(
            f"this model's maximum context length is {max_model_len} tokens; the request needs "
            f"{num_prompt_tokens + requested} ({num_prompt_tokens} in the prompt + {requested} for "
            "max_tokens): shorten the prompt or lower max_tokens"
        )
    return requested


def sampling_params(
    body: _SamplingFields,
    max_tokens: int,
    logprobs: int | None,
    seed: int | None,
    structured_outputs: StructuredOutputsParams | None = None,
) -> SamplingParams:
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    return SamplingParams(
        structured_outputs=structured_outputs,
        logit_bias=logit_bias(body.logit_bias),
        prompt_logprobs=_prompt_logprobs(body),
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=0 if body.top_k is None else body.top_k,
        min_p=0.0 if body.min_p is None else body.min_p,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        seed=seed,
        max_tokens=max_tokens,
        min_tokens=min(body.min_tokens, max_tokens),
        stop=stop,
        stop_token_ids=list(body.stop_token_ids or []),
        include_stop_str_in_output=body.include_stop_str_in_output,
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        skip_special_tokens=body.skip_special_tokens,
    )


def _prompt_logprobs(body: _SamplingFields) -> int | None:
    """vLLM's `prompt_logprobs`, or the completions' `echo` with `logprobs` (the echoed prompt gets
    logprobs too, as OpenAI's legacy endpoint gives them): the larger top-n of the two."""
    asked = [getattr(body, "prompt_logprobs", None)]
    if getattr(body, "echo", False):
        asked.append(getattr(body, "logprobs", None))
    numbers = [n for n in asked if isinstance(n, int) and not isinstance(n, bool)]
    return max(numbers) if numbers else None


def logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI sends token ids as JSON object keys (strings): "50256" -> 50256; values in [-100, 100]."""
    if not bias:
        return None
    result: dict[int, float] = {}
    for key, value in bias.items():
        if not key.strip().isdigit():
            raise APIError(
                HTTPStatus.BAD_REQUEST, f"logit_bias keys must be token ids, got {key!r}", param="logit_bias"
            )
        if not -MAX_ABS_LOGIT_BIAS <= value <= MAX_ABS_LOGIT_BIAS:
            raise APIError(
                HTTPStatus.BAD_REQUEST,
                f"logit_bias values must be in [-100, 100], got {value} for token {key}",
                param="logit_bias",
            )
        result[int(key)] = value
    return result


def build_requests(
    ctx: ServingContext,
    prefix: str,
    prompts: list[PromptInput],
    body: _SamplingFields,
    requested_max_tokens: int | None,
    logprobs: int | None,
    arrival_time: float,
    structured_outputs: StructuredOutputsParams | None = None,
    x_request_id: str | None = None,
) -> list[Request]:
    """One engine request per (prompt, choice): choice index = prompt index * n + j, as OpenAI orders
    them. With a seed, choice j samples with seed + j (identical choices would be pointless)."""
    ctx.limits.check_choices(len(prompts), body.n)
    if body.kv_transfer_params is not None and len(prompts) * body.n != 1:
        raise InvalidRequestError(
            "kv_transfer_params: one prompt and n=1 per request (one prompt's KV moves)"
        )
    requests = []
    group = uuid.uuid4().hex[:12]  # engine ids are unique even when clients reuse x-request-id
    for p_index, prompt in enumerate(prompts):
        max_tokens = resolve_max_tokens(requested_max_tokens, len(prompt.token_ids), ctx.max_model_len)
        for j in range(body.n):
            seed = None if body.seed is None else body.seed + j
            params = sampling_params(body, max_tokens, logprobs, seed, structured_outputs)
            request = ctx.engine.engine.make_request(
                f"{prefix}-{group}-{p_index * body.n + j}",
                prompt.token_ids,
                params,
                arrival_time,
                priority=body.priority,
            )
            request.prompt = prompt.text
            request.timeline.x_request_id = x_request_id
            ctx.engine.engine.accept_kv_transfer(request, body.kv_transfer_params)
            requests.append(request)
    return requests


def choice_index(request_id: str) -> int:
    """The choice index that `build_requests` wrote at the end of an engine request id."""
    return int(request_id.rsplit("-", 1)[1])


def wants_timing(body: _SamplingFields, raw: HTTPRequest) -> bool:
    """Timing is opt-in: the body's `kvflow.timing`, or the x-kvflow-timing header set to 1 or true."""
    return bool(body.kvflow and body.kvflow.timing) or raw.headers.get(TIMING_HEADER, "") in ("1", "true")


def now() -> float:
    """Arrival timestamps share the engine timelines' clock."""
    return time.monotonic()


async def off_loop(work: Callable[[], T]) -> T:
    """Run CPU work proportional to the request's size (tokenizing, templating) in a worker thread."""
    return await asyncio.to_thread(work)
