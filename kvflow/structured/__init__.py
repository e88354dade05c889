"""Structured output: a request's JSON schema / regex / choice / grammar -> per-step allowed tokens.

    grammar_spec.py   StructuredOutputsParams -> the llguidance grammar text (the cache key), and
                      its validation (InvalidRequestError naming the field and the reason)
    backend.py        llguidance: the tokenizer it needs, compiled grammars, per-request matchers
    manager.py        StructuredOutputManager: compilation in a thread pool with a cache by grammar,
                      request readiness, the step's bitmask fill (off the engine thread), advancing
                      the matchers on accepted tokens

The engine owns one manager; the model runner only applies the bitmask (kvflow/sample/token_bitmask.py).
Why llguidance (not xgrammar): benchmarks/NOTES.md, "Structured output".
"""

from kvflow.structured.grammar_spec import GrammarSpec, grammar_spec
from kvflow.structured.manager import StructuredOutputManager

__all__ = ["GrammarSpec", "StructuredOutputManager", "grammar_spec"]
