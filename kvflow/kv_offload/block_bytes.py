"""One KV block's bytes, out of and back into the paged KV store (kvflow/attention/kv_store.py),
for the offload tier (kvflow/kv_offload/disk_tier.py).

Every pool tensor of a full-attention or latent store is [num_slots, ...] with slot = block_id x
block_size + offset, so block b is row b of each tensor viewed as [num_blocks, -1]: K and V (and
their scales and zero points when the KV is quantized, or the latents and indexer keys of MLA),
layer by layer. A block's payload is those rows' raw bytes, concatenated in the store's tensor
order: the same bytes come back, whatever the dtype (no conversion, no rounding).
"""

from __future__ import annotations

import torch

from kvflow.attention.kv_store import KVStore
from kvflow.config import ConfigError
from kvflow.kv_offload.disk_tier import DiskKVTier


def offloadable_kinds_error(store: KVStore) -> str | None:
    """Why this store's blocks cannot go to the tier (None: they can): only models whose layers are
    all of one full-attention kind (plain or latent), where a block's bytes depend on the prefix
    alone; a sliding window's, a linear-attention state's or a compressed block's do not fit."""
    config = store.kv_cache_config
    if store.compressed_pages is not None or store.state_layout is not None:
        return "its cache holds compressed blocks or a linear-attention state"
    if config is not None and (
        len(config.groups) != 1 or config.groups[0].spec.kind not in ("full_attention", "mla")
    ):
        kinds = sorted({g.spec.kind for g in config.groups})
        return f"its layers are of the cache kinds {', '.join(kinds)} (the tier holds full-attention blocks)"
    return None


class BlockBytes:
    """Copies blocks of `store` to bytes and back."""

    def __init__(self, store: KVStore, purpose: str = "the KV offload tier") -> None:
        reason = offloadable_kinds_error(store)
        if reason is not None:
            raise ConfigError(f"{purpose} cannot serve this model: {reason}")
        tensors = [t for layer in [*store.layers, *store.latent_layers] for t in layer.tensors]
        num_slots = store.num_blocks * store.block_size
        if not tensors or any(t.shape[0] != num_slots for t in tensors):
            raise ConfigError(f"{purpose} needs every KV tensor paged by slot ([num_slots, ...])")
        self.num_blocks = store.num_blocks
        # Each tensor as [num_blocks, bytes per block] uint8 (a view: no copy).
        self._rows = [t.view(store.num_blocks, -1).view(torch.uint8) for t in tensors]
        self.block_bytes = sum(r.shape[1] for r in self._rows)
        # Each tensor's dtype and per-slot shape: part of the tier's fingerprint (fingerprint.py) and
        # the KV transfer's. Not the slot count: a pool of another size holds the same blocks (a
        # restart with more memory, a decode instance larger than its prefill instance).
        self.layout = [[str(t.dtype), list(t.shape[1:])] for t in tensors]

    def read(self, block_id: int) -> bytes:
        """Block `block_id`'s bytes, every tensor's row in order."""
        return torch.cat([rows[block_id] for rows in self._rows]).numpy().tobytes()

    def write(self, block_id: int, payload: bytes | memoryview) -> None:
        """Put a payload made by `read` (of the same model and settings) into block `block_id`."""
        if len(payload) != self.block_bytes:
            raise ValueError(
                f"a KV block payload has {len(payload)} bytes, this store's blocks {self.block_bytes}"
            )
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        offset = 0
        for rows in self._rows:
            width = rows.shape[1]
            rows[block_id].copy_(data[offset : offset + width])
            offset += width


class OffloadIO:
    """The model runner's side of the tier: before each forward pass, copy the step's evicted blocks
    out to the tier (queued to its writer: the step does not wait for the disk) and the restored
    blocks in (kvflow/kv_offload/restores.py)."""

    def __init__(self, blocks: BlockBytes, tier: DiskKVTier | None) -> None:
        self.blocks = blocks
        self.tier = tier  # None: restores only (a decode instance's blocks from its prefill instance)

    def apply(
        self, kv_saves: list[tuple[int, bytes]], kv_restores: list[tuple[int, bytes | memoryview]]
    ) -> None:
        # Saves first: a block evicted this step may be one a restore is about to fill.
        if self.tier is not None:
            for block_id, block_hash in kv_saves:
                if not self.tier.refresh(block_hash):  # copy out only what the tier lacks
                    self.tier.store(block_hash, self.blocks.read(block_id))
        for block_id, payload in kv_restores:
            self.blocks.write(block_id, payload)
