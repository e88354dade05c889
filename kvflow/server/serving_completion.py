"""POST /v1/completions: prompts (text or token ids, one or many) x n choices, streamed or not."""

from __future__ import annotations

from http import HTTPStatus

from fastapi import Request as HTTPRequest
from fastapi.responses import Response

from kvflow.outputs import RequestOutput, TokenLogprobs
from kvflow.request import Request
from kvflow.server.errors import APIError
from kvflow.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from kvflow.server.serving import (
    PromptInput,
    ServingContext,
    build_requests,
    now,
    off_loop,
    unsupported_fields,
)
from kvflow.server.serving_response import ResponseBuilder, serve_choices
from kvflow.server.structured_request import structured_outputs_from

# Prefix of the response id and of the engine request ids.
ID_PREFIX = "cmpl"


def _check(body: CompletionRequest) -> None:
    unsupported_fields(body)
    if body.suffix:
        raise APIError(HTTPStatus.BAD_REQUEST, "suffix is not supported", param="suffix")
    if body.echo and body.logprobs is not None:
        raise APIError(
            HTTPStatus.BAD_REQUEST,
            "echo with logprobs needs prompt logprobs, which are not supported",
            "echo",
        )


def _prompt_items(body: CompletionRequest) -> list[str | list[int]]:
    """The request's prompts, each text or token ids (not tokenized yet)."""
    prompt = body.prompt
    if isinstance(prompt, str):
        items: list[str | list[int]] = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        # One prompt given as token ids.
        items = [prompt]  # type: ignore[list-item]
    else:
        items = list(prompt)  # type: ignore[arg-type]
    if not items:
        raise APIError(HTTPStatus.BAD_REQUEST, "prompt must not be empty", param="prompt")
    return items


def _tokenize(ctx: ServingContext, items: list[str | list[int]]) -> list[PromptInput]:
    result = []
    for item in items:
        if isinstance(item, str):
            result.append(PromptInput(item, ctx.tokenizer.encode(item)))
        else:
            result.append(PromptInput(None, list(item)))
    return result


def completion_logprobs(
    ctx: ServingContext, token_ids: list[int], logprobs: list[TokenLogprobs], text_offset: int
) -> CompletionLogprobs:
    """The legacy shape: parallel lists; `text_offset` counts characters from the choice's text start."""
    result = CompletionLogprobs()
    offset = text_offset
    for token_id, position in zip(token_ids, logprobs, strict=False):
        token = position[token_id].decoded_token or ctx.tokenizer.decode(
            [token_id], skip_special_tokens=False
        )
        result.tokens.append(token)
        result.token_logprobs.append(position[token_id].logprob)
        result.top_logprobs.append({lp.decoded_token or str(t): lp.logprob for t, lp in position.items()})
        result.text_offset.append(offset)
        offset += len(token)
    return result


class CompletionResponseBuilder(ResponseBuilder[CompletionChoice, CompletionChoice]):
    """`text_completion` objects: chunks and the response share one shape, each choice carries `text`.
    With `echo`, a choice's text starts with its prompt: the first chunk of a streamed choice carries it."""

    chunk_type = CompletionResponse
    response_type = CompletionResponse

    def __init__(
        self, ctx: ServingContext, body: CompletionRequest, prompts: list[PromptInput], response_id: str
    ) -> None:
        super().__init__(response_id, ctx.served_model_name)
        self.ctx = ctx
        self.prompts = prompts
        self.n = body.n
        self.echo = body.echo
        self._echo_sent: set[int] = set()  # streamed choices whose prompt has been sent
        # choice index -> characters streamed so far: where the next delta's logprobs text_offset starts
        self._text_lengths: dict[int, int] = {}

    def _echo_text(self, index: int) -> str:
        prompt = self.prompts[index // self.n]
        return prompt.text if prompt.text is not None else self.ctx.tokenizer.decode(prompt.token_ids)

    def stream_choice(self, index: int, output: RequestOutput) -> CompletionChoice | None:
        text = output.delta_text
        if self.echo and index not in self._echo_sent:
            self._echo_sent.add(index)
            text = self._echo_text(index) + text
        if not text and not output.finished and not output.delta_token_ids:
            return None
        offset = self._text_lengths.get(index, 0)
        self._text_lengths[index] = offset + len(text)
        logprobs = None
        if output.delta_logprobs is not None:
            logprobs = completion_logprobs(self.ctx, output.delta_token_ids, output.delta_logprobs, offset)
        out = output.outputs[0]
        return CompletionChoice(
            index=index,
            text=text,
            logprobs=logprobs,
            finish_reason=out.finish_reason,
            stop_reason=out.stop_reason,
        )

    def final_choice(self, index: int, final: RequestOutput) -> CompletionChoice:
        out = final.outputs[0]
        prefix = self._echo_text(index) if self.echo else ""
        logprobs = None
        if out.logprobs is not None:
            logprobs = completion_logprobs(self.ctx, out.token_ids, out.logprobs, len(prefix))
        return CompletionChoice(
            index=index,
            text=prefix + out.text,
            logprobs=logprobs,
            finish_reason=out.finish_reason,
            stop_reason=out.stop_reason,
        )


async def create_completion(ctx: ServingContext, body: CompletionRequest, raw: HTTPRequest) -> Response:
    arrival = now()
    ctx.check_model(body.model)
    _check(body)
    items = _prompt_items(body)
    ctx.limits.check_choices(len(items), body.n)  # before tokenizing what would be refused anyway

    def prepare() -> tuple[list[PromptInput], list[Request]]:
        constraint = structured_outputs_from(body)
        prompts = _tokenize(ctx, items)
        return prompts, build_requests(
            ctx, ID_PREFIX, prompts, body, body.max_tokens, body.logprobs, arrival, constraint
        )

    prompts, requests = await off_loop(prepare)
    builder = CompletionResponseBuilder(ctx, body, prompts, f"{ID_PREFIX}-{raw.state.request_id}")
    return await serve_choices(ctx, raw, body, prompts, requests, builder)
