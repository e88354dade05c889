"""A read-only picture of the KV pool: which request holds each block, which free blocks still cache
a prefix (the live dashboard's block map). Pure Python, no torch.

Cost: one pass over the usable blocks and one over the request tables, O(num_blocks + table
entries); nothing is copied but ids. Call it from the thread that owns the manager (the engine
thread): the pool has no lock, and a snapshot taken between two of its updates would be torn.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvflow.kv_cache.manager import KVCacheManager

# Codes of `BlockMap.owner` for blocks no request holds (non-negative codes index `owner_groups`).
FREE = -1  # free, holds nothing reusable: handed out first
CACHED = -2  # free, but its K/V still serves the prefix hash it carries (evicted last-in-last-out)


@dataclass(frozen=True)
class BlockMap:
    """owner[i] describes usable block i + 1 (block 0, the null block, is never shown).

    owner[i] >= 0 indexes `owner_groups`: the request ids holding that block, in the order of the
    request tables. A group of two or more requests is a shared prefix block (ref_cnt == len(group)).
    `cached_in_use[i]` is True for a held block that is also in the prefix-cache index (another
    request with the same prefix would hit it). `cache_group[i]` is the cache group (kv_cache_config:
    full attention, a sliding window, a linear-attention state...) whose tables hold the block, -1 for
    a free block; `cache_group_kinds[g]` names group g's kind."""

    owner: list[int]
    owner_groups: list[list[str]]
    cached_in_use: list[bool]
    cache_group: list[int]
    cache_group_kinds: list[str]

    @property
    def num_blocks(self) -> int:
        return len(self.owner)

    @property
    def num_used(self) -> int:
        return sum(1 for code in self.owner if code >= 0)

    @property
    def num_cached_free(self) -> int:
        return sum(1 for code in self.owner if code == CACHED)

    @property
    def num_free(self) -> int:
        """Free blocks, cached ones included (what the scheduler can hand out)."""
        return self.num_blocks - self.num_used

    @property
    def num_shared(self) -> int:
        return sum(1 for code in self.owner if code >= 0 and len(self.owner_groups[code]) > 1)


def snapshot_block_map(manager: KVCacheManager) -> BlockMap:
    """The pool as it is now (see the module docstring for when to call it)."""
    pool = manager.block_pool
    holders: dict[int, list[str]] = {}
    block_group: dict[int, int] = {}
    for g, group in enumerate(manager.groups):
        for request_id in group.req_to_blocks:
            for block in group.held_blocks(request_id):
                holders.setdefault(block.block_id, []).append(request_id)
                block_group[block.block_id] = g
    group_index: dict[tuple[str, ...], int] = {}
    groups: list[list[str]] = []
    owner: list[int] = []
    cached_in_use: list[bool] = []
    cache_group = [block_group.get(block.block_id, -1) for block in pool.blocks[1:]]
    for block in pool.blocks[1:]:
        ids = holders.get(block.block_id)
        if ids is None:
            owner.append(CACHED if block.block_hash is not None else FREE)
            cached_in_use.append(False)
            continue
        key = tuple(ids)
        code = group_index.get(key)
        if code is None:
            code = group_index[key] = len(groups)
            groups.append(list(ids))
        owner.append(code)
        cached_in_use.append(block.block_hash is not None)
    kinds = [group.spec.kind for group in manager.kv_cache_config.groups]
    return BlockMap(owner, groups, cached_in_use, cache_group, kinds)
