"""What every reasoning parser answers, and the streamer that splits a stream with any of them."""

from __future__ import annotations

from typing import Literal, Protocol

ReasoningParserName = Literal["deepseek_r1", "qwen3", "openai_gptoss"]
REASONING_PARSERS: tuple[ReasoningParserName, ...] = ("deepseek_r1", "qwen3", "openai_gptoss")
# Where the prompt leaves the output (parser-specific meaning, read by split and the gate):
#   open    the output starts where content has not begun (inside the reasoning, or before it)
#   closed  the output starts in the content (thinking off)
#   none    neither: the model may open a reasoning block itself
PromptState = Literal["open", "closed", "none"]


class ReasoningParser(Protocol):
    """Splits one output into reasoning and content; the structured-output gate
    (kvflow/structured/reasoning_gate.py) reads `start` and `end` as token ids."""

    @property
    def name(self) -> ReasoningParserName: ...

    @property
    def start(self) -> str | None:
        """The text that opens the reasoning at the output's first token, or None when none does."""

    @property
    def end(self) -> str:
        """The text after which the content (and a constraint on it) begins."""

    @property
    def keeps_special_tokens(self) -> bool:
        """Whether split reads special tokens (the request's text must keep them)."""

    def prompt_state(self, prompt_text: str) -> PromptState: ...

    def split(self, text: str, prompt_open: bool) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output; None for a part that is absent or empty."""

    def safe_prefix(self, text: str) -> str:
        """The longest prefix of a partial output whose split no later text can change."""


class ReasoningStreamer:
    """One choice's stream split into reasoning and content deltas: each delta re-splits the safe
    prefix and sends what grew, so the streamed pieces concatenate to the non-streamed split."""

    def __init__(self, parser: ReasoningParser, prompt_open: bool) -> None:
        self.parser = parser
        self.prompt_open = prompt_open
        self._text = ""  # everything so far
        self._sent = {"reasoning": 0, "content": 0}  # characters of each part sent

    def feed(self, delta: str, finished: bool) -> tuple[str | None, str | None]:
        """(reasoning delta, content delta) this delta releases; None where nothing new."""
        self._text += delta
        text = self._text if finished else self.parser.safe_prefix(self._text)
        reasoning, content = self.parser.split(text, self.prompt_open)
        return self._new(reasoning, "reasoning"), self._new(content, "content")

    def _new(self, part: str | None, which: str) -> str | None:
        sent = self._sent[which]
        if part is None or len(part) <= sent:
            return None
        self._sent[which] = len(part)
        return part[sent:]
