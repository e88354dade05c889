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
    stream    the same, as Messages events (messages_stream.py)
Images and documents are refused with a 400 (the models kvflow serves read text).
"""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import Any

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvflow.server.anthropic_protocol import (
    CountTokensRequest,
    ImageBlock,
    MessageParam,
    MessagesRequest,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
    message_usage,
    stop_fields,
)
from kvflow.server.errors import APIError
from kvflow.server.messages_stream import MessageEvents
from kvflow.server.protocol import ChatCompletionRequest
from kvflow.server.serving import ServingContext, off_loop
from kvflow.server.serving_chat import chat_request_from, create_chat_completion, render_chat_prompt
from kvflow.server.serving_tools import tool_call_arguments_as_objects


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
    return chat_request_from(fields)


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
    stop_reason, stop_sequence = stop_fields(choice.get("finish_reason"), choice.get("stop_reason"), body)
    out = {
        "id": "msg_" + chat["id"].removeprefix("chatcmpl-"),
        "type": "message",
        "role": "assistant",
        "model": chat["model"],
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": message_usage(chat.get("usage") or {}),
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
