"""The `<think> ... </think>` parsers:

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

A stream holds back a marker split across deltas until it is whole (safe_prefix).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvflow.reasoning.base import PromptState, ReasoningParserName

THINK_START, THINK_END = "<think>", "</think>"


@dataclass(frozen=True)
class ThinkReasoningParser:
    name: ReasoningParserName
    start: str = THINK_START
    end: str = THINK_END
    keeps_special_tokens: bool = False  # `<think>` is a plain added token

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

    def safe_prefix(self, text: str) -> str:
        """The text up to any trailing partial marker (the start of `<think>` or `</think>`)."""
        for marker in (self.end, self.start):
            for k in range(min(len(marker) - 1, len(text)), 0, -1):
                if text.endswith(marker[:k]):
                    return text[:-k]
        return text
