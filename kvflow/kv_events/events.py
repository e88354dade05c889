"""The KV event wire format, field for field vLLM's (`vllm/distributed/kv_events.py`, v0.28).

msgpack via msgspec, as vLLM encodes it: a batch is a positional array `[ts, events, dp_rank]`
(`array_like=True`); each event is a map tagged `"type": "<class name>"` (`tag=True`), fields left at
their default omitted (`omit_defaults=True`). Field order and names are the contract: vllm-router's
decoder (`src/kv_index/wire.rs`) and Dynamo's read these bytes, so nothing here is renamed.
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec

# Where a block lives. vLLM names the accelerator's pool "GPU": consumers read it as "the engine's
# own pool, no transfer needed" (vllm-router scores it at full credit). kvflow's pool is the compute
# device's memory too (host RAM on a CPU), so it publishes "GPU" for the same meaning; a block
# written to the KV offload tier (kvflow/kv_offload/) is "STORAGE", vLLM's name for disk.
MEDIUM_POOL = "GPU"
MEDIUM_STORAGE = "STORAGE"

# vLLM's names for the kind of cache group a block belongs to (`kv_cache_spec_kind`).
KIND_FULL_ATTENTION = "full_attention"
KIND_SLIDING_WINDOW = "sliding_window"
KIND_MLA = "mla_attention"

# Block hashes on the wire: a non-negative 64-bit integer (vllm-router rejects negative ones and
# reads 8-byte integers; vLLM sends either bytes or an int). 8 bytes of a digest of kvflow's own
# cache key, so a block's stored and removed events carry the same number.
_EXTERNAL_HASH_BYTES = 8


def external_block_hash(key: bytes) -> int:
    """The wire hash of a prefix-cache key (kvflow/kv_cache/single_type_manager.py `group_key`)."""
    return int.from_bytes(hashlib.blake2b(key, digest_size=_EXTERNAL_HASH_BYTES).digest(), "big")


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float  # seconds since the epoch (time.time()) when the step's events were taken
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """One change to a replica's cache; the tag is the class name."""


class BlockStored(KVCacheEvent):
    """Consecutive full blocks entered the cache. `token_ids` holds `block_size` tokens per block, in
    order; `parent_block_hash` is the block before the first (None at the start of a sequence)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None  # deprecated in vLLM, kept positional for its decoder
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    """Blocks left the cache (evicted to hold other tokens, or their tier dropped them)."""

    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    """Every cached block of the publisher is gone (a reset, or the engine starting over)."""


# What one batch carries (the union msgspec decodes by tag).
KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(EventBatch):
    events: list[KVEvent]


def encode_batch(batch: KVEventBatch) -> bytes:
    return msgspec.msgpack.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """For subscribers written in Python (kvflow's tests, `kvflow doctor` over replicas)."""
    return msgspec.msgpack.decode(payload, type=KVEventBatch)
