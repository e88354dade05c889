"""The block pool's record of what entered and left the prefix-cache index, as KV events.

Pure Python (the wire structs are msgspec, no torch). Invariant: `announced` is exactly the set of
prefix-cache keys the published stream says are cached, so a subscriber that replays every batch
from the start holds the same set (tests/kv_events/). A block is announced when it enters the index
(kvflow/kv_cache/single_type_manager.py `cache_blocks`) and withdrawn when the index drops it
(kvflow/kv_cache/block_pool.py `_evict`): eviction for reuse, or a failed step's blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvflow.kv_events.events import (
    MEDIUM_POOL,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    external_block_hash,
)


@dataclass(frozen=True)
class GroupTag:
    """The cache group a block belongs to, as the wire names it."""

    group_idx: int
    kind: str
    sliding_window: int | None = None


class KVEventLog:
    def __init__(self, block_size: int, medium: str = MEDIUM_POOL) -> None:
        self.block_size = block_size
        self.medium = medium
        self._pending: list[KVEvent] = []
        # key -> group index, for every block announced and not yet withdrawn.
        self._announced: dict[bytes, int] = {}

    def stored(
        self, keys: Sequence[bytes], parent: bytes | None, token_ids: Sequence[int], group: GroupTag
    ) -> None:
        """Consecutive full blocks entered the index: `keys[i]` holds `token_ids[i*bs:(i+1)*bs]`;
        `parent` is the key of the block before `keys[0]` (None at a sequence's start)."""
        if len(token_ids) != len(keys) * self.block_size:
            raise ValueError(
                f"{len(keys)} blocks of {self.block_size} tokens carry {len(token_ids)} token ids"
            )
        if not keys:
            return
        for key in keys:
            self._announced[key] = group.group_idx
        self._pending.append(
            BlockStored(
                block_hashes=[external_block_hash(k) for k in keys],
                parent_block_hash=None if parent is None else external_block_hash(parent),
                token_ids=list(token_ids),
                block_size=self.block_size,
                lora_id=None,
                medium=self.medium,
                lora_name=None,
                group_idx=group.group_idx,
                kv_cache_spec_kind=group.kind,
                kv_cache_spec_sliding_window=group.sliding_window,
            )
        )

    def removed(self, key: bytes) -> None:
        """The index dropped `key`. Keys never announced (a kind that publishes nothing) are skipped;
        consecutive removals of one group share an event, as vLLM batches them."""
        group_idx = self._announced.pop(key, None)
        if group_idx is None:
            return
        wire_hash = external_block_hash(key)
        last = self._pending[-1] if self._pending else None
        if isinstance(last, BlockRemoved) and last.group_idx == group_idx:
            last.block_hashes.append(wire_hash)
        else:
            self._pending.append(
                BlockRemoved(block_hashes=[wire_hash], medium=self.medium, group_idx=group_idx)
            )

    def cleared(self) -> None:
        """Every block is gone (the engine's pool was reset)."""
        self._announced.clear()
        self._pending.append(AllBlocksCleared())

    def take(self) -> list[KVEvent]:
        """The events since the last call, oldest first (one engine step's worth)."""
        events, self._pending = self._pending, []
        return events

    @property
    def announced(self) -> set[int]:
        """Wire hashes of every block the stream says is cached now."""
        return {external_block_hash(key) for key in self._announced}
