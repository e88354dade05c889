"""POST /v1/completions: prompts (text or token ids, one or many) x n choices, streamed or not."""

from __future__ import annotations

import time
from http import HTTPStatus

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, StreamingResponse

from kvflow.outputs import RequestOutput, TokenLogprobs
from kvflow.server.errors import APIError
from kvflow.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
)
from kvflow.server.serving import (
    PromptInput,
    ServingContext,
    build_requests,
    choice_index,
    collect_finals,
    kvflow_timing,
    now,
    output_timing,
    sse,
    sse_stream,
    unsupported_fields,
    usage_of,
    wants_timing,
)


def _prompts(ctx: ServingContext, body: CompletionRequest) -> list[PromptInput]:
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


async def create_completion(ctx: ServingContext, body: CompletionRequest, raw: HTTPRequest) -> object:
    arrival = now()
    ctx.check_model(body.model)
    unsupported_fields(body)
    if body.suffix:
        raise APIError(HTTPStatus.BAD_REQUEST, "suffix is not supported", param="suffix")
    if body.echo and body.logprobs is not None:
        raise APIError(
            HTTPStatus.BAD_REQUEST,
            "echo with logprobs needs prompt logprobs, which are not supported",
            "echo",
        )
    prompts = _prompts(ctx, body)
    request_id = raw.state.request_id
    requests = build_requests(ctx, "cmpl", prompts, body, body.max_tokens, body.logprobs, arrival)
    stream = ctx.engine.add_requests(requests)
    timing = wants_timing(body, raw)
    response_id = f"cmpl-{request_id}"
    created = int(time.time())
    model = ctx.served_model_name

    def echo_text(index: int) -> str:
        prompt = prompts[index // body.n]
        return prompt.text if prompt.text is not None else ctx.tokenizer.decode(prompt.token_ids)

    if not body.stream:
        finals = await collect_finals(stream, raw)
        choices = []
        for final in finals:
            index = choice_index(final.request_id)
            out = final.outputs[0]
            prefix = echo_text(index) if body.echo else ""
            choices.append(
                CompletionChoice(
                    index=index,
                    text=prefix + out.text,
                    logprobs=completion_logprobs(ctx, out.token_ids, out.logprobs, len(prefix))
                    if out.logprobs is not None
                    else None,
                    finish_reason=out.finish_reason,
                    stop_reason=out.stop_reason,
                )
            )
        response = CompletionResponse(
            id=response_id,
            created=created,
            model=model,
            choices=choices,
            usage=usage_of(finals, body.n),
            kvflow=kvflow_timing(finals) if timing else None,
        )
        return JSONResponse(response.model_dump(exclude_none=True))

    options = body.stream_options
    sent_echo: set[int] = set()
    text_lengths: dict[int, int] = {}
    completion_tokens: dict[int, int] = {}
    prompt_tokens = {i: len(p.token_ids) for i, p in enumerate(prompts)}

    def events(output: RequestOutput) -> list[str]:
        index = choice_index(output.request_id)
        out = output.outputs[0]
        text = output.delta_text
        if body.echo and index not in sent_echo:
            sent_echo.add(index)
            text = echo_text(index) + text
        if not text and not output.finished and not output.delta_token_ids:
            return []
        offset = text_lengths.get(index, 0)
        text_lengths[index] = offset + len(text)
        completion_tokens[index] = len(out.token_ids)
        logprobs = None
        if output.delta_logprobs is not None:
            logprobs = completion_logprobs(ctx, output.delta_token_ids, output.delta_logprobs, offset)
        chunk = CompletionResponse(
            id=response_id,
            created=created,
            model=model,
            choices=[
                CompletionChoice(
                    index=index,
                    text=text,
                    logprobs=logprobs,
                    finish_reason=out.finish_reason,
                    stop_reason=out.stop_reason,
                )
            ],
        )
        if options is not None and options.continuous_usage_stats:
            p = prompt_tokens[index // body.n]
            chunk.usage = UsageInfo(
                prompt_tokens=p, completion_tokens=len(out.token_ids), total_tokens=p + len(out.token_ids)
            )
        if timing and output.finished:
            chunk.kvflow = {"timing": output_timing(output), "index": index}
        return [sse(chunk)]

    def tail() -> list[str]:
        if options is None or not options.include_usage:
            return []
        prompt = sum(prompt_tokens.values())
        completion = sum(completion_tokens.values())
        usage = UsageInfo(
            prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
        )
        return [
            sse(CompletionResponse(id=response_id, created=created, model=model, choices=[], usage=usage))
        ]

    return StreamingResponse(sse_stream(stream, events, tail), media_type="text/event-stream")
