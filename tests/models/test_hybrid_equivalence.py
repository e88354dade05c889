"""Families mixing cache kinds vs transformers on the same weights: gpt-oss (sliding + full layers,
sinks), Gemma 3 (5 local : 1 global, its own local rope) and Qwen3-Next (Gated DeltaNet + gated full
attention). Greedy tokens identical and top-5 logprobs close (float32), with prompts longer than the
windows, under default settings, chunked prefill smaller than the window, preemption and prefix-cache
hits, each asserted to have happened (hits per cache group)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fixtures.checkpoints import HYBRID_ARCHS
from test_hf_equivalence import _check, _params, hf_reference

from kvflow import LLM, SamplingParams

pytest.importorskip("transformers")

# Checkpoints every 16 tokens, so that the prompts' 40-token shared prefix can restore a state.
STATE_CHECKPOINTS = {"linear_state_checkpoint_interval": 16}


@pytest.fixture(scope="module", params=HYBRID_ARCHS)
def reference(request: pytest.FixtureRequest, tiny_checkpoint_factory: Callable[..., Path]) -> dict[str, Any]:
    return {**hf_reference(tiny_checkpoint_factory(request.param)), "arch": request.param}


def _engine(reference: dict[str, Any], **engine_args: Any) -> LLM:
    if reference["arch"] == "qwen3_next":
        engine_args = {**STATE_CHECKPOINTS, **engine_args}
    return LLM(str(reference["path"]), dtype="float32", **engine_args)


# A pool too small for all prompts at once. Gemma 3's layers form 7 groups of one layer (5 : 1 : 1),
# so its prompts take several times the blocks of the others' 2 groups.
PREEMPTION_POOL = {"gpt_oss": 40, "gemma3": 90, "qwen3_next": 40}


@pytest.mark.parametrize("scenario", ["default", "chunked-prefill", "preemption"])
def test_greedy_matches_transformers(reference: dict[str, Any], scenario: str) -> None:
    engine_args: dict[str, Any] = {
        "default": {},
        # Chunks of 6 tokens: smaller than the sliding windows (8) and the state checkpoints (16).
        "chunked-prefill": {"max_num_batched_tokens": 6},
        "preemption": {"num_kv_blocks": PREEMPTION_POOL[reference["arch"]], "max_num_batched_tokens": 64},
    }[scenario]
    llm = _engine(reference, **engine_args)
    outputs = llm.generate(reference["prompts"], _params())
    _check(reference, outputs)
    if scenario == "preemption":
        assert sum(o.metrics.num_preemptions for o in outputs) > 0, "the tiny pool should force preemption"
    llm.llm_engine.scheduler.check_integrity()


def test_prefix_cache_hits_in_every_group_give_identical_outputs(reference: dict[str, Any]) -> None:
    llm = _engine(reference)
    first = llm.generate(reference["prompts"], _params())
    second = llm.generate(reference["prompts"], _params())
    _check(reference, first)
    _check(reference, second)
    # The last prompt shares a 40-token prefix with the one before: attention groups can hit blocks
    # allocated in the same step; a state checkpoint enters the cache once its step has run.
    hit = second if reference["arch"] == "qwen3_next" else first
    assert hit[-1].num_cached_tokens >= 32
    assert all(o.num_cached_tokens > 0 for o in second if len(o.prompt_token_ids) >= 33)
    manager = llm.llm_engine.scheduler.kv_cache_manager
    assert len(manager.groups) > 1
    for group in manager.groups:
        assert group.num_hit_blocks > 0, f"no prefix hit in cache group {group.group_id} ({group.spec.kind})"


def test_sliding_blocks_are_freed_as_the_window_moves(tiny_checkpoint_factory: Callable[..., Path]) -> None:
    llm = LLM(str(tiny_checkpoint_factory("gpt_oss")), dtype="float32", block_size=4)
    engine = llm.llm_engine
    manager = engine.scheduler.kv_cache_manager
    sliding, full = manager.groups
    assert sliding.spec.kind == "sliding_attention" and full.spec.kind == "full_attention"
    engine.add_request("r", list(range(3, 40)), SamplingParams(max_tokens=40, ignore_eos=True))
    engine.step()  # the prefill: the whole 37-token prompt's blocks, in both groups
    assert len(sliding.held_blocks("r")) == len(full.held_blocks("r")) == 10
    held, free = [], []
    while engine.has_unfinished_requests():
        engine.step()
        if "r" in sliding.req_to_blocks:
            held.append((len(sliding.held_blocks("r")), len(full.held_blocks("r"))))
            free.append(manager.num_free_blocks)
    # Window 8, blocks of 4: from the first decode on, the sliding table holds at most 3 live blocks
    # while the full one grows to every token's.
    assert max(s for s, _ in held) <= 3 and held[-1][1] == -(-(37 + 39) // 4)
    assert any(b > a for a, b in itertools.pairwise(free)), "no sliding block came back"
