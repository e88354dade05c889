"""DeepSeek-V4's cache kinds as block bookkeeping (pure Python, no torch): compressed entries held at
one per rate and cached per block span, hits on multiples of the spans, an HCA state that needs no
checkpoint there, the groups of V4-Pro's 61 layers."""

from __future__ import annotations

from typing import Any

import pytest

from kvflow.compressed_config import CSA, HCA, SLIDING_ONLY, cache_layers, compressed_attention_config
from kvflow.kv_cache.compressed_kinds import build_compressed_kv_cache_config
from kvflow.kv_cache.kv_cache_config import KVCacheConfig
from kvflow.kv_cache.manager import KVCacheManager
from kvflow.kv_cache.specs import CompressedSpec, CompressorStateSpec
from kvflow.request import Request
from kvflow.sampling_params import SamplingParams

TINY: dict[str, Any] = {
    "head_dim": 32,
    "num_attention_heads": 4,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "layer_types": [SLIDING_ONLY, CSA, HCA, CSA],
    "compress_rates": {CSA: 4, HCA: 8},
    "sliding_window": 8,
    "o_groups": 2,
    "index_head_dim": 16,
}


def _config(block_size: int = 4, interval: int | None = 32) -> KVCacheConfig:
    c = compressed_attention_config(TINY, len(TINY["layer_types"]), "config.json")
    return build_compressed_kv_cache_config(
        c,
        block_size=block_size,
        vector_bytes=32 * 4,
        index_key_bytes=16 * 4,
        checkpoint_interval=interval,
    )


def test_cache_layers_of_each_layer_kind() -> None:
    c = compressed_attention_config(TINY, 4, "config.json")
    kinds = [kind for _, kind in cache_layers(c)]
    assert kinds == [
        "sliding_attention",
        "sliding_attention", "csa_entries", "csa_index_keys", "csa_state",
        "sliding_attention", "hca_entries", "hca_state",
        "sliding_attention", "csa_entries", "csa_index_keys", "csa_state",
    ]  # fmt: skip


def test_entries_per_block_and_their_token_spans() -> None:
    config = _config()
    spans = {g.spec.kind + str(getattr(g.spec, "compress_rate", "")): g.spec for g in config.groups}
    csa = [g.spec for g in config.groups if isinstance(g.spec, CompressedSpec) and g.spec.compress_rate == 4]
    hca = [g.spec for g in config.groups if isinstance(g.spec, CompressedSpec) and g.spec.compress_rate == 8]
    # 4-token pages of 32 float32 values: 4 entries of 32 (16 tokens of CSA, 32 of HCA), 8 index keys of 16.
    assert sorted(s.entries_per_block for s in csa) == [4, 4, 8, 8]
    assert {s.tokens_per_block for s in hca} == {32}
    assert spans  # every kind built
    with pytest.raises(Exception, match="multiple of 32"):
        _config(interval=16)


def _request(n: int, rid: str = "r") -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=4))


def test_compressed_blocks_grow_at_one_per_rate_and_hits_land_on_spans() -> None:
    config = _config()
    manager = KVCacheManager(400, 4, True, kv_cache_config=config)
    first = _request(70)
    assert manager.allocate_slots(first, 70)
    for group in manager.groups:
        if isinstance(group.spec, CompressedSpec):
            spec = group.spec
            assert len(group.held_blocks("r")) == -(-(70 // spec.compress_rate) // spec.entries_per_block)
        if isinstance(group.spec, CompressorStateSpec):
            assert len(group.held_blocks("r")) >= group.spec.pages_per_state
    first.num_computed_tokens = 70
    manager.allocate_slots(first, 1)  # the checkpoints written by the prefill step enter the cache
    manager.free(first)
    second = _request(70, "s")
    hit = manager.get_computed_blocks(second)
    # 64: a multiple of every span (16, 32) and of the checkpoint interval (32), below 69.
    assert hit.num_tokens == 64
    for group, blocks in zip(manager.groups, hit.blocks, strict=True):
        if isinstance(group.spec, CompressorStateSpec) and group.spec.empty_at_boundaries:
            assert blocks == []  # HCA: nothing of the state is needed at a multiple of its rate
    assert manager.allocate_slots(second, 6, hit)
    manager.check_integrity()


def test_v4_pro_groups_and_spans_at_16_token_blocks() -> None:
    types = [HCA, HCA] + [CSA if i % 2 else HCA for i in range(59)]
    c = compressed_attention_config(
        {
            "head_dim": 512,
            "num_attention_heads": 128,
            "q_lora_rank": 1536,
            "qk_rope_head_dim": 64,
            "layer_types": types,
            "o_groups": 16,
            "index_head_dim": 128,
        },
        61,
        "config.json",
    )
    config = build_compressed_kv_cache_config(c, block_size=16, vector_bytes=512 * 2, index_key_bytes=128 * 2)
    spans = {
        (g.spec.compress_rate, g.spec.entries_per_block, g.spec.tokens_per_block)
        for g in config.groups
        if isinstance(g.spec, CompressedSpec)
    }
    # 16 KB pages: 16 CSA entries (64 tokens), 64 index keys (256), 16 HCA entries (2,048 tokens).
    assert spans == {(4, 16, 64), (4, 64, 256), (128, 16, 2048)}
    state = next(g.spec for g in config.groups if isinstance(g.spec, CompressorStateSpec))
    assert state.checkpoint_interval is not None and state.checkpoint_interval % 2048 == 0
