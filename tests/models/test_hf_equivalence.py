"""kvflow vs Hugging Face transformers on the same weights: greedy tokens identical, logprobs close.

Each architecture's tiny random checkpoint (tests/fixtures/checkpoints.py) runs a batch of prompts
of 1 to a few hundred tokens under the engine's different paths: default, chunked prefill,
prefix-cache hits, and a KV pool small enough to force preemption and recompute.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from fixtures.checkpoints import MLA_ARCHS, MOE_ARCHS
from fixtures.reference import hf_greedy

from kvflow import LLM, SamplingParams

transformers = pytest.importorskip("transformers")

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
PROMPT_LENGTHS = [1, 7, 33, 90, 200, 300]
NUM_NEW_TOKENS = 12
NUM_LOGPROBS = 5
LOGPROB_ATOL = 2e-4  # float32 end to end; differences come from summation order only


def _prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(vocab_size) for _ in range(40)]
    prompts = [[rng.randrange(vocab_size) for _ in range(n)] for n in PROMPT_LENGTHS]
    # Two prompts sharing a 40-token prefix: with prefix caching on, the second hits 32 of them.
    prompts += [shared + [rng.randrange(vocab_size) for _ in range(9)], [*shared, 3, 1, 4]]
    return prompts


def hf_reference(path: Path, num_prompts: int | None = None) -> dict[str, Any]:
    """The checkpoint's prompts (the first `num_prompts`) and transformers' greedy tokens and
    float32 logprobs for each."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = _prompts(model.config.vocab_size)[:num_prompts]
    tokens, logprobs = [], []
    for prompt in prompts:
        new_tokens, logits = hf_greedy(model, prompt, NUM_NEW_TOKENS)
        tokens.append(new_tokens)
        logprobs.append([torch.log_softmax(step.float(), -1) for step in logits])
    return {"path": path, "prompts": prompts, "tokens": tokens, "logprobs": logprobs}


# Dense, mixture-of-experts and latent-attention models share the scenarios below.
@pytest.fixture(scope="module", params=[*ARCHS, *MOE_ARCHS, *MLA_ARCHS])
def reference(request: pytest.FixtureRequest, tiny_checkpoint_factory: Callable[..., Path]) -> dict[str, Any]:
    """The checkpoint, its prompts and transformers' greedy tokens and logprobs for each."""
    return {**hf_reference(tiny_checkpoint_factory(request.param)), "arch": request.param}


def _params() -> SamplingParams:
    # min_tokens bans EOS exactly as transformers' min_new_tokens does.
    return SamplingParams(
        temperature=0.0, max_tokens=NUM_NEW_TOKENS, min_tokens=NUM_NEW_TOKENS, logprobs=NUM_LOGPROBS
    )


def _check(reference: dict[str, Any], outputs: list[Any]) -> None:
    for i, out in enumerate(outputs):
        completion = out.outputs[0]
        assert completion.token_ids == reference["tokens"][i], (
            f"prompt {i} ({len(reference['prompts'][i])} tokens)"
        )
        assert completion.finish_reason == "length"
        for step, position in enumerate(completion.logprobs):
            ref = reference["logprobs"][i][step]
            assert len(position) >= NUM_LOGPROBS
            for token, lp in position.items():
                assert math.isclose(lp.logprob, float(ref[token]), abs_tol=LOGPROB_ATOL), (i, step, token)


# A pool too small for all prompts at once: requests are preempted and recomputed. With a
# sliding window (mistral) requests release blocks as they go, so its pool is smaller still
# and prefill is chunked so that the longest prompt fits at all.
PREEMPTION_ARGS = {"num_kv_blocks": 24}
PREEMPTION_ARGS_SLIDING = {"num_kv_blocks": 8, "max_num_batched_tokens": 48}


@pytest.mark.parametrize("scenario", ["default", "chunked-prefill", "preemption", "few-seqs-no-prefix-cache"])
def test_greedy_matches_transformers(reference: dict[str, Any], scenario: str) -> None:
    engine_args: dict[str, Any] = {
        "default": {},
        "chunked-prefill": {"max_num_batched_tokens": 24},
        "preemption": PREEMPTION_ARGS_SLIDING if reference["arch"] == "mistral" else PREEMPTION_ARGS,
        "few-seqs-no-prefix-cache": {"max_num_seqs": 3, "enable_prefix_caching": False},
    }[scenario]
    llm = LLM(str(reference["path"]), dtype="float32", **engine_args)
    outputs = llm.generate(reference["prompts"], _params())
    _check(reference, outputs)
    if scenario == "preemption":
        assert sum(o.metrics.num_preemptions for o in outputs) > 0, "the tiny pool should force preemption"
    llm.llm_engine.scheduler.check_integrity()


def test_prefix_cache_hits_give_identical_outputs(reference: dict[str, Any]) -> None:
    llm = LLM(str(reference["path"]), dtype="float32")
    first = llm.generate(reference["prompts"], _params())
    second = llm.generate(reference["prompts"], _params())
    _check(reference, first)
    _check(reference, second)
    assert first[-1].num_cached_tokens >= 32  # shares a 40-token prefix with the previous prompt
    long_prompts = [o for o in second if len(o.prompt_token_ids) >= 33]
    assert all(o.num_cached_tokens > 0 for o in long_prompts), "a repeated prompt must hit the cache"
