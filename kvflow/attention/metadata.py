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
    positions: torch.Tensor  # [T] int64, position of every flat token
    slot_mapping: torch.Tensor  # [T] int64, where each token's K/V is written
    num_decode_tokens: int  # flat tokens [0, num_decode_tokens) are single-token queries
    decode_kv_slots: torch.Tensor | None  # [num_decodes, max_keys] int64, padded with slot 0
    decode_attend: torch.Tensor | None  # [num_decodes, 1, 1, max_keys] bool, False on padding
    decode_num_keys: torch.Tensor | None  # [num_decodes] int64: valid (leading) entries of each row
    prefills: list[PrefillChunkMetadata]
