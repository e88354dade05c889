"""Tool calls in model output (tool_choice=auto), and the constrained formats of required / named.

base.py          ToolParser: final text -> content + calls; parsed-call types
hermes.py        <tool_call>{"name": ..., "arguments": {...}}</tool_call>  (Qwen2.5, Qwen3, Hermes)
llama3_json.py   {"name": ..., "parameters": {...}} (optionally after <|python_tag|>; Llama-3.1)
openai_harmony.py  gpt-oss: commentary messages to functions.NAME (with --reasoning-parser openai_gptoss)
constrained.py   tool_choice=required / named: the JSON schema the output is held to, and how its
                 text splits into calls (raw argument substrings, so streamed == non-streamed)
"""

from kvflow.server.tool_parsers.base import ParsedToolCall, ToolParser
from kvflow.server.tool_parsers.hermes import HermesToolParser
from kvflow.server.tool_parsers.llama3_json import Llama3JsonToolParser
from kvflow.server.tool_parsers.openai_harmony import OpenAIHarmonyToolParser

PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "openai": OpenAIHarmonyToolParser,
}


def detect_parser(chat_template: str | None) -> str:
    """--tool-call-parser auto: Llama-3.1's template writes <|python_tag|> / "parameters"; Hermes-style
    templates (Qwen) write <tool_call>; gpt-oss's harmony template writes <|channel|>; anything else
    gets hermes, the most common format."""
    template = chat_template or ""
    if "<|channel|>" in template:
        return "openai"
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or ("ipython" in template and '"parameters"' in template):
        return "llama3_json"
    return "hermes"


def get_tool_parser(name: str, chat_template: str | None) -> ToolParser:
    return PARSERS[detect_parser(chat_template) if name == "auto" else name]()


__all__ = [
    "PARSERS",
    "OpenAIHarmonyToolParser",
    "ParsedToolCall",
    "ToolParser",
    "detect_parser",
    "get_tool_parser",
]
