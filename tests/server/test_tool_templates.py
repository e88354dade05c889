"""Tool-call parsing on real chat templates (tests/fixtures/chat_templates/, sources in its README:
Qwen2.5-Instruct's template and Llama-3.1's JSON-tool template): what the template writes for an
assistant's tool call, the parser detected from the template reads back as the same call."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from test_tool_parsers import WEATHER

from kvflow.assets import bundled_model_dir
from kvflow.server.serving_tools import tool_call_arguments_as_objects
from kvflow.server.tool_parsers import detect_parser, get_tool_parser
from kvflow.server.tool_parsers.hermes import HermesToolParser
from kvflow.tokenizer import Tokenizer

TEMPLATES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"
CALL_ARGS = {"city": 'Zürich "Old Town"', "unit": "c"}


def tokenizer_with_template(tmp_path: Path, template_file: str) -> Tokenizer:
    """The bundled model's tokenizer with a real model's chat template."""
    shutil.copy(bundled_model_dir() / "tokenizer.json", tmp_path / "tokenizer.json")
    template = (TEMPLATES / template_file).read_text()
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": template, "bos_token": "<s>", "eos_token": "</s>"})
    )
    return Tokenizer.from_pretrained(tmp_path)


def assistant_call_message(content: str | None = None) -> dict[str, Any]:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps(CALL_ARGS)},
    }
    return {"role": "assistant", "content": content, "tool_calls": [call]}


def rendered_assistant_turn(tok: Tokenizer, start: str, end: str, content: str | None = None) -> str:
    """What the template writes for an assistant turn that called get_weather (OpenAI-shaped input,
    arguments as text, converted as the server converts them)."""
    messages = tool_call_arguments_as_objects(
        [{"role": "user", "content": "Weather in Zürich?"}, assistant_call_message(content)]
    )
    text = tok.apply_chat_template(messages, add_generation_prompt=False, tools=[WEATHER])
    turn = text[text.rindex(start) + len(start) :]
    return turn[: turn.index(end)]


def test_qwen25_template_round_trip(tmp_path: Path) -> None:
    tok = tokenizer_with_template(tmp_path, "qwen2.5_instruct.jinja")
    assert detect_parser(tok.chat_template) == "hermes"
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tools=[WEATHER])
    assert "<tools>" in prompt and json.dumps(WEATHER["function"]["name"]) in prompt
    # The generation prompt ends with "<|im_start|>assistant\n": a model's output starts after it.
    turn = rendered_assistant_turn(tok, "<|im_start|>assistant\n", "<|im_end|>")
    extracted = get_tool_parser("auto", tok.chat_template).extract(turn)
    assert extracted.content is None
    assert [(c.name, json.loads(c.arguments)) for c in extracted.calls] == [("get_weather", CALL_ARGS)]
    with_content = rendered_assistant_turn(tok, "<|im_start|>assistant\n", "<|im_end|>", "Let me check.")
    assert HermesToolParser().extract(with_content).content == "Let me check."


def test_llama31_template_round_trip(tmp_path: Path) -> None:
    tok = tokenizer_with_template(tmp_path, "llama3.1_json.jinja")
    assert detect_parser(tok.chat_template) == "llama3_json"
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tools=[WEATHER])
    assert "Environment: ipython" in prompt and '"get_weather"' in prompt
    header = "<|start_header_id|>assistant<|end_header_id|>\n\n"
    turn = rendered_assistant_turn(tok, header, "<|eot_id|>")
    extracted = get_tool_parser("auto", tok.chat_template).extract(turn)
    assert extracted.content is None
    assert [(c.name, json.loads(c.arguments)) for c in extracted.calls] == [("get_weather", CALL_ARGS)]
