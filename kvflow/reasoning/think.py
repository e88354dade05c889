"""Reasoning output (`--reasoning-parser`, vLLM's and SGLang's flag): the text between a reasoning
model's markers is `reasoning_content`, the rest `content`; a structured-output or tool-call
constraint applies once the reasoning has ended, not to it.

    deepseek_r1   DeepSeek-R1 / V3.1+ (chat_template_kwargs `thinking`)
    qwen3         Qwen3 (`enable_thinking`), QwQ
Both mark the reasoning `<think> ... </think>`; the templates differ in who opens it. R1's (and the
Qwen3 thinking-2507 one) opens `<think>` at the end of the prompt, so the output starts inside the
reasoning; Qwen3's hybrid models write `<think>` themselves; with thinking off, V3.1's and Qwen3's
templates close an (empty) think block in the prompt. So, for either name:
    reasoning  iff the prompt ends inside an open `<think>`, or the output starts with `<think>`;
               it runs to the first `</think>` (to the end if none came: cut while thinking)
    content    the rest (all of an output that is not reasoning)
The constraint (kvflow/structured/manager.py) follows the same rule token by token: held back while
the output is inside the reasoning, and at the first token, when the prompt leaves the think block
neither open nor closed, the grammar's tokens and `<think>` are allowed.

`ReasoningStreamer` splits a stream the same way delta by delta: a marker split across deltas is held
back until it is whole, so the streamed pieces concatenate to the non-streamed split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ReasoningParserName = Literal["deepseek_r1", "qwen3"]
PromptState = Literal["open", "closed", "none"]
REASONING_PARSERS: tuple[ReasoningParserName, ...] = ("deepseek_r1", "qwen3")
THINK_START, THINK_END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    name: ReasoningParserName
    start: str = THINK_START
    end: str = THINK_END

    def prompt_state(self, prompt_text: str) -> PromptState:
        """Where the prompt leaves the think block: "open" (the output starts inside the reasoning),
        "closed" (thinking off: no reasoning), or "none" (the model may open one)."""
        tail = prompt_text.rstrip()
        opened, closed = tail.rfind(self.start), tail.rfind(self.end)
        if opened > closed:
            return "open"
        if closed >= 0 and tail.endswith(self.end):
            return "closed"
        return "none"

    def split(self, text: str, prompt_open: bool) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output; None for a part that is absent or empty."""
        if not (prompt_open or text.startswith(self.start)):
            return None, text or None
        body = text.removeprefix(self.start)
        at = body.find(self.end)
        if at < 0:
            return body or None, None
        return body[:at] or None, body[at + len(self.end) :] or None


def get_reasoning_parser(name: str | None) -> ReasoningParser | None:
    if name is None:
        return None
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r} (known: {', '.join(REASONING_PARSERS)})")
    return ReasoningParser(name)


class ReasoningStreamer:
    """One choice's stream split into reasoning and content deltas (module docstring)."""

    def __init__(self, parser: ReasoningParser, prompt_open: bool) -> None:
        self.parser = parser
        self.prompt_open = prompt_open
        self._text = ""  # everything so far
        self._sent = {"reasoning": 0, "content": 0}  # characters of each part sent

    def feed(self, delta: str, finished: bool) -> tuple[str | None, str | None]:
        """(reasoning delta, content delta) this delta releases; None where nothing new."""
        self._text += delta
        reasoning, content = self.parser.split(
            self._text if finished else self._safe_prefix(), self.prompt_open
        )
        return self._new(reasoning, "reasoning"), self._new(content, "content")

    def _safe_prefix(self) -> str:
        """The text up to any trailing partial marker (the start of `<think>` or `</think>`)."""
        text = self._text
        for marker in (self.parser.end, self.parser.start):
            for k in range(min(len(marker) - 1, len(text)), 0, -1):
                if text.endswith(marker[:k]):
                    return text[:-k]
        return text

    def _new(self, part: str | None, which: str) -> str | None:
        sent = self._sent[which]
        if part is None or len(part) <= sent:
            return None
        self._sent[which] = len(part)
        return part[sent:]
