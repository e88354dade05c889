"""The Responses API (POST /v1/responses, kvflow/server/serving_responses.py) through the official
`openai` client: plain (the text equals the chat completion of the same conversation), streamed (the
events reassemble into the same response, in order), instructions, a named function tool (a
function_call item whose arguments parse) and its function_call_output turn, previous_response_id
(the earlier turn is in the prompt: the prefix cache reports it), retrieve and delete, a JSON
schema in text.format, and bad input in OpenAI's error shape; the store's bounds."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
from fixtures.live_server import LiveServer
from openai import BadRequestError, NotFoundError, OpenAI

from kvflow.server.response_store import ResponseStore

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather of a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
    },
}


def client(server: LiveServer) -> OpenAI:
    return OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def long_context(start_server: Callable[..., LiveServer]) -> LiveServer:
    return start_server(engine={"max_model_len": 1024, "num_kv_blocks": 256})


def test_a_response_equals_the_chat_completion_of_the_same_conversation(long_context: LiveServer) -> None:
    server = long_context
    response = client(server).responses.create(
        model=server.model,
        input="Tell me about foxes.",
        instructions="Be terse.",
        max_output_tokens=12,
        temperature=0,
    )
    assert response.id.startswith("resp_") and response.status in ("completed", "incomplete")
    chat = client(server).chat.completions.create(
        model=server.model,
        messages=[
            {"role": "system", "content": "Be terse."},
            {"role": "user", "content": "Tell me about foxes."},
        ],
        max_tokens=12,
        temperature=0,
    )
    assert response.output_text == chat.choices[0].message.content
    assert response.usage is not None and response.usage.output_tokens == chat.usage.completion_tokens


def test_the_stream_reassembles_into_the_same_response(long_context: LiveServer) -> None:
    server = long_context
    api = client(server)
    whole = api.responses.create(
        model=server.model, input="Tell me about foxes.", max_output_tokens=10, temperature=0
    )
    events = list(
        api.responses.create(
            model=server.model, input="Tell me about foxes.", max_output_tokens=10, temperature=0, stream=True
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] in (
        "response.completed",
        "response.incomplete",
    )
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_function_and_its_output_turn(long_context: LiveServer, stream: bool) -> None:
    server = long_context
    api = client(server)
    kwargs = {
        "model": server.model,
        "input": "Weather in Paris?",
        "tools": [WEATHER],
        "max_output_tokens": 40,
        "temperature": 0,
    }
    kwargs["tool_choice"] = {"type": "function", "name": "get_weather"}
    if stream:
        events = list(api.responses.create(**kwargs, stream=True))
        response = events[-1].response
    else:
        response = api.responses.create(**kwargs)
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert isinstance(json.loads(calls[0].arguments)["city"], str)
    follow = api.responses.create(
        model=server.model,
        previous_response_id=response.id,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}],
        tools=[WEATHER],
        max_output_tokens=4,
    )
    assert follow.previous_response_id == response.id and follow.usage.input_tokens_details.cached_tokens > 0


def test_previous_response_id_continues_the_conversation_and_the_store_answers(
    long_context: LiveServer,
) -> None:
    server = long_context
    api = client(server)
    first = api.responses.create(
        model=server.model, input="Tell me about owls.", max_output_tokens=6, temperature=0
    )
    second = api.responses.create(
        model=server.model, previous_response_id=first.id, input="And bats?", max_output_tokens=6
    )
    # The second prompt holds the first turn: its tokens come from the prefix cache.
    assert second.usage.input_tokens > first.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens >= 16
    assert api.responses.retrieve(first.id).output_text == first.output_text
    api.responses.delete(first.id)
    with pytest.raises(NotFoundError):
        api.responses.retrieve(first.id)
    with pytest.raises(NotFoundError, match="not stored here"):
        api.responses.create(
            model=server.model, previous_response_id=first.id, input="again", max_output_tokens=2
        )


def test_a_json_schema_format_holds_the_output(long_context: LiveServer) -> None:
    server = long_context
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}},
        "required": ["n"],
        "additionalProperties": False,
    }
    # Bounded and greedy, so the text ends within max_output_tokens (sampled at temperature 1 an
    # unbounded integer can run past it: tests/server/test_anthropic_messages.py, session 35).
    response = client(server).responses.create(
        model=server.model,
        input="A number, please.",
        max_output_tokens=30,
        temperature=0,
        text={"format": {"type": "json_schema", "name": "number", "schema": schema, "strict": True}},
    )
    assert isinstance(json.loads(response.output_text)["n"], int)


def test_bad_input_gets_openais_error_shape(long_context: LiveServer) -> None:
    server = long_context
    api = client(server)
    image = [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]
    with pytest.raises(BadRequestError, match="content of type 'input_image' is not supported") as bad:
        api.responses.create(model=server.model, input=image)
    assert bad.value.body["param"] == "input.0.content.0"
    with pytest.raises(BadRequestError, match="built-in tool 'web_search'"):
        api.responses.create(model=server.model, input="hi", tools=[{"type": "web_search"}])
    with pytest.raises(BadRequestError, match="background is not supported"):
        api.responses.create(model=server.model, input="hi", background=True)
    with pytest.raises(NotFoundError):
        api.responses.create(model="no-such-model", input="hi")


def test_the_store_is_bounded_in_count_and_bytes() -> None:
    store = ResponseStore(max_responses=3, max_bytes=10_000)
    for i in range(5):
        store.put(f"r{i}", [{"role": "user", "content": "x"}], {"id": f"r{i}"})
    assert len(store) == 3 and store.get("r0") is None and store.get("r4") is not None
    store.put("big", [{"role": "user", "content": "y" * 9_950}], {"id": "big"})  # with the rest: > 10 kB
    assert store.num_bytes <= 10_000 and store.get("big") is not None and len(store) < 3  # the oldest went
