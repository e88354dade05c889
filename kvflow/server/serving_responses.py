"""POST /v1/responses (OpenAI's Responses API) through the chat completions path: the same template,
engine, limits, metrics and timing; only the shapes differ (the stream: responses_stream.py).

    input      a string (one user message) or items: messages (role user / system / developer /
               assistant; input_text / output_text parts), function_call, function_call_output
               (-> assistant tool_calls, "tool" messages); reasoning items are dropped, as the
               templates drop earlier turns' reasoning; images and files are refused (400)
    instructions -> a system message first (not carried over to the next response, as OpenAI's)
    previous_response_id -> that response's conversation (stored, response_store.py) before the input
    tools (function) / tool_choice / parallel_tool_calls -> the chat's; text.format json_schema /
               json_object -> response_format; reasoning.effort "none" -> thinking off in the template
    output     reasoning (--reasoning-parser) -> a reasoning item, content -> a message item with one
               output_text part, tool_calls -> function_call items; finish_reason length -> status
               incomplete (incomplete_details.reason max_output_tokens)
"""

from __future__ import annotations

import json
import uuid
from http import HTTPStatus
from typing import Any

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvflow.server.errors import APIError
from kvflow.server.protocol import ChatCompletionRequest
from kvflow.server.response_store import ResponseStore
from kvflow.server.responses_protocol import ResponsesRequest, response_object
from kvflow.server.responses_stream import ResponseEvents
from kvflow.server.serving import ServingContext
from kvflow.server.serving_chat import chat_request_from, create_chat_completion

TEXT_PARTS = ("input_text", "output_text", "text")
REFUSED_FIELDS = ("background", "conversation", "prompt")


def _bad(message: str, param: str | None = None) -> APIError:
    return APIError(HTTPStatus.BAD_REQUEST, message, param=param)


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where} must be a string or a list of content parts", where)
    text = ""
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            raise _bad(
                f"{where}.{j}: content of type {kind!r} is not supported (text parts only)", f"{where}.{j}"
            )
        text += str(part.get("text", ""))
    return text


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The input as chat messages (module docstring)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise _bad(f"input.{i}.role must be user, system, developer or assistant", f"input.{i}.role")
            content = _content_text(item.get("content", ""), f"input.{i}.content")
            out.append({"role": "system" if role == "developer" else role, "content": content})
        elif kind == "function_call":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") is not None:
                out[-1]["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": item["call_id"],
                    "content": _content_text(item["output"], f"input.{i}.output"),
                }
            )
        elif kind != "reasoning":
            raise _bad(f"input.{i}: items of type {kind!r} are not supported", f"input.{i}.type")
    return out


def _chat_fields(body: ResponsesRequest) -> dict[str, Any]:
    fields: dict[str, Any] = {"parallel_tool_calls": body.parallel_tool_calls}
    if body.tools:
        for i, tool in enumerate(body.tools):
            if tool.get("type") != "function":
                raise _bad(
                    f"tools.{i}: the built-in tool {tool.get('type')!r} is not supported (function tools)",
                    f"tools.{i}.type",
                )
        fields["tools"] = [
            {
                "type": "function",
                "function": {
                    k: t[k] for k in ("name", "description", "parameters", "strict") if t.get(k) is not None
                },
            }
            for t in body.tools
        ]
    if body.tool_choice is not None:
        choice = body.tool_choice
        fields["tool_choice"] = (
            choice if isinstance(choice, str) else {"type": "function", "function": {"name": choice.name}}
        )
    fmt = body.text.format if body.text is not None else None
    if fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise _bad("text.format of type json_schema needs a schema", "text.format.schema")
        schema = {"name": fmt.name or "output", "schema": fmt.schema_, "strict": fmt.strict}
        fields["response_format"] = {"type": "json_schema", "json_schema": schema}
    elif fmt is not None and fmt.type == "json_object":
        fields["response_format"] = {"type": "json_object"}
    if body.reasoning is not None and body.reasoning.effort == "none":
        fields["chat_template_kwargs"] = {"enable_thinking": False, "thinking": False}
    for name in ("temperature", "top_p", "user"):
        if getattr(body, name) is not None:
            fields[name] = getattr(body, name)
    return fields


def conversation(body: ResponsesRequest, store: ResponseStore) -> list[dict[str, Any]]:
    """The messages the model sees, without instructions: the previous response's, then the input."""
    earlier: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        stored = store.get(body.previous_response_id)
        if stored is None:
            raise APIError(
                HTTPStatus.NOT_FOUND,
                f"previous response {body.previous_response_id!r} is not stored here (unknown, dropped from "
                "the bounded store, or made before a restart)",
                param="previous_response_id",
            )
        earlier = stored.messages
    return [*earlier, *input_messages(body.input)]


def to_chat_request(body: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    for name in REFUSED_FIELDS:
        if getattr(body, name) not in (None, False):
            raise _bad(f"{name} is not supported by this server", name)
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    fields = {
        "model": body.model,
        "messages": [*system, *messages],
        "stream": body.stream,
        **_chat_fields(body),
    }
    if body.max_output_tokens is not None:
        fields["max_tokens"] = body.max_output_tokens
    if body.stream:
        fields["stream_options"] = {"include_usage": True}
    return chat_request_from(fields)


def output_items(response_id: str, message: dict[str, Any]) -> list[dict[str, Any]]:
    suffix = response_id.removeprefix("resp_")
    items: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        text = {"type": "reasoning_text", "text": message["reasoning_content"]}
        items.append({"type": "reasoning", "id": f"rs_{suffix}", "summary": [], "content": [text]})
    if message.get("content"):
        part = {"type": "output_text", "text": message["content"], "annotations": []}
        items.append(
            {
                "type": "message",
                "id": f"msg_{suffix}",
                "status": "completed",
                "role": "assistant",
                "content": [part],
            }
        )
    for i, call in enumerate(message.get("tool_calls") or []):
        function = call["function"]
        items.append(
            {
                "type": "function_call",
                "id": f"fc_{suffix}_{i}",
                "call_id": call["id"],
                "name": function["name"],
                "arguments": function["arguments"],
                "status": "completed",
            }
        )
    return items


def assistant_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output as the chat messages the next turn's conversation holds."""
    return input_messages([item for item in output if item["type"] != "reasoning"])


def remember(
    store: ResponseStore, body: ResponsesRequest, messages: list[dict[str, Any]], response: dict[str, Any]
) -> None:
    if body.store:
        store.put(response["id"], [*messages, *assistant_messages(response["output"])], response)


async def create_response(
    ctx: ServingContext, store: ResponseStore, body: ResponsesRequest, raw: HTTPRequest
) -> Response:
    messages = conversation(body, store)
    response_id = f"resp_{uuid.uuid4().hex}"
    chat = await create_chat_completion(ctx, to_chat_request(body, messages), raw)
    if isinstance(chat, StreamingResponse):
        events = ResponseEvents(body, response_id, lambda response: remember(store, body, messages, response))
        return StreamingResponse(events.translate(chat.body_iterator), media_type="text/event-stream")
    if chat.status_code != HTTPStatus.OK:
        return chat
    data = json.loads(bytes(chat.body))
    choice = data["choices"][0]
    output = output_items(response_id, choice["message"])
    response = response_object(
        body, response_id, data["model"], output, choice.get("finish_reason"), data.get("usage")
    )
    if "kvflow" in data:
        response["kvflow"] = data["kvflow"]
    remember(store, body, messages, response)
    return JSONResponse(response)
