"""Llama-3.1's JSON tool calls (its template's "JSON based tool calling"): the whole output is
`{"name": "f", "parameters": {...}}`, optionally after <|python_tag|>, several separated by ";"."""

from __future__ import annotations

import json

from kvflow.server.tool_parsers.base import ExtractedToolCalls, ParsedToolCall, ToolParser, call_from_json

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    def extract(self, text: str) -> ExtractedToolCalls:
        body = text.strip()
        if body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG) :].lstrip()
        if not body.startswith("{"):
            return ExtractedToolCalls(text, [])
        decoder = json.JSONDecoder()
        calls: list[ParsedToolCall] = []
        pos = 0
        while pos < len(body):
            try:
                obj, end = decoder.raw_decode(body, pos)
            except json.JSONDecodeError:
                return ExtractedToolCalls(text, [])
            call = call_from_json(obj, "parameters") or call_from_json(obj, "arguments")
            if call is None:
                return ExtractedToolCalls(text, [])
            calls.append(call)
            pos = end
            while pos < len(body) and body[pos] in " \n\t;":
                pos += 1
        return ExtractedToolCalls(None, calls)

    def content_prefix(self, text: str) -> int:
        """A call starts the output; text that does not start like one is content throughout."""
        head = text.lstrip()
        if not head or head.startswith("{") or PYTHON_TAG.startswith(head[: len(PYTHON_TAG)]):
            return 0
        return len(text)
