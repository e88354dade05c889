"""gpt-oss's harmony output (`--reasoning-parser openai_gptoss`, `--tool-call-parser openai`):

- The split, pure Python: analysis bodies are the reasoning; final bodies and preambles the content;
  a call to a function stays in the content for the tool parser; built-in tool calls are neither;
  the recipient may come before the channel; the streamed deltas, however the text is cut between
  tokens, concatenate to the whole split.
- Live, on the tiny gpt-oss with harmony's special tokens added to its tokenizer and a harmony chat
  template: outputs forced through headers by a grammar come back split (streamed and not), a forced
  call comes back as `tool_calls`, and the engine's gate holds a constraint until
  `<|channel|>final<|message|>`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fixtures.live_server import ENGINE_KWARGS, LiveServer
from fixtures.reasoning_stream import chat_completion, streamed_split, with_marker_tokens

from kvflow.reasoning import HarmonyReasoningParser, ReasoningStreamer
from kvflow.server.launcher import ServerConfig
from kvflow.server.tool_parsers import OpenAIHarmonyToolParser, detect_parser
from kvflow.structured.reasoning_gate import ReasoningGate, ReasoningMarkers
from kvflow.tokenizer import Tokenizer as KvflowTokenizer

HARMONY_TOKENS = (
    "<|start|>",
    "<|channel|>",
    "<|message|>",
    "<|end|>",
    "<|call|>",
    "<|return|>",
    "<|constrain|>",
)
PARSER = HarmonyReasoningParser()

ANALYSIS_THEN_FINAL = (
    "<|channel|>analysis<|message|>Two and two.<|end|><|start|>assistant<|channel|>final<|message|>Four."
)
WITH_CALL = (
    "<|channel|>analysis<|message|>Need weather.<|end|>"
    "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Oslo"}<|call|>'
)


def test_analysis_is_reasoning_and_final_is_content() -> None:
    assert PARSER.split(ANALYSIS_THEN_FINAL, prompt_open=True) == ("Two and two.", "Four.")
    # Cut while thinking: all reasoning; the final channel straight away: all content.
    assert PARSER.split("<|channel|>analysis<|message|>Hmm", prompt_open=True) == ("Hmm", None)
    assert PARSER.split("<|channel|>final<|message|>Hi<|return|>", prompt_open=True) == (None, "Hi")
    # The prompt ended inside a final body ("closed"): the output is the answer from its first token.
    assert PARSER.split("Hi<|return|>", prompt_open=False) == (None, "Hi")


def test_a_function_call_stays_in_the_content_for_the_tool_parser() -> None:
    reasoning, content = PARSER.split(WITH_CALL, prompt_open=True)
    assert reasoning == "Need weather."
    assert (
        content
        == 'Checking.<|channel|>commentary to=functions.get_weather<|message|>{"city": "Oslo"}<|call|>'
    )
    extracted = OpenAIHarmonyToolParser().extract(content)
    assert extracted.content == "Checking."
    assert [(c.name, json.loads(c.arguments)) for c in extracted.calls] == [("get_weather", {"city": "Oslo"})]
    # The recipient before the channel (as the template writes earlier calls) reads the same.
    first = ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Oslo"}<|call|>'
    _, content = PARSER.split(first, prompt_open=True)
    assert OpenAIHarmonyToolParser().extract(content or "").calls[0].name == "get_weather"
    # A built-in tool's call is neither reasoning nor content.
    browse = '<|channel|>analysis to=browser.search<|message|>{"q": "x"}<|call|>'
    assert PARSER.split(browse, prompt_open=True) == (None, None)


def test_the_prompt_says_where_the_output_starts() -> None:
    assert PARSER.prompt_state("<|start|>user<|message|>hi<|end|><|start|>assistant") == "open"
    assert PARSER.prompt_state("<|start|>assistant<|channel|>final<|message|>") == "closed"
    assert PARSER.prompt_state("<|start|>assistant<|channel|>analysis<|message|>") == "open"
    assert PARSER.prompt_state("<|start|>user<|message|>hi<|end|>") == "none"
    assert detect_parser("{{ '<|start|>assistant<|channel|>final<|message|>' }}") == "openai"


@pytest.mark.parametrize(
    "text", [ANALYSIS_THEN_FINAL, WITH_CALL, " to=functions.f<|channel|>commentary<|message|>{}"]
)
def test_streamed_splits_equal_the_whole_split_however_the_text_is_cut(text: str) -> None:
    """Cuts fall between tokens: a special token arrives whole, ordinary text character by character."""
    pieces = [p for p in _tokens(text) if p]
    whole = PARSER.split(text, prompt_open=True)
    for size in (1, 2, 3):
        streamer = ReasoningStreamer(PARSER, prompt_open=True)
        chunks = ["".join(pieces[i : i + size]) for i in range(0, len(pieces), size)]
        out = [streamer.feed(c, i == len(chunks) - 1) for i, c in enumerate(chunks)]
        got = ("".join(r or "" for r, _ in out) or None, "".join(c or "" for _, c in out) or None)
        assert got == whole, (size, chunks)


def _tokens(text: str) -> list[str]:
    """Special tokens whole, everything else one character at a time."""
    out: list[str] = []
    i = 0
    while i < len(text):
        special = next((t for t in HARMONY_TOKENS if text.startswith(t, i)), None)
        out.append(special or text[i])
        i += len(special) if special else 1
    return out


# A harmony chat template cut to what the tests need: each message as a harmony message, then the
# assistant's header; `final_only` ends the prompt inside a final body (the model then only answers).
TEMPLATE = (
    "{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant"
    "{% if final_only is defined and final_only %}<|channel|>final<|message|>{% endif %}{% endif %}"
)
MESSAGES = [{"role": "user", "content": "What is two plus two?"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


@pytest.fixture(scope="module")
def harmony_model(
    tiny_checkpoint_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """The tiny gpt-oss with harmony's seven special tokens added to its tokenizer."""
    source = tiny_checkpoint_factory("gpt_oss", vocab_size=520)
    out = tmp_path_factory.mktemp("harmony") / "model"
    tokenizer = with_marker_tokens(source, out, HARMONY_TOKENS, True, TEMPLATE)
    assert tokenizer.get_vocab_size() <= 520
    return out


@pytest.fixture(scope="module")
def server(harmony_model: Path) -> Iterator[LiveServer]:
    engine = {**ENGINE_KWARGS, "reasoning_parser": "openai_gptoss"}
    live = LiveServer(harmony_model, ServerConfig(served_model_name="oss", tool_call_parser="openai"), engine)
    yield live
    live.stop()


def chat(server: LiveServer, **body: Any) -> httpx.Response:
    return chat_completion(server, {"model": "oss", "messages": MESSAGES, **body})


def streamed(server: LiveServer, **body: Any) -> tuple[str | None, str | None]:
    return streamed_split(server, {"model": "oss", "messages": MESSAGES, **body})


def _forced(grammar: str) -> dict[str, Any]:
    # The prompt ends inside a final body, so the grammar holds the output from its first token.
    return {
        "structured_outputs": {"grammar": grammar},
        "chat_template_kwargs": {"final_only": True},
        "max_tokens": 60,
        "temperature": 0,
    }


def test_forced_channels_split_into_reasoning_and_content(server: LiveServer) -> None:
    grammar = (
        "start: /[a-z]{3}/ <|end|> <|start|> /assistant/ <|channel|> /analysis/ <|message|> /[a-z]{4}/"
        " <|end|> <|start|> /assistant/ <|channel|> /final/ <|message|> /[a-z]{5}/"
    )
    response = chat(server, **_forced(grammar))
    assert response.status_code == 200, response.text
    message = response.json()["choices"][0]["message"]
    reasoning, content = message["reasoning_content"], message["content"]
    assert len(reasoning) == 4 and reasoning.isalpha()
    assert len(content) == 8 and content.isalpha()  # the answer the prompt opened, then the final one
    assert streamed(server, **_forced(grammar)) == (reasoning, content)


def test_a_forced_function_call_comes_back_as_tool_calls(server: LiveServer) -> None:
    grammar = (
        r"start: <|end|> <|start|> /assistant/ <|channel|> /commentary to=functions\.get_weather/ <|message|>"
        r' /\{"city": "[a-z]{3}"\}/ <|call|>'
    )
    response = chat(server, tools=TOOLS, **_forced(grammar))
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert "tool_calls" in choice["message"], choice
    calls = choice["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert len(json.loads(calls[0]["function"]["arguments"])["city"]) == 3
    assert choice["finish_reason"] == "tool_calls" and choice["message"].get("content") is None


def test_the_gate_holds_a_constraint_until_the_final_channel(harmony_model: Path) -> None:
    tokenizer = KvflowTokenizer.from_pretrained(str(harmony_model))
    markers = ReasoningMarkers.encode(PARSER, tokenizer)
    # <|channel|> final <|message|> (the tiny vocabulary spells "final" in three pieces; o200k in one)
    assert markers.start_id is None
    assert markers.end_ids == tuple(tokenizer.encode("<|channel|>final<|message|>", add_special_tokens=False))
    assert tokenizer.decode(markers.end_ids[:1], skip_special_tokens=False) == "<|channel|>"
    prompt = tokenizer.encode("<|start|>user<|message|>hi<|end|><|start|>assistant", add_special_tokens=False)
    gate = ReasoningGate.for_prompt(markers, tokenizer, prompt)
    assert gate.holds
    thinking = tokenizer.encode(
        "<|channel|>analysis<|message|>abc<|end|><|start|>assistant", add_special_tokens=False
    )
    assert gate.feed(thinking) == [] and gate.holds
    answer = tokenizer.encode("{}", add_special_tokens=False)
    assert gate.feed([*markers.end_ids, *answer]) == answer and not gate.holds
    closed = tokenizer.encode("<|start|>assistant<|channel|>final<|message|>", add_special_tokens=False)
    assert not ReasoningGate.for_prompt(markers, tokenizer, closed).holds
