"""POST /v1/chat/completions: messages through the checkpoint's chat template, n choices, streamed or not."""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from fastapi import Request as HTTPRequest
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

from kvflow.outputs import RequestOutput, TokenLogprobs
from kvflow.reasoning import ReasoningStreamer
from kvflow.request import Request
from kvflow.server.chat_content import check_template_kwargs, template_messages
from kvflow.server.errors import APIError, validation_message
from kvflow.server.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    DeltaMessage,
    PromptLogprob,
    TopLogprob,
    UsageInfo,
)
from kvflow.server.serving import (
    PromptInput,
    ServingContext,
    build_requests,
    now,
    off_loop,
    unsupported_fields,
)
from kvflow.server.serving_completion import vllm_prompt_logprobs
from kvflow.server.serving_response import ResponseBuilder, serve_choices
from kvflow.server.serving_tools import (
    ToolCallStreamer,
    ToolPlan,
    final_message,
    plan_tools,
    tool_call_arguments_as_objects,
)
from kvflow.server.structured_request import structured_outputs_from

# Prefix of the response id and of the engine request ids.
ID_PREFIX = "chatcmpl"


def render_chat_prompt(
    ctx: ServingContext,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    template_kwargs: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> PromptInput:
    """Template -> text -> token ids. `messages` come from `template_messages`; `template_kwargs`
    passed `check_template_kwargs`. The rendered text already holds the special tokens the template
    writes (BOS for Llama-3), so it is encoded without adding them again (as vLLM does). CPU work
    proportional to the conversation: call it through `off_loop`."""
    text = ctx.tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tools=tools, **(template_kwargs or {})
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
    check_template_kwargs(body.chat_template_kwargs)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(HTTPStatus.BAD_REQUEST, "top_logprobs needs logprobs=true", param="top_logprobs")
    if body.prompt_logprobs is not None and body.stream:
        raise APIError(
            HTTPStatus.BAD_REQUEST,
            "prompt_logprobs is returned in non-streamed chat completions only "
            "(/v1/completions streams them in its first chunk)",
            param="prompt_logprobs",
        )


class ChatResponseBuilder(ResponseBuilder[ChatStreamChoice, ChatChoice]):
    """`chat.completion` / `chat.completion.chunk` objects: the response carries a `message`, a chunk a
    `delta` (the role once per choice at the head of the stream, then content)."""

    chunk_type = ChatCompletionChunk
    response_type = ChatCompletionResponse

    def __init__(
        self,
        ctx: ServingContext,
        n: int,
        top_n: int,
        response_id: str,
        tools: ToolPlan | None = None,
        prompt_logprobs: int | None = None,
        prompt_text: str | None = None,
    ) -> None:
        super().__init__(response_id, ctx.served_model_name)
        # --reasoning-parser: the output splits into reasoning and content (kvflow/reasoning/).
        self.reasoning = ctx.engine.engine.reasoning
        self.prompt_open = (
            self.reasoning is not None and self.reasoning.prompt_state(prompt_text or "") == "open"
        )
        self._reasoning_streams: dict[int, ReasoningStreamer] = {}  # per choice index
        self.ctx = ctx
        self.n = n
        self.top_n = top_n  # top_logprobs per token (0: the sampled token's only)
        self.tools = tools if tools is not None and tools.mode != "none" else None
        self._tool_streams: dict[int, ToolCallStreamer] = {}  # per choice index
        self.prompt_logprobs = prompt_logprobs  # vLLM's top-n for the prompt's tokens, or None
        self._prompt_entries: list[dict[int, PromptLogprob] | None] | None = None

    def stream_head(self) -> list[BaseModel]:
        # OpenAI streams start with the role and empty content, sent before the prompt is even scheduled.
        return [
            self.chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
            for i in range(self.n)
        ]

    def stream_choice(self, index: int, output: RequestOutput) -> ChatStreamChoice | None:
        if not output.delta_text and not output.finished and not output.delta_token_ids:
            return None
        logprobs = None
        if output.delta_logprobs is not None:
            logprobs = chat_logprobs(self.ctx, output.delta_token_ids, output.delta_logprobs, self.top_n)
        out = output.outputs[0]
        reasoning, text = self._split_delta(index, output.delta_text, output.finished)
        held_back = self.reasoning is not None and not (reasoning or text)  # half a marker, say
        delta = DeltaMessage(content=None if reasoning and not text else text, reasoning_content=reasoning)
        finish_reason = out.finish_reason
        if self.tools is not None:  # tool calls are read from the content, after the reasoning
            streamer = self._tool_streams.setdefault(index, ToolCallStreamer(self.tools))
            content, calls = streamer.feed(text, output.finished)
            delta = DeltaMessage(content=content, reasoning_content=reasoning, tool_calls=calls or None)
            finish_reason = streamer.finish_reason(finish_reason)
            held_back = content is None and not calls and not reasoning
        if held_back and not output.finished and logprobs is None:
            return None
        return ChatStreamChoice(
            index=index,
            delta=delta,
            logprobs=logprobs,
            finish_reason=finish_reason,
            stop_reason=out.stop_reason,
        )

    def _split_delta(self, index: int, delta: str, finished: bool) -> tuple[str | None, str]:
        """(reasoning delta or None, content delta) of one choice's output delta."""
        if self.reasoning is None:
            return None, delta
        streamer = self._reasoning_streams.setdefault(
            index, ReasoningStreamer(self.reasoning, self.prompt_open)
        )
        reasoning, content = streamer.feed(delta, finished)
        return reasoning, content or ""

    def final_choice(self, index: int, final: RequestOutput) -> ChatChoice:
        if self.prompt_logprobs is not None and final.prompt_logprobs is not None and index == 0:
            # The n choices share one prompt: its entries go once, at the response's top level.
            self._prompt_entries = vllm_prompt_logprobs(
                final.prompt_logprobs, self.prompt_logprobs, final.prompt_token_ids
            )
        out = final.outputs[0]
        logprobs = None
        if out.logprobs is not None:
            logprobs = chat_logprobs(self.ctx, out.token_ids, out.logprobs, self.top_n)
        reasoning, text = None, out.text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.split(out.text, self.prompt_open)
            text = content or ""
        message = ChatResponseMessage(content=None if reasoning and not text else text)
        finish_reason = out.finish_reason
        if self.tools is not None:  # tool calls are read from the content, after the reasoning
            message, finish_reason = final_message(self.tools, text, finish_reason)
        message.reasoning_content = reasoning
        return ChatChoice(
            index=index,
            message=message,
            logprobs=logprobs,
            finish_reason=finish_reason,
            stop_reason=out.stop_reason,
        )

    def response(
        self, choices: list[ChatChoice], usage: UsageInfo, kvflow: dict[str, Any] | None
    ) -> BaseModel:
        response = super().response(choices, usage, kvflow)
        assert isinstance(response, ChatCompletionResponse)
        response.prompt_logprobs = self._prompt_entries
        return response


async def create_chat_completion(
    ctx: ServingContext, body: ChatCompletionRequest, raw: HTTPRequest
) -> Response:
    arrival = now()
    ctx.check_model(body.model)
    _check(body)
    ctx.limits.check_choices(1, body.n)
    messages = tool_call_arguments_as_objects(template_messages(body.messages))
    top_n = body.top_logprobs or 0
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    logprobs = top_n if body.logprobs else None

    reasoning = ctx.engine.engine.reasoning
    sampled = body
    if reasoning is not None and reasoning.keeps_special_tokens and body.skip_special_tokens:
        # harmony's headers are special tokens: the parser reads them in the text
        sampled = body.model_copy(update={"skip_special_tokens": False})

    def prepare() -> tuple[PromptInput, list[Request], ToolPlan]:
        validate = ctx.engine.engine.structured.validate
        tools = plan_tools(body, ctx.tool_call_parser, ctx.tokenizer.chat_template, validate)
        constraint = tools.constraint() or structured_outputs_from(body, validate)
        prompt = render_chat_prompt(
            ctx, messages, body.add_generation_prompt, body.chat_template_kwargs, tools.template_tools
        )
        requests = build_requests(
            ctx,
            ID_PREFIX,
            [prompt],
            sampled,
            requested,
            logprobs,
            arrival,
            constraint,
            x_request_id=raw.state.request_id,
        )
        return prompt, requests, tools

    prompt, requests, tools = await off_loop(prepare)
    response_id = f"{ID_PREFIX}-{raw.state.request_id}"
    builder = ChatResponseBuilder(ctx, body.n, top_n, response_id, tools, body.prompt_logprobs, prompt.text)
    return await serve_choices(ctx, raw, body, [prompt], requests, builder)


def chat_request_from(fields: dict[str, Any]) -> ChatCompletionRequest:
    """The chat request another API's body was translated into (kvflow/server/serving_messages.py,
    serving_responses.py), validated as a chat body is: a 400 naming the field."""
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        message, param = validation_message(exc.errors())
        raise APIError(HTTPStatus.BAD_REQUEST, message, param=param) from exc
