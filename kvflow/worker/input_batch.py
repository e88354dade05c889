"""SchedulerOutput -> the flat token batch and its attention metadata.

Order of the flat batch: single-token query rows first, then each longer chunk as a run. The
single-token rows are the decodes and every token of a short chunk (at most
MAX_QUERY_ROWS_PER_CHUNK tokens: chiefly a speculative step's k + 1 verification tokens), each row
a query at its own position attending to the keys up to it. So verification attends through the
same batched decode path (in bf16 the native in-place kernel) as a plain decode of the same
position does, with the same numbers, instead of a gather and a masked SDPA per request.
Slot of position p of a request: block_table[p // block_size] * block_size + p % block_size.
Sliding window W (HF semantics): query position q sees key positions k with q - W < k <= q, so a
query never needs keys before q - W + 1 and blocks released by the KV manager are never read.
A model mixing cache kinds (kvflow/kv_cache/kv_cache_config.py) gets one AttentionMetadata per
attention group (its block tables, its window) and one StateMetadata per linear-attention group,
over the same flat token order; its layers read `meta.for_layer(i)`.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvflow.attention.metadata import (
    AttentionMetadata,
    CompressedMetadata,
    CompressedRequest,
    PrefillChunkMetadata,
    StateMetadata,
    StateRequest,
)
from kvflow.kv_cache.kv_cache_config import KVCacheConfig
from kvflow.kv_cache.specs import CompressedSpec, KVCacheSpec, LinearAttentionSpec, SlidingWindowSpec
from kvflow.query_rows import MAX_QUERY_ROWS_PER_CHUNK
from kvflow.scheduler_output import ScheduledRequest, SchedulerOutput

# A sliding-window chunk longer than its window is attended in pieces of max(W, this) queries
# (_prefill_metadata): each piece reads W - 1 + piece keys, so fewer, larger calls for tiny windows.
MIN_WINDOW_PIECE = 64


@dataclass(frozen=True)
class _QueryRow:
    block_ids: list[int]
    position: int  # the query's position: it attends keys up to and including it


@dataclass
class InputBatch:
    requests: list[ScheduledRequest]  # in flat-batch order
    input_ids: torch.Tensor  # [T] int64
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor  # [N] int64: flat index of the last token of each sampling request
    sampling_requests: list[ScheduledRequest]  # the N requests, aligned with logits_indices


@dataclass
class DecodeRows:
    """A decode-only step (every scheduled token a query row, no prefill chunk) as plain lists, for
    the native decoder, which derives the RoPE rows, K/V slots and key slots itself
    (kvflow/kernels/decode_forward.cpp forward_rows): the same rows, in the same order, as
    build_input_batch's flat batch. Why lists: a step's Python runs with the caches cold after the
    forward streamed the weights, and every small tensor built here cost ~10-20 us there."""

    requests: list[ScheduledRequest]  # in flat-batch order
    token_ids: list[int]  # [M]
    positions: list[int]  # [M]: each row's query position
    block_tables: list[list[int]]  # [M]: each row's request's block table (rows of a request share it)
    logits_indices: list[int]  # rows to sample from (build_input_batch's logits_indices)
    sampling_requests: list[ScheduledRequest]


def build_decode_rows(scheduler_output: SchedulerOutput, all_query_rows: bool = False) -> DecodeRows | None:
    """The step as DecodeRows, or None if it has a prefill chunk (build_input_batch then)."""
    row_limit = sys.maxsize if all_query_rows else MAX_QUERY_ROWS_PER_CHUNK
    scheduled = scheduler_output.scheduled
    if any(r.num_tokens > row_limit for r in scheduled):
        return None
    token_ids: list[int] = []
    positions: list[int] = []
    block_tables: list[list[int]] = []
    logits_indices: list[int] = []
    for req in scheduled:
        start, n = req.num_computed_tokens, req.num_tokens
        token_ids += req.token_ids
        positions += range(start, start + n)
        block_tables += [req.block_ids[0]] * n
        if req.do_sample:  # the last position; with drafts, the k + 1 positions that verify them
            logits_indices += range(len(token_ids) - 1 - req.num_spec_tokens, len(token_ids))
    return DecodeRows(
        requests=scheduled,
        token_ids=token_ids,
        positions=positions,
        block_tables=block_tables,
        logits_indices=logits_indices,
        sampling_requests=[r for r in scheduled if r.do_sample],
    )


def _first_key_position(query_position: int, sliding_window: int | None) -> int:
    return 0 if sliding_window is None else max(0, query_position - sliding_window + 1)


def _slots(block_ids: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Slots of positions [start, end) of one request."""
    return [block_ids[p // block_size] * block_size + p % block_size for p in range(start, end)]


def _decode_metadata(
    rows: list[_QueryRow], block_size: int, sliding_window: int | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Padded key slots [B, L], the attend mask [B, 1, 1, L] and the number of valid keys [B] of
    single-token query rows (valid keys are each row's leading entries)."""
    if sliding_window is None:
        return _causal_decode_metadata(rows, block_size)
    query_pos = torch.tensor([r.position for r in rows], dtype=torch.int64)  # [B]
    first_key = torch.tensor(
        [_first_key_position(r.position, sliding_window) for r in rows], dtype=torch.int64
    )
    num_keys = query_pos - first_key + 1
    max_keys = int(num_keys.max())
    max_blocks = max(len(r.block_ids) for r in rows)
    block_tables = torch.tensor(
        [r.block_ids + [0] * (max_blocks - len(r.block_ids)) for r in rows], dtype=torch.int64
    )  # [B, max_blocks], padded with the null block
    key_pos = first_key[:, None] + torch.arange(max_keys)[None, :]  # [B, L]
    valid = key_pos <= query_pos[:, None]
    key_pos = torch.where(valid, key_pos, 0)
    slots = block_tables.gather(1, key_pos // block_size) * block_size + key_pos % block_size
    slots = torch.where(valid, slots, 0)
    return slots, valid[:, None, None, :], num_keys


def _causal_decode_metadata(
    rows: list[_QueryRow], block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """_decode_metadata without a sliding window: every row's keys are positions 0..p, so the slots
    come from one table per request (the rows of a request share its block list), expanded over
    the blocks at once; a request's several rows (speculative verification) index the same table
    row. The same values as the windowed path, in fewer small tensor ops (this runs every step)."""
    tables: list[list[int]] = []  # distinct block lists, in row order
    owner: list[int] = []  # row -> its table
    for r in rows:
        if not tables or r.block_ids is not tables[-1]:
            tables.append(r.block_ids)
        owner.append(len(tables) - 1)
    max_keys = max(r.position for r in rows) + 1
    max_blocks = -(-max_keys // block_size)
    block_tables = torch.tensor(
        [t[:max_blocks] + [0] * (max_blocks - min(len(t), max_blocks)) for t in tables], dtype=torch.int64
    )  # [num_tables, max_blocks], padded with the null block
    slots = _block_slots(block_tables, block_size)[:, :max_keys]
    if len(tables) < len(rows):
        slots = slots[owner]  # [B, L]
    num_keys = torch.tensor([r.position + 1 for r in rows], dtype=torch.int64)
    valid = torch.arange(max_keys)[None, :] < num_keys[:, None]
    return torch.where(valid, slots, 0), valid[:, None, None, :], num_keys


def _prefill_metadata(
    req: ScheduledRequest, block_ids: list[int], token_start: int, block_size: int, sliding_window: int | None
) -> list[PrefillChunkMetadata]:
    """A prefill chunk's attention metadata: one entry, or under a sliding window that cuts the
    chunk's keys, one per piece of at most max(W, MIN_WINDOW_PIECE) queries (a band, not the
    chunk's whole square: an 8k prompt's 2,048-token chunks spent 17x the band's work in one masked
    SDPA each; benchmarks/NOTES.md, session 17)."""
    start, n = req.num_computed_tokens, req.num_tokens
    if sliding_window is not None and n > sliding_window:
        piece = max(sliding_window, MIN_WINDOW_PIECE)
        return [
            _windowed_piece(
                block_ids, token_start + a - start, a, min(a + piece, start + n), block_size, sliding_window
            )
            for a in range(start, start + n, piece)
        ]
    token_end = token_start + n
    first_key = _first_key_position(start, sliding_window)
    if start == 0:
        return [PrefillChunkMetadata(token_start, token_end, kv_slots=None, attend=None, leading_keys=True)]
    key_pos = torch.arange(first_key, start + n)  # [L]
    query_pos = torch.arange(start, start + n)  # [n]
    attend = key_pos[None, :] <= query_pos[:, None]
    if sliding_window is not None:
        attend &= key_pos[None, :] > query_pos[:, None] - sliding_window
    leading = sliding_window is None or start + n <= sliding_window  # no key leaves any window
    kv_slots = torch.tensor(_slots(block_ids, first_key, start + n, block_size), dtype=torch.int64)
    return [PrefillChunkMetadata(token_start, token_end, kv_slots, attend, leading_keys=leading)]


def _windowed_piece(
    block_ids: list[int], token_start: int, first: int, end: int, block_size: int, window: int
) -> PrefillChunkMetadata:
    """Queries at positions [first, end) under window W: their keys are positions
    [first - W + 1, end), read from the pool (the chunk's own K/V are written before attention)."""
    first_key = max(0, first - window + 1)
    key_pos = torch.arange(first_key, end)  # [L]
    query_pos = torch.arange(first, end)  # [n]
    attend = (key_pos[None, :] <= query_pos[:, None]) & (key_pos[None, :] > query_pos[:, None] - window)
    kv_slots = torch.tensor(_slots(block_ids, first_key, end, block_size), dtype=torch.int64)
    # Leading keys (the flash kernel) only while no key has left any query's window yet.
    return PrefillChunkMetadata(token_start, token_start + end - first, kv_slots, attend, end <= window)


@dataclass(frozen=True)
class _FlatBatch:
    """The step's requests in flat-batch order and what every cache group shares of it."""

    ordered: list[ScheduledRequest]
    as_rows: list[ScheduledRequest]  # the leading requests whose every token is a query row
    token_starts: list[int]  # flat index of each ordered request's first token
    positions: torch.Tensor  # [T] int64
    row_limit: int


def _attention_metadata(
    batch: _FlatBatch, group: int, block_size: int, window: int | None
) -> AttentionMetadata:
    """One attention group's slots, decode rows and prefill chunks (its tables, its window)."""
    query_rows = [
        _QueryRow(r.block_ids[group], p)
        for r in batch.as_rows
        for p in range(r.num_computed_tokens, r.num_computed_tokens + r.num_tokens)
    ]
    slot_mapping: list[int] = []
    prefills: list[PrefillChunkMetadata] = []
    for req, token_start in zip(batch.ordered, batch.token_starts, strict=True):
        table = req.block_ids[group]
        start = req.num_computed_tokens
        slot_mapping.extend(_slots(table, start, start + req.num_tokens, block_size))
        if req.num_tokens > batch.row_limit:
            prefills.extend(_prefill_metadata(req, table, token_start, block_size, window))
    decode_slots, decode_attend, decode_num_keys = (
        _decode_metadata(query_rows, block_size, window) if query_rows else (None, None, None)
    )
    return AttentionMetadata(
        positions=batch.positions,
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64),
        num_decode_tokens=len(query_rows),
        decode_kv_slots=decode_slots,
        decode_attend=decode_attend,
        decode_num_keys=decode_num_keys,
        prefills=prefills,
    )


def _state_metadata(batch: _FlatBatch, state_group: int) -> StateMetadata:
    """The `state_group`-th linear-attention group's pages of every request (ScheduledRequest.state_steps)."""
    requests = []
    for req, token_start in zip(batch.ordered, batch.token_starts, strict=True):
        step = req.state_steps[state_group]
        end = token_start + req.num_tokens
        requests.append(StateRequest(token_start, end, step.source, step.state, step.checkpoints))
    decodes = [i for i, r in enumerate(requests) if r.num_tokens == 1]
    rows = [requests[i] for i in decodes]
    return StateMetadata(
        requests=requests,
        decode_requests=decodes,
        decode_tokens=torch.tensor([r.token_start for r in rows], dtype=torch.int64),
        decode_source=torch.tensor([r.source or r.state for r in rows], dtype=torch.int64),
        decode_fresh=torch.tensor([r.source is None for r in rows], dtype=torch.bool),
        decode_state=torch.tensor([r.state for r in rows], dtype=torch.int64),
    )


def build_input_batch(
    scheduler_output: SchedulerOutput,
    block_size: int,
    sliding_window: int | None,
    all_query_rows: bool = False,
    kv_cache_config: KVCacheConfig | None = None,
) -> InputBatch:
    """`all_query_rows` (batch-invariant mode): every token a query row, prefill chunks included, so
    that a token's attention never depends on how its prompt was chunked or what shared the step
    (one row's keys and summation order are the same in any batch).

    `kv_cache_config`: a hybrid model's cache groups; each gets its own metadata from its tables
    (AttentionMetadata.for_layer). Without it, one group with `sliding_window` on every layer."""
    row_limit = sys.maxsize if all_query_rows else MAX_QUERY_ROWS_PER_CHUNK
    as_rows = [r for r in scheduler_output.scheduled if r.num_tokens <= row_limit]
    ordered = as_rows + [r for r in scheduler_output.scheduled if r.num_tokens > row_limit]
    input_ids: list[int] = []
    positions: list[int] = []
    token_starts: list[int] = []
    logits_indices: list[int] = []
    for req in ordered:
        token_starts.append(len(input_ids))
        start = req.num_computed_tokens
        input_ids.extend(req.token_ids)
        positions.extend(range(start, start + req.num_tokens))
        if req.do_sample:  # the last position; with drafts, the k + 1 positions that verify them
            logits_indices.extend(range(len(input_ids) - 1 - req.num_spec_tokens, len(input_ids)))
    batch = _FlatBatch(ordered, as_rows, token_starts, torch.tensor(positions, dtype=torch.int64), row_limit)
    if kv_cache_config is None:
        meta = _attention_metadata(batch, 0, block_size, sliding_window)
    elif not kv_cache_config.is_hybrid:
        meta = _attention_metadata(batch, 0, block_size, _window(kv_cache_config.groups[0].spec))
    else:
        meta = _hybrid_metadata(batch, block_size, kv_cache_config)
    return InputBatch(
        requests=ordered,
        input_ids=torch.tensor(input_ids, dtype=torch.int64),
        attn_metadata=meta,
        logits_indices=torch.tensor(logits_indices, dtype=torch.int64),
        sampling_requests=[r for r in ordered if r.do_sample],
    )


def _window(spec: KVCacheSpec) -> int | None:
    return spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None


def _hybrid_metadata(batch: _FlatBatch, block_size: int, kv_cache_config: KVCacheConfig) -> AttentionMetadata:
    groups: list[AttentionMetadata | StateMetadata | CompressedMetadata] = []
    num_state_groups = 0
    for g, group in enumerate(kv_cache_config.groups):
        spec = group.spec
        if isinstance(spec, LinearAttentionSpec):
            groups.append(_state_metadata(batch, num_state_groups))
            num_state_groups += 1
        elif isinstance(spec, CompressedSpec):
            groups.append(_compressed_metadata(batch, g, spec))
        else:
            groups.append(_attention_metadata(batch, g, block_size, _window(spec)))
    first = next(m for m in groups if isinstance(m, AttentionMetadata))
    return dataclasses.replace(first, group_metadata=tuple(groups), layer_group=kv_cache_config.layer_group)


def _compressed_metadata(batch: _FlatBatch, group: int, spec: CompressedSpec) -> CompressedMetadata:
    """A compressed-entries group's tables of every request (DeepSeek-V4, CompressedMetadata)."""
    requests = [
        CompressedRequest(start, start + req.num_tokens, req.num_computed_tokens, req.block_ids[group])
        for req, start in zip(batch.ordered, batch.token_starts, strict=True)
    ]
    return CompressedMetadata(requests, spec.compress_rate, spec.entries_per_block)


def _block_slots(blocks: torch.Tensor, block_size: int) -> torch.Tensor:
    """Block ids [..., N] -> the slots of their positions [..., N * block_size], in block order."""
    return (blocks[..., None] * block_size + torch.arange(block_size)).flatten(-2)


def slot_vector(block_ids: Sequence[int], block_size: int) -> torch.Tensor:
    """[len(block_ids) * block_size] int64: the slot of every position a request's blocks hold."""
    return _block_slots(torch.tensor(block_ids, dtype=torch.int64), block_size)


def query_rows_metadata(rows: Sequence[tuple[torch.Tensor, int, int]]) -> AttentionMetadata:
    """Metadata of a batch of query rows only (no prefill chunk, no sliding window), built from each
    request's slot vector instead of its block table: a draft model's k steps reuse one vector.

    rows[i] = (slots, start, n): request i feeds n tokens at positions start .. start + n - 1, and
    slots (from slot_vector, at least start + n entries) are the slots of its positions from 0. A
    row at position p attends the leading p + 1 entries, so one request's rows all read the same
    vector (stride 0, nothing copied); entries past a row's keys are the request's own slots (never
    read by the native kernel, masked by `decode_attend` in the torch path).
    """
    max_keys = max(start + n for _, start, n in rows)
    tables, slot_mapping = [], []
    for slots, start, n in rows:
        padded = slots[:max_keys]
        if len(padded) < max_keys:  # a shorter request: pad with the null block's slot 0
            padded = torch.cat([padded, padded.new_zeros(max_keys - len(padded))])
        tables.append(padded.expand(n, max_keys))
        slot_mapping.append(slots[start : start + n])
    positions = torch.tensor([p for _, start, n in rows for p in range(start, start + n)], dtype=torch.int64)
    num_keys = positions + 1
    return AttentionMetadata(
        positions=positions,
        slot_mapping=slot_mapping[0] if len(rows) == 1 else torch.cat(slot_mapping),
        num_decode_tokens=len(positions),
        decode_kv_slots=tables[0] if len(rows) == 1 else torch.cat(tables),  # [R, max_keys]
        decode_attend=(torch.arange(max_keys)[None, :] < num_keys[:, None])[:, None, None, :],
        decode_num_keys=num_keys,
        prefills=[],
    )
