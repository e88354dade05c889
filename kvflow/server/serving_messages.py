"""POST /v1/messages (the Anthropic Messages API) through the chat completions path: the same
template, engine, limits, metrics and timing; only the shapes differ.

    request   system -> a system message; text blocks -> content; tool_use blocks -> tool_calls;
              tool_result blocks -> "tool" messages; tools (input_schema) -> functions; tool_choice
              auto / any / tool / none -> auto / required / named / none; stop_sequences -> stop;
              thinking disabled / otherwise -> chat_template_kwargs enable_thinking and thinking
              false / true; output_config.format (json_schema) -> response_format
    response  reasoning_content (--reasoning-parser) -> a thinking block, content -> a text block,
              tool_calls -> tool_use blocks (input parsed); finish_reason stop / length / tool_calls
              -> end_turn or stop_sequence / max_tokens / tool_use; usage -> input_tokens (net of the
              prefix cache's hits), cache_read_input_tokens, output_tokens
    stream    message_start, then per block content_block_start / *_delta / content_block_stop
              (text_delta, thinking_delta, input_json_delta), message_delta (stop reason, usage),
              message_stop; an error after the stream began is an `error` event
Images and documents are refused with a 400 (the models kvflow serves read text).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator
from http import HTTPStatus
from typing import Any

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from kvflow.server.anthropic_protocol import (
    CountTokensRequest,
    ImageBlock,
    MessageParam,
    MessagesRequest,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from kvflow.server.errors import APIError, validation_message
from kvflow.server.protocol import ChatCompletionRequest
from kvflow.server.serving import ServingContext, off_loop
from kvflow.server.serving_chat import create_chat_completion, render_chat_prompt
from kvflow.server.serving_response import chat_sse_data
from kvflow.server.serving_tools import tool_call_arguments_as_objects

STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


def _text(content: str | list[TextBlock]) -> str:
    return content if isinstance(content, str) else "".join(b.text for b in content)


def chat_messages(messages: list[MessageParam], system: str | list[TextBlock] | None) -> list[dict[str, Any]]:
    """The conversation as chat messages (module docstring)."""
    out: list[dict[str, Any]] = [{"role": "system", "content": _text(system)}] if system else []
    for i, message in enumerate(messages):
        blocks = (
            [TextBlock(type="text", text=message.content)]
            if isinstance(message.content, str)
            else message.content
        )
        text, calls = "", []
        for j, block in enumerate(blocks):
            if isinstance(block, ImageBlock):
                raise APIError(
                    HTTPStatus.BAD_REQUEST,
                    f"{block.type} content is not supported: the served model reads text",
                    param=f"messages.{i}.content.{j}",
                )
            if isinstance(block, TextBlock):
                text += block.text
            elif isinstance(block, ToolUseBlock):
                arguments = json.dumps(block.input)
                calls.append(
                    {
                        "id": block.id,
                        "type": "function",
                        "function": {"name": block.name, "arguments": arguments},
                    }
                )
            elif isinstance(block, ToolResultBlock):
                out.append(
                    {"role": "tool", "tool_call_id": block.tool_use_id, "content": _text(block.content)}
                )
            elif isinstance(block, ThinkingBlock):
                continue  # earlier turns' reasoning: the templates leave it out of the prompt too
        if text or calls or not blocks:
            entry: dict[str, Any] = {"role": message.role, "content": text}
            if calls:
                entry["tool_calls"] = calls
            out.append(entry)
    return out


def _tools(body: MessagesRequest | CountTokensRequest) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if body.tools:
        fields["tools"] = [
            {
                "type": "function",
                "function": {"name": t.name, "description": t.description, "parameters": t.input_schema},
            }
            for t in body.tools
        ]
    choice = body.tool_choice
    if choice is not None:
        if choice.type == "tool":
            if not choice.name:
                raise APIError(
                    HTTPStatus.BAD_REQUEST, "tool_choice of type tool needs a name", param="tool_choice.name"
                )
            fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
        fields["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    if body.thinking is not None:
        enabled = body.thinking.type != "disabled"
        fields["chat_template_kwargs"] = {"enable_thinking": enabled, "thinking": enabled}
    return fields


def to_chat_request(body: MessagesRequest) -> ChatCompletionRequest:
    fields: dict[str, Any] = {
        "model": body.model,
        "messages": chat_messages(body.messages, body.system),
        "max_tokens": body.max_tokens,
        "stream": body.stream,
        **_tools(body),
    }
    if body.stream:
        fields["stream_options"] = {"include_usage": True}
    for name in ("temperature", "top_p", "top_k"):
        if getattr(body, name) is not None:
            fields[name] = getattr(body, name)
    if body.stop_sequences:
        fields["stop"] = body.stop_sequences
    output_format = body.output_config.format if body.output_config is not None else None
    if output_format is not None:
        fields["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "output", "schema": output_format.schema_},
        }
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        message, param = validation_message(exc.errors())
        raise APIError(HTTPStatus.BAD_REQUEST, message, param=param) from exc


def _stop(finish_reason: str | None, stop_reason: Any, body: MessagesRequest) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) in Anthropic's terms."""
    if (
        finish_reason == "stop"
        and isinstance(stop_reason, str)
        and stop_reason in (body.stop_sequences or ())
    ):
        return "stop_sequence", stop_reason
    return STOP_REASONS.get(finish_reason or "", "end_turn"), None


def _usage(usage: dict[str, Any]) -> dict[str, int]:
    cached = int(((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0)
    return {
        "input_tokens": int(usage.get("prompt_tokens", 0)) - cached,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
        "output_tokens": int(usage.get("completion_tokens", 0)),
    }


def to_message(chat: dict[str, Any], body: MessagesRequest) -> dict[str, Any]:
    choice = chat["choices"][0]
    message = choice["message"]
    content: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        arguments = call["function"]["arguments"]
        content.append(
            {
                "type": "tool_use",
                "id": call["id"],
                "name": call["function"]["name"],
                "input": json.loads(arguments or "{}"),
            }
        )
    stop_reason, stop_sequence = _stop(choice.get("finish_reason"), choice.get("stop_reason"), body)
    out = {
        "id": "msg_" + chat["id"].removeprefix("chatcmpl-"),
        "type": "message",
        "role": "assistant",
        "model": chat["model"],
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": _usage(chat.get("usage") or {}),
    }
    if "kvflow" in chat:
        out["kvflow"] = chat["kvflow"]
    return out


async def create_message(ctx: ServingContext, body: MessagesRequest, raw: HTTPRequest) -> Response:
    chat = await create_chat_completion(ctx, to_chat_request(body), raw)
    if isinstance(chat, StreamingResponse):
        events = MessageEvents(body)
        return StreamingResponse(events.translate(chat.body_iterator), media_type="text/event-stream")
    if chat.status_code != HTTPStatus.OK:
        return chat
    return JSONResponse(to_message(json.loads(bytes(chat.body)), body))


async def count_message_tokens(ctx: ServingContext, body: CountTokensRequest) -> dict[str, int]:
    """POST /v1/messages/count_tokens: the prompt's tokens as /v1/messages would render it."""
    ctx.check_model(body.model)
    fields = _tools(body)
    messages = tool_call_arguments_as_objects(chat_messages(body.messages, body.system))
    kwargs, tools = fields.get("chat_template_kwargs"), fields.get("tools")
    prompt = await off_loop(lambda: render_chat_prompt(ctx, messages, True, kwargs, tools))
    return {"input_tokens": len(prompt.token_ids)}


def sse(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


class MessageEvents:
    """Chat completion chunks -> the Messages stream's events (module docstring)."""

    def __init__(self, body: MessagesRequest) -> None:
        self.body = body
        self.index = -1  # the open content block's index
        self.open: str | None = None  # its type
        self.finish: tuple[str | None, Any] = (None, None)
        self.usage: dict[str, Any] = {}
        self.started = False

    async def translate(self, chunks: AsyncIterable[str | bytes | memoryview]) -> AsyncIterator[str]:
        async for data in chat_sse_data(chunks):
            for out in self._event(data):
                yield out

    def _event(self, data: str) -> list[str]:
        if data == "[DONE]":
            return self._close_block() + self._finish()
        chunk = json.loads(data)
        if "error" in chunk:  # the chat stream's mid-stream error event
            error = chunk["error"]
            kind = "overloaded_error" if error.get("code") == HTTPStatus.SERVICE_UNAVAILABLE else "api_error"
            return [
                sse("error", {"type": "error", "error": {"type": kind, "message": error.get("message", "")}})
            ]
        out = self._start(chunk) if not self.started else []
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            out += self._delta(choice)
        return out

    def _start(self, chunk: dict[str, Any]) -> list[str]:
        self.started = True
        message = {
            "id": "msg_" + chunk["id"].removeprefix("chatcmpl-"),
            "type": "message",
            "role": "assistant",
            "model": chunk["model"],
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0},
        }
        return [
            sse("message_start", {"type": "message_start", "message": message}),
            sse("ping", {"type": "ping"}),
        ]

    def _delta(self, choice: dict[str, Any]) -> list[str]:
        delta = choice.get("delta") or {}
        out: list[str] = []
        if delta.get("reasoning_content"):
            out += self._block("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            out.append(self._block_delta({"type": "thinking_delta", "thinking": delta["reasoning_content"]}))
        if delta.get("content"):
            out += self._block("text", {"type": "text", "text": ""})
            out.append(self._block_delta({"type": "text_delta", "text": delta["content"]}))
        for call in delta.get("tool_calls") or []:
            function = call.get("function") or {}
            if call.get("id"):  # a new call: its own block
                out += self._close_block()
                block = {"type": "tool_use", "id": call["id"], "name": function.get("name", ""), "input": {}}
                out += self._block("tool_use", block)
            if function.get("arguments"):
                out.append(
                    self._block_delta({"type": "input_json_delta", "partial_json": function["arguments"]})
                )
        if choice.get("finish_reason"):
            self.finish = (choice["finish_reason"], choice.get("stop_reason"))
        return out

    def _block(self, kind: str, start: dict[str, Any]) -> list[str]:
        if self.open == kind:
            return []
        out = self._close_block()
        self.index += 1
        self.open = kind
        return [
            *out,
            sse(
                "content_block_start",
                {"type": "content_block_start", "index": self.index, "content_block": start},
            ),
        ]

    def _block_delta(self, delta: dict[str, Any]) -> str:
        return sse(
            "content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta}
        )

    def _close_block(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [sse("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _finish(self) -> list[str]:
        stop_reason, stop_sequence = _stop(*self.finish, self.body)
        delta = {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
        }
        delta["usage"] = _usage(self.usage)
        return [sse("message_delta", delta), sse("message_stop", {"type": "message_stop"})]
