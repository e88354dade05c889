"""A request's structured-output fields -> SamplingParams.structured_outputs, or a 400 naming the field.

Three spellings, at most one per request: OpenAI's `response_format` (text / json_object /
json_schema), vLLM's `structured_outputs` ({json | regex | choice | grammar | json_object}) and
vLLM's older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`. The constraint is
checked here by the engine's grammar validation (llguidance, against the model's tokenizer, about
the time of a compile, once per distinct grammar), so an invalid schema, an unsupported keyword, a
bad regex or a grammar naming a token the model lacks is a 400 before any engine work.
"""

from __future__ import annotations

from collections.abc import Callable
from http import HTTPStatus
from typing import Any

from kvflow.errors import InvalidRequestError
from kvflow.sampling_params import StructuredOutputsParams
from kvflow.server.errors import APIError
from kvflow.server.protocol import _SamplingFields


def _bad(message: str, param: str) -> APIError:
    return APIError(HTTPStatus.BAD_REQUEST, message, param=param)


Validate = Callable[[StructuredOutputsParams, str], object]  # StructuredOutputManager.validate


def structured_outputs_from(body: _SamplingFields, validate: Validate) -> StructuredOutputsParams | None:
    """The request's one constraint (validated by `validate`, the engine's grammar check), or None."""
    found = _candidates(body)
    if len(found) > 1:
        names = ", ".join(param for param, _ in found)
        raise _bad(f"give at most one structured output constraint; got {names}", found[1][0])
    if not found:
        return None
    param, fields = found[0]
    try:
        params = StructuredOutputsParams(**fields)
        validate(params, param)
    except InvalidRequestError as exc:
        raise _bad(str(exc), param) from exc
    return params


def _candidates(body: _SamplingFields) -> list[tuple[str, dict[str, Any]]]:
    """(field name, StructuredOutputsParams kwargs) for every constraint the request gives."""
    found: list[tuple[str, dict[str, Any]]] = []
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append(("response_format", {"json_object": True}))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise _bad(
                "response_format of type json_schema needs json_schema.schema (the JSON schema)",
                "response_format.json_schema.schema",
            )
        found.append(("response_format.json_schema.schema", {"json": fmt.json_schema.schema_}))
    so = body.structured_outputs
    if so is not None:
        fields = {
            "json": so.json_,
            "regex": so.regex,
            "choice": so.choice,
            "grammar": so.grammar,
            "json_object": so.json_object,
        }
        given = {k: v for k, v in fields.items() if v not in (None, False)}
        if len(given) != 1:
            raise _bad(
                "structured_outputs needs exactly one of json, regex, choice, grammar, json_object",
                "structured_outputs",
            )
        (kind,) = given
        found.append((f"structured_outputs.{kind}", given))
    for name, kind in (
        ("guided_json", "json"),
        ("guided_regex", "regex"),
        ("guided_choice", "choice"),
        ("guided_grammar", "grammar"),
    ):
        value = getattr(body, name)
        if value is not None:
            found.append((name, {kind: value}))
    return found
