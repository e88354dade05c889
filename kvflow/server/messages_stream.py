"""The Messages API's stream, from the chat completion chunks (serving_messages.py): message_start,
then per content block content_block_start / *_delta / content_block_stop (text_delta,
thinking_delta, input_json_delta), message_delta (stop reason, usage), message_stop; an error after
the stream began is an `error` event."""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator
from http import HTTPStatus
from typing import Any

from kvflow.server.anthropic_protocol import MessagesRequest, message_usage, stop_fields
from kvflow.server.serving_response import chat_sse_data


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
        stop_reason, stop_sequence = stop_fields(*self.finish, self.body)
        delta = {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
        }
        delta["usage"] = message_usage(self.usage)
        return [sse("message_delta", delta), sse("message_stop", {"type": "message_stop"})]
