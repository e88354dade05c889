"""Hermes format (Qwen2.5, Qwen3, NousResearch Hermes): each call is
`<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>`; content may come before the calls."""

from __future__ import annotations

import json
import re

from kvflow.server.tool_parsers.base import (
    ExtractedToolCalls,
    ParsedToolCall,
    ToolParser,
    call_from_json,
    partial_marker_start,
)

START, END = "<tool_call>", "</tool_call>"
# A block closed by </tool_call>, or the last one left open at the end of the output (EOS came first).
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


class HermesToolParser(ToolParser):
    def extract(self, text: str) -> ExtractedToolCalls:
        start = text.find(START)
        if start < 0:
            return ExtractedToolCalls(text, [])
        calls: list[ParsedToolCall] = []
        for match in _BLOCK.finditer(text, start):
            try:
                call = call_from_json(json.loads(match.group(1)), "arguments")
            except json.JSONDecodeError:
                call = None
            if call is None:  # not a call after all: the whole output is content
                return ExtractedToolCalls(text, [])
            calls.append(call)
        content = text[:start].rstrip()  # leading whitespace stays: a stream has sent it already
        return ExtractedToolCalls(content or None, calls)

    def content_prefix(self, text: str) -> int:
        return partial_marker_start(text, START)
