"""The Responses API's stream, from the chat completion chunks (serving_responses.py):

    response.created, response.in_progress
    per output item, in order (reasoning, message, function calls):
        response.output_item.added
        reasoning   response.reasoning_text.delta ... response.reasoning_text.done
        message     response.content_part.added, response.output_text.delta ...,
                    response.output_text.done, response.content_part.done
        function    response.function_call_arguments.delta ... response.function_call_arguments.done
        response.output_item.done
    response.completed (or response.incomplete at max_output_tokens), with the whole response
Every event carries `type` and a `sequence_number`; an error after the stream began is an `error`
event. Concatenated, the deltas equal the non-streamed output.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator, Callable
from typing import Any

from kvflow.server.responses_protocol import ResponsesRequest, response_object
from kvflow.server.serving_response import chat_sse_data


class ResponseEvents:
    def __init__(
        self, body: ResponsesRequest, response_id: str, on_complete: Callable[[dict[str, Any]], None]
    ) -> None:
        self.body = body
        self.response_id = response_id
        self.suffix = response_id.removeprefix("resp_")
        self.on_complete = on_complete
        self.sequence = 0
        self.model = body.model or ""
        self.items: list[dict[str, Any]] = []  # the output so far; the last may be open
        self.open: str | None = None  # the open item's kind
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.started = False

    def _event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"

    async def translate(self, chunks: AsyncIterable[str | bytes | memoryview]) -> AsyncIterator[str]:
        async for data in chat_sse_data(chunks):
            for out in self._chunk(data):
                yield out

    def _chunk(self, data: str) -> list[str]:
        if data == "[DONE]":
            return self._close() + self._complete()
        chunk = json.loads(data)
        if "error" in chunk:
            error = chunk["error"]
            return [
                self._event(
                    "error",
                    code=str(error.get("code")),
                    message=error.get("message", ""),
                    param=error.get("param"),
                )
            ]
        out: list[str] = []
        if not self.started:
            self.started, self.model = True, chunk.get("model", self.model)
            shell = self._response(status="in_progress")
            out += [
                self._event("response.created", response=shell),
                self._event("response.in_progress", response=shell),
            ]
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            out += self._delta(choice)
        return out

    def _response(self, status: str | None = None) -> dict[str, Any]:
        response = response_object(
            self.body, self.response_id, self.model, self.items, self.finish_reason, self.usage
        )
        if status is not None:
            response["status"] = status
        return response

    def _delta(self, choice: dict[str, Any]) -> list[str]:
        delta = choice.get("delta") or {}
        out: list[str] = []
        if delta.get("reasoning_content"):
            out += self._item(
                "reasoning", {"type": "reasoning", "id": f"rs_{self.suffix}", "summary": [], "content": []}
            )
            out += self._text_delta("response.reasoning_text.delta", delta["reasoning_content"])
        if delta.get("content"):
            item = {
                "type": "message",
                "id": f"msg_{self.suffix}",
                "status": "in_progress",
                "role": "assistant",
                "content": [],
            }
            out += self._item("message", item)
            out += self._text_delta("response.output_text.delta", delta["content"])
        for call in delta.get("tool_calls") or []:
            function = call.get("function") or {}
            if call.get("id"):
                out += self._close()
                calls = sum(1 for i in self.items if i["type"] == "function_call")
                item = {
                    "type": "function_call",
                    "id": f"fc_{self.suffix}_{calls}",
                    "call_id": call["id"],
                    "name": function.get("name", ""),
                    "arguments": "",
                    "status": "in_progress",
                }
                out += self._item("function_call", item)
            if function.get("arguments"):
                self.items[-1]["arguments"] += function["arguments"]
                out.append(
                    self._event(
                        "response.function_call_arguments.delta",
                        item_id=self.items[-1]["id"],
                        output_index=len(self.items) - 1,
                        delta=function["arguments"],
                    )
                )
        if choice.get("finish_reason"):
            self.finish_reason = choice["finish_reason"]
        return out

    def _item(self, kind: str, item: dict[str, Any]) -> list[str]:
        if self.open == kind and kind != "function_call":
            return []
        out = self._close()
        self.items.append(item)
        self.open = kind
        index = len(self.items) - 1
        out.append(self._event("response.output_item.added", output_index=index, item=dict(item)))
        if kind == "message":
            item["content"].append({"type": "output_text", "text": "", "annotations": []})
            part = {"type": "output_text", "text": "", "annotations": []}
            out.append(
                self._event(
                    "response.content_part.added",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    part=part,
                )
            )
        if kind == "reasoning":
            item["content"].append({"type": "reasoning_text", "text": ""})
        return out

    def _text_delta(self, kind: str, text: str) -> list[str]:
        item = self.items[-1]
        item["content"][0]["text"] += text
        return [
            self._event(
                kind, item_id=item["id"], output_index=len(self.items) - 1, content_index=0, delta=text
            )
        ]

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        item, index = self.items[-1], len(self.items) - 1
        kind, self.open = self.open, None
        out: list[str] = []
        if kind == "message":
            part = item["content"][0]
            out.append(
                self._event(
                    "response.output_text.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    text=part["text"],
                )
            )
            out.append(
                self._event(
                    "response.content_part.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    part=part,
                )
            )
        elif kind == "reasoning":
            text = item["content"][0]["text"]
            out.append(
                self._event(
                    "response.reasoning_text.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    text=text,
                )
            )
        else:
            out.append(
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    arguments=item["arguments"],
                )
            )
        if "status" in item:
            item["status"] = "completed"
        out.append(self._event("response.output_item.done", output_index=index, item=item))
        return out

    def _complete(self) -> list[str]:
        response = self._response()
        self.on_complete(response)
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return [self._event(kind, response=response)]
