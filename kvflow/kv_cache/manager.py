"""Per-request KV blocks in every cache group: allocate_slots / free / longest cached prefix.

The coordinator over one SingleTypeManager per cache group (kvflow/kv_cache/single_type_manager.py)
and one BlockPool: a request has a block table in each group; the scheduler only asks "can this
request get its blocks in every group" (allocate_slots is all or nothing) and never sees layer kinds.

Prefix caching: the i-th full block of a request's tokens is identified by a chained hash
    hash_i = sha256(hash_{i-1} || tokens of block i as little-endian int64),  hash_{-1} = b""
so equal hashes mean equal whole prefixes (the K/V of a block depends on every token before it);
each group caches its blocks under its own key of that hash (single_type_manager.group_key). A hit
is the longest length every group can serve at once: full attention needs every block of the
prefix, a sliding window only the blocks of its last window, a linear-attention state a checkpoint
taken at exactly that length. Each group's longest hit at most n is a function f_g(n) <= n, so
iterating n <- f_g(n) over the groups until no group lowers it reaches the largest length valid
for all (any common hit k <= n stays <= every f_g(n)).
"""

from __future__ import annotations

import hashlib
import struct
from collections import Counter
from dataclasses import dataclass

from kvflow.config import ConfigError
from kvflow.kv_cache.block_pool import BlockPool, IntegrityError, KVCacheBlock
from kvflow.kv_cache.kv_cache_config import KVCacheConfig, build_kv_cache_config
from kvflow.kv_cache.single_type_manager import (
    LinearAttentionManager,
    SingleTypeManager,
    StateStep,
    make_manager,
)
from kvflow.kv_cache.specs import cdiv
from kvflow.request import Request

__all__ = ["KVCacheManager", "PrefixHit", "cdiv"]


@dataclass(frozen=True)
class PrefixHit:
    """A prefix-cache hit: `num_tokens` tokens computed already, and per group the blocks that hold
    them (a sliding group's leading nulls stand for blocks its window left; a state group's list is
    the checkpoint's pages). Take no reference until allocate_slots."""

    num_tokens: int
    blocks: tuple[list[KVCacheBlock], ...]


def single_group_config(
    block_size: int, sliding_window: int | None, enable_prefix_caching: bool
) -> KVCacheConfig:
    """One group, every layer of one kind: full attention or one sliding window (pages of 1 byte per
    token: the pure-Python bookkeeping does not care about bytes)."""
    kind = "full_attention" if sliding_window is None else "sliding_attention"
    return build_kv_cache_config(
        [kind],
        block_size=block_size,
        token_bytes=1,
        sliding_window=sliding_window,
        enable_prefix_caching=enable_prefix_caching,
    )


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        sliding_window: int | None = None,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        if block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {block_size}")
        if sliding_window is not None and sliding_window < 1:
            raise ConfigError(f"sliding_window must be >= 1, got {sliding_window}")
        if kv_cache_config is None:
            kv_cache_config = single_group_config(block_size, sliding_window, enable_prefix_caching)
        if kv_cache_config.block_size != block_size:
            raise ConfigError(f"block_size {block_size} != the cache groups' {kv_cache_config.block_size}")
        self.kv_cache_config = kv_cache_config
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks, enable_prefix_caching)
        self.groups: list[SingleTypeManager] = [
            make_manager(group.spec, self.block_pool, i) for i, group in enumerate(kv_cache_config.groups)
        ]
        self._state_groups = [m for m in self.groups if isinstance(m, LinearAttentionManager)]
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

    @property
    def req_to_blocks(self) -> dict[str, list[KVCacheBlock]]:
        """Group 0's tables (a single-group model's only ones)."""
        return self.groups[0].req_to_blocks

    def block_table(self, request_id: str, group: int = 0) -> list[int]:
        return self.groups[group].block_table(request_id)

    def block_tables(self, request_id: str) -> list[list[int]]:
        """The request's table in every group, in group order."""
        return [m.block_table(request_id) for m in self.groups]

    def state_steps(self, request_id: str) -> tuple[StateStep, ...]:
        """This step's state pages of each linear-attention group (empty without such groups)."""
        return tuple(m.step(request_id) for m in self._state_groups)

    def num_blocks_peak_prefill(self, num_prompt_tokens: int, max_chunk_tokens: int) -> int:
        return self.kv_cache_config.num_blocks_peak_prefill(num_prompt_tokens, max_chunk_tokens)

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

    def get_computed_blocks(self, request: Request) -> PrefixHit:
        """The longest prefix every group holds cached (module docstring), capped at
        (num_tokens - 1) // block_size blocks: at least one token is left to compute, because
        sampling needs the logits at the last position. Takes no reference (see allocate_slots)."""
        if not self.enable_prefix_caching:
            return PrefixHit(0, tuple([] for _ in self.groups))
        hashes = self.hash_request_blocks(request)
        num_blocks = (request.num_tokens - 1) // self.block_size
        while True:
            lowered = num_blocks
            for manager in self.groups:
                lowered = manager.longest_hit(hashes, lowered)
            if lowered == num_blocks or len(self.groups) == 1:
                num_blocks = lowered
                break
            num_blocks = lowered
        blocks = tuple(m.hit_blocks(hashes, num_blocks) for m in self.groups)
        return PrefixHit(num_blocks * self.block_size, blocks)

    def allocate_slots(self, request: Request, num_new_tokens: int, hit: PrefixHit | None = None) -> bool:
        """Give `request` blocks in every group for positions up to num_computed + num_new_tokens - 1.

        `hit` (from get_computed_blocks, only on a request's first allocation) heads its tables and
        counts as computed. Returns False, changing nothing, when the free queue cannot supply the
        blocks of every group.
        """
        rid = request.request_id
        is_admission = rid not in self.groups[0].req_to_blocks
        num_hit = hit.num_tokens if hit is not None else 0
        if num_hit and (not is_admission or request.num_computed_tokens):
            raise ValueError(f"request {rid}: a prefix hit can only head a request's first allocation")
        num_computed = request.num_computed_tokens + num_hit
        num_tokens = num_computed + num_new_tokens
        hits = hit.blocks if hit is not None and num_hit else tuple([] for _ in self.groups)
        needed = sum(
            m.num_blocks_needed(rid, num_computed, num_tokens, h)
            for m, h in zip(self.groups, hits, strict=True)
        )
        if needed > self.block_pool.get_num_free_blocks():
            return False
        # Commit, in phases across the groups (kvflow/kv_cache/single_type_manager.py): every hit is
        # taken before any group's new blocks could evict it. The hashes first: a state group keys
        # the checkpoints it allocates by them.
        hashes = self.hash_request_blocks(request) if self.enable_prefix_caching else []
        for manager in self.groups:
            manager.release(rid, num_computed)
        for manager, blocks in zip(self.groups, hits, strict=True):
            manager.save_hits(rid, num_computed, blocks)
        for manager in self.groups:
            manager.allocate_new(request, num_computed, num_tokens)
        if self.enable_prefix_caching:
            for manager in self.groups:
                manager.cache_blocks(request, hashes, num_tokens)
            if is_admission:
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += num_hit
        return True

    def trim(self, request: Request, num_tokens: int) -> None:
        """Free the blocks past the ones `num_tokens` positions need (rejected drafts' blocks)."""
        for manager in self.groups:
            manager.trim(request.request_id, num_tokens)

    def free(self, request: Request) -> None:
        """Release all of a request's blocks in every group, tail first (see BlockPool.free_blocks)."""
        for manager in self.groups:
            manager.free(request.request_id)

    def covers(self, request: Request) -> bool:
        """Every group holds blocks for the request's computed tokens."""
        return all(m.covers(request.request_id, request.num_computed_tokens) for m in self.groups)

    def check_integrity(self) -> None:
        """Pool invariants, plus: each block's ref_cnt equals the number of tables (over all groups)
        holding it, and every request has a table in every group."""
        self.block_pool.check_integrity()
        requests = set(self.groups[0].req_to_blocks)
        refs: Counter[int] = Counter()
        for manager in self.groups:
            if set(manager.req_to_blocks) != requests:
                raise IntegrityError(
                    f"group {manager.group_id} has tables for {sorted(manager.req_to_blocks)}, "
                    f"group 0 for {sorted(requests)}"
                )
            refs.update(manager.reference_counts())
        for block in self.block_pool.blocks[1:]:
            if block.ref_cnt != refs[block.block_id]:
                raise IntegrityError(
                    f"block {block.block_id}: ref_cnt={block.ref_cnt}, held by {refs[block.block_id]} tables"
                )
