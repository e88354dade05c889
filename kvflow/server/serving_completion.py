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
    PromptLogprob,
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


def prompt_completion_logprobs(
    ctx: ServingContext, token_ids: list[int], entries: list[TokenLogprobs | None], top_n: int
) -> CompletionLogprobs:
    """An echoed prompt's part of the legacy logprobs: the first token has none (null, as OpenAI).
    `text_offset` indexes the echoed text, which shows no special tokens (a BOS the tokenizer added
    is listed in `tokens` but takes no characters), so the output's offsets continue from it."""
    result = CompletionLogprobs()
    offset = 0
    for token_id, position in zip(token_ids, entries, strict=False):
        token = ctx.tokenizer.decode([token_id], skip_special_tokens=False)
        result.tokens.append(token)
        result.text_offset.append(offset)
        offset += len(ctx.tokenizer.decode([token_id], skip_special_tokens=True))
        if position is None:
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
            continue
        result.token_logprobs.append(position[token_id].logprob)
        top = {t: lp for t, lp in position.items() if lp.rank <= top_n or t == token_id}
        result.top_logprobs.append({lp.decoded_token or str(t): lp.logprob for t, lp in top.items()})
    return result


def vllm_prompt_logprobs(
    entries: list[TokenLogprobs | None], top_n: int, prompt_ids: list[int]
) -> list[dict[int, PromptLogprob] | None]:
    """vLLM's `prompt_logprobs`: per prompt token, the token itself plus the top-n by rank."""
    result: list[dict[int, PromptLogprob] | None] = []
    for token_id, position in zip(prompt_ids, entries, strict=False):
        if position is None:
            result.append(None)
            continue
        result.append(
            {
                t: PromptLogprob(logprob=lp.logprob, rank=lp.rank, decoded_token=lp.decoded_token)
                for t, lp in position.items()
                if lp.rank <= top_n or t == token_id
            }
        )
    return result


def _joined(prompt: CompletionLogprobs, output: CompletionLogprobs | None) -> CompletionLogprobs:
    """The echoed prompt's logprobs, then the output's (its text offsets already count the prompt)."""
    if output is None:
        return prompt
    return CompletionLogprobs(
        tokens=prompt.tokens + output.tokens,
        token_logprobs=prompt.token_logprobs + output.token_logprobs,
        top_logprobs=prompt.top_logprobs + output.top_logprobs,
        text_offset=prompt.text_offset + output.text_offset,
    )


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
        self.logprobs = body.logprobs  # echo + logprobs: the prompt's logprobs lead the choice's
        self.prompt_logprobs = body.prompt_logprobs  # vLLM's field: its own list per choice
        self._echo_sent: set[int] = set()  # streamed choices whose prompt has been sent
        # choice index -> characters streamed so far: where the next delta's logprobs text_offset starts
        self._text_lengths: dict[int, int] = {}

    def _echo_text(self, index: int) -> str:
        prompt = self.prompts[index // self.n]
        return prompt.text if prompt.text is not None else self.ctx.tokenizer.decode(prompt.token_ids)

    def stream_choice(self, index: int, output: RequestOutput) -> CompletionChoice | None:
        text = output.delta_text
        first = index not in self._echo_sent
        self._echo_sent.add(index)
        if self.echo and first:
            text = self._echo_text(index) + text
        if not text and not output.finished and not output.delta_token_ids:
            return None
        offset = self._text_lengths.get(index, 0)
        self._text_lengths[index] = offset + len(text)
        logprobs = None
        if output.delta_logprobs is not None:
            logprobs = completion_logprobs(self.ctx, output.delta_token_ids, output.delta_logprobs, offset)
        if first and self.echo and self.logprobs is not None and output.prompt_logprobs is not None:
            prompt = prompt_completion_logprobs(
                self.ctx, output.prompt_token_ids, output.prompt_logprobs, self.logprobs
            )
            logprobs = _joined(prompt, logprobs)
        out = output.outputs[0]
        return CompletionChoice(
            index=index,
            text=text,
            logprobs=logprobs,
            prompt_logprobs=self._vllm_prompt_logprobs(output) if first else None,
            finish_reason=out.finish_reason,
            stop_reason=out.stop_reason,
        )

    def _vllm_prompt_logprobs(self, output: RequestOutput) -> list[dict[int, PromptLogprob] | None] | None:
        if self.prompt_logprobs is None or output.prompt_logprobs is None:
            return None
        return vllm_prompt_logprobs(output.prompt_logprobs, self.prompt_logprobs, output.prompt_token_ids)

    def final_choice(self, index: int, final: RequestOutput) -> CompletionChoice:
        out = final.outputs[0]
        prefix = self._echo_text(index) if self.echo else ""
        logprobs = None
        if out.logprobs is not None:
            logprobs = completion_logprobs(self.ctx, out.token_ids, out.logprobs, len(prefix))
        if self.echo and self.logprobs is not None and final.prompt_logprobs is not None:
            prompt = prompt_completion_logprobs(
                self.ctx, final.prompt_token_ids, final.prompt_logprobs, self.logprobs
            )
            logprobs = _joined(prompt, logprobs)
        return CompletionChoice(
            index=index,
            text=prefix + out.text,
            logprobs=logprobs,
            prompt_logprobs=self._vllm_prompt_logprobs(final),
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
        constraint = structured_outputs_from(body, ctx.engine.engine.structured.validate)
        prompts = _tokenize(ctx, items)
        return prompts, build_requests(
            ctx,
            ID_PREFIX,
            prompts,
            body,
            body.max_tokens,
            body.logprobs,
            arrival,
            constraint,
            x_request_id=raw.state.request_id,
        )

    prompts, requests = await off_loop(prepare)
    builder = CompletionResponseBuilder(ctx, body, prompts, f"{ID_PREFIX}-{raw.state.request_id}")
    return await serve_choices(ctx, raw, body, prompts, requests, builder)
