"""Batch-invariant mode: a seeded request's tokens and logprobs do not depend on what else runs.

Without the mode, a request's rows go through different kernels as the batch grows (the GEMV up to
8 rows, oneDNN above), and its prompt is chunked around the other requests' decodes, so near-tied
tokens can flip. With it, every linear runs the row-invariant GEMVs and every query row attends
alone, so the same request alone and inside a busy, chunked, mixed batch gives the same floats.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.errors import InvalidRequestError
from kvflow.kernels import native_decoder_classes

pytestmark = pytest.mark.skipif(
    native_decoder_classes() is None,
    reason="native kernels unavailable (no AVX512-BF16 or AVX2, or no compiler)",
)

# A small token budget chunks the prompts, and how depends on the other requests' decodes.
BUDGET = 24
NUM_OTHERS = 11  # with the seeded request: 12 decode rows, past the GEMV's 8 in the default mode


@pytest.mark.parametrize(
    ("arch", "engine_args"),
    [("llama", {}), ("qwen3", {"kv_cache_dtype": "int8"}), ("qwen2", {"quantization": "int8"})],
)
def test_seeded_request_is_the_same_alone_and_in_a_busy_batch(
    arch: str, engine_args: dict[str, object], tiny_checkpoint_factory: Callable[..., Path]
) -> None:
    path = tiny_checkpoint_factory(arch, dtype=torch.bfloat16)
    llm = LLM(str(path), dtype="bfloat16", batch_invariant=True, max_num_batched_tokens=BUDGET, **engine_args)
    rng = random.Random(3)
    vocab = llm.llm_engine.arch.vocab_size
    prompt = [rng.randrange(vocab) for _ in range(50)]
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=24, ignore_eos=True, logprobs=2)
    alone = llm.generate([prompt], seeded)[0].outputs[0]
    others = [[rng.randrange(vocab) for _ in range(rng.randint(5, 60))] for _ in range(NUM_OTHERS)]
    busy_params = [
        SamplingParams(temperature=0.8, max_tokens=rng.randint(10, 30), ignore_eos=True)
    ] * NUM_OTHERS
    busy = llm.generate([*others[:5], prompt, *others[5:]], [*busy_params[:5], seeded, *busy_params[5:]])
    in_batch = busy[5].outputs[0]
    assert in_batch.token_ids == alone.token_ids
    assert in_batch.logprobs == alone.logprobs  # the floats, exactly


def test_batch_invariant_refuses_a_model_off_the_native_kernels(
    tiny_checkpoint_factory: Callable[..., Path],
) -> None:
    path = tiny_checkpoint_factory("llama")
    with pytest.raises(
        InvalidRequestError, match="batch_invariant needs every layer on kvflow's native kernels"
    ):
        LLM(str(path), dtype="float32", batch_invariant=True)
