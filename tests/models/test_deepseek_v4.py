"""DeepSeek-V4 vs transformers on the same weights: a sliding-only layer, CSA (rate 4, top-4 entries)
and HCA (rate 8) layers, a hash-routed layer, two residual streams, a window of 8. Greedy tokens
identical and top-5 logprobs close (float32) for prompts up to 300 tokens (75 CSA entries, 37 HCA
ones), under default settings, chunks smaller than a compression block, preemption and prefix hits;
and the cache as it is held: windows bounded, compressed entries growing at 1 / rate."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fixtures.checkpoints import V4_ARCH
from test_hf_equivalence import _check, _params, hf_reference

from kvflow import LLM, SamplingParams
from kvflow.compressed_config import WINDOW
from kvflow.errors import ModelLoadError

pytest.importorskip("transformers")

# Blocks of 4 tokens: CSA entries span 16 tokens a block, index keys 32, HCA entries 32, so prefix hits
# land on multiples of 32 tokens, where the CSA states are checkpointed.
PREFIX_CACHE = {"block_size": 4, "linear_state_checkpoint_interval": 32}


@pytest.fixture(scope="module")
def reference(tiny_checkpoint_factory: Callable[..., Path]) -> dict[str, Any]:
    return {**hf_reference(tiny_checkpoint_factory(V4_ARCH)), "arch": V4_ARCH}


@pytest.mark.parametrize("scenario", ["default", "chunked-prefill", "preemption"])
def test_greedy_matches_transformers(reference: dict[str, Any], scenario: str) -> None:
    engine_args: dict[str, Any] = {
        "default": {},
        # Chunks of 3 tokens: smaller than a CSA block (4), so every compressor's tail crosses chunks.
        "chunked-prefill": {"max_num_batched_tokens": 3},
        "preemption": {"num_kv_blocks": 70, "max_num_batched_tokens": 64},
    }[scenario]
    llm = LLM(str(reference["path"]), dtype="float32", **engine_args)
    outputs = llm.generate(reference["prompts"], _params())
    _check(reference, outputs)
    if scenario == "preemption":
        assert sum(o.metrics.num_preemptions for o in outputs) > 0, "the tiny pool should force preemption"
    llm.llm_engine.scheduler.check_integrity()


def test_prefix_hits_on_compression_blocks_give_identical_outputs(reference: dict[str, Any]) -> None:
    llm = LLM(str(reference["path"]), dtype="float32", **PREFIX_CACHE)
    first = llm.generate(reference["prompts"], _params())
    second = llm.generate(reference["prompts"], _params())
    _check(reference, first)
    _check(reference, second)
    # The largest multiple of 32 below each prompt's length: a CSA checkpoint enters the cache once
    # its step has run, so the hits come on the second pass.
    for prompt, out in zip(reference["prompts"], second, strict=True):
        assert out.num_cached_tokens == (len(prompt) - 1) // 32 * 32
    manager = llm.llm_engine.scheduler.kv_cache_manager
    for group in manager.groups:
        if group.spec.kind != "hca_state":  # nothing of an HCA state is restored at a boundary
            assert group.num_hit_blocks > 0, (
                f"no prefix hit in cache group {group.group_id} ({group.spec.kind})"
            )
    manager.check_integrity()


def test_a_request_holds_its_window_and_entries_at_one_per_rate(
    tiny_checkpoint_factory: Callable[..., Path],
) -> None:
    llm = LLM(str(tiny_checkpoint_factory(V4_ARCH)), dtype="float32", block_size=4)
    engine = llm.llm_engine
    manager = engine.scheduler.kv_cache_manager
    engine.add_request("r", list(range(3, 200)), SamplingParams(max_tokens=60, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
        if "r" not in manager.groups[0].req_to_blocks:
            continue
        length = engine.scheduler.requests["r"].num_computed_tokens
        for group in manager.groups:
            held = len(group.held_blocks("r"))
            if group.spec.kind == WINDOW and length > 200:  # the prompt's blocks go at the first decode
                assert held <= 8 // 4 + 1  # the window's 8 tokens, one block of misalignment
            elif group.spec.kind.endswith(("_entries", "_keys")):
                spec: Any = group.spec
                assert held == -(-(length // spec.compress_rate) // spec.entries_per_block)


def test_quantized_checkpoints_are_refused_naming_quantization_config(
    tiny_checkpoint_factory: Callable[..., Path], tmp_path: Path
) -> None:
    source = tiny_checkpoint_factory(V4_ARCH)
    for item in source.iterdir():
        (tmp_path / item.name).symlink_to(item)
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises((ModelLoadError, ValueError), match="quantization_config"):
        LLM(str(tmp_path), dtype="float32")
