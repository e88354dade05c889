"""BlockPool: exact block ids, LRU eviction order, cache hits on free blocks, integrity (no torch)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvflow.config import ConfigError
from kvflow.kv_cache.block_pool import (
    NULL_BLOCK_ID,
    BlockPool,
    IntegrityError,
    KVCacheBlock,
    NoFreeBlocksError,
)


def ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [block.block_id for block in blocks]


def queue_ids(pool: BlockPool) -> list[int]:
    return list(pool.free_block_queue)


def h(i: int) -> bytes:
    return bytes([i]) * 32


def test_initial_state_reserves_the_null_block() -> None:
    pool = BlockPool(num_blocks=10, enable_caching=True)
    assert pool.null_block.block_id == NULL_BLOCK_ID == pool.null_block_id == 0
    assert pool.num_usable_blocks == 9
    assert pool.get_num_free_blocks() == 9
    assert queue_ids(pool) == list(range(1, 10))
    assert pool.usage == 0.0
    pool.check_integrity()


def test_too_small_pool_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="at least 2 blocks"):
        BlockPool(num_blocks=1, enable_caching=True)


def test_get_new_blocks_hands_out_ids_in_order_and_never_the_null_block() -> None:
    pool = BlockPool(num_blocks=6, enable_caching=True)
    first = pool.get_new_blocks(3)
    assert ids(first) == [1, 2, 3]
    assert all(block.ref_cnt == 1 for block in first)
    assert ids(pool.get_new_blocks(2)) == [4, 5]
    assert pool.get_num_free_blocks() == 0
    assert pool.usage == 1.0
    with pytest.raises(NoFreeBlocksError, match="asked for 1 KV blocks, only 0 are free"):
        pool.get_new_blocks(1)
    pool.check_integrity()


def test_lru_eviction_order_tail_blocks_first_uncached_blocks_before_any_cached() -> None:
    pool = BlockPool(num_blocks=10, enable_caching=True)
    blocks = pool.get_new_blocks(4)  # [1, 2, 3, 4]; free queue [5..9]
    for i, block in enumerate(blocks[:3]):  # 1..3 full and cached, 4 partial
        pool.cache_full_block(block, h(i))
    pool.free_blocks(reversed(blocks))  # a request frees its blocks tail first
    # Block 4 holds nothing reusable: it goes to the front. Cached 3, 2, 1 go to the tail in
    # that order, so the request's head block (most likely shared) is evicted last.
    assert queue_ids(pool) == [4, 5, 6, 7, 8, 9, 3, 2, 1]
    pool.check_integrity()

    new = pool.get_new_blocks(7)
    assert ids(new) == [4, 5, 6, 7, 8, 9, 3]
    # Handing out block 3 evicted it from the prefix cache; 2 and 1 are still cached.
    assert blocks[2].block_hash is None
    assert pool.get_cached_block(h(2)) is None
    assert pool.get_cached_block(h(1)) is blocks[1]
    assert pool.get_cached_block(h(0)) is blocks[0]
    assert queue_ids(pool) == [2, 1]
    pool.check_integrity()


def test_touch_on_a_free_cached_block_takes_it_out_of_the_free_queue() -> None:
    pool = BlockPool(num_blocks=6, enable_caching=True)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_block(blocks[0], h(0))
    pool.cache_full_block(blocks[1], h(1))
    pool.free_blocks(reversed(blocks))
    assert queue_ids(pool) == [3, 4, 5, 2, 1]

    hit = pool.get_cached_block(h(1))
    assert hit is blocks[1] and hit.ref_cnt == 0
    pool.touch([hit])
    assert hit.ref_cnt == 1
    assert queue_ids(pool) == [3, 4, 5, 1]  # the others keep their order
    pool.touch([hit])  # a second request hitting an in-use block: shared, not re-queued
    assert hit.ref_cnt == 2
    assert queue_ids(pool) == [3, 4, 5, 1]
    pool.check_integrity()

    pool.free_blocks([hit])
    assert hit.ref_cnt == 1 and queue_ids(pool) == [3, 4, 5, 1]
    pool.free_blocks([hit])
    assert hit.ref_cnt == 0 and queue_ids(pool) == [3, 4, 5, 1, 2]  # most recently freed: tail
    assert pool.get_cached_block(h(1)) is hit  # still cached while free
    pool.check_integrity()


def test_cache_full_block_keeps_the_first_block_for_a_duplicate_hash() -> None:
    pool = BlockPool(num_blocks=4, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_block(a, h(7))
    pool.cache_full_block(b, h(7))  # the same prefix computed twice concurrently
    assert a.block_hash == h(7) and b.block_hash is None
    assert pool.get_cached_block(h(7)) is a
    pool.free_blocks([b, a])
    assert queue_ids(pool) == [2, 3, 1]  # b (uncached) to the front, a (cached) to the tail
    pool.check_integrity()


def test_evict_free_cached_blocks_drops_only_free_ones() -> None:
    pool = BlockPool(num_blocks=5, enable_caching=True)
    held, freed = pool.get_new_blocks(2)
    pool.cache_full_block(held, h(1))
    pool.cache_full_block(freed, h(2))
    pool.free_blocks([freed])
    assert pool.evict_free_cached_blocks() == 1
    assert pool.get_cached_block(h(2)) is None and freed.block_hash is None
    assert pool.get_cached_block(h(1)) is held  # still referenced: computed by an earlier step
    pool.check_integrity()


def test_caching_disabled_never_indexes_blocks() -> None:
    pool = BlockPool(num_blocks=4, enable_caching=False)
    (block,) = pool.get_new_blocks(1)
    pool.cache_full_block(block, h(1))
    assert block.block_hash is None and pool.get_cached_block(h(1)) is None
    pool.free_blocks([block])
    pool.check_integrity()


def test_null_block_is_ignored_by_touch_and_free() -> None:
    pool = BlockPool(num_blocks=3, enable_caching=True)
    pool.touch([pool.null_block])
    pool.free_blocks([pool.null_block])
    assert pool.null_block.ref_cnt == 0 and queue_ids(pool) == [1, 2]
    pool.check_integrity()


def test_double_free_raises() -> None:
    pool = BlockPool(num_blocks=3, enable_caching=True)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(IntegrityError, match="freed more often"):
        pool.free_blocks([block])


def test_check_integrity_detects_corruption() -> None:
    pool = BlockPool(num_blocks=4, enable_caching=True)
    (block,) = pool.get_new_blocks(1)
    block.ref_cnt = 0  # in use per the queue, unreferenced per the count
    with pytest.raises(IntegrityError, match="ref_cnt=0"):
        pool.check_integrity()
    block.ref_cnt = 1
    pool.check_integrity()

    block.block_hash = h(3)  # carries a hash the index does not know
    with pytest.raises(IntegrityError, match="carries a hash"):
        pool.check_integrity()
    block.block_hash = None
    pool.cached_block_hash_to_block[h(4)] = block  # index entry to a block with another hash
    with pytest.raises(IntegrityError, match="another hash"):
        pool.check_integrity()
    del pool.cached_block_hash_to_block[h(4)]

    pool.free_block_queue[99] = pool.blocks[2]  # a block twice in the queue
    with pytest.raises(IntegrityError):
        pool.check_integrity()


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["alloc", "free", "cache", "hit"]), st.integers(0, 6)), max_size=60
    )
)
def test_random_operations_keep_the_invariants(ops: list[tuple[str, int]]) -> None:
    """Random alloc/cache/free/hit sequences: integrity holds after every operation, and freeing
    every held reference returns the pool to all-free."""
    pool = BlockPool(num_blocks=8, enable_caching=True)
    held: list[KVCacheBlock] = []  # one entry per reference we hold
    next_hash = 0
    for op, arg in ops:
        if op == "alloc" and arg <= pool.get_num_free_blocks():
            new = pool.get_new_blocks(arg)
            assert NULL_BLOCK_ID not in ids(new)
            held += new
        elif op == "free" and held:
            pool.free_blocks([held.pop(arg % len(held))])
        elif op == "cache" and held:
            pool.cache_full_block(held[arg % len(held)], next_hash.to_bytes(32, "little"))
            next_hash += 1
        elif op == "hit" and pool.cached_block_hash_to_block:
            hashes = list(pool.cached_block_hash_to_block)
            block = pool.get_cached_block(hashes[arg % len(hashes)])
            assert block is not None
            pool.touch([block])
            held.append(block)
        pool.check_integrity()
    pool.free_blocks(reversed(held))
    pool.check_integrity()
    assert pool.get_num_free_blocks() == pool.num_usable_blocks
