"""Penalties against hand-computed values and a direct per-token loop (vLLM / HF semantics)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvflow.sample.penalties import apply_penalties
from kvflow.sampling_params import SamplingParams


def _penalised(
    logits: list[list[float]],
    params: list[SamplingParams],
    prompts: list[list[int]],
    outputs: list[list[int]],
) -> list[list[float]]:
    tensor = torch.tensor(logits, dtype=torch.float32)
    apply_penalties(tensor, params, prompts, outputs)
    return tensor.tolist()


def _reference(
    logits: list[float], params: SamplingParams, prompt: list[int], output: list[int]
) -> list[float]:
    """Direct per-token computation: repetition (prompt or output), then frequency, then presence."""
    result = []
    for token, value in enumerate(logits):
        count = output.count(token)
        if token in prompt or token in output:
            r = params.repetition_penalty
            value = value / r if value > 0 else value * r
        value -= params.frequency_penalty * count
        value -= params.presence_penalty * (1.0 if count > 0 else 0.0)
        result.append(value)
    return result


def test_ids_outside_vocab_are_ignored() -> None:
    params = [SamplingParams(repetition_penalty=2.0, frequency_penalty=1.0)]
    result = _penalised([[2.0, 2.0, 2.0, 2.0]], params, [[1, 7, -1]], [[3, 9, 3]])
    # Token 1 (prompt): 2 / 2 = 1. Token 3 (output twice): 2 / 2 - 2 = -1. Ids 7, -1, 9 ignored.
    assert result == [[2.0, 1.0, 2.0, -1.0]]


def test_duplicate_prompt_and_output_occurrences_penalised_once() -> None:
    params = [SamplingParams(repetition_penalty=2.0)]
    result = _penalised([[8.0, 8.0]], params, [[0, 0, 0]], [[0, 0]])
    assert result == [[4.0, 8.0]]


def test_repetition_penalty_divides_positive_multiplies_negative() -> None:
    logits = [[2.0, -1.0, 4.0, -3.0, 0.0, 1.0, 6.0, -2.0]]
    params = [SamplingParams(repetition_penalty=2.0)]
    # seen = prompt {0, 1} | output {2, 3, 4}; tokens 5, 6, 7 unseen.
    result = _penalised(logits, params, [[0, 1]], [[2, 3, 4, 2]])
    assert result == [[1.0, -2.0, 2.0, -6.0, 0.0, 1.0, 6.0, -2.0]]


def test_repetition_penalty_below_one_encourages() -> None:
    result = _penalised([[2.0, -2.0, 1.0]], [SamplingParams(repetition_penalty=0.5)], [[0]], [[1]])
    assert result == [[4.0, -1.0, 1.0]]


def test_frequency_penalty_counts_output_only() -> None:
    logits = [[1.0] * 8]
    params = [SamplingParams(frequency_penalty=0.5)]
    # Token 0 is only in the prompt: untouched. Token 3 appears 3 times in the output.
    result = _penalised(logits, params, [[0, 0, 1]], [[1, 3, 3, 3, 7]])
    assert result == [[1.0, 0.5, 1.0, -0.5, 1.0, 1.0, 1.0, 0.5]]


def test_presence_penalty_is_binary_and_output_only() -> None:
    logits = [[1.0] * 8]
    params = [SamplingParams(presence_penalty=1.5)]
    result = _penalised(logits, params, [[0, 2]], [[1, 3, 3, 3]])
    assert result == [[1.0, -0.5, 1.0, -0.5, 1.0, 1.0, 1.0, 1.0]]


def test_negative_additive_penalties_raise_logits() -> None:
    params = [SamplingParams(frequency_penalty=-1.0, presence_penalty=-0.5)]
    result = _penalised([[0.0, 0.0, 0.0]], params, [[]], [[2, 2]])
    assert result == [[0.0, 0.0, 2.5]]


def test_combined_order_repetition_then_frequency_then_presence() -> None:
    # Token 1: 3.0 / 1.5 = 2.0; then - 0.25 * 2 = 1.5; then - 1.0 = 0.5.
    # Token 2 (prompt only): -1.0 * 1.5 = -1.5, no additive penalty.
    params = [SamplingParams(repetition_penalty=1.5, frequency_penalty=0.25, presence_penalty=1.0)]
    result = _penalised([[5.0, 3.0, -1.0, 0.5]], params, [[2]], [[1, 1]])
    assert result == [[5.0, 0.5, -1.5, 0.5]]


def test_rows_without_penalties_are_untouched() -> None:
    logits = [[1.0, 2.0, 3.0, 4.0]] * 3
    params = [SamplingParams(), SamplingParams(presence_penalty=1.0), SamplingParams()]
    prompts = [[0, 1, 2, 3]] * 3
    outputs = [[3], [3], [3]]
    result = _penalised(logits, params, prompts, outputs)
    assert result == [[1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0, 3.0], [1.0, 2.0, 3.0, 4.0]]


def test_repetition_only_rows_pay_for_prompt_histogram() -> None:
    # Row 0 has a frequency penalty only: its prompt must not count as "seen" for anything.
    params = [SamplingParams(frequency_penalty=1.0), SamplingParams(repetition_penalty=2.0)]
    result = _penalised([[2.0, 2.0], [2.0, 2.0]], params, [[0], [0]], [[], []])
    assert result == [[2.0, 2.0], [1.0, 2.0]]


def test_banned_minus_inf_stays_minus_inf() -> None:
    params = [SamplingParams(repetition_penalty=1.3, frequency_penalty=-2.0, presence_penalty=-2.0)]
    result = _penalised([[float("-inf"), 1.0]], params, [[0]], [[0, 0]])
    assert result[0][0] == float("-inf")


_params_strategy = st.builds(
    SamplingParams,
    repetition_penalty=st.sampled_from([1.0, 0.7, 1.3, 2.0]),
    frequency_penalty=st.sampled_from([0.0, 0.5, -1.0, 2.0]),
    presence_penalty=st.sampled_from([0.0, 1.0, -0.5]),
)


@settings(max_examples=40, deadline=None)
@given(data=st.data(), num_rows=st.integers(1, 4), vocab_size=st.integers(1, 12))
def test_matches_direct_computation(data: st.DataObject, num_rows: int, vocab_size: int) -> None:
    tokens = st.lists(st.integers(0, vocab_size - 1), max_size=10)
    values = st.lists(st.floats(-8, 8, allow_nan=False, width=32), min_size=vocab_size, max_size=vocab_size)
    logits = [data.draw(values) for _ in range(num_rows)]
    params = [data.draw(_params_strategy) for _ in range(num_rows)]
    prompts = [data.draw(tokens) for _ in range(num_rows)]
    outputs = [data.draw(tokens) for _ in range(num_rows)]

    result = torch.tensor(_penalised(logits, params, prompts, outputs))
    expected = torch.tensor(
        [_reference(*row) for row in zip(logits, params, prompts, outputs, strict=True)],
        dtype=torch.float32,
    )
    torch.testing.assert_close(result, expected, rtol=1e-6, atol=1e-5)
