"""tool_choice=required / named: the output is held to a JSON schema built from the tools' parameter
schemas (vLLM's formats), so it always parses:

    named     the output IS the function's arguments object
    required  [{"name": "<tool>", "parameters": {...}}, ...]  (one item without parallel_tool_calls)

The grammar writes compact JSON with keys in schema order (grammar_spec.py), so a call's arguments
are a raw substring of the output: `split_required_calls` finds each call's name and the span of its
"parameters" value, even in a partial output. Streaming sends those spans' growth as argument
fragments, and the non-streamed response uses the same spans: the two always agree.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
_CALL_HEAD = re.compile(r'\{"name":("(?:[^"\\]|\\.)*"),"parameters":')


def parameters_schema(function: dict[str, Any]) -> dict[str, Any]:
    return function.get("parameters") or EMPTY_PARAMETERS


def required_schema(functions: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """One or more calls of the given functions, each {"name": const, "parameters": its schema}."""
    items = [
        {
            "type": "object",
            "properties": {"name": {"const": f["name"]}, "parameters": parameters_schema(f)},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for f in functions
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


@dataclass
class CallSpan:
    """One call in a (partial) required-format output: `arguments` is the text of its parameters so
    far; `complete` once the value has closed."""

    name: str
    arguments: str
    complete: bool


def split_required_calls(text: str) -> list[CallSpan]:
    """The calls of a (partial) `[{"name":...,"parameters":...},...]` output, in order."""
    calls: list[CallSpan] = []
    pos = 0
    while True:
        head = _CALL_HEAD.search(text, pos)
        if head is None:
            return calls
        name = json.loads(head.group(1))
        start = head.end()
        end = _value_end(text, start)
        if end is None:
            calls.append(CallSpan(name, text[start:], complete=False))
            return calls
        calls.append(CallSpan(name, text[start:end], complete=True))
        pos = end


def _value_end(text: str, start: int) -> int | None:
    """The index just past the JSON value starting at `start`, or None if it has not closed yet.
    Tracks nesting and strings (with escapes); a scalar value ends at the next , } or ]."""
    depth = 0
    in_string = escaped = False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
                if depth == 0:
                    return i + 1
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            if depth == 0:
                return i  # a scalar ended by its container
            depth -= 1
            if depth == 0:
                return i + 1
        elif ch == "," and depth == 0:
            return i
    return None
