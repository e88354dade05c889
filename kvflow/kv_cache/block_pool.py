"""Physical KV cache blocks: ref counts, the free queue (LRU eviction order), the prefix-cache index.

Pure Python, no torch: the model runner owns the K/V tensors; this module only decides which block
id holds which tokens. Every non-null block is in exactly one of two states:

    in use  ref_cnt > 0, not in the free queue
    free    ref_cnt == 0, in the free queue; it may still carry a block hash ("cached"), in which
            case its K/V stays valid and a later request with the same prefix can take it back
            (`touch`) until `get_new_blocks` evicts it.

The free queue is ordered oldest-first: the front is the next block handed out (and evicted).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from kvflow.config import ConfigError
from kvflow.errors import KVFlowError
from kvflow.kv_events.event_log import KVEventLog

# Block 0 is never allocated: block tables show it where sliding-window attention released a block,
# so a table keeps one entry per block-sized span of positions (position p -> table[p // block_size]).
NULL_BLOCK_ID = 0


class IntegrityError(KVFlowError):
    """The block bookkeeping broke an invariant (a bug, never a user error)."""


class NoFreeBlocksError(KVFlowError):
    """More blocks were requested than the free queue holds (callers check first)."""


@dataclass(eq=False)  # identity semantics: two blocks are never "equal", even with equal fields
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    # Chained hash of the tokens of this block and all before it; set once the block is full and
    # entered into the prefix-cache index, cleared when the block is evicted.
    block_hash: bytes | None = None

    @property
    def is_null(self) -> bool:
        return self.block_id == NULL_BLOCK_ID


class BlockPool:
    null_block_id = NULL_BLOCK_ID

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 2:
            raise ConfigError(f"the KV pool needs at least 2 blocks (block 0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(block_id) for block_id in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        # block_id -> block, front = least recently freed. OrderedDict gives O(1) pop-front, append,
        # prepend and removal of an arbitrary block (a cache hit on a free block).
        self.free_block_queue: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (block.block_id, block) for block in self.blocks[1:]
        )
        self.cached_block_hash_to_block: dict[bytes, KVCacheBlock] = {}
        # When not None (a KV offload tier is on, kvflow/kv_offload/): (block_id, block_hash) of every
        # cached block evicted to be handed out again, for the step to save before it is overwritten.
        # Only evictions for reuse: a block evict_free_cached_blocks drops holds no valid K/V.
        self.evicted: list[tuple[int, bytes]] | None = None
        # When not None (`kv_events_config`, kvflow/kv_events/): every key entering or leaving the
        # index is recorded for the engine to publish after the step.
        self.kv_events: KVEventLog | None = None

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def get_num_free_blocks(self) -> int:
        """Blocks `get_new_blocks` can hand out, cached (evictable) ones included."""
        return len(self.free_block_queue)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks in use (ref_cnt > 0); free cached blocks count as free."""
        return 1.0 - self.get_num_free_blocks() / self.num_usable_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        if num_blocks > self.get_num_free_blocks():
            raise NoFreeBlocksError(
                f"asked for {num_blocks} KV blocks, only {self.get_num_free_blocks()} are free"
            )
        new_blocks = []
        for _ in range(num_blocks):
            _, block = self.free_block_queue.popitem(last=False)
            if self.evicted is not None and block.block_hash is not None:
                self.evicted.append((block.block_id, block.block_hash))
            self._evict(block)
            block.ref_cnt = 1
            new_blocks.append(block)
        return new_blocks

    def _evict(self, block: KVCacheBlock) -> None:
        """Drop a free block from the prefix-cache index: its K/V is about to be overwritten."""
        if block.block_hash is None:
            return
        if self.cached_block_hash_to_block.get(block.block_hash) is block:
            del self.cached_block_hash_to_block[block.block_hash]
            if self.kv_events is not None:
                self.kv_events.removed(block.block_hash)
        block.block_hash = None

    def evict_free_cached_blocks(self) -> int:
        """Drop every free block from the prefix-cache index; returns how many were dropped.

        Blocks enter the index when they are allocated for tokens about to be computed (so that
        requests in the same step can share them). If that computation fails, the blocks hold no
        valid K/V: after the failed requests are freed, this makes sure no later request hits them.
        Blocks still referenced were computed by earlier, successful steps and stay cached.
        """
        stale = [block for block in self.free_block_queue.values() if block.block_hash is not None]
        for block in stale:
            self._evict(block)
        return len(stale)

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cache-hit blocks; a free one leaves the free queue (no longer evictable)."""
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                del self.free_block_queue[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference per block; blocks reaching 0 become free.

        Callers pass a request's blocks tail first: among cached blocks, the order of freeing is the
        order of eviction, and a request's head blocks are the ones other requests share (a common
        system prompt), so they should be evicted last. A block without a hash holds nothing
        reusable, so it goes to the FRONT of the queue and is handed out before any cached block
        is evicted (vLLM appends it to the tail; that needlessly evicts cached prefixes first).
        """
        for block in ordered_blocks:
            if block.is_null:
                continue
            if block.ref_cnt <= 0:
                raise IntegrityError(f"block {block.block_id} freed more often than it was referenced")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue[block.block_id] = block
                if block.block_hash is None:
                    self.free_block_queue.move_to_end(block.block_id, last=False)

    def cache_full_block(self, block: KVCacheBlock, block_hash: bytes) -> bool:
        """Enter a full, in-use block into the prefix-cache index; True if it entered now.

        If another block already holds the same hash (two requests computed the same prefix before
        either could hit the other), the index keeps the first one and `block` stays uncached: one
        hash maps to one block, so the index stays a plain dict.
        """
        if not self.enable_caching or block.is_null or block.block_hash is not None:
            return False
        if block_hash in self.cached_block_hash_to_block:
            return False
        block.block_hash = block_hash
        self.cached_block_hash_to_block[block_hash] = block
        return True

    def check_integrity(self) -> None:
        """Raise IntegrityError unless every invariant of the module docstring holds."""
        if self.null_block.ref_cnt != 0 or self.null_block.block_hash is not None:
            raise IntegrityError("the null block was allocated or cached")
        if NULL_BLOCK_ID in self.free_block_queue:
            raise IntegrityError("the null block is in the free queue")
        num_used = 0
        for block in self.blocks[1:]:
            queued = self.free_block_queue.get(block.block_id) is block
            if queued == (block.ref_cnt > 0) or block.ref_cnt < 0:
                raise IntegrityError(
                    f"block {block.block_id}: ref_cnt={block.ref_cnt}, in free queue={queued}"
                )
            num_used += block.ref_cnt > 0
            if (
                block.block_hash is not None
                and self.cached_block_hash_to_block.get(block.block_hash) is not block
            ):
                raise IntegrityError(f"block {block.block_id} carries a hash the index does not map to it")
        # Keys are unique in an OrderedDict; each key must name its own block (no block twice).
        for block_id, block in self.free_block_queue.items():
            if not 0 <= block_id < self.num_blocks or self.blocks[block_id] is not block:
                raise IntegrityError(
                    f"the free queue holds a foreign block or one under a wrong id ({block_id})"
                )
        if num_used + len(self.free_block_queue) != self.num_usable_blocks:
            raise IntegrityError(
                f"{num_used} used + {len(self.free_block_queue)} free != {self.num_usable_blocks}"
            )
        for block_hash, block in self.cached_block_hash_to_block.items():
            if block.block_hash != block_hash:
                raise IntegrityError(f"hash index maps to block {block.block_id}, which carries another hash")
