"""Mixture-of-experts and latent-attention models vs transformers on the same weights.

Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2 and DeepSeek-V3 tiny random checkpoints
(tests/fixtures/checkpoints.py: MOE_ARCHS, MLA_ARCHS) under the engine's paths, with the prompts,
checks and pool sizes of the dense models' test (tests/models/test_hf_equivalence.py): greedy
tokens identical, top-5 logprobs within float32 summation-order differences.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from fixtures.checkpoints import MLA_ARCHS, MOE_ARCHS
from fixtures.reference import hf_greedy
from test_hf_equivalence import NUM_NEW_TOKENS, PREEMPTION_ARGS, _check, _params, _prompts

from kvflow import LLM

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=MOE_ARCHS + MLA_ARCHS)
def reference(request: pytest.FixtureRequest, tiny_checkpoint_factory: Callable[..., Path]) -> dict[str, Any]:
    path = tiny_checkpoint_factory(request.param)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = _prompts(model.config.vocab_size)
    tokens, logprobs = [], []
    for prompt in prompts:
        new_tokens, logits = hf_greedy(model, prompt, NUM_NEW_TOKENS)
        tokens.append(new_tokens)
        logprobs.append([torch.log_softmax(step.float(), -1) for step in logits])
    return {"path": path, "arch": request.param, "prompts": prompts, "tokens": tokens, "logprobs": logprobs}


@pytest.mark.parametrize("scenario", ["default", "chunked-prefill", "preemption"])
def test_greedy_matches_transformers(reference: dict[str, Any], scenario: str) -> None:
    engine_args: dict[str, Any] = {
        "default": {},
        "chunked-prefill": {"max_num_batched_tokens": 24},
        "preemption": PREEMPTION_ARGS,
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
    assert all(o.num_cached_tokens > 0 for o in second if len(o.prompt_token_ids) >= 33)


# Config variants the fixtures' defaults leave out, each against transformers on the default path.
VARIANTS = [
    ("deepseek_v3", {"rope_interleave": False}),  # rotate_half rope pairs
    ("deepseek_v3", {"q_lora_rank": None, "n_group": 1, "topk_group": 1}),  # no groups
    ("deepseek_v2", {"topk_method": "greedy", "q_lora_rank": 24, "n_group": None, "topk_group": None}),
    ("qwen2_moe", {"mlp_only_layers": [1]}),  # a dense layer after a sparse one
    ("mixtral", {"sliding_window": 32}),
]


@pytest.mark.parametrize(("arch", "overrides"), VARIANTS, ids=[f"{a}-{'-'.join(o)}" for a, o in VARIANTS])
def test_config_variants_match_transformers(
    tiny_checkpoint_factory: Callable[..., Path], arch: str, overrides: dict[str, Any]
) -> None:
    path = tiny_checkpoint_factory(arch, **overrides)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = _prompts(model.config.vocab_size)[:6]
    tokens, logprobs = [], []
    for prompt in prompts:
        new_tokens, logits = hf_greedy(model, prompt, NUM_NEW_TOKENS)
        tokens.append(new_tokens)
        logprobs.append([torch.log_softmax(step.float(), -1) for step in logits])
    reference = {"prompts": prompts, "tokens": tokens, "logprobs": logprobs}
    _check(reference, LLM(str(path), dtype="float32").generate(prompts, _params()))
