"""Per-request KV blocks: allocate_slots / free / longest cached prefix / sliding-window release.

A request's block table maps positions to physical blocks: position p lives in
`block_table[p // block_size]`, slot `p % block_size`. The table only grows at its tail; at its head,
blocks that sliding-window attention no longer reads are released and replaced by the null block.

Prefix caching: the i-th full block of a request's tokens is identified by a chained hash
    hash_i = sha256(hash_{i-1} || tokens of block i as little-endian int64),  hash_{-1} = b""
so equal hashes mean equal whole prefixes (the K/V of a block depends on every token before it).
"""

from __future__ import annotations

import hashlib
import struct
from collections import Counter
from collections.abc import Sequence

from kvflow.config import ConfigError
from kvflow.kv_cache.block_pool import BlockPool, IntegrityError, KVCacheBlock
from kvflow.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool, sliding_window: int | None = None
    ) -> None:
        if block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {block_size}")
        if sliding_window is not None and sliding_window < 1:
            raise ConfigError(f"sliding_window must be >= 1, got {sliding_window}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window
        self.block_pool = BlockPool(num_blocks, enable_prefix_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Leading blocks of each request already offered to the hash index (or released).
        self._num_cached_blocks: dict[str, int] = {}
        # Leading blocks of each request released by the sliding window (null in its table).
        self._num_released_blocks: dict[str, int] = {}
        # Prefix-cache stats in tokens, counted once per admission (see allocate_slots).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self._block_format = struct.Struct(f"<{block_size}q")

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def block_table(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, [])]

    def hash_request_blocks(self, request: Request) -> list[bytes]:
        """Extend `request.block_hashes` to every full block of `request.all_token_ids`.

        Incremental and stable: tokens are only ever appended, so earlier hashes stay valid.
        """
        hashes = request.block_hashes
        bs = self.block_size
        parent = hashes[-1] if hashes else b""
        for i in range(len(hashes), request.num_tokens // bs):
            tokens = self._block_format.pack(*request.all_token_ids[i * bs : (i + 1) * bs])
            parent = hashlib.sha256(parent + tokens).digest()
            hashes.append(parent)
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest run of cached blocks from the start of `request`, and the tokens they hold.

        Capped at (num_tokens - 1) // block_size blocks: at least one token is left to compute,
        because sampling needs the logits at the last position. Takes no reference (see allocate_slots).
        """
        if not self.enable_prefix_caching:
            return [], 0
        hashes = self.hash_request_blocks(request)
        computed: list[KVCacheBlock] = []
        for block_hash in hashes[: (request.num_tokens - 1) // self.block_size]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            computed.append(block)
        return computed, len(computed) * self.block_size

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: Sequence[KVCacheBlock] = ()
    ) -> bool:
        """Give `request` blocks for positions up to num_computed + num_new_tokens - 1.

        `new_computed_blocks` (a prefix hit from get_computed_blocks, only on a request's first
        allocation) become the head of its table and count as computed. Returns False, changing
        nothing, when the free queue cannot supply the new blocks.
        """
        rid = request.request_id
        is_admission = rid not in self.req_to_blocks
        blocks = self.req_to_blocks.get(rid, [])
        if new_computed_blocks and (blocks or request.num_computed_tokens):
            raise ValueError(f"request {rid}: computed blocks can only head a request's first allocation")
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_table = len(blocks) + len(new_computed_blocks)
        num_release = min(self._num_releasable(num_computed), num_table)
        num_new_blocks = max(0, cdiv(num_computed + num_new_tokens, self.block_size) - num_table)
        hits_kept = list(new_computed_blocks[num_release:])
        if num_new_blocks > self._num_available(blocks, num_release, hits_kept):
            return False

        # Commit. Hit blocks the window already left behind are never touched: null at once.
        self.block_pool.touch(hits_kept)
        blocks = blocks + [self.block_pool.null_block] * (len(new_computed_blocks) - len(hits_kept))
        blocks += hits_kept
        self._release_window_blocks(rid, blocks, num_release)
        blocks += self.block_pool.get_new_blocks(num_new_blocks)
        self.req_to_blocks[rid] = blocks
        if is_admission and self.enable_prefix_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += len(new_computed_blocks) * self.block_size
        # The new tokens' K/V is written in this very step before any attention reads it (the runner
        # writes a layer's K/V for the whole batch first), so caching now, as vLLM does, is safe.
        self._cache_full_blocks(request, blocks, num_computed + num_new_tokens)
        return True

    def _num_releasable(self, num_computed: int) -> int:
        """Leading blocks no query from position num_computed on will read again.

        Sliding window W (HF semantics): query q attends keys k with q - W < k <= q, so the earliest
        key still needed is num_computed - W + 1; block i ends at (i + 1) * block_size - 1.
        """
        if self.sliding_window is None:
            return 0
        return max(0, (num_computed - self.sliding_window + 1) // self.block_size)

    def _num_available(
        self, blocks: list[KVCacheBlock], num_release: int, hits_kept: list[KVCacheBlock]
    ) -> int:
        """Free blocks once the planned release and touches are done (cached free blocks included)."""
        num_freed = sum(1 for block in blocks[:num_release] if not block.is_null and block.ref_cnt == 1)
        num_taken = sum(1 for block in hits_kept if block.ref_cnt == 0)  # a free hit leaves the queue
        return self.block_pool.get_num_free_blocks() + num_freed - num_taken

    def _release_window_blocks(self, request_id: str, blocks: list[KVCacheBlock], num_release: int) -> None:
        start = self._num_released_blocks.get(request_id, 0)
        released = [block for block in blocks[start:num_release] if not block.is_null]
        blocks[start:num_release] = [self.block_pool.null_block] * max(0, num_release - start)
        self._num_released_blocks[request_id] = max(start, num_release)
        # Tail first, like free(): released cached blocks stay in the prefix cache, evictable.
        self.block_pool.free_blocks(reversed(released))

    def _cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock], num_tokens: int) -> None:
        if not self.enable_prefix_caching:
            return
        hashes = self.hash_request_blocks(request)
        start = self._num_cached_blocks.get(request.request_id, 0)
        num_full = min(num_tokens // self.block_size, len(hashes))
        for i in range(start, num_full):
            self.block_pool.cache_full_block(blocks[i], hashes[i])  # skips null and already-cached
        self._num_cached_blocks[request.request_id] = max(start, num_full)

    def trim(self, request: Request, num_tokens: int) -> None:
        """Free the blocks past the ones `num_tokens` positions need (speculative decoding: blocks
        allocated only for rejected drafts). They hold no real token's K/V, so no cached hash."""
        rid = request.request_id
        blocks = self.req_to_blocks.get(rid)
        needed = cdiv(num_tokens, self.block_size)
        if blocks is None or len(blocks) <= needed:
            return
        extra = blocks[needed:]
        del blocks[needed:]
        self._num_cached_blocks[rid] = min(self._num_cached_blocks.get(rid, 0), needed)
        self.block_pool.free_blocks(reversed(extra))

    def free(self, request: Request) -> None:
        """Release all of a request's blocks, tail first (see BlockPool.free_blocks)."""
        rid = request.request_id
        blocks = self.req_to_blocks.pop(rid, [])
        self._num_cached_blocks.pop(rid, None)
        self._num_released_blocks.pop(rid, None)
        self.block_pool.free_blocks(reversed(blocks))

    def check_integrity(self) -> None:
        """Pool invariants, plus: each block's ref_cnt equals the number of request tables holding it."""
        self.block_pool.check_integrity()
        refs: Counter[int] = Counter()
        for rid, blocks in self.req_to_blocks.items():
            num_released = self._num_released_blocks.get(rid, 0)
            if any(block.is_null != (i < num_released) for i, block in enumerate(blocks)):
                raise IntegrityError(f"request {rid}: null blocks outside its released head ({num_released})")
            block_ids = [block.block_id for block in blocks if not block.is_null]
            if len(set(block_ids)) != len(block_ids):
                raise IntegrityError(f"request {rid} holds a block twice: {block_ids}")
            refs.update(block_ids)
        for block in self.block_pool.blocks[1:]:
            if block.ref_cnt != refs[block.block_id]:
                raise IntegrityError(
                    f"block {block.block_id}: ref_cnt={block.ref_cnt}, "
                    f"held by {refs[block.block_id]} request tables"
                )
