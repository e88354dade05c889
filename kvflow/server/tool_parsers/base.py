"""What a tool parser returns, and the interface every parser implements."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str  # a JSON object as text (OpenAI's function.arguments)


@dataclass(frozen=True)
class ExtractedToolCalls:
    content: str | None  # the text outside the calls; None when there is none
    calls: list[ParsedToolCall]


class ToolParser(ABC):
    """Reads tool calls out of a finished output (tool_choice=auto). Streaming holds text back from
    `might_start_call` on, and extracts the calls once the output is complete."""

    @abstractmethod
    def extract(self, text: str) -> ExtractedToolCalls:
        """Calls found in `text` (malformed ones are left as content), and the remaining content."""

    @abstractmethod
    def content_prefix(self, text: str) -> int:
        """How many leading characters of a partial output are certainly content (not part of a
        call): the streamer may send them now."""


def call_from_json(obj: Any, arguments_key: str) -> ParsedToolCall | None:
    """{"name": str, arguments_key: object} -> a call; anything else -> None (not a call)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(arguments_key, {})
    if isinstance(args, str):  # some models write the arguments as a JSON string already
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def partial_marker_start(text: str, marker: str) -> int:
    """The index where a (possibly partial) `marker` starts at the end of `text`, or len(text)."""
    found = text.find(marker)
    if found >= 0:
        return found
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return len(text) - size
    return len(text)
