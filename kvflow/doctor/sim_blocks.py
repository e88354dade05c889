"""The KV block pool as the simulator needs it: counts, plus which freed blocks still hold a
request's own tokens, the way kvflow/kv_cache/block_pool.py keeps them.

Freed blocks stay cached until handed out again: a request's blocks are freed tail first onto the
end of the free queue (blocks without a full block's tokens to the front, to be reused first), and
new blocks come from the front. So a preempted request finds its head blocks again when it is
re-admitted soon enough, and recomputes only the rest: without this, a simulated preemption storm
recomputes several times more than kvflow does.

Cache kinds (kvflow/kv_cache/kv_cache_config.py): a model's first full-attention group is the token
table above; every other group (a sliding window, a linear-attention state, more full-attention
layers) takes the blocks `other_group_blocks` says from the same free queue, and serves no prefix
hit here (the engine keeps them cached too; a hybrid's preempted request recomputes a little more in
the simulator than in kvflow).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence

from kvflow.kv_cache.specs import KVCacheSpec, LinearAttentionSpec, SlidingWindowSpec, cdiv

BlockKey = tuple[int, int]  # (request index, block index): the tokens a full block holds


def other_group_blocks(spec: KVCacheSpec, num_computed: int, num_tokens: int) -> int:
    """Blocks a request holds in a group of `spec` while a step computes its tokens num_computed ..
    num_tokens - 1, as kvflow/kv_cache/single_type_manager.py allocates them: a sliding window
    frees (at the allocation) the blocks no query from num_computed on reads; a state holds its
    pages, plus those of the checkpoints this step writes (freed at the next allocation)."""
    if isinstance(spec, SlidingWindowSpec):
        total = cdiv(num_tokens, spec.block_size)
        return total - min(total, spec.num_releasable(num_computed))
    if isinstance(spec, LinearAttentionSpec):
        checkpoints = len(spec.checkpoint_boundaries(num_computed, num_tokens))
        return spec.pages_per_state * (1 + checkpoints)
    return cdiv(num_tokens, spec.block_size)


class SimBlockPool:
    def __init__(self, num_blocks: int | None, block_size: int, caching: bool) -> None:
        self.block_size, self.caching = block_size, caching
        self.unlimited = num_blocks is None
        # `num_blocks` usable blocks, as kvflow's num_kv_blocks counts them; block 0 is the null
        # block the engine adds on top (kvflow/engine/engine.py), never handed out. (Counted in
        # them, the planted 12-block kv_pool run held 11 in the replay: 16 preemptions where the
        # server had 8, session 37.)
        self.free_queue: OrderedDict[int, BlockKey | None] = OrderedDict(
            (i, None) for i in range(1, 1 if num_blocks is None else num_blocks + 1)
        )
        self.cached: dict[BlockKey, int] = {}  # key -> block holding it (in use or free)
        self.keys: dict[int, BlockKey] = {}  # block -> its key
        self.tables: dict[int, list[int]] = {}  # request index -> its blocks, in order
        self.others: dict[int, list[int]] = {}  # request index -> its blocks in the other groups
        self._next_id = 0 if num_blocks is None else num_blocks + 1  # unlimited pools mint new ids

    @property
    def num_free(self) -> float:
        return math.inf if self.unlimited else float(len(self.free_queue))

    def cached_prefix(self, request: int, first_block: int, max_tokens: int) -> list[int]:
        """The request's own blocks still cached from token block `first_block` on (the blocks
        before it are a prefix shared with other requests), within `max_tokens` tokens."""
        if not self.caching:
            return []
        found: list[int] = []
        while (first_block + len(found) + 1) * self.block_size <= max_tokens:
            block = self.cached.get((request, first_block + len(found)))
            if block is None:
                break
            found.append(block)
        return found

    def free_needed(self, new_blocks: int, hits: list[int]) -> int:
        """Free-queue blocks an allocation takes: the new ones and the hits that are free."""
        return new_blocks + sum(1 for b in hits if b in self.free_queue)

    def allocate(self, request: int, new_blocks: int, hits: Sequence[int] = ()) -> None:
        table = self.tables.setdefault(request, [])
        for block in hits:
            self.free_queue.pop(block, None)
            table.append(block)
        for _ in range(new_blocks):
            table.append(self._take())

    def resize_others(self, request: int, count: int) -> None:
        """Hold `count` blocks in the other cache groups: new ones from the free queue, released
        ones back to its front (holding nothing reusable here)."""
        held = self.others.setdefault(request, [])
        while len(held) < count:
            held.append(self._take())
        while len(held) > count:
            self._release_anonymous(held.pop())

    def _release_anonymous(self, block: int) -> None:
        if not self.unlimited:
            self.free_queue[block] = None
            self.free_queue.move_to_end(block, last=False)

    def _take(self) -> int:
        if self.unlimited:
            self._next_id += 1
            return self._next_id
        block, _ = self.free_queue.popitem(last=False)
        key = self.keys.pop(block, None)
        if key is not None and self.cached.get(key) == block:
            del self.cached[key]  # evicted: its tokens are overwritten
        return block

    def mark_full(self, request: int, first_block: int, num_computed: int) -> None:
        """Index the request's own blocks its computed tokens fill (they become reusable); its table
        starts at token block `first_block`."""
        if not self.caching:
            return
        table = self.tables.get(request, [])
        for i in range(min(num_computed // self.block_size - first_block, len(table))):
            key = (request, first_block + i)
            if key not in self.cached:
                self.cached[key] = table[i]
                self.keys[table[i]] = key

    def free(self, request: int) -> int:
        """Release the request's blocks, tail first (its other groups' first); returns how many."""
        for block in reversed(self.others.pop(request, [])):
            self._release_anonymous(block)
        table = self.tables.pop(request, [])
        for block in reversed(table):
            if self.unlimited:
                continue
            self.free_queue[block] = self.keys.get(block)
            if block not in self.keys:
                self.free_queue.move_to_end(block, last=False)
        return len(table)
