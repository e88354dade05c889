"""Reasoning output (`--reasoning-parser`, vLLM's and SGLang's flag): a reasoning model's thinking
comes back as `reasoning_content`, the rest as `content`; a structured-output or tool-call constraint
applies once the reasoning has ended, not to it.

    base.py      the parser interface (ReasoningParser) and the stream splitter (ReasoningStreamer)
    think.py     deepseek_r1, qwen3: `<think> ... </think>`
    harmony.py   openai_gptoss: gpt-oss's harmony channels (analysis, commentary, final)
"""

from __future__ import annotations

from kvflow.reasoning.base import (
    REASONING_PARSERS,
    PromptState,
    ReasoningParser,
    ReasoningParserName,
    ReasoningStreamer,
)
from kvflow.reasoning.harmony import HarmonyReasoningParser
from kvflow.reasoning.think import ThinkReasoningParser


def get_reasoning_parser(name: str | None) -> ReasoningParser | None:
    if name is None:
        return None
    if name == "openai_gptoss":
        return HarmonyReasoningParser()
    if name == "deepseek_r1":
        return ThinkReasoningParser("deepseek_r1")
    if name == "qwen3":
        return ThinkReasoningParser("qwen3")
    raise ValueError(f"unknown reasoning parser {name!r} (known: {', '.join(REASONING_PARSERS)})")


__all__ = [
    "REASONING_PARSERS",
    "HarmonyReasoningParser",
    "PromptState",
    "ReasoningParser",
    "ReasoningParserName",
    "ReasoningStreamer",
    "ThinkReasoningParser",
    "get_reasoning_parser",
]
