"""KVCacheManager: prefix hits with exact shared blocks, the one-token cap, sliding-window release,
allocation failure without side effects (no torch)."""

from __future__ import annotations

import pytest

from kvflow.config import ConfigError
from kvflow.kv_cache.block_pool import IntegrityError
from kvflow.kv_cache.manager import KVCacheManager, PrefixHit
from kvflow.request import Request
from kvflow.sampling_params import SamplingParams


def make_request(request_id: str, token_ids: list[int]) -> Request:
    return Request(request_id, token_ids, SamplingParams(max_tokens=8), arrival_time=0.0)


def queue_ids(manager: KVCacheManager) -> list[int]:
    return list(manager.block_pool.free_block_queue)


def refs(manager: KVCacheManager, block_ids: list[int]) -> list[int]:
    return [manager.block_pool.blocks[i].ref_cnt for i in block_ids]


def admit(manager: KVCacheManager, request: Request) -> bool:
    """What the scheduler does for a waiting request: prefix lookup, then allocate the rest."""
    hit = manager.get_computed_blocks(request)
    if not manager.allocate_slots(request, request.num_tokens - hit.num_tokens, hit):
        return False
    request.num_computed_tokens = hit.num_tokens
    return True


def compute(request: Request) -> None:
    """What the scheduler's update does once the runner computed the scheduled tokens."""
    request.num_computed_tokens = request.num_tokens


def test_prefix_hit_reuses_exact_blocks_and_shares_ref_counts() -> None:
    manager = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    a = make_request("a", list(range(10)))  # 2 full blocks + 2 tokens
    assert manager.get_computed_blocks(a) == PrefixHit(0, ([],))
    assert admit(manager, a)
    assert manager.block_table("a") == [1, 2, 3]
    # The two full blocks are cached at schedule time; the partial block 3 is not.
    assert [b.block_hash is not None for b in manager.req_to_blocks["a"]] == [True, True, False]
    compute(a)

    b = make_request("b", [*range(8), 100, 101, 102])
    hit = manager.get_computed_blocks(b)
    assert [blk.block_id for blk in hit.blocks[0]] == [1, 2] and hit.num_tokens == 8
    assert admit(manager, b)
    assert manager.block_table("b") == [1, 2, 4]
    assert refs(manager, [1, 2, 3, 4]) == [2, 2, 1, 1]
    assert manager.prefix_cache_queries == 10 + 11 and manager.prefix_cache_hits == 8
    manager.check_integrity()

    manager.free(a)
    assert refs(manager, [1, 2, 3]) == [1, 1, 0]
    assert queue_ids(manager)[0] == 3  # a's uncached tail block is reused first
    manager.free(b)
    # b freed tail first: 4 (uncached) to the front, then 2 and 1 (cached) to the tail.
    assert queue_ids(manager) == [4, 3, *range(5, 16), 2, 1]
    assert manager.usage == 0.0 and manager.req_to_blocks == {}
    manager.check_integrity()


def test_prefix_hit_on_free_cached_blocks_after_the_owner_finished() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=2, enable_prefix_caching=True)
    a = make_request("a", [5, 6, 7, 8, 9])
    assert admit(manager, a)
    compute(a)
    manager.free(a)
    b = make_request("b", [5, 6, 7, 8, 1, 2])
    assert admit(manager, b)
    assert manager.block_table("b")[:2] == [1, 2]  # taken back out of the free queue
    assert refs(manager, [1, 2]) == [1, 1]
    assert 1 not in queue_ids(manager) and 2 not in queue_ids(manager)
    manager.check_integrity()


def test_hit_is_capped_to_leave_one_token_to_compute() -> None:
    manager = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    a = make_request("a", list(range(8)))  # exactly 2 full blocks, both cached
    assert admit(manager, a)
    compute(a)

    same = make_request("same", list(range(8)))
    hit = manager.get_computed_blocks(same)
    # (8 - 1) // 4 = 1 block: the last token must be computed to get its logits.
    assert [blk.block_id for blk in hit.blocks[0]] == [1] and hit.num_tokens == 4
    assert admit(manager, same)
    assert manager.block_table("same") == [1, 3]
    # Block 3 recomputes a's second block: same hash, so the index keeps block 2 and 3 stays uncached.
    assert manager.req_to_blocks["same"][1].block_hash is None
    manager.check_integrity()

    longer = make_request("longer", list(range(9)))
    assert manager.get_computed_blocks(longer).num_tokens == 8


def test_no_prefix_caching_means_no_hits_and_no_stats() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    a = make_request("a", [1, 2, 3, 4, 5])
    assert admit(manager, a)
    compute(a)
    assert manager.get_computed_blocks(make_request("b", [1, 2, 3, 4, 5])) == PrefixHit(0, ([],))
    assert manager.prefix_cache_queries == 0 and manager.block_pool.cached_block_hash_to_block == {}


def test_block_hashes_are_chained_and_incremental() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=2, enable_prefix_caching=True)
    a = make_request("a", [1, 2, 3, 4, 5])
    b = make_request("b", [9, 9, 3, 4])
    ha = list(manager.hash_request_blocks(a))
    hb = manager.hash_request_blocks(b)
    assert len(ha) == 2 and len(hb) == 2
    assert ha[1] != hb[1]  # same tokens in block 1, different prefix
    a.append_output_token_ids([6])
    assert manager.hash_request_blocks(a)[:2] == ha and len(a.block_hashes) == 3


def test_sliding_window_releases_exact_blocks() -> None:
    # W = 4, block_size = 4: query q reads keys q-3..q.
    manager = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False, sliding_window=4)
    r = make_request("r", list(range(10)))
    assert admit(manager, r)
    assert manager.block_table("r") == [1, 2, 3]
    compute(r)

    r.append_output_token_ids([50])  # decode position 10: reads keys 7..10, block 0 (0..3) is dead
    assert manager.allocate_slots(r, 1)
    assert manager.block_table("r") == [0, 2, 3]
    assert queue_ids(manager)[0] == 1  # uncached: reused first
    compute(r)
    manager.check_integrity()

    r.append_output_token_ids([51])  # position 11 reads 8..11: block 1 (4..7) is dead
    assert manager.allocate_slots(r, 1)
    assert manager.block_table("r") == [0, 0, 3]
    assert queue_ids(manager)[:2] == [2, 1]
    compute(r)

    r.append_output_token_ids([52])  # position 12 reads 9..12: a new block, block 2 (8..11) still live
    assert manager.allocate_slots(r, 1)
    assert manager.block_table("r") == [0, 0, 3, 2]  # the released block 2 is handed out again
    manager.check_integrity()
    manager.free(r)
    assert manager.num_free_blocks == 7
    manager.check_integrity()


def test_sliding_window_released_cached_blocks_stay_in_the_prefix_cache() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=2, enable_prefix_caching=True, sliding_window=2)
    r = make_request("r", [1, 2, 3, 4, 5])
    assert admit(manager, r)
    compute(r)
    r.append_output_token_ids([6])  # position 5 reads 4..5: blocks 0 (0..1) and 1 (2..3) are dead
    assert manager.allocate_slots(r, 1)
    assert manager.block_table("r") == [0, 0, 3]
    assert queue_ids(manager)[-2:] == [2, 1]  # cached: to the tail, tail block first
    # A new request with the same prefix hits the released blocks it still reads (its first query,
    # at position 4, reads keys 3..4: block 1), and the window's dead blocks stand as nulls.
    other = make_request("other", [1, 2, 3, 4, 9, 9])
    hit = manager.get_computed_blocks(other)
    assert [b.block_id for b in hit.blocks[0]] == [0, 2] and hit.num_tokens == 4
    manager.check_integrity()


def test_prefix_hit_inside_the_dead_window_is_not_touched() -> None:
    manager = KVCacheManager(num_blocks=10, block_size=2, enable_prefix_caching=True, sliding_window=2)
    a = make_request("a", list(range(9)))
    assert admit(manager, a)
    compute(a)
    manager.free(a)
    b = make_request("b", list(range(9)))
    hit = manager.get_computed_blocks(b)
    assert hit.num_tokens == 8
    assert manager.allocate_slots(b, 1, hit)
    # Computing position 8 reads keys 7..8: hit blocks 0..2 are dead at once, block 3 (6..7) is kept.
    assert manager.block_table("b") == [0, 0, 0, 4, 5]
    assert refs(manager, [1, 2, 3, 4]) == [0, 0, 0, 1]
    manager.check_integrity()


def test_allocate_failure_has_no_side_effects() -> None:
    manager = KVCacheManager(num_blocks=6, block_size=4, enable_prefix_caching=True)  # 5 usable
    a = make_request("a", list(range(8)))
    assert admit(manager, a)
    compute(a)
    manager.free(a)  # blocks 1, 2 cached and free
    big = make_request("big", list(range(100, 112)))  # 3 blocks: takes 3, 4, 5
    assert admit(manager, big)
    assert manager.block_table("big") == [3, 4, 5]

    # c hits blocks 1, 2 (free) and needs 1 more block: the only free blocks ARE its hits.
    c = make_request("c", [*range(8), 7, 7])
    hit = manager.get_computed_blocks(c)
    assert [b.block_id for b in hit.blocks[0]] == [1, 2]
    before = (queue_ids(manager), refs(manager, list(range(1, 6))), dict(manager.req_to_blocks))
    stats = (manager.prefix_cache_queries, manager.prefix_cache_hits)
    assert not manager.allocate_slots(c, c.num_tokens - hit.num_tokens, hit)
    assert (queue_ids(manager), refs(manager, list(range(1, 6))), dict(manager.req_to_blocks)) == before
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == stats
    assert c.block_hashes and "c" not in manager.req_to_blocks
    manager.check_integrity()

    # A running request that needs one more block than is free also fails cleanly.
    big.num_computed_tokens = 12
    assert not manager.allocate_slots(big, 12)  # would need 3 more, 2 are free
    assert manager.block_table("big") == [3, 4, 5]
    manager.check_integrity()


def test_check_integrity_detects_ref_count_mismatch() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    assert admit(manager, make_request("a", [1, 2, 3]))
    manager.req_to_blocks["a"][0].ref_cnt = 2
    with pytest.raises(IntegrityError, match="held by 1 tables"):
        manager.check_integrity()


def test_invalid_arguments() -> None:
    with pytest.raises(ConfigError):
        KVCacheManager(num_blocks=4, block_size=0, enable_prefix_caching=True)
    with pytest.raises(ConfigError):
        KVCacheManager(num_blocks=4, block_size=2, enable_prefix_caching=True, sliding_window=0)
    manager = KVCacheManager(num_blocks=8, block_size=2, enable_prefix_caching=True)
    r = make_request("r", [1, 2, 3, 4, 5])
    assert admit(manager, r)
    with pytest.raises(ValueError, match="first allocation"):
        manager.allocate_slots(r, 1, PrefixHit(2, (manager.req_to_blocks["r"][:1],)))
    manager.free(make_request("unknown", [1]))  # freeing a request without blocks is a no-op
    manager.check_integrity()
