"""DeepSeek-V4's cache kinds and their groups over the one pool (pure Python).

A V4 layer caches up to four things, each a *cache layer* of its own kind (so the grouping of
kv_cache_config.py applies unchanged: cache layers of one kind form groups over layer slots):
    sliding_attention   every layer: the K=V vector (head_dim) of its last `sliding_window` tokens
    csa_entries         a CSA layer's pooled entries, one per csa_rate tokens (head_dim each)
    csa_index_keys      its indexer's pooled keys, one per csa_rate tokens (index_head_dim each)
    hca_entries         an HCA layer's pooled entries, one per hca_rate tokens (head_dim each)
    csa_state/hca_state its compressor's state: raw projections of the last ring_rows positions
A block is one page in every slot, `block_size` window tokens (block_size x head_dim values, in the
model dtype or int8 / fp8 with a 2-byte scale each): an entries page holds page / entry bytes
entries (index keys: about head_dim / index_head_dim times as many), so a block of CSA entries spans
block_size x csa_rate tokens, of HCA entries block_size x hca_rate. A state (float32 whatever the
KV dtype) spans cdiv(state bytes, page) pages.

Prefix hits land where every group can serve them: a multiple of each compressed kind's block span
(HCA's: block_size x 128 = 2,048 tokens at 16-token blocks), where each compressor's pending tail
is empty. HCA then needs nothing of its state; CSA needs the raw rows of the window before (its
overlap), so CSA states are checkpointed at multiples of `checkpoint_interval` (a multiple of the
spans).
"""

from __future__ import annotations

import math

from kvflow.compressed_config import (
    CSA,
    CSA_ENTRIES,
    CSA_INDEX,
    CSA_STATE,
    HCA,
    HCA_ENTRIES,
    HCA_STATE,
    WINDOW,
    CompressedAttentionConfig,
    cache_layers,
)
from kvflow.config import ConfigError
from kvflow.kv_cache.kv_cache_config import (
    CHECKPOINT_COST_RATIO,
    KVCacheConfig,
    group_size_for,
    lay_out_groups,
)
from kvflow.kv_cache.specs import (
    CompressedSpec,
    CompressorStateSpec,
    KVCacheSpec,
    SlidingWindowSpec,
    cdiv,
)

STATE_ITEMSIZE = 4  # compressor rows are kept in float32 (the gate's softmax runs in float32)


def ring_rows(c: CompressedAttentionConfig, kind: str) -> int:
    """Positions a compressor's state keeps: CSA's window pools 2 x rate tokens (its own and the
    one before), HCA's only its own."""
    return 2 * c.csa_rate if kind == CSA else c.hca_rate


def state_row_width(c: CompressedAttentionConfig, kind: str) -> int:
    """Values per position of a state row: CSA [kv 2d | gate 2d | index kv 2di | index gate 2di]
    (the two overlapping series Ca, Cb), HCA [kv d | gate d]."""
    if kind == CSA:
        return 4 * (c.head_dim + c.index_head_dim)
    return 2 * c.head_dim


def state_bytes(c: CompressedAttentionConfig, kind: str) -> int:
    return ring_rows(c, kind) * state_row_width(c, kind) * STATE_ITEMSIZE


def _entries_per_block(page_bytes: int, entry_bytes: int, block_size: int, rate: int) -> int:
    """As many entries as a page holds, rounded down so a block spans whole token blocks."""
    step = block_size // math.gcd(block_size, rate)
    per = page_bytes // entry_bytes // step * step
    if per < 1:
        raise ConfigError(f"a {page_bytes}-byte page cannot hold whole blocks of {entry_bytes}-byte entries")
    return per


def _group_size(counts: dict[str, int]) -> int:
    """Layers per group: of the growing kinds' layer counts (entries, index keys), the one that pads
    them least, the larger on a tie (fewer groups; a size of 1 would pad nothing but give every
    layer a manager of its own). kv_cache_config.py's fewest-layers rule would give V4-Flash (21 CSA,
    20 HCA layers) CSA groups of 20 + 1 padded to 20: 40 slots of entries for 21 layers, 1.9x its
    bytes; here groups of 21 pad one HCA slot instead (the padding is real pool bytes, never used)."""
    growing = [n for kind, n in counts.items() if kind in (CSA_ENTRIES, CSA_INDEX, HCA_ENTRIES)]
    if not growing:
        return group_size_for(list(counts.values()))

    def padding(size: int) -> int:
        return sum(cdiv(n, size) * size - n for n in growing)

    return min(set(growing), key=lambda size: (padding(size), -size))


def build_compressed_kv_cache_config(
    c: CompressedAttentionConfig,
    *,
    block_size: int,
    vector_bytes: int,
    index_key_bytes: int,
    enable_prefix_caching: bool = True,
    checkpoint_interval: int | None = None,
) -> KVCacheConfig:
    """The groups of a DeepSeek-V4 model (module docstring). vector_bytes: one window vector or
    entry (head_dim values, and its scale when quantized: cache_bytes.part_bytes); index_key_bytes:
    one indexer key (index_head_dim values and scale)."""
    page_bytes = block_size * vector_bytes
    entry = vector_bytes
    specs: dict[str, KVCacheSpec] = {
        WINDOW: SlidingWindowSpec(block_size, page_bytes, c.sliding_window),
        CSA_ENTRIES: CompressedSpec(
            block_size,
            page_bytes,
            c.csa_rate,
            _entries_per_block(page_bytes, entry, block_size, c.csa_rate),
            CSA_ENTRIES,
        ),
        CSA_INDEX: CompressedSpec(
            block_size,
            page_bytes,
            c.csa_rate,
            _entries_per_block(page_bytes, index_key_bytes, block_size, c.csa_rate),
            CSA_INDEX,
        ),
        HCA_ENTRIES: CompressedSpec(
            block_size,
            page_bytes,
            c.hca_rate,
            _entries_per_block(page_bytes, entry, block_size, c.hca_rate),
            HCA_ENTRIES,
        ),
    }
    layers = cache_layers(c)
    kinds = [kind for _, kind in layers]
    spans = [s.tokens_per_block for k, s in specs.items() if isinstance(s, CompressedSpec) and k in kinds]
    lcm = math.lcm(block_size, *spans)
    csa_pages = cdiv(state_bytes(c, CSA), page_bytes)
    interval = checkpoint_interval
    if interval is None:
        # The smallest multiple of the spans at which one CSA checkpoint (its pages in every CSA
        # layer) costs at most CHECKPOINT_COST_RATIO x the compressed KV of the tokens it covers.
        interval = lcm
        csa_e, csa_i, hca_e = (specs[k] for k in (CSA_ENTRIES, CSA_INDEX, HCA_ENTRIES))
        assert isinstance(csa_e, CompressedSpec) and isinstance(csa_i, CompressedSpec)
        assert isinstance(hca_e, CompressedSpec)
        blocks_per_token = (
            c.num_csa_layers * (1 / csa_e.tokens_per_block + 1 / csa_i.tokens_per_block)
            + c.num_hca_layers / hca_e.tokens_per_block
        )
        while csa_pages * c.num_csa_layers > CHECKPOINT_COST_RATIO * blocks_per_token * interval:
            interval += lcm
    elif interval % lcm:
        raise ConfigError(
            f"linear_state_checkpoint_interval must be a multiple of {lcm} for this model (every compressed "
            f"block's token span), got {interval}"
        )
    on = interval if enable_prefix_caching else None
    specs[CSA_STATE] = CompressorStateSpec(
        block_size,
        page_bytes,
        state_bytes=state_bytes(c, CSA),
        pages_per_state=csa_pages,
        checkpoint_interval=on,
        label=CSA_STATE,
    )
    specs[HCA_STATE] = CompressorStateSpec(
        block_size,
        page_bytes,
        state_bytes=state_bytes(c, HCA),
        pages_per_state=cdiv(state_bytes(c, HCA), page_bytes),
        checkpoint_interval=on,
        empty_at_boundaries=True,
        label=HCA_STATE,
    )
    by_kind: dict[str, list[int]] = {}
    for index, kind in enumerate(kinds):
        by_kind.setdefault(kind, []).append(index)
    return lay_out_groups(by_kind, specs, _group_size({kind: len(v) for kind, v in by_kind.items()}))
