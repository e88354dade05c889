"""Tool-call parsers' edge cases, the streamers (streamed pieces reassemble to the non-streamed
result) and the request checks of plan_tools. No model: pure text. The round trip through real
chat templates is in test_tool_templates.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvflow.server.errors import APIError
from kvflow.server.protocol import ChatCompletionRequest
from kvflow.server.serving_tools import (
    ToolCallStreamer,
    ToolPlan,
    final_calls,
    plan_tools,
)
from kvflow.server.tool_parsers.base import ParsedToolCall
from kvflow.server.tool_parsers.hermes import HermesToolParser
from kvflow.server.tool_parsers.llama3_json import Llama3JsonToolParser
from kvflow.structured import grammar_spec  # the tokenizer-free half of the engine's validation

TEMPLATES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}
CALL_ARGS = {"city": 'Zürich "Old Town"', "unit": "c"}


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        ("plain answer", "plain answer", []),
        ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>', None, [("f", {"a": 1})]),
        (
            'ok <tool_call>{"name": "f", "arguments": {}}</tool_call>\n'
            '<tool_call>{"name": "g", "arguments": "{\\"x\\": 2}"}</tool_call>',
            "ok",
            [("f", {}), ("g", {"x": 2})],
        ),
        (
            '<tool_call>\n{"name": "f", "arguments": {"a": 1}}',
            None,
            [("f", {"a": 1})],
        ),  # EOS before the close
        ("<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
        ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    ],
)
def test_hermes_parser(text: str, content: str | None, calls: list[tuple[str, Any]]) -> None:
    extracted = HermesToolParser().extract(text)
    assert extracted.content == content
    assert [(c.name, json.loads(c.arguments)) for c in extracted.calls] == calls


@pytest.mark.parametrize(
    ("text", "calls"),
    [
        ('{"name": "f", "parameters": {"a": 1}}', [("f", {"a": 1})]),
        (
            '<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"b": [1]}}',
            [("f", {}), ("g", {"b": [1]})],
        ),
        ("Hello there", []),
        ('{"answer": 42}', []),
        ('{"name": "f", "parameters": {', []),
    ],
)
def test_llama3_json_parser(text: str, calls: list[tuple[str, Any]]) -> None:
    extracted = Llama3JsonToolParser().extract(text)
    assert [(c.name, json.loads(c.arguments)) for c in extracted.calls] == calls
    assert extracted.content == (None if calls else text)


def reassemble(plan: ToolPlan, text: str, piece: int) -> tuple[str, list[ParsedToolCall]]:
    """Feed `text` in pieces of `piece` characters; rebuild content and calls from the deltas."""
    streamer = ToolCallStreamer(plan)
    content, names, args = "", {}, {}
    chunks = [text[i : i + piece] for i in range(0, len(text), piece)] or [""]
    for i, chunk in enumerate(chunks):
        delta_content, deltas = streamer.feed(chunk, finished=i == len(chunks) - 1)
        content += delta_content or ""
        for d in deltas:
            if d.function.name is not None:
                assert d.index not in names and d.id is not None  # the name comes once, with the id
                names[d.index] = d.function.name
            args[d.index] = args.get(d.index, "") + (d.function.arguments or "")
    return content, [ParsedToolCall(names[i], args[i]) for i in sorted(names)]


@pytest.mark.parametrize("piece", [1, 3, 1000])
def test_streamed_calls_reassemble_to_the_final_result(piece: int) -> None:
    auto = ToolPlan("auto", [WEATHER], parser=HermesToolParser())
    text = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    content, calls = reassemble(auto, text, piece)
    assert (content, calls) == final_calls(auto, text) and content == "Checking."
    plain = "no <tool_ call here"
    assert reassemble(auto, plain, piece) == (plain, [])

    required = ToolPlan("required", [WEATHER, TIME])
    text = (
        '[{"name":"get_weather","parameters":{"city":"a}\\"b","unit":"c"}},'
        '{"name":"get_time","parameters":{}}]'
    )
    content, calls = reassemble(required, text, piece)
    assert content == "" and calls == final_calls(required, text)[1]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": 'a}"b', "unit": "c"}),
        ("get_time", {}),
    ]

    named = ToolPlan("named", [WEATHER], named="get_weather")
    text = '{"city":"Oslo"}'
    assert reassemble(named, text, piece) == ("", [ParsedToolCall("get_weather", text)])


def chat_body(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], **fields})


def test_plan_tools_checks_the_request() -> None:
    named = {"type": "function", "function": {"name": "nope"}}
    for body, param in (
        (chat_body(tools=[WEATHER], tool_choice=named), "tool_choice"),
        (chat_body(tool_choice="required"), "tool_choice"),
        (chat_body(tools=[WEATHER, WEATHER]), "tools"),
        (
            chat_body(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}),
            "tool_choice",
        ),
        (
            chat_body(
                tools=[
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "object", "if": {}}},
                    }
                ],
                tool_choice="required",
            ),
            "tools",
        ),
    ):
        with pytest.raises(APIError) as info:
            plan_tools(body, "auto", None, grammar_spec)
        assert info.value.param == param
    assert plan_tools(chat_body(tools=[WEATHER]), "auto", None, grammar_spec).mode == "auto"
    assert (
        plan_tools(chat_body(tools=[WEATHER], tool_choice="none"), "auto", None, grammar_spec).template_tools
        is None
    )
    plan = plan_tools(
        chat_body(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}),
        "hermes",
        None,
        grammar_spec,
    )
    constraint = plan.constraint()
    assert (
        plan.mode == "named"
        and constraint is not None
        and constraint.json == WEATHER["function"]["parameters"]
    )
