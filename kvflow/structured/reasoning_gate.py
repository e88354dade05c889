"""A constrained request's grammar held back while its output is inside the reasoning
(kvflow/reasoning.py: `--reasoning-parser`). Phases, token by token:

    reasoning     the prompt ended inside `<think>`, or the output opened it: no mask, the grammar
                  consumes nothing, until the output's tokens spell `</think>` (the parser's `end`;
                  harmony's: `<|channel|>final<|message|>`, the prompt having ended at a header)
    may_open      the prompt left the think block neither open nor closed: the first token may be
                  the grammar's or `<think>` (a single token in the tokenizers that use it)
    constrained   the grammar masks and consumes every token (thinking off, or the reasoning ended)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvflow.reasoning import ReasoningParser
from kvflow.tokenizer import Tokenizer

Phase = Literal["reasoning", "may_open", "constrained"]
PROMPT_TAIL_TOKENS = 32  # the prompt's end read for an open or closed think block


@dataclass(frozen=True)
class ReasoningMarkers:
    """A parser's markers as token ids, encoded once per engine (not once per request)."""

    parser: ReasoningParser
    start_id: int | None  # `<think>` when it is one token, else None (the first token cannot open it)
    end_ids: tuple[int, ...]

    @classmethod
    def encode(cls, parser: ReasoningParser, tokenizer: Tokenizer) -> ReasoningMarkers:
        start = [] if parser.start is None else tokenizer.encode(parser.start, add_special_tokens=False)
        end_ids = tuple(tokenizer.encode(parser.end, add_special_tokens=False))
        return cls(parser, start[0] if len(start) == 1 else None, end_ids)


class ReasoningGate:
    def __init__(self, phase: Phase, start_id: int | None, end_ids: tuple[int, ...]) -> None:
        self.phase: Phase = phase
        self.start_id = start_id
        self.end_ids = end_ids
        self._tail: list[int] = []  # the last len(end_ids) reasoning tokens

    @classmethod
    def for_prompt(
        cls, markers: ReasoningMarkers, tokenizer: Tokenizer, prompt_token_ids: list[int]
    ) -> ReasoningGate:
        tail = tokenizer.decode(prompt_token_ids[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
        state = markers.parser.prompt_state(tail)
        phase: Phase = "reasoning" if state == "open" else "constrained"
        if state == "none" and markers.start_id is not None:
            phase = "may_open"
        return cls(phase, markers.start_id, markers.end_ids)

    @property
    def holds(self) -> bool:
        """No mask this step: the output is inside the reasoning."""
        return self.phase == "reasoning"

    @property
    def extra_token(self) -> int | None:
        """A token allowed beside the grammar's this step (`<think>`, while it may still open)."""
        return self.start_id if self.phase == "may_open" else None

    def feed(self, token_ids: list[int]) -> list[int]:
        """Advance over a step's output tokens; the ones the grammar must consume (after the reasoning)."""
        for i, token in enumerate(token_ids):
            if self.phase == "constrained":
                return token_ids[i:]
            if self.phase == "may_open":
                if token != self.start_id:
                    self.phase = "constrained"
                    return token_ids[i:]
                self.phase = "reasoning"
                continue
            self._tail = [*self._tail, token][-len(self.end_ids) :]
            if tuple(self._tail) == self.end_ids:
                self.phase = "constrained"
                return token_ids[i + 1 :]
        return []
