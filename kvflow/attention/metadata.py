"""Per-step attention inputs, built once by the model runner and shared by every layer.

The flat batch puts single-token queries (decodes, and 1-token chunks) first, then each prefill
chunk as a contiguous run: decodes are attended in one batched call, prefill chunks one by one
(each is compute-bound and large, so the per-call overhead does not matter there).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PrefillChunkMetadata:
    token_start: int  # the chunk's queries are flat tokens [token_start, token_end)
    token_end: int
    # Slots of the keys the chunk attends, in position order, or None when it attends only to
    # itself (no cached context): then the fresh K/V of the chunk are used without a gather.
    kv_slots: torch.Tensor | None  # [num_keys] int64
    # attend[i, j]: may query i see key j; None = plain causal over the chunk itself.
    attend: torch.Tensor | None  # [num_queries, num_keys] bool
    # Query i attends exactly the first num_keys - num_queries + i + 1 keys (causal, no sliding
    # window cutting any): the native kernel can then read them in place, one row per query.
    leading_keys: bool = False


@dataclass
class AttentionMetadata:
    """One attention cache group's view of the step (kvflow/kv_cache/: slots come from that group's
    block tables, windows from its kind). A hybrid model's step is the first attention group's
    metadata carrying every group's in `group_metadata` (state groups' as StateMetadata) and each
    layer's group in `layer_group`: a layer reads `meta.for_layer(i)`."""

    positions: torch.Tensor  # [T] int64, position of every flat token
    slot_mapping: torch.Tensor  # [T] int64, where each token's K/V is written
    num_decode_tokens: int  # flat tokens [0, num_decode_tokens) are single-token queries
    decode_kv_slots: torch.Tensor | None  # [num_decodes, max_keys] int64, padded with slot 0
    decode_attend: torch.Tensor | None  # [num_decodes, 1, 1, max_keys] bool, False on padding
    decode_num_keys: torch.Tensor | None  # [num_decodes] int64: valid (leading) entries of each row
    prefills: list[PrefillChunkMetadata]
    group_metadata: tuple[AttentionMetadata | StateMetadata | CompressedMetadata, ...] = ()
    layer_group: tuple[int, ...] = ()

    def for_layer(self, layer: int) -> AttentionMetadata | StateMetadata | CompressedMetadata:
        """The metadata of layer `layer`'s cache group (this one for a single-group model)."""
        return self.group_metadata[self.layer_group[layer]] if self.layer_group else self

    def attention_for_layer(self, layer: int) -> AttentionMetadata:
        meta = self.for_layer(layer)
        if not isinstance(meta, AttentionMetadata):
            raise TypeError(f"layer {layer} caches a recurrent state, not K/V")
        return meta

    def state_for_layer(self, layer: int) -> StateMetadata:
        meta = self.for_layer(layer)
        if not isinstance(meta, StateMetadata):
            raise TypeError(f"layer {layer} caches K/V, not a recurrent state")
        return meta

    def compressed_for_layer(self, layer: int) -> CompressedMetadata:
        meta = self.for_layer(layer)
        if not isinstance(meta, CompressedMetadata):
            raise TypeError(f"cache layer {layer} holds no compressed entries")
        return meta


@dataclass
class StateRequest:
    """One request's tokens in the flat batch, for one linear-attention cache group: flat tokens
    [token_start, token_end), in order (a recurrence: never split into independent rows). Pages are
    pool block ids (scheduler_output.StateStep): the state is read from `source` (None: zeros),
    written to `state`, and after the first j tokens also to each checkpoint's pages."""

    token_start: int
    token_end: int
    source: list[int] | None
    state: list[int]
    checkpoints: list[tuple[int, list[int]]]

    @property
    def num_tokens(self) -> int:
        return self.token_end - self.token_start


@dataclass
class StateMetadata:
    """One linear-attention group's step: every request's state pages, in flat-batch order, and the
    single-token requests (decodes) gathered for the batched one-step form."""

    requests: list[StateRequest]
    decode_requests: list[int]  # indices into `requests` of those with exactly one token
    decode_tokens: torch.Tensor  # [B] int64: their flat token index
    decode_source: torch.Tensor  # [B, pages] int64: their source pages (row of a fresh request: its state's)
    decode_fresh: torch.Tensor  # [B] bool: no source (a one-token prompt): the state starts at zero
    decode_state: torch.Tensor  # [B, pages] int64


@dataclass
class CompressedRequest:
    """One request's tokens in the flat batch, for one compressed-entries group (DeepSeek-V4):
    flat tokens [token_start, token_end) at positions [start, start + their number); entry e of the
    request lives at slot block_ids[e // entries_per_block] * entries_per_block + e % entries_per_block."""

    token_start: int
    token_end: int
    start: int
    block_ids: list[int]

    @property
    def end(self) -> int:
        """Positions computed once this step has run."""
        return self.start + self.token_end - self.token_start


@dataclass
class CompressedMetadata:
    requests: list[CompressedRequest]  # in flat-batch order
    compress_rate: int
    entries_per_block: int

    def entry_slots(self, request: CompressedRequest, first: int, last: int) -> torch.Tensor:
        """[last - first] int64: the slots of entries first .. last - 1 of `request`."""
        per = self.entries_per_block
        e = torch.arange(first, last)
        table = torch.tensor(request.block_ids, dtype=torch.int64)
        return table[e // per] * per + e % per
