"""StructuredOutputsParams -> one llguidance grammar (JSON text), which is also the compile cache key.

JSON schemas compile with `whitespace_flexible: false`: the output is compact JSON (", " and ": "
never get free whitespace), so a model that knows nothing about JSON cannot fill its token budget
with spaces and newlines before the document closes. A schema may still opt in through its own
`x-guidance` options (llguidance applies defaults -> schema["x-guidance"] -> overrides).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import llguidance

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

from kvflow.errors import InvalidRequestError
from kvflow.sampling_params import StructuredOutputsParams

JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}
ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class GrammarSpec:
    """`grammar`: llguidance's grammar text; equal texts compile to the same matcher (the cache key).
    `field`: the request field it came from, named in errors (e.g. "structured_outputs.json")."""

    grammar: str
    field: str


def build_grammar(params: StructuredOutputsParams, field: str | None = None) -> GrammarSpec:
    """The grammar text, not yet validated (cheap: no parser is built). Raises InvalidRequestError
    for a schema that is not a JSON object."""
    where = field or f"structured_outputs.{params.kind}"
    try:
        return GrammarSpec(_grammar_text(params), where)
    except (ValueError, TypeError) as exc:
        raise InvalidRequestError(f"{where}: {exc}") from exc


def grammar_spec(params: StructuredOutputsParams, field: str | None = None) -> GrammarSpec:
    """Build the grammar and validate it (no tokenizer needed: cheap, safe from any thread).

    Raises InvalidRequestError("<field>: <reason>") for a schema that is not JSON, a keyword llguidance
    does not implement, a regex or grammar that does not compile. `field` defaults to
    "structured_outputs.<kind>" (the offline API's and vLLM's name)."""
    spec = build_grammar(params, field)
    error = llguidance.LLMatcher.validate_grammar(spec.grammar)
    if error:
        raise InvalidRequestError(f"{spec.field}: {error.strip()}")
    return spec


def _grammar_text(params: StructuredOutputsParams) -> str:
    if params.json is not None:
        schema = json.loads(params.json) if isinstance(params.json, str) else params.json
        if not isinstance(schema, dict):
            raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}")
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    if params.json_object:
        return llguidance.LLMatcher.grammar_from_json_schema(ANY_JSON_OBJECT, defaults=JSON_OPTIONS)
    if params.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if params.choice is not None:
        return llguidance.grammar_from("choice", json.dumps(params.choice))
    assert params.grammar is not None  # StructuredOutputsParams holds exactly one constraint
    # Lark as is; GBNF (llama.cpp's format, `root ::= ...`) is converted by llguidance.
    return llguidance.grammar_from("grammar", params.grammar)
