"""One cache group's block tables over the shared pool: full attention, sliding window, linear state.

Each manager keeps `req_to_blocks[request_id]`, the request's table in this group: position p lives
in block table[p // block_size] for the token-indexed kinds; a linear-attention group's table is the
pages of the request's running state. The coordinator (kvflow/kv_cache/manager.py) drives every
group through the same phases per allocation, so that no group's new blocks can evict another
group's prefix hit before it is taken:
    1. num_blocks_needed   net blocks the allocation takes from the free queue (nothing changes)
    2. release             blocks the request no longer reads go back to the pool (cached ones stay
                           cached, evictable): a sliding window's leading blocks, a state's
                           checkpoints of the previous step (no block is taken, so no hit is lost)
    3. save_hits           a prefix hit's cached blocks head the table (first allocation only)
    4. allocate_new        blocks for the tokens up to num_tokens
    5. cache_blocks        full blocks enter the prefix-cache index under this group's key
Prefix hits: `longest_hit(hashes, max_blocks)` is the largest hit of at most `max_blocks` blocks this
group can serve (0 always can); `hit_blocks` the blocks of a hit of that length.
"""

from __future__ import annotations

from collections import Counter

from kvflow.kv_cache.block_pool import BlockPool, IntegrityError, KVCacheBlock
from kvflow.kv_cache.specs import (
    CompressedSpec,
    CompressorStateSpec,
    KVCacheSpec,
    LinearAttentionSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    cdiv,
)
from kvflow.kv_events.event_log import GroupTag
from kvflow.kv_events.events import KIND_FULL_ATTENTION, KIND_MLA, KIND_SLIDING_WINDOW
from kvflow.request import Request
from kvflow.scheduler_output import StateStep


def group_key(block_hash: bytes, group_id: int, page: int = 0) -> bytes:
    """The prefix-cache key of a block of group `group_id`: the same tokens cache different bytes in
    each group. Group 0 keeps the plain chained hash (a single-group model pays nothing); a state's
    pages add their index."""
    if group_id == 0 and page == 0:
        return block_hash
    return block_hash + group_id.to_bytes(2, "little") + page.to_bytes(4, "little")


class SingleTypeManager:
    def __init__(self, spec: KVCacheSpec, pool: BlockPool, group_id: int) -> None:
        self.spec = spec
        self.block_size = spec.block_size
        self.pool = pool
        self.group_id = group_id
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Leading blocks of each request already offered to the hash index (or released).
        self._num_cached_blocks: dict[str, int] = {}
        self.num_hit_blocks = 0  # blocks reused from the prefix cache, cumulative (stats and tests)

    # --------------------------------------------------------------------------------- prefix hits

    def longest_hit(self, hashes: list[bytes], max_blocks: int) -> int:
        """Full attention: the leading run of cached blocks (the hashes chain, so it is a prefix)."""
        for i in range(max_blocks):
            if self.pool.get_cached_block(group_key(hashes[i], self.group_id)) is None:
                return i
        return max_blocks

    def hit_blocks(self, hashes: list[bytes], num_blocks: int) -> list[KVCacheBlock]:
        return [self._cached(hashes[i]) for i in range(num_blocks)]

    def _cached(self, block_hash: bytes, page: int = 0) -> KVCacheBlock:
        block = self.pool.get_cached_block(group_key(block_hash, self.group_id, page))
        if block is None:
            raise IntegrityError(f"group {self.group_id}: a prefix hit lost a block before it was taken")
        return block

    # ---------------------------------------------------------------------------------- allocation

    def num_blocks_needed(
        self, request_id: str, num_computed: int, num_tokens: int, hits: list[KVCacheBlock]
    ) -> int:
        blocks = self.req_to_blocks.get(request_id, [])
        num_new = max(0, cdiv(num_tokens, self.block_size) - len(blocks) - len(hits))
        return num_new + sum(1 for b in hits if b.ref_cnt == 0)  # a free hit leaves the free queue

    def save_hits(self, request_id: str, num_computed: int, hits: list[KVCacheBlock]) -> None:
        if not hits:
            return
        self.pool.touch(hits)
        self.req_to_blocks.setdefault(request_id, []).extend(hits)
        self.num_hit_blocks += len(hits)

    def release(self, request_id: str, num_computed: int) -> None:
        """Full attention keeps every block until the request finishes."""

    def allocate_new(self, request: Request, num_computed: int, num_tokens: int) -> None:
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_new = cdiv(num_tokens, self.block_size) - len(blocks)
        if num_new > 0:
            blocks += self.pool.get_new_blocks(num_new)

    def cache_blocks(self, request: Request, hashes: list[bytes], num_tokens: int) -> None:
        """Enter the full blocks among the first `num_tokens` tokens into the index. Their K/V is
        written in this very step before any attention reads it (the runner writes a layer's K/V for
        the whole batch first), so caching now, as vLLM does, is safe."""
        rid = request.request_id
        blocks = self.req_to_blocks[rid]
        start = self._num_cached_blocks.get(rid, 0)
        num_full = min(num_tokens // self.block_size, len(hashes), len(blocks))
        entered = [
            i
            for i in range(start, num_full)
            if self.pool.cache_full_block(blocks[i], group_key(hashes[i], self.group_id))
        ]
        self._num_cached_blocks[rid] = max(start, num_full)
        if self.pool.kv_events is not None and entered:
            self._announce(request, hashes, entered)

    def _announce(self, request: Request, hashes: list[bytes], entered: list[int]) -> None:
        """KV events for the blocks that just entered the index, one BlockStored per run of
        consecutive blocks (a block another request cached first breaks the run: it was announced
        then, and stays the next run's parent)."""
        assert self.pool.kv_events is not None
        bs, tag = self.block_size, self.event_tag()
        runs: list[list[int]] = []
        for i in entered:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            first, last = run[0], run[-1]
            parent = group_key(hashes[first - 1], self.group_id) if first > 0 else None
            keys = [group_key(hashes[i], self.group_id) for i in run]
            tokens = request.all_token_ids[first * bs : (last + 1) * bs]
            self.pool.kv_events.stored(keys, parent, tokens, tag)

    def event_tag(self) -> GroupTag:
        """This group as KV events name it (vLLM's `kv_cache_spec_kind`)."""
        kind = KIND_MLA if isinstance(self.spec, MLAAttentionSpec) else KIND_FULL_ATTENTION
        return GroupTag(self.group_id, kind)

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Free the blocks past the ones `num_tokens` positions need (speculative decoding: blocks
        allocated only for rejected drafts). They hold no real token's K/V, so no cached hash."""
        blocks = self.req_to_blocks.get(request_id)
        needed = cdiv(num_tokens, self.block_size)
        if blocks is None or len(blocks) <= needed:
            return
        extra = blocks[needed:]
        del blocks[needed:]
        self._num_cached_blocks[request_id] = min(self._num_cached_blocks.get(request_id, 0), needed)
        self.pool.free_blocks(reversed(extra))

    def free(self, request_id: str) -> None:
        """Release all of a request's blocks, tail first (see BlockPool.free_blocks)."""
        blocks = self.req_to_blocks.pop(request_id, [])
        self._num_cached_blocks.pop(request_id, None)
        self.pool.free_blocks(reversed(blocks))

    # ------------------------------------------------------------------------------------- queries

    def held_blocks(self, request_id: str) -> list[KVCacheBlock]:
        """Every block the request holds in this group (the dashboard's map, integrity)."""
        return [b for b in self.req_to_blocks.get(request_id, []) if not b.is_null]

    def block_table(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, [])]

    def covers(self, request_id: str, num_tokens: int) -> bool:
        return len(self.req_to_blocks.get(request_id, [])) * self.block_size >= num_tokens

    def check_request(self, request_id: str) -> None:
        blocks = self.req_to_blocks[request_id]
        if any(b.is_null for b in blocks):
            raise IntegrityError(f"group {self.group_id}, request {request_id}: null block in a full table")

    def reference_counts(self) -> Counter[int]:
        refs: Counter[int] = Counter()
        for rid in self.req_to_blocks:
            self.check_request(rid)
            ids = [b.block_id for b in self.held_blocks(rid)]
            if len(set(ids)) != len(ids):
                raise IntegrityError(f"group {self.group_id}: request {rid} holds a block twice: {ids}")
            refs.update(ids)
        return refs


class FullAttentionManager(SingleTypeManager):
    pass


class SlidingWindowManager(SingleTypeManager):
    """Blocks wholly before the window of the next query are released (null in the table), so a
    table keeps one entry per block-sized span of positions."""

    def __init__(self, spec: SlidingWindowSpec, pool: BlockPool, group_id: int) -> None:
        super().__init__(spec, pool, group_id)
        self.window_spec = spec
        # Leading blocks of each request released by the window (null in its table).
        self._num_released: dict[str, int] = {}

    def event_tag(self) -> GroupTag:
        return GroupTag(self.group_id, KIND_SLIDING_WINDOW, self.window_spec.sliding_window)

    def longest_hit(self, hashes: list[bytes], max_blocks: int) -> int:
        """The largest k <= max_blocks whose last `num_hit_blocks_needed` blocks are all cached (or,
        for k below that, blocks 0 .. k - 1): scanned from the right, a run of cached blocks."""
        needed = self.window_spec.num_hit_blocks_needed
        run = 0
        for i in range(max_blocks - 1, -1, -1):
            if self.pool.get_cached_block(group_key(hashes[i], self.group_id)) is None:
                run = 0
                continue
            run += 1
            if run >= needed:
                return i + run
        return run  # blocks 0 .. run - 1 are cached: a hit shorter than the window

    def hit_blocks(self, hashes: list[bytes], num_blocks: int) -> list[KVCacheBlock]:
        first = self.window_spec.num_releasable(num_blocks * self.block_size)
        null = self.pool.null_block
        return [null] * first + [self._cached(hashes[i]) for i in range(first, num_blocks)]

    def num_blocks_needed(
        self, request_id: str, num_computed: int, num_tokens: int, hits: list[KVCacheBlock]
    ) -> int:
        blocks = self.req_to_blocks.get(request_id, [])
        num_table = len(blocks) + len(hits)
        num_release = min(self.window_spec.num_releasable(num_computed), num_table)
        num_new = max(0, cdiv(num_tokens, self.block_size) - num_table)
        freed = sum(1 for b in blocks[:num_release] if not b.is_null and b.ref_cnt == 1)
        taken = sum(1 for b in hits if not b.is_null and b.ref_cnt == 0)
        return num_new + taken - freed

    def save_hits(self, request_id: str, num_computed: int, hits: list[KVCacheBlock]) -> None:
        """`hits` leads with nulls for the blocks the window already left (hit_blocks): never taken."""
        if not hits:
            return
        kept = [b for b in hits if not b.is_null]
        self.pool.touch(kept)
        self.req_to_blocks.setdefault(request_id, []).extend(hits)
        self._num_released[request_id] = len(hits) - len(kept)
        self.num_hit_blocks += len(kept)

    def release(self, request_id: str, num_computed: int) -> None:
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None:
            return
        num_release = min(self.window_spec.num_releasable(num_computed), len(blocks))
        start = self._num_released.get(request_id, 0)
        released = [b for b in blocks[start:num_release] if not b.is_null]
        blocks[start:num_release] = [self.pool.null_block] * max(0, num_release - start)
        self._num_released[request_id] = max(start, num_release)
        # Tail first, like free(): released cached blocks stay in the prefix cache, evictable.
        self.pool.free_blocks(reversed(released))

    def free(self, request_id: str) -> None:
        self._num_released.pop(request_id, None)
        super().free(request_id)

    def check_request(self, request_id: str) -> None:
        num_released = self._num_released.get(request_id, 0)
        blocks = self.req_to_blocks[request_id]
        if any(b.is_null != (i < num_released) for i, b in enumerate(blocks)):
            raise IntegrityError(
                f"group {self.group_id}, request {request_id}: null blocks outside its released head "
                f"({num_released})"
            )


class LinearAttentionManager(SingleTypeManager):
    """A running state per request (its table), plus checkpoints: a chunk crossing a multiple of
    the checkpoint interval writes the state there into new pages, which the request holds until its
    next allocation, when they enter the prefix cache and go back to the pool at once (cached,
    evictable). So a request holds `pages_per_state` blocks whatever its length, and a prefix hit
    at a checkpoint restores from pages other requests left behind."""

    def __init__(self, spec: LinearAttentionSpec, pool: BlockPool, group_id: int) -> None:
        super().__init__(spec, pool, group_id)
        self.state_spec = spec
        # Pages a request holds for one step only: (hash of the checkpoint or None for a prefix
        # hit's restore source, its pages).
        self._transient: dict[str, list[tuple[bytes | None, list[KVCacheBlock]]]] = {}
        self._steps: dict[str, StateStep] = {}

    @property
    def pages(self) -> int:
        return self.state_spec.pages_per_state

    def longest_hit(self, hashes: list[bytes], max_blocks: int) -> int:
        interval = self.state_spec.checkpoint_interval
        if interval is None:
            return 0
        per = interval // self.block_size
        for k in range(max_blocks // per * per, 0, -per):
            key = hashes[k - 1]
            if all(self.pool.get_cached_block(group_key(key, self.group_id, p)) for p in range(self.pages)):
                return k
        return 0

    def hit_blocks(self, hashes: list[bytes], num_blocks: int) -> list[KVCacheBlock]:
        if num_blocks == 0:
            return []
        return [self._cached(hashes[num_blocks - 1], p) for p in range(self.pages)]

    def num_blocks_needed(
        self, request_id: str, num_computed: int, num_tokens: int, hits: list[KVCacheBlock]
    ) -> int:
        running = 0 if request_id in self.req_to_blocks else self.pages
        checkpoints = self.pages * len(self.state_spec.checkpoint_boundaries(num_computed, num_tokens))
        taken = sum(1 for b in hits if b.ref_cnt == 0)
        freed = sum(1 for _, pages in self._transient.get(request_id, []) for b in pages if b.ref_cnt == 1)
        return running + checkpoints + taken - freed

    def save_hits(self, request_id: str, num_computed: int, hits: list[KVCacheBlock]) -> None:
        if not hits:
            return
        self.pool.touch(hits)
        self._transient.setdefault(request_id, []).append((None, list(hits)))
        self.num_hit_blocks += len(hits)

    def release(self, request_id: str, num_computed: int) -> None:
        """The previous step's checkpoints were written by it: into the index, back to the pool.
        (The restore source of a first step after a hit was read by it: back to the pool.)"""
        transient = self._transient.pop(request_id, [])
        for key, pages in transient:
            if key is not None:
                for p, block in enumerate(pages):
                    self.pool.cache_full_block(block, group_key(key, self.group_id, p))
        self.pool.free_blocks(reversed([block for _, pages in transient for block in pages]))

    def allocate_new(self, request: Request, num_computed: int, num_tokens: int) -> None:
        rid = request.request_id
        fresh = rid not in self.req_to_blocks
        if fresh:
            self.req_to_blocks[rid] = self.pool.get_new_blocks(self.pages)
        state = self.req_to_blocks[rid]
        transient = self._transient.setdefault(rid, [])
        source: list[int] | None = [b.block_id for b in state] if num_computed > 0 else None
        if fresh and transient:  # the first step after a prefix hit reads the hit's checkpoint
            source = [b.block_id for b in transient[0][1]]
        checkpoints: list[tuple[int, list[int]]] = []
        for boundary in self.state_spec.checkpoint_boundaries(num_computed, num_tokens):
            pages = self.pool.get_new_blocks(self.pages)
            transient.append((request.block_hashes[boundary // self.block_size - 1], pages))
            checkpoints.append((boundary - num_computed, [b.block_id for b in pages]))
        self._steps[rid] = StateStep(source, [b.block_id for b in state], checkpoints)

    def cache_blocks(self, request: Request, hashes: list[bytes], num_tokens: int) -> None:
        """Checkpoints are cached by the next `release`, once their step has written them."""

    def step(self, request_id: str) -> StateStep:
        return self._steps[request_id]

    def trim(self, request_id: str, num_tokens: int) -> None:
        raise IntegrityError("linear-attention states cannot roll back rejected draft tokens")

    def free(self, request_id: str) -> None:
        """Checkpoints a finished step wrote are cached first (the request's last step completed
        before it is freed: finished, preempted or aborted between steps)."""
        self.release(request_id, 0)
        self._steps.pop(request_id, None)
        super().free(request_id)

    def held_blocks(self, request_id: str) -> list[KVCacheBlock]:
        transient = [b for _, pages in self._transient.get(request_id, []) for b in pages]
        return super().held_blocks(request_id) + transient

    def covers(self, request_id: str, num_tokens: int) -> bool:
        return len(self.req_to_blocks.get(request_id, [])) == self.pages

    def check_request(self, request_id: str) -> None:
        if len(self.req_to_blocks[request_id]) != self.pages:
            raise IntegrityError(f"group {self.group_id}, request {request_id}: a state of the wrong size")


class CompressorStateManager(LinearAttentionManager):
    """A compressor's state (CompressorStateSpec): a CSA one checkpointed like a linear-attention
    state; an HCA one is empty at every multiple of its rate, so a hit at a checkpoint boundary
    restores nothing (the first step after it reads no row of the state)."""

    def __init__(self, spec: CompressorStateSpec, pool: BlockPool, group_id: int) -> None:
        super().__init__(spec, pool, group_id)
        self.compressor_spec = spec

    def longest_hit(self, hashes: list[bytes], max_blocks: int) -> int:
        interval = self.state_spec.checkpoint_interval
        if not self.compressor_spec.empty_at_boundaries or interval is None:
            return super().longest_hit(hashes, max_blocks)
        per = interval // self.block_size
        return max_blocks // per * per

    def hit_blocks(self, hashes: list[bytes], num_blocks: int) -> list[KVCacheBlock]:
        if self.compressor_spec.empty_at_boundaries:
            return []
        return super().hit_blocks(hashes, num_blocks)


class CompressedManager(SingleTypeManager):
    """Compressed entries (CompressedSpec): entry e of a request lives in block table[e //
    entries_per_block]; block i spans tokens [i * S, (i + 1) * S), S = tokens_per_block, and is
    cached, once full, under the hash of the token block ending at its last token."""

    def __init__(self, spec: CompressedSpec, pool: BlockPool, group_id: int) -> None:
        super().__init__(spec, pool, group_id)
        self.compressed_spec = spec
        # Token blocks (of block_size) per compressed block: a multiple (compressed_kinds.py).
        self.span = spec.tokens_per_block // spec.block_size

    def _key(self, hashes: list[bytes], block: int) -> bytes:
        return group_key(hashes[(block + 1) * self.span - 1], self.group_id)

    def longest_hit(self, hashes: list[bytes], max_blocks: int) -> int:
        for i in range(max_blocks // self.span):
            if self.pool.get_cached_block(self._key(hashes, i)) is None:
                return i * self.span
        return max_blocks // self.span * self.span

    def hit_blocks(self, hashes: list[bytes], num_blocks: int) -> list[KVCacheBlock]:
        if num_blocks % self.span:
            raise IntegrityError(
                f"group {self.group_id}: a hit of {num_blocks} blocks splits a compressed block"
            )
        return [self._cached_key(self._key(hashes, i)) for i in range(num_blocks // self.span)]

    def _cached_key(self, key: bytes) -> KVCacheBlock:
        block = self.pool.get_cached_block(key)
        if block is None:
            raise IntegrityError(f"group {self.group_id}: a prefix hit lost a block before it was taken")
        return block

    def _blocks_for(self, num_tokens: int) -> int:
        return self.compressed_spec.num_blocks_held(num_tokens)

    def num_blocks_needed(
        self, request_id: str, num_computed: int, num_tokens: int, hits: list[KVCacheBlock]
    ) -> int:
        blocks = self.req_to_blocks.get(request_id, [])
        num_new = max(0, self._blocks_for(num_tokens) - len(blocks) - len(hits))
        return num_new + sum(1 for b in hits if b.ref_cnt == 0)

    def allocate_new(self, request: Request, num_computed: int, num_tokens: int) -> None:
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_new = self._blocks_for(num_tokens) - len(blocks)
        if num_new > 0:
            blocks += self.pool.get_new_blocks(num_new)

    def cache_blocks(self, request: Request, hashes: list[bytes], num_tokens: int) -> None:
        """Full compressed blocks enter the index (their entries are written this step, before any
        attention reads them, as for full attention)."""
        rid = request.request_id
        blocks = self.req_to_blocks[rid]
        start = self._num_cached_blocks.get(rid, 0)
        num_full = min(
            num_tokens // self.compressed_spec.tokens_per_block, len(hashes) // self.span, len(blocks)
        )
        for i in range(start, num_full):
            self.pool.cache_full_block(blocks[i], self._key(hashes, i))
        self._num_cached_blocks[rid] = max(start, num_full)

    def trim(self, request_id: str, num_tokens: int) -> None:
        raise IntegrityError("compressed entries cannot roll back rejected draft tokens")

    def covers(self, request_id: str, num_tokens: int) -> bool:
        return len(self.req_to_blocks.get(request_id, [])) >= self._blocks_for(num_tokens)


def make_manager(spec: KVCacheSpec, pool: BlockPool, group_id: int) -> SingleTypeManager:
    if isinstance(spec, SlidingWindowSpec):
        return SlidingWindowManager(spec, pool, group_id)
    if isinstance(spec, CompressorStateSpec):
        return CompressorStateManager(spec, pool, group_id)
    if isinstance(spec, CompressedSpec):
        return CompressedManager(spec, pool, group_id)
    if isinstance(spec, LinearAttentionSpec):
        return LinearAttentionManager(spec, pool, group_id)
    return FullAttentionManager(spec, pool, group_id)
