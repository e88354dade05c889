"""DeepSeek-V4 vs transformers on the same weights: a sliding-only layer, CSA (rate 4, top-4 entries)
and HCA (rate 8) layers, a hash-routed layer, two residual streams, a window of 8. Greedy tokens
identical and top-5 logprobs close (float32) for prompts up to 300 tokens (75 CSA entries, 37 HCA
ones), under default settings, chunks smaller than a compression block, preemption and prefix hits;
and the cache as it is held: windows bounded, compressed entries growing at 1 / rate."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fixtures.checkpoints import V4_ARCH
from test_hf_equivalence import _check, _params, hf_reference

from kvflow import LLM, SamplingParams
from kvflow.compressed_config import WINDOW
from kvflow.config import ConfigError

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


# Teacher-forced top-1 agreement with the bf16 pool over 48 positions in 8-token chunks (8 prompts in
# 4-token chunks took 28 s a kind for the same verdict). Measured: int8 41 (85%), fp8 37 (77%), the
# same in 4-token chunks; over 96 positions 86 and 73 (bf16 itself in 4-token chunks: 94). Below
# MLA's floors (tests/models/test_mla.py), since K = V puts the rounding in the values as well as the
# scores, and an index key's rounding can flip a top-k pick. A broken format agrees at chance.
KV_AGREEMENT_FLOOR = {"int8": 0.8, "fp8_e4m3": 0.7}


@pytest.mark.parametrize("kind", ["int8", "fp8_e4m3"])
def test_quantized_compressed_kv_is_close_to_bf16(
    tiny_checkpoint_factory: Callable[..., Path], kind: str
) -> None:
    """Windows, entries and indexer keys in int8 / fp8 with a scale per vector (the compressor states
    stay float32): next-token argmax along the bf16-pool greedy continuation, 8-token chunks reading
    the quantized context back (kvflow/attention/compressed_store.py)."""
    from quant.test_kv_quant import teacher_forced_agreement

    path = str(tiny_checkpoint_factory(V4_ARCH))
    prompts = [[5 + i, 17, 42 + i, 99, 7, 3 + i, 250, 11] * 6 for i in range(4)]  # 48 tokens: 12 CSA entries
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    bf16 = LLM(path, dtype="bfloat16", max_model_len=128)
    reference = [o.outputs[0].token_ids for o in bf16.generate(prompts, params)]
    llm = LLM(
        path, dtype="bfloat16", max_model_len=128, kv_cache_dtype=kind, max_num_batched_tokens=8,
        enable_prefix_caching=False,
    )  # fmt: skip
    engine = llm.llm_engine
    # Every vector is its values in one byte each and a 2-byte scale: 16 tokens x (32 + 2) a page.
    assert engine.kv_cache_config.page_bytes == 16 * (32 + 2)
    agree, total = teacher_forced_agreement(llm, prompts, reference)
    print(f"deepseek_v4 {kind} compressed KV: teacher-forced top-1 agreement with bf16 KV {agree}/{total}")
    assert agree / total >= KV_AGREEMENT_FLOOR[kind]


def test_int4_compressed_kv_is_refused(tiny_checkpoint_factory: Callable[..., Path]) -> None:
    with pytest.raises(ConfigError, match=r"int4.*not supported for DeepSeek-V4"):
        LLM(str(tiny_checkpoint_factory(V4_ARCH)), dtype="float32", kv_cache_dtype="int4")


@pytest.mark.parametrize("kind", ["auto", "int8", "fp8_e4m3"])
def test_entry_pool_round_trip(kind: str) -> None:
    """Rows written at slots across pages read back (to within the format's step), and the scales
    at the end of a page never overwrite another row's values."""
    import torch

    from kvflow.attention.compressed_store import EntryPool

    width, per, blocks = 16, 6, 4
    page = per * (width + 2) if kind != "auto" else per * width * 4
    pages = torch.zeros(blocks, page, dtype=torch.uint8)
    pool = EntryPool(pages, per, width, torch.float32, kind)
    slots = torch.tensor([1, 5, 6, 11, 23])
    values = torch.randn(5, width)
    pool.write(slots, values)
    back = pool.gather(slots)
    tolerance = {"auto": 0.0, "int8": 0.02, "fp8_e4m3": 0.07}[kind]
    assert torch.allclose(back, values, atol=tolerance * float(values.abs().max()), rtol=tolerance)
    assert pool.gather(torch.tensor([0, 2])).abs().sum() == 0  # untouched rows stay zero


def test_the_mtp_layer_in_a_checkpoint_does_not_break_loading(
    tiny_checkpoint_factory: Callable[..., Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Released V4 checkpoints carry their multi-token-prediction layer (mtp.*,
    num_nextn_predict_layers): not run here (speculation comes later), left unread with a warning."""
    import logging

    import torch
    from safetensors.torch import save_file

    source = tiny_checkpoint_factory(V4_ARCH)
    for item in source.iterdir():
        (tmp_path / item.name).symlink_to(item)
    save_file(
        {"mtp.0.attn.wq_a.weight": torch.zeros(32, 64), "mtp.0.enorm.weight": torch.ones(64)},
        tmp_path / "mtp.safetensors",
    )
    with caplog.at_level(logging.WARNING, logger="kvflow"):
        llm = LLM(str(tmp_path), dtype="float32")
    assert any("mtp.0." in r.getMessage() for r in caplog.records)
    out = llm.generate([[5, 17, 42, 99]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
