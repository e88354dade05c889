"""POST /v1/chat/completions: messages through the checkpoint's chat template, n choices, streamed or not."""

from __future__ import annotations

import time
from http import HTTPStatus
from typing import Any

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, StreamingResponse

from kvflow.outputs import RequestOutput, TokenLogprobs
from kvflow.server.errors import APIError
from kvflow.server.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatResponseMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    DeltaMessage,
    TopLogprob,
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


def render_chat_prompt(
    ctx: ServingContext,
    messages: list[ChatMessage],
    add_generation_prompt: bool = True,
    template_kwargs: dict[str, Any] | None = None,
) -> PromptInput:
    """Template -> text -> token ids. The rendered text already holds the special tokens the template
    writes (BOS for Llama-3), so it is encoded without adding them again (as vLLM does)."""
    text = ctx.tokenizer.apply_chat_template(
        [m.model_dump(exclude_none=True) for m in messages],
        add_generation_prompt=add_generation_prompt,
        **(template_kwargs or {}),
    )
    return PromptInput(text, ctx.tokenizer.encode(text, add_special_tokens=False))


def _top_logprob(ctx: ServingContext, position: TokenLogprobs, token_id: int) -> TopLogprob:
    lp = position[token_id]
    text = lp.decoded_token or ctx.tokenizer.decode([token_id], skip_special_tokens=False)
    return TopLogprob(token=text, logprob=lp.logprob, bytes=list(text.encode("utf-8")))


def chat_logprobs(
    ctx: ServingContext, token_ids: list[int], logprobs: list[TokenLogprobs], top_n: int
) -> ChatLogprobs:
    """One entry per output token: the sampled token's logprob and the `top_n` most likely, by rank."""
    content = []
    for token_id, position in zip(token_ids, logprobs, strict=False):
        top = sorted((t for t, lp in position.items() if lp.rank <= top_n), key=lambda t: position[t].rank)
        content.append(
            ChatTokenLogprob(
                **_top_logprob(ctx, position, token_id).model_dump(),
                top_logprobs=[_top_logprob(ctx, position, t) for t in top],
            )
        )
    return ChatLogprobs(content=content)


def _check(body: ChatCompletionRequest) -> None:
    unsupported_fields(body)
    if body.tools:
        raise APIError(HTTPStatus.BAD_REQUEST, "tools (function calling) are not supported", param="tools")
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(HTTPStatus.BAD_REQUEST, "top_logprobs needs logprobs=true", param="top_logprobs")


async def create_chat_completion(
    ctx: ServingContext, body: ChatCompletionRequest, raw: HTTPRequest
) -> object:
    arrival = now()
    ctx.check_model(body.model)
    _check(body)
    prompt = render_chat_prompt(ctx, body.messages, body.add_generation_prompt, body.chat_template_kwargs)
    top_n = body.top_logprobs or 0
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    logprobs = top_n if body.logprobs else None
    requests = build_requests(ctx, "chatcmpl", [prompt], body, requested, logprobs, arrival)
    stream = ctx.engine.add_requests(requests)
    timing = wants_timing(body, raw)
    response_id = f"chatcmpl-{raw.state.request_id}"
    created = int(time.time())
    model = ctx.served_model_name

    if not body.stream:
        finals = await collect_finals(stream, raw)
        choices = []
        for final in finals:
            out = final.outputs[0]
            choices.append(
                ChatChoice(
                    index=choice_index(final.request_id),
                    message=ChatResponseMessage(content=out.text),
                    logprobs=chat_logprobs(ctx, out.token_ids, out.logprobs, top_n)
                    if out.logprobs is not None
                    else None,
                    finish_reason=out.finish_reason,
                    stop_reason=out.stop_reason,
                )
            )
        response = ChatCompletionResponse(
            id=response_id,
            created=created,
            model=model,
            choices=choices,
            usage=usage_of(finals, body.n),
            kvflow=kvflow_timing(finals) if timing else None,
        )
        return JSONResponse(response.model_dump(exclude_none=True))

    options = body.stream_options
    num_prompt = len(prompt.token_ids)
    completion_tokens: dict[int, int] = {}

    def chunk(choices: list[ChatStreamChoice]) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=response_id, created=created, model=model, choices=choices)

    def usage(completion: int) -> UsageInfo:
        return UsageInfo(
            prompt_tokens=num_prompt, completion_tokens=completion, total_tokens=num_prompt + completion
        )

    def events(output: RequestOutput) -> list[str]:
        index = choice_index(output.request_id)
        out = output.outputs[0]
        result: list[str] = []
        completion_tokens[index] = len(out.token_ids)
        if not output.delta_text and not output.finished and not output.delta_token_ids:
            return result
        logprobs = None
        if output.delta_logprobs is not None:
            logprobs = chat_logprobs(ctx, output.delta_token_ids, output.delta_logprobs, top_n)
        choice = ChatStreamChoice(
            index=index,
            delta=DeltaMessage(content=output.delta_text),
            logprobs=logprobs,
            finish_reason=out.finish_reason,
            stop_reason=out.stop_reason,
        )
        data = chunk([choice])
        if options is not None and options.continuous_usage_stats:
            data.usage = usage(len(out.token_ids))
        if timing and output.finished:
            data.kvflow = {"timing": output_timing(output), "index": index}
        result.append(sse(data))
        return result

    def tail() -> list[str]:
        if options is None or not options.include_usage:
            return []
        final = chunk([])
        final.usage = usage(sum(completion_tokens.values()))
        return [sse(final)]

    # OpenAI streams start with the role and empty content, sent before the prompt is even scheduled.
    head = [
        sse(chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))]))
        for i in range(body.n)
    ]
    return StreamingResponse(sse_stream(stream, events, tail, head), media_type="text/event-stream")
