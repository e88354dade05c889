"""The Anthropic Messages API (POST /v1/messages, kvflow/server/serving_messages.py) through the
official `anthropic` client, unchanged: plain, streamed (the events reassemble into the same
message), a system prompt, stop sequences, tool use (a named tool: the input always parses), a
tool_result turn, count_tokens, the x-api-key header, and bad input in Anthropic's error shape with
the right status; the text equals the chat completion of the same conversation."""

from __future__ import annotations

import json
from collections.abc import Callable

import httpx
import pytest
from fixtures.live_server import LiveServer

anthropic = pytest.importorskip("anthropic")

MESSAGES = [{"role": "user", "content": "Say something about foxes."}]
# anthropic 2.x dropped temperature from messages.create; the API field still reaches the server.
GREEDY = {"temperature": 0}
WEATHER = {
    "name": "get_weather",
    "description": "Current weather of a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
    },
}


def client(server: LiveServer, key: str = "unused") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key=key, max_retries=0)


def test_a_message_equals_the_chat_completion_of_the_same_conversation(server: LiveServer) -> None:
    message = client(server).messages.create(
        model=server.model, max_tokens=12, messages=MESSAGES, system="You are terse.", extra_body=GREEDY
    )
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.stop_reason in ("end_turn", "max_tokens") and message.content[0].type == "text"
    assert message.usage.output_tokens > 0 and message.usage.input_tokens > 0
    with server.client() as http:
        chat = http.post(
            "/v1/chat/completions",
            json={
                "model": server.model,
                "max_tokens": 12,
                "temperature": 0,
                "messages": [{"role": "system", "content": "You are terse."}, *MESSAGES],
            },
        ).json()
    assert message.content[0].text == chat["choices"][0]["message"]["content"]
    assert message.usage.output_tokens == chat["usage"]["completion_tokens"]


def test_the_stream_reassembles_into_the_same_message(server: LiveServer) -> None:
    api = client(server)
    whole = api.messages.create(model=server.model, max_tokens=10, messages=MESSAGES, extra_body=GREEDY)
    with api.messages.stream(
        model=server.model, max_tokens=10, messages=MESSAGES, extra_body=GREEDY
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert {"content_block_start", "content_block_delta", "content_block_stop", "message_delta"} <= set(kinds)
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens


def test_a_stop_sequence_is_reported_as_such(server: LiveServer) -> None:
    api = client(server)
    text = (
        api.messages.create(model=server.model, max_tokens=10, messages=MESSAGES, extra_body=GREEDY)
        .content[0]
        .text
    )
    stop = text.strip()[2:4]  # two characters the greedy output holds
    message = api.messages.create(
        model=server.model, max_tokens=10, messages=MESSAGES, extra_body=GREEDY, stop_sequences=[stop]
    )
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop


@pytest.fixture(scope="module")
def long_context(start_server: Callable[..., LiveServer]) -> LiveServer:
    """A server with room for the tool definitions the template renders into the prompt."""
    return start_server(engine={"max_model_len": 1024, "num_kv_blocks": 256})


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_tool_comes_back_as_a_tool_use_block(long_context: LiveServer, stream: bool) -> None:
    server = long_context
    api = client(server)
    kwargs = {
        "model": server.model,
        "max_tokens": 40,
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [WEATHER],
        "tool_choice": {"type": "tool", "name": "get_weather"},
        "extra_body": GREEDY,
    }
    if stream:
        with api.messages.stream(**kwargs) as events:
            message = events.get_final_message()
    else:
        message = api.messages.create(**kwargs)
    tool = [block for block in message.content if block.type == "tool_use"]
    assert message.stop_reason == "tool_use" and len(tool) == 1
    assert tool[0].name == "get_weather" and isinstance(tool[0].input["city"], str) and tool[0].id
    # The result goes back as a tool_result turn: the conversation continues.
    follow = api.messages.create(
        model=server.model,
        max_tokens=5,
        tools=[WEATHER],
        messages=[
            *kwargs["messages"],
            {"role": "assistant", "content": [tool[0].model_dump(exclude_none=True)]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": tool[0].id, "content": "sunny"}],
            },
        ],
    )
    # The turn's prompt holds the first one, whose prefix the cache still has (Anthropic's cache read).
    total = follow.usage.input_tokens + follow.usage.cache_read_input_tokens
    assert total > message.usage.input_tokens and follow.usage.cache_read_input_tokens > 0


def test_count_tokens_counts_what_messages_renders(server: LiveServer) -> None:
    api = client(server)
    counted = api.messages.count_tokens(model=server.model, messages=MESSAGES, system="You are terse.")
    made = api.messages.create(model=server.model, max_tokens=1, messages=MESSAGES, system="You are terse.")
    assert counted.input_tokens == made.usage.input_tokens + made.usage.cache_read_input_tokens


def test_bad_input_gets_anthropics_error_shape(server: LiveServer) -> None:
    api = client(server)
    with pytest.raises(anthropic.BadRequestError) as bad:
        api.messages.create(model=server.model, max_tokens=0, messages=MESSAGES)
    assert bad.value.body["type"] == "error" and bad.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError) as unknown:
        api.messages.create(model="no-such-model", max_tokens=4, messages=MESSAGES)
    assert unknown.value.body["error"]["type"] == "not_found_error"
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    with pytest.raises(anthropic.BadRequestError, match="image content is not supported"):
        api.messages.create(model=server.model, max_tokens=4, messages=[{"role": "user", "content": [image]}])


def test_x_api_key_authenticates(start_server: Callable[..., LiveServer]) -> None:
    live = start_server(api_key="sesame")
    message = client(live, key="sesame").messages.create(model=live.model, max_tokens=2, messages=MESSAGES)
    assert message.content
    with pytest.raises(anthropic.AuthenticationError) as denied:
        client(live, key="wrong").messages.create(model=live.model, max_tokens=2, messages=MESSAGES)
    assert denied.value.body["error"]["type"] == "authentication_error"
    raw = httpx.post(f"{live.base_url}/v1/messages", json={"model": live.model})
    assert raw.status_code == 401 and raw.json()["type"] == "error"


def test_output_config_format_holds_the_text_to_the_schema(server: LiveServer) -> None:
    # No other properties, a bounded integer, and greedy: an open object let the random model
    # (sampled at Anthropic's default temperature 1) start a second property's string, which
    # max_tokens cut mid-way (a full-suite run, session 35). The grammar holds every prefix; only a
    # text that ends within max_tokens parses.
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}},
        "required": ["n"],
        "additionalProperties": False,
    }
    message = client(server).messages.create(
        model=server.model,
        max_tokens=30,
        messages=MESSAGES,
        output_config={"format": {"type": "json_schema", "schema": schema}},
        extra_body=GREEDY,
    )
    assert message.stop_reason == "end_turn", message.content[0].text
    assert isinstance(json.loads(message.content[0].text)["n"], int)
