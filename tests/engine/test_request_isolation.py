"""A failure that belongs to one request ends only that request: the rest of its batch produces
exactly the tokens it would have produced without it (seeded sampling included)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from kvflow import SamplingParams
from kvflow.engine.engine import LLMEngine
from kvflow.outputs import RequestOutput

MAX_TOKENS = 12
REPRODUCIBLE = ("seeded", "greedy")


@pytest.fixture(scope="module")
def engine(tiny_checkpoint_factory: Callable[..., Path]) -> LLMEngine:
    return LLMEngine.from_kwargs(
        model=str(tiny_checkpoint_factory("llama")), dtype="float32", max_model_len=256
    )


def healthy_requests() -> dict[str, tuple[list[int], SamplingParams]]:
    return {
        "seeded": (
            [5, 6, 7],
            SamplingParams(temperature=1.0, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True),
        ),
        "greedy": ([8, 9], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)),
        "random": (
            [10, 11],
            SamplingParams(temperature=0.8, top_k=20, max_tokens=MAX_TOKENS, ignore_eos=True),
        ),
    }


def poisoned() -> SamplingParams:
    """A request whose own sampling fails inside the batched step: a seed torch cannot take, set after
    validation (what the server let through before seeds were range-checked at the door)."""
    params = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS)
    params.seed = 2**64
    return params


def run(
    engine: LLMEngine,
    requests: dict[str, tuple[list[int], SamplingParams]],
    late: dict[str, tuple[list[int], SamplingParams]],
) -> dict[str, RequestOutput]:
    """Run `requests`; add `late` after a few steps, into the running batch. -> final outputs by id."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    finals: dict[str, RequestOutput] = {}
    steps = 0
    while engine.has_unfinished_requests():
        if steps == 3:
            for rid, (prompt, params) in late.items():
                engine.add_request(rid, prompt, params)
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
        steps += 1
    engine.scheduler.check_integrity()
    assert engine.scheduler.kv_cache_usage == 0.0
    return finals


def test_a_request_failing_in_the_batched_step_ends_alone(engine: LLMEngine) -> None:
    alone = run(engine, healthy_requests(), {})
    together = run(engine, healthy_requests(), {"poisoned": ([3, 4], poisoned())})
    failed = together.pop("poisoned")
    assert failed.outputs[0].finish_reason == "abort"
    assert failed.error is not None and "sampling failed" in failed.error and "Overflow" in failed.error
    for rid, output in together.items():
        assert output.error is None and output.outputs[0].finish_reason == "length", rid
    # Bit for bit what they produced without the poisoned request: greedy, and seeded (which draws
    # from its own generator, rewound after the failed batched attempt). Unseeded sampling draws from
    # the engine's shared generator, so its tokens depend on the batch by design.
    for rid in REPRODUCIBLE:
        assert together[rid].outputs[0].token_ids == alone[rid].outputs[0].token_ids, rid


def test_a_poisoned_request_from_the_first_step_fails_alone(engine: LLMEngine) -> None:
    """The poisoned request is in the very first batch, before any seeded generator exists."""
    alone = run(engine, healthy_requests(), {})
    together = run(engine, {**healthy_requests(), "poisoned": ([3, 4], poisoned())}, {})
    assert together.pop("poisoned").error is not None
    for rid in REPRODUCIBLE:
        assert together[rid].outputs[0].token_ids == alone[rid].outputs[0].token_ids, rid
