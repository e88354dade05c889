"""gpt-oss's tool calls (`--tool-call-parser openai`, vLLM's name), read from the content that the
harmony reasoning parser (`--reasoning-parser openai_gptoss`, kvflow/reasoning/harmony.py) leaves:
each call is a commentary message to a function, kept there whole:

    <|channel|>commentary to=functions.NAME<|message|>{"arg": ...}<|call|>

Without that reasoning parser the special tokens are not in the text, and no call is found.
"""

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

START = "<|channel|>commentary to=functions."
# A call closed by <|call|> (or <|end|>), or the last one left open at the end of the output.
_CALL = re.compile(
    r"<\|channel\|>commentary to=functions\.([^\s<]+)<\|message\|>(.*?)(?:<\|call\|>|<\|end\|>|$)", re.DOTALL
)


class OpenAIHarmonyToolParser(ToolParser):
    def extract(self, text: str) -> ExtractedToolCalls:
        start = text.find(START)
        if start < 0:
            return ExtractedToolCalls(text, [])
        calls: list[ParsedToolCall] = []
        rest: list[str] = [text[:start]]
        position = start
        for match in _CALL.finditer(text, start):
            rest.append(text[position : match.start()])
            position = match.end()
            try:
                arguments = json.loads(match.group(2))
                call = call_from_json({"name": match.group(1), "arguments": arguments}, "arguments")
            except json.JSONDecodeError:
                call = None
            if call is None:  # not a call after all: the whole output is content
                return ExtractedToolCalls(text, [])
            calls.append(call)
        rest.append(text[position:])
        content = "".join(rest).rstrip()
        return ExtractedToolCalls(content or None, calls)

    def content_prefix(self, text: str) -> int:
        return partial_marker_start(text, START)
