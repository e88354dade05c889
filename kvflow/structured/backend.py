"""llguidance bound to one tokenizer: compiled grammars and the per-request matcher.

A compiled grammar is an `LLMatcher` in its initial state; each request gets a `deep_copy` of it
(microseconds), so the cache holds one template per distinct grammar. llguidance builds its lexer
lazily (~0.5 ms for a small schema, ~2 ms for 50 properties on the Qwen2 vocabulary, then ~1 ms more
for the first mask; benchmarks/NOTES.md): `compile` computes that first mask too, so copies start warm.
"""

from __future__ import annotations

from collections.abc import Iterable

import llguidance

from kvflow.errors import InvalidRequestError
from kvflow.structured.grammar_spec import GrammarSpec

# Each bitmask word holds 32 tokens (vLLM v1's and llguidance's layout: bit b of word w = token 32w+b).
BITS_PER_WORD = 32


class GrammarBackend:
    """The tokenizer-dependent half: building it reads the whole vocabulary (~0.7 s for 151k tokens),
    so the manager builds it once, in its compile thread, on the first constrained request."""

    def __init__(self, tokenizer_json: str, eos_token_ids: Iterable[int]) -> None:
        eos = sorted(eos_token_ids)
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, eos_token=eos or None)
        self.vocab_size: int = self.tokenizer.vocab_size
        self.bitmask_width = (self.vocab_size + BITS_PER_WORD - 1) // BITS_PER_WORD

    def compile(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        """The grammar's matcher in its initial state (copy it per request). Raises InvalidRequestError
        for what validation without a tokenizer could not see (llguidance's resource limits)."""
        matcher = llguidance.LLMatcher(self.tokenizer, spec.grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"{spec.field}: {matcher.get_error()}")
        # The first mask builds the lexer state every copy then shares (~1 ms for 50 properties on a
        # 151k vocabulary): pay it here, in the compile thread, not in a request's first step.
        matcher.compute_bitmask()
        return matcher
