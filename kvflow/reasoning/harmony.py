"""gpt-oss's harmony format (`--reasoning-parser openai_gptoss`, vLLM's name): the output is a
sequence of messages, each a header and a body, written with special tokens:

    <|channel|>analysis<|message|>BODY<|end|>                         the reasoning
    <|start|>assistant<|channel|>commentary<|message|>BODY<|end|>     a preamble: content
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>ARGS<|call|>
    <|start|>assistant<|channel|>final<|message|>BODY<|return|>       the answer: content

(the recipient may also come first: `<|start|>assistant to=functions.NAME<|channel|>commentary json`).
The chat template ends the prompt with `<|start|>assistant`, so the output starts with a header.

    reasoning  every analysis body, in order
    content    final and preamble bodies, in order; a call to `functions.*` is kept in content whole,
               header and body (`<|channel|>commentary to=functions.NAME<|message|>ARGS<|call|>`),
               for the `openai` tool parser (kvflow/server/tool_parsers/openai_harmony.py);
               calls to the built-in tools (browser, python) are neither
The parser reads special tokens, so a chat request under it keeps them in its text
(`keeps_special_tokens`). A structured-output constraint applies once `<|channel|>final<|message|>`
has been written (`end`); before it, the output is headers, reasoning and calls.

Streaming: special tokens arrive whole (one token each), so a message's split only grows as its text
does. The one ambiguity is the very start: ` to=functions.x` before `<|channel|>` is a header,
and is held back until the next special token says so.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvflow.reasoning.base import PromptState, ReasoningParserName

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
TERMINATORS = ("<|end|>", "<|call|>", "<|return|>")
FINAL_HEADER = f"{CHANNEL}final{MESSAGE}"
_TOKEN = re.compile(r"<\|(start|channel|message|end|call|return|constrain)\|>")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_CHANNEL_NAME = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
# What a recipient-first header looks like before its <|channel|> arrives: held back while streaming.
_PARTIAL_RECIPIENT = re.compile(r"\s*(t(o(=\S*)?)?)?")
FUNCTIONS = "functions."


@dataclass
class _Message:
    """The message being read: its channel and recipient (from the header), and where it goes."""

    channel: str
    recipient: str | None = None

    @property
    def is_function_call(self) -> bool:
        return self.recipient is not None and self.recipient.startswith(FUNCTIONS)

    @property
    def part(self) -> str | None:
        """ "reasoning", "content", or None (a built-in tool's call: neither)."""
        if self.channel == "analysis" and self.recipient is None:
            return "reasoning"
        if self.recipient is not None and not self.is_function_call:
            return None
        return "content"


@dataclass(frozen=True)
class HarmonyReasoningParser:
    name: ReasoningParserName = "openai_gptoss"
    start: str | None = None  # the output opens with a header, not a single marker token
    end: str = FINAL_HEADER
    keeps_special_tokens: bool = True

    def prompt_state(self, prompt_text: str) -> PromptState:
        """ "closed" when the prompt ends inside a final message's body (the output is the answer),
        "open" when it ends at an assistant header or inside another body, "none" otherwise."""
        tail = prompt_text.rstrip()
        body_at = tail.rfind(MESSAGE)
        boundary = max(tail.rfind(START), *(tail.rfind(t) for t in TERMINATORS))
        if body_at > boundary:
            header = tail[boundary:body_at]
            return "closed" if _header(header).channel == "final" else "open"
        last_start = tail.rfind(START)
        if last_start >= 0 and last_start >= boundary and "assistant" in tail[last_start:]:
            return "open"
        return "none"

    def split(self, text: str, prompt_open: bool) -> tuple[str | None, str | None]:
        reasoning: list[str] = []
        content: list[str] = []
        parts = {"reasoning": reasoning, "content": content}
        first = _TOKEN.search(text)
        leading = text[: first.start()] if first else text
        opens_header = first is not None and first.group(1) in ("channel", "start", "constrain")
        if opens_header and _PARTIAL_RECIPIENT.fullmatch(leading):
            message: _Message | None = None  # the output starts in a header
            header = leading
        else:  # the output continues the body the prompt left open
            message = _Message("analysis" if prompt_open else "final")
            header = ""
        position = 0
        for token in _TOKEN.finditer(text):
            piece = text[position : token.start()]
            position = token.end()
            if message is None:
                header += piece
            else:
                _append(parts, message, piece)
            kind = token.group(1)
            if kind == "message":
                message = _header(header)
                header = ""
                if message.is_function_call:
                    content.append(f"{CHANNEL}commentary to={message.recipient}{MESSAGE}")
            elif kind in ("end", "call", "return"):
                if message is not None and message.is_function_call:
                    content.append(token.group(0))
                message = None
            elif message is None:
                header += token.group(0)  # <|start|>, <|channel|>, <|constrain|>: the header goes on
            else:  # a header token inside a body (a body cut off without its terminator)
                message = None
                header = token.group(0)
        if message is not None:
            _append(parts, message, text[position:])
        return "".join(reasoning) or None, "".join(content) or None

    def safe_prefix(self, text: str) -> str:
        if _TOKEN.search(text) is None and _PARTIAL_RECIPIENT.fullmatch(text):
            return ""  # may still be a recipient-first header
        return text


def _header(header: str) -> _Message:
    channel = _CHANNEL_NAME.search(header)
    recipient = _RECIPIENT.search(header)
    return _Message(channel.group(1) if channel else "final", recipient.group(1) if recipient else None)


def _append(parts: dict[str, list[str]], message: _Message, piece: str) -> None:
    part = message.part
    if part is not None and piece:
        parts[part].append(piece)
