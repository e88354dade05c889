"""StructuredOutputsParams checks and grammar validation: every bad constraint is an
InvalidRequestError naming the field and llguidance's reason, before any engine work."""

from __future__ import annotations

import pytest

from kvflow.errors import InvalidRequestError
from kvflow.sampling_params import SamplingParams, StructuredOutputsParams
from kvflow.structured import grammar_spec


def test_exactly_one_constraint() -> None:
    with pytest.raises(InvalidRequestError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(InvalidRequestError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(InvalidRequestError, match="choice"):
        StructuredOutputsParams(choice=[])
    assert StructuredOutputsParams(json_object=True).kind == "json_object"


@pytest.mark.parametrize(
    ("params", "field", "reason"),
    [
        (StructuredOutputsParams(json={"type": "foo"}), "structured_outputs.json", "Invalid type"),
        (
            StructuredOutputsParams(json={"type": "object", "if": {}}),
            "structured_outputs.json",
            "Unimplemented",
        ),
        (StructuredOutputsParams(json="[1, 2]"), "structured_outputs.json", "must be an object"),
        (StructuredOutputsParams(json="{not json"), "structured_outputs.json", "Expecting"),
        (StructuredOutputsParams(regex="a(b"), "structured_outputs.regex", "unclosed group"),
        (
            StructuredOutputsParams(grammar="start: missing_rule"),
            "structured_outputs.grammar",
            "missing_rule",
        ),
    ],
)
def test_invalid_constraints_name_the_field(params: StructuredOutputsParams, field: str, reason: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        grammar_spec(params)
    assert str(info.value).startswith(field + ":") and reason in str(info.value)


def test_equal_constraints_share_one_grammar() -> None:
    a = grammar_spec(
        StructuredOutputsParams(json={"type": "object", "properties": {"x": {"type": "integer"}}})
    )
    b = grammar_spec(
        StructuredOutputsParams(json='{"type": "object", "properties": {"x": {"type": "integer"}}}')
    )
    assert a.grammar == b.grammar  # the compile cache's key
    assert grammar_spec(StructuredOutputsParams(regex="[a-z]+")).grammar != a.grammar


def test_logit_bias_range() -> None:
    assert SamplingParams(logit_bias={3: -100, 4: 100}).logit_bias == {3: -100, 4: 100}
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        SamplingParams(logit_bias={3: 101})
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        SamplingParams(logit_bias={-1: 1})
