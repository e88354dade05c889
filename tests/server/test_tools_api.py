"""Structured output and tool calling through the official `openai` client against a live server on
the bundled model (which knows nothing about tools or JSON: the grammar alone makes outputs valid).
Sampling at temperature 1 with a seed, so streamed and non-streamed runs of one request produce the
same tokens and can be compared exactly."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pydantic
import pytest
from fixtures.live_server import ENGINE_KWARGS, LiveServer

from kvflow.assets import bundled_model_dir
from kvflow.server.launcher import ServerConfig

MODEL = "tiny-target"
WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME_PARAMS = {
    "type": "object",
    "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMS}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME_PARAMS}},
]
SCHEMAS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
MESSAGES: list[Any] = [{"role": "user", "content": "What is the weather in Oslo?"}]
MAX_TOKENS = 120


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=10)
    age: int = pydantic.Field(ge=0, le=120)
    role: str = pydantic.Field(json_schema_extra={"enum": ["admin", "user"]})


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    engine = {**ENGINE_KWARGS, "max_model_len": 1024}  # the tool list alone is ~200 prompt tokens
    live = LiveServer(bundled_model_dir(), ServerConfig(served_model_name=MODEL), engine)
    yield live
    live.stop()


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def test_parse_returns_the_pydantic_object(client: openai.OpenAI) -> None:
    for seed in range(3):
        completion = client.chat.completions.parse(
            model=MODEL, messages=MESSAGES, response_format=Person, max_tokens=MAX_TOKENS, seed=seed
        )
        parsed = completion.choices[0].message.parsed
        assert isinstance(parsed, Person) and parsed.role in ("admin", "user")


def check_calls(calls: Any, expected_names: set[str] | None = None) -> list[tuple[str, str]]:
    assert calls, "no tool calls"
    assert len({c.id for c in calls}) == len(calls)
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        assert expected_names is None or call.function.name in expected_names
    return [(c.function.name, c.function.arguments) for c in calls]


def streamed_calls(client: openai.OpenAI, **request: Any) -> tuple[list[tuple[str, str]], str | None]:
    """Reassemble a streamed response's tool calls (name once, then argument fragments)."""
    names: dict[int, str] = {}
    args: dict[int, str] = {}
    finish = None
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **request):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                if delta.function and delta.function.name:
                    assert delta.index not in names and delta.id
                    names[delta.index] = delta.function.name
                args[delta.index] = args.get(delta.index, "") + (
                    (delta.function and delta.function.arguments) or ""
                )
    return [(names[i], args[i]) for i in sorted(names)], finish


@pytest.mark.parametrize("seed", [0, 1])
def test_required_tool_calls_validate_and_stream_identically(client: openai.OpenAI, seed: int) -> None:
    request = {
        "messages": MESSAGES,
        "tools": TOOLS,
        "tool_choice": "required",
        "max_tokens": MAX_TOKENS,
        "seed": seed,
    }
    response = client.chat.completions.create(model=MODEL, **request)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = check_calls(choice.message.tool_calls)
    assert streamed_calls(client, **request) == (calls, "tool_calls")


def test_named_and_single_tool_choice(client: openai.OpenAI) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    request = {
        "messages": MESSAGES,
        "tools": TOOLS,
        "tool_choice": named,
        "max_tokens": MAX_TOKENS,
        "seed": 3,
    }
    response = client.chat.completions.create(model=MODEL, **request)
    calls = check_calls(response.choices[0].message.tool_calls, {"get_time"})
    assert len(calls) == 1 and re.fullmatch(r"[A-Z]{3}", json.loads(calls[0][1])["zone"])
    assert streamed_calls(client, **request) == (calls, "tool_calls")
    single = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=MAX_TOKENS,
        seed=5,
    )
    assert len(check_calls(single.choices[0].message.tool_calls)) == 1


def test_auto_passes_tools_to_the_template_and_returns_content(client: openai.OpenAI) -> None:
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0)
    auto = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=8, temperature=0
    )
    assert (
        auto.usage and plain.usage and auto.usage.prompt_tokens > plain.usage.prompt_tokens
    )  # tools in the prompt
    # This model never writes a <tool_call> block: auto leaves its text as content.
    assert auto.choices[0].message.tool_calls is None and auto.choices[0].message.content


def test_regex_choice_and_schema_on_both_endpoints(client: openai.OpenAI) -> None:
    regex = r"[a-z]{3}-\d{2}"
    out = client.completions.create(
        model=MODEL, prompt="id:", max_tokens=20, extra_body={"structured_outputs": {"regex": regex}}
    )
    assert re.fullmatch(regex, out.choices[0].text) and out.choices[0].finish_reason == "stop"
    out = client.completions.create(
        model=MODEL, prompt="x", max_tokens=20, extra_body={"guided_choice": ["alpha", "beta"]}
    )
    assert out.choices[0].text in ("alpha", "beta")
    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=20, extra_body={"guided_regex": regex}, seed=1
    )
    assert re.fullmatch(regex, chat.choices[0].message.content or "")
    schema = {"name": "w", "schema": WEATHER_PARAMS, "strict": True}
    chat = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=MAX_TOKENS,
        response_format={"type": "json_schema", "json_schema": schema},
    )
    jsonschema.validate(json.loads(chat.choices[0].message.content or ""), WEATHER_PARAMS)
    out = client.completions.create(
        model=MODEL,
        prompt="x",
        max_tokens=MAX_TOKENS,
        extra_body={"guided_json": TIME_PARAMS, "kvflow": {"timing": True}},
    )
    jsonschema.validate(json.loads(out.choices[0].text), TIME_PARAMS)
    timing = (out.model_extra or {})["kvflow"]["timing"]
    assert timing["grammar_compile_ms"] is not None and timing["grammar_compile_ms"] >= 0


@pytest.mark.parametrize(
    ("body", "param", "reason"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
            "needs",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nope"}},
                }
            },
            "response_format.json_schema.schema",
            "Invalid type",
        ),
        (
            {"structured_outputs": {"json": {"type": "object", "if": {}}}},
            "structured_outputs.json",
            "Unimplemented",
        ),
        ({"guided_regex": "a(b"}, "guided_regex", "unclosed group"),
        ({"guided_grammar": "start: <[99999999]>"}, "guided_grammar", "Token range end too large"),
        ({"guided_grammar": "start: <|no_such_token|>"}, "guided_grammar", "unknown special token"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "at most one"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "nope",
        ),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
    ],
)
def test_bad_constraints_are_400_naming_the_field(
    server: LiveServer, body: dict[str, Any], param: str, reason: str
) -> None:
    with server.client() as http:
        response = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and reason in error["message"]


def test_compile_time_histogram(server: LiveServer, client: openai.OpenAI) -> None:
    before = server.metric("grammar_compile_time_seconds_count", model_name=MODEL)
    client.completions.create(
        model=MODEL, prompt="x", max_tokens=10, extra_body={"guided_choice": ["yes", "no"]}
    )
    assert server.metric("grammar_compile_time_seconds_count", model_name=MODEL) == before + 1
    with httpx.Client(base_url=server.base_url) as http:
        assert "kvflow:grammar_compile_time_seconds_bucket" in http.get("/metrics").text


def test_auto_extracts_a_hermes_call_streamed_and_not(client: openai.OpenAI) -> None:
    """The model is held (by a regex) to text that contains a Hermes call after some content; `auto`
    must read it out of the text, the same way streamed and not."""
    call = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "[A-Z]{3}"}}\n</tool_call>'
    regex = "Sure[a-z ]{0,6}\\.\n" + re.escape(call).replace(re.escape("[A-Z]{3}"), "[A-Z]{3}")
    request = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": MAX_TOKENS, "seed": 2}
    response = client.chat.completions.create(model=MODEL, extra_body={"guided_regex": regex}, **request)
    message = response.choices[0].message
    assert response.choices[0].finish_reason == "tool_calls"
    assert message.content is not None and message.content.startswith("Sure")
    calls = check_calls(message.tool_calls, {"get_time"})
    content, streamed, finish = "", {}, None
    for chunk in client.chat.completions.create(
        model=MODEL, stream=True, extra_body={"guided_regex": regex}, **request
    ):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                name = delta.function.name if delta.function else None
                entry = streamed.setdefault(delta.index, [name, ""])
                entry[1] += (delta.function and delta.function.arguments) or ""
    assert content == message.content and finish == "tool_calls"
    assert [tuple(v) for _, v in sorted(streamed.items())] == calls
