"""Property: for random JSON schemas (objects, arrays, enums, nesting, `required`, string patterns,
integer bounds), every output sampled at temperature 1 validates. Sizes are bounded (maxLength,
maxItems, integer ranges, depth), so every document can close within the token budget."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvflow import LLM, SamplingParams
from kvflow.assets import bundled_model_dir
from kvflow.sampling_params import StructuredOutputsParams

MAX_TOKENS = 320  # worst case: a few bounded strings written one escaped character per token
PATTERNS = ["^[a-z]{1,6}$", "^[A-Z][a-z]{0,4}$", "^\\d{3}-\\d{2}$", "^(on|off)$"]
NAMES = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=8)


def leaf() -> st.SearchStrategy[dict[str, Any]]:
    integer = st.tuples(st.integers(-50, 50), st.integers(0, 100)).map(
        lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]}
    )
    string = st.integers(1, 8).map(lambda n: {"type": "string", "maxLength": n})
    pattern = st.sampled_from(PATTERNS).map(lambda p: {"type": "string", "pattern": p})
    enum = st.lists(
        st.text(alphabet="xyz ", min_size=1, max_size=4), min_size=1, max_size=4, unique=True
    ).map(lambda values: {"enum": values})
    boolean = st.just({"type": "boolean"})
    return st.one_of(integer, string, pattern, enum, boolean)


def obj(children: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    def build(props: dict[str, dict[str, Any]], data: st.DataObject) -> dict[str, Any]:
        required = data.draw(st.lists(st.sampled_from(sorted(props)), unique=True)) if props else []
        return {"type": "object", "properties": props, "required": required, "additionalProperties": False}

    return st.builds(build, st.dictionaries(NAMES, children, min_size=1, max_size=3), st.data())


def schemas() -> st.SearchStrategy[dict[str, Any]]:
    def extend(children: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
        array = st.tuples(children, st.integers(1, 3)).map(
            lambda t: {"type": "array", "items": t[0], "maxItems": t[1]}
        )
        return st.one_of(obj(children), array)

    # Depth <= 2 below the top-level object: a bounded document.
    return obj(st.recursive(leaf(), extend, max_leaves=4))


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    yield LLM(str(bundled_model_dir()), dtype="float32", max_model_len=512)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=schemas(), seed=st.integers(0, 2**16))
def test_random_schemas_always_validate(llm: LLM, schema: dict[str, Any], seed: int) -> None:
    params = [
        SamplingParams(
            temperature=1.0,
            seed=seed + i,
            max_tokens=MAX_TOKENS,
            structured_outputs=StructuredOutputsParams(json=schema),
        )
        for i in range(2)
    ]
    for output in llm.generate(["{", "Data:"], params):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", (schema, completion.text)
        jsonschema.validate(json.loads(completion.text), schema)
