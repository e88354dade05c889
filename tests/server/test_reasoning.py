"""Reasoning output (`--reasoning-parser`, kvflow/reasoning.py) on the tiny Llama with two tokens
added to its tokenizer, `<think>` and `</think>` (plain added tokens, as Qwen3's and DeepSeek-R1's
are), and an R1-style chat template: the prompt opens `<think>` unless `thinking` is false, which
closes an empty block instead (DeepSeek-V3.1's template kwarg).

- The split: outputs forced through the markers by a regex constraint come back as
  `reasoning_content` and `content`, streamed and not, the streamed deltas concatenating to the same.
- The constraint after the reasoning: with the prompt inside `<think>`, a JSON schema leaves the
  reasoning free (no `{` forced at its start) and holds the content after `</think>` to the schema.
- The engine's gate (kvflow/structured/reasoning_gate.py), and the streamer against the whole split
  over every way of cutting the text into deltas.
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

from kvflow.reasoning import ReasoningStreamer, ThinkReasoningParser
from kvflow.server.launcher import ServerConfig
from kvflow.structured.reasoning_gate import ReasoningGate

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if thinking is defined and not thinking %}<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}"
    "{% endif %}"
)
MESSAGES = [{"role": "user", "content": "What is two plus two?"}]


@pytest.fixture(scope="module")
def thinking_model(
    tiny_checkpoint_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """The tiny Llama with a vocabulary two larger, `<think>` and `</think>` the two new ids."""
    source = tiny_checkpoint_factory("llama", vocab_size=514)
    out = tmp_path_factory.mktemp("thinking") / "model"
    tokenizer = with_marker_tokens(source, out, ("<think>", "</think>"), False, TEMPLATE)
    assert tokenizer.token_to_id("<think>") == 512 and tokenizer.get_vocab_size() == 514
    return out


@pytest.fixture(scope="module")
def server(thinking_model: Path) -> Iterator[LiveServer]:
    engine = {**ENGINE_KWARGS, "reasoning_parser": "deepseek_r1"}
    live = LiveServer(thinking_model, ServerConfig(served_model_name="thinker"), engine)
    yield live
    live.stop()


def chat(server: LiveServer, **body: Any) -> httpx.Response:
    return chat_completion(server, {"model": "thinker", "messages": MESSAGES, **body})


def streamed(server: LiveServer, **body: Any) -> tuple[str | None, str | None]:
    return streamed_split(server, {"model": "thinker", "messages": MESSAGES, **body})


def test_forced_markers_split_into_reasoning_and_content(server: LiveServer) -> None:
    """Thinking off (the prompt closes the block): the regex forces the model through the markers."""
    body = {
        "structured_outputs": {"grammar": "start: <think> /[a-z]{3}/ </think> /[a-z]{4}/"},
        "chat_template_kwargs": {"thinking": False},
        "max_tokens": 40,
        "temperature": 0,
    }
    response = chat(server, **body)
    assert response.status_code == 200, response.text
    message = response.json()["choices"][0]["message"]
    reasoning, content = message["reasoning_content"], message["content"]
    assert len(reasoning) == 3 and reasoning.isalpha() and len(content) == 4 and content.isalpha()
    assert streamed(server, **body) == (reasoning, content)


def test_thinking_off_without_markers_is_all_content(server: LiveServer) -> None:
    body = {"chat_template_kwargs": {"thinking": False}, "max_tokens": 6, "temperature": 0}
    body["logit_bias"] = {"512": -100, "513": -100}
    message = chat(server, **body).json()["choices"][0]["message"]
    assert message.get("reasoning_content") is None and message["content"]


def test_a_schema_holds_the_content_after_the_reasoning_not_the_reasoning(server: LiveServer) -> None:
    # Closed and bounded, so the answer ends within max_tokens whatever the greedy path on this CPU
    # (an open object let a sampled model open a second property past it: session 35).
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}},
        "required": ["n"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    # The reasoning never ends (</think> banned): nothing constrains it, so no "{" is forced first.
    free = chat(server, response_format=fmt, logit_bias={"513": -100}, max_tokens=8, temperature=0)
    message = free.json()["choices"][0]["message"]
    assert message.get("content") is None and message["reasoning_content"]
    assert not message["reasoning_content"].lstrip().startswith("{")
    # </think> first: the rest is the schema's.
    done = chat(server, response_format=fmt, logit_bias={"513": 100}, max_tokens=40, temperature=0)
    message = done.json()["choices"][0]["message"]
    assert message.get("reasoning_content") is None
    assert isinstance(json.loads(message["content"])["n"], int)


def test_the_gate_holds_the_grammar_until_the_end_marker() -> None:
    gate = ReasoningGate("reasoning", start_id=7, end_ids=(8, 9))
    assert gate.holds and gate.feed([1, 2, 8]) == [] and gate.holds
    assert gate.feed([9, 3, 4]) == [3, 4] and not gate.holds  # the marker split across steps
    may = ReasoningGate("may_open", start_id=7, end_ids=(8,))
    assert may.extra_token == 7 and may.feed([7, 5]) == [] and may.holds
    plain = ReasoningGate("may_open", start_id=7, end_ids=(8,))
    assert plain.feed([5, 6]) == [5, 6] and plain.phase == "constrained" and plain.extra_token is None


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
def test_streamed_splits_equal_the_whole_split_however_the_text_is_cut(name: str) -> None:
    parser = ThinkReasoningParser(name)  # type: ignore[arg-type]
    texts = ["<think>abc</think>xyz", "abc</think>xyz", "plain", "<think>cut", "</think>{}", "<th", "a < b"]
    for text in texts:
        for prompt_open in (True, False):
            whole = parser.split(text, prompt_open)
            for cuts in _all_cuts(len(text), pieces=3):
                streamer = ReasoningStreamer(parser, prompt_open)
                parts = [text[a:b] for a, b in zip((0, *cuts), (*cuts, len(text)), strict=True)]
                out = [streamer.feed(p, i == len(parts) - 1) for i, p in enumerate(parts)]
                got = ("".join(r or "" for r, _ in out) or None, "".join(c or "" for _, c in out) or None)
                assert got == whole, (text, prompt_open, parts)


def _all_cuts(n: int, pieces: int) -> list[tuple[int, ...]]:
    if n < pieces:
        return [()]
    return [(a, b) for a in range(1, n - 1) for b in range(a + 1, n)]


def test_the_prompt_says_where_the_reasoning_starts() -> None:
    parser = ThinkReasoningParser("qwen3")
    assert parser.prompt_state("<|im_start|>assistant\n<think>\n") == "open"
    assert parser.prompt_state("<|im_start|>assistant\n<think>\n\n</think>\n\n") == "closed"
    assert parser.prompt_state("<|im_start|>assistant\n") == "none"
