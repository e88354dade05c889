"""Cache groups over one pool (no torch): sliding layers hold only their window, a linear-attention
state is flat in L and checkpointed for prefix hits, and a hit is a hit in every group at once."""

from __future__ import annotations

import itertools

import pytest

from kvflow.config import ConfigError
from kvflow.kv_cache.kv_cache_config import build_kv_cache_config, group_size_for
from kvflow.kv_cache.manager import KVCacheManager, PrefixHit
from kvflow.kv_cache.specs import LinearAttentionSpec, SlidingWindowSpec
from kvflow.request import Request
from kvflow.sampling_params import SamplingParams

BLOCK = 4


def make_request(request_id: str, token_ids: list[int]) -> Request:
    return Request(request_id, token_ids, SamplingParams(max_tokens=64), arrival_time=0.0)


def admit(manager: KVCacheManager, request: Request, num_new: int | None = None) -> PrefixHit:
    hit = manager.get_computed_blocks(request)
    n = request.num_tokens - hit.num_tokens if num_new is None else num_new
    assert manager.allocate_slots(request, n, hit)
    request.num_computed_tokens = hit.num_tokens + n
    return hit


def decode(manager: KVCacheManager, request: Request, token: int) -> None:
    request.append_output_token_ids([token])
    assert manager.allocate_slots(request, 1)
    request.num_computed_tokens += 1


def gpt_oss_like(num_blocks: int = 64, window: int = 8, caching: bool = True) -> KVCacheManager:
    kinds = ["sliding_attention", "full_attention"] * 2
    config = build_kv_cache_config(
        kinds, block_size=BLOCK, token_bytes=64, sliding_window=window, enable_prefix_caching=caching
    )
    return KVCacheManager(num_blocks, BLOCK, caching, kv_cache_config=config)


def qwen3_next_like(
    num_blocks: int = 128, interval: int | None = 8, state_bytes: int = 600
) -> KVCacheManager:
    kinds = ["linear_attention"] * 3 + ["full_attention"]
    config = build_kv_cache_config(
        kinds, block_size=BLOCK, token_bytes=64, state_bytes=state_bytes, checkpoint_interval=interval
    )
    return KVCacheManager(num_blocks, BLOCK, True, kv_cache_config=config)


def test_groups_have_equal_sizes_and_share_layer_slots() -> None:
    assert group_size_for([12, 12]) == 12  # gpt-oss: one group per kind
    assert group_size_for([52, 10]) == 10  # Gemma 3 27B: the fewest layers of a kind
    assert group_size_for([11, 12]) == 12  # nearly equal: one group each, little padding
    gemma = build_kv_cache_config(
        ["sliding_attention"] * 5 + ["full_attention"], block_size=16, token_bytes=8, sliding_window=1024
    )
    assert gemma.num_layer_slots == 1 and len(gemma.groups) == 6
    assert gemma.layer_group == (0, 1, 2, 3, 4, 5) and gemma.layer_slot == (0,) * 6
    qwen = build_kv_cache_config(
        (["linear_attention"] * 3 + ["full_attention"]) * 12, block_size=16, token_bytes=8, state_bytes=100
    )
    assert qwen.num_layer_slots == 12 and [len(g.layer_ids) for g in qwen.groups] == [12] * 4
    assert qwen.groups[3].layer_ids == tuple(range(3, 48, 4))  # the full-attention group
    assert qwen.layer_slot[7] == 1 and qwen.layer_group[7] == 3
    with pytest.raises(ConfigError, match="sliding_window"):
        build_kv_cache_config(["sliding_attention"], block_size=16, token_bytes=8)
    with pytest.raises(ConfigError, match="unknown layer kinds"):
        build_kv_cache_config(["mamba"], block_size=16, token_bytes=8)


def test_sliding_group_holds_its_window_and_frees_blocks_as_it_decodes() -> None:
    manager = gpt_oss_like()
    sliding, full = manager.groups
    r = make_request("r", list(range(20)))
    admit(manager, r)
    assert len(full.held_blocks("r")) == 5 and len(sliding.held_blocks("r")) == 5
    free_before = manager.num_free_blocks
    frees = []
    for t in range(20):
        decode(manager, r, 100 + t)
        frees.append(manager.num_free_blocks)
        manager.check_integrity()
    # Position L reads keys L - 7 .. L: the sliding table keeps at most 3 live blocks of 4 tokens.
    assert len(sliding.held_blocks("r")) <= 3
    assert len(full.held_blocks("r")) == 10  # 40 tokens, every block kept
    held = len(sliding.held_blocks("r")) + len(full.held_blocks("r"))
    assert manager.kv_cache_config.num_blocks_held(r.num_tokens) == held == 12
    # The pool's free count rises as the window moves: a released block comes back every 4 tokens.
    assert any(b > a for a, b in itertools.pairwise(frees))
    assert free_before - manager.num_free_blocks == 2  # 5 more full blocks, 3 sliding ones released
    manager.free(r)
    manager.check_integrity()
    assert manager.num_free_blocks == 63


def test_a_prefix_hit_is_a_hit_in_every_group() -> None:
    manager = gpt_oss_like()
    a = make_request("a", list(range(32)))
    admit(manager, a)
    manager.free(a)  # every block free and cached
    b = make_request("b", [*range(32), 7, 7, 7])
    hit = admit(manager, b)
    assert hit.num_tokens == 32
    sliding_hit, full_hit = hit.blocks
    assert len(full_hit) == 8 and all(not blk.is_null for blk in full_hit)
    # The sliding group needs only the blocks holding keys 25 .. 31 (the query at 32 reads 25 .. 32).
    assert [blk.is_null for blk in sliding_hit] == [True] * 6 + [False] * 2
    assert manager.groups[0].num_hit_blocks == 2 and manager.groups[1].num_hit_blocks == 8
    manager.check_integrity()


def test_a_missing_window_block_shortens_the_hit_for_every_group() -> None:
    manager = gpt_oss_like()
    a = make_request("a", list(range(32)))
    admit(manager, a)
    manager.free(a)
    sliding = manager.groups[0]
    # Evict the sliding group's block 6 (keys 24 .. 27; group 0 caches under the plain hash): a hit
    # at 32 tokens needs it.
    lost = manager.block_pool.get_cached_block(a.block_hashes[6])
    assert lost is not None and lost not in manager.groups[1].hit_blocks(a.block_hashes, 8)
    manager.block_pool._evict(lost)
    b = make_request("b", [*range(32), 7])
    hit = manager.get_computed_blocks(b)
    # 28 tokens would need block 6 too (keys 21 .. 27); 24 needs blocks 4 and 5 (keys 17 .. 23).
    assert hit.num_tokens == 24
    assert len(hit.blocks[1]) == 6 and sliding.longest_hit(b.block_hashes, 8) == 6


def test_linear_state_is_flat_and_checkpointed_at_interval_boundaries() -> None:
    manager = qwen3_next_like()
    spec = manager.kv_cache_config.groups[0].spec
    assert isinstance(spec, LinearAttentionSpec)
    assert spec.pages_per_state == 3  # 600 bytes over pages of 4 tokens x 64 bytes
    assert spec.checkpoint_interval == 8
    r = make_request("r", list(range(20)))
    admit(manager, r, num_new=12)  # chunk 1: tokens 0 .. 11 cross the boundary at 8
    steps = manager.state_steps("r")
    assert len(steps) == 3  # one per linear group
    assert steps[0].source is None and len(steps[0].state) == 3
    assert [(j, len(p)) for j, p in steps[0].checkpoints] == [(8, 3)]
    manager.check_integrity()
    assert manager.allocate_slots(r, 8)  # chunk 2: tokens 12 .. 19 cross 16
    r.num_computed_tokens = 20
    steps = manager.state_steps("r")
    assert steps[0].source == steps[0].state and [j for j, _ in steps[0].checkpoints] == [4]
    for t in range(30):
        decode(manager, r, 50 + t)
        manager.check_integrity()
        for group in manager.groups[:3]:
            assert len(group.req_to_blocks["r"]) == 3  # the running state: flat in L
    manager.free(r)
    manager.check_integrity()
    assert manager.num_free_blocks == 127


def test_prefix_hit_restores_from_the_last_checkpoint_in_reach() -> None:
    manager = qwen3_next_like()
    a = make_request("a", list(range(20)))
    admit(manager, a, num_new=12)
    assert manager.allocate_slots(a, 8)
    a.num_computed_tokens = 20
    manager.free(a)  # the checkpoints of 8 and 16 tokens are cached now
    b = make_request("b", [*range(20), 9, 9, 9, 9, 9])
    hit = admit(manager, b)
    # Full attention holds 5 blocks of the prefix; the states only checkpoints at 8 and 16.
    assert hit.num_tokens == 16
    assert [len(blocks) for blocks in hit.blocks] == [3, 3, 3, 4]
    step = manager.state_steps("b")[0]
    assert step.source == [blk.block_id for blk in hit.blocks[0]] and step.source != step.state
    assert [j for j, _ in step.checkpoints] == [8]  # 24 = 16 + 8
    manager.check_integrity()
    # The restore source goes back to the pool after the step that read it.
    assert manager.allocate_slots(b, 0) and all(blk.ref_cnt == 0 for blk in hit.blocks[0])
    manager.check_integrity()


def test_a_checkpoint_is_cached_only_after_its_step() -> None:
    manager = qwen3_next_like()
    a = make_request("a", list(range(10)))
    admit(manager, a)  # writes the checkpoint of 8 tokens during this step
    b = make_request("b", list(range(10)))
    assert manager.get_computed_blocks(b).num_tokens == 0  # the same step cannot restore from it
    assert manager.allocate_slots(a, 0)
    assert manager.get_computed_blocks(b).num_tokens == 8


def test_no_prefix_caching_means_no_checkpoints() -> None:
    kinds = ["linear_attention", "full_attention"]
    config = build_kv_cache_config(
        kinds, block_size=BLOCK, token_bytes=64, state_bytes=100, enable_prefix_caching=False
    )
    manager = KVCacheManager(32, BLOCK, False, kv_cache_config=config)
    r = make_request("r", list(range(30)))
    admit(manager, r)
    assert manager.state_steps("r")[0].checkpoints == []
    assert manager.num_free_blocks == 31 - 1 - 8


def test_failed_allocation_in_one_group_changes_nothing_in_any() -> None:
    manager = gpt_oss_like(num_blocks=12)  # 11 usable
    a = make_request("a", list(range(16)))
    admit(manager, a)  # 4 full + 4 sliding blocks; big needs 6 + 6, 3 are free
    big = make_request("big", list(range(100, 124)))
    before = manager.num_free_blocks
    hit = manager.get_computed_blocks(big)
    assert not manager.allocate_slots(big, 24, hit)
    assert manager.num_free_blocks == before and "big" not in manager.groups[1].req_to_blocks
    manager.check_integrity()


def test_peak_prefill_blocks_and_bytes_per_kind() -> None:
    manager = gpt_oss_like(window=128)
    config = manager.kv_cache_config
    spec = config.groups[0].spec
    assert isinstance(spec, SlidingWindowSpec)
    # A 32k request: full blocks for every token, sliding blocks for about the window.
    assert config.groups[1].spec.num_blocks_held(32768) == 8192
    assert spec.num_blocks_held(32768) == 32
    held = config.bytes_held_by_kind(32768)
    assert held["full_attention"] == 8192 * config.bytes_per_block
    assert held["sliding_attention"] == 32 * config.bytes_per_block
    assert config.num_blocks_peak_prefill(32768, 512) == 8192 + -(-(128 - 1 + 512) // BLOCK) + 1
