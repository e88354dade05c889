"""Layers of one cache kind form groups; every group draws its blocks from one pool (pure Python).

Physical layout (vLLM v1's hybrid allocator): the pool has `num_layer_slots` layer slots, and slot j
holds one page of `page_bytes` for every block id. The i-th layer of a group lives in slot i, so a
block id handed to a group is one page in each of its layers' slots. All groups have the same number
of layers (`group_size`; a kind with more layers forms several groups, the last one padded), so a
block costs `bytes_per_block` whichever group holds it: one memory budget, one free queue, one
eviction order, one integrity check, and per-group block tables on top.

Group size: the fewest layers of any kind, unless every kind has nearly as many layers as the largest
(within GROUP_SIZE_SLACK), when one group per kind wastes few padded slots (vLLM's rule). gpt-oss (12
sliding, 12 full): 2 groups of 12. Gemma 3 27B (52 sliding, 10 full): 10 per group, so one full group
and 6 sliding ones (the last 2 layers in a group of 10 slots). Qwen3-Next (36 linear, 12 full): 3
linear groups and one full one, 12 slots.

A state kind (linear attention) lays each layer's state over the same pages: `pages_per_state` pages
of the bytes a page can hold for it (its K/V data bytes; scales are not used for states).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvflow.config import ConfigError
from kvflow.kv_cache.specs import (
    FullAttentionSpec,
    KVCacheSpec,
    LinearAttentionSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    cdiv,
)

LAYER_KINDS = ("full_attention", "sliding_attention", "mla", "linear_attention")
# One group per kind when the largest kind has fewer than this many times the smallest one's layers.
GROUP_SIZE_SLACK = 1.25
# A state checkpoint may cost at most this many times the full-attention KV of the tokens it covers:
# at 1.0, caching a prefix costs at most twice its attention KV (docs/doctor.md, "Cache kinds").
CHECKPOINT_COST_RATIO = 1.0


@dataclass(frozen=True)
class KVCacheGroup:
    spec: KVCacheSpec
    layer_ids: tuple[int, ...]  # model layers, in order; layer_ids[i] lives in layer slot i


@dataclass(frozen=True)
class KVCacheConfig:
    groups: tuple[KVCacheGroup, ...]
    num_layer_slots: int
    layer_group: tuple[int, ...]  # model layer -> its group's index
    layer_slot: tuple[int, ...]  # model layer -> its layer slot

    @property
    def block_size(self) -> int:
        return self.groups[0].spec.block_size

    @property
    def page_bytes(self) -> int:
        return self.groups[0].spec.page_bytes

    @property
    def bytes_per_block(self) -> int:
        """One block id's pages in every layer slot: what the pool spends per block."""
        return self.page_bytes * self.num_layer_slots

    @property
    def is_hybrid(self) -> bool:
        return len(self.groups) > 1

    def num_blocks_held(self, num_tokens: int) -> int:
        return sum(g.spec.num_blocks_held(num_tokens) for g in self.groups)

    def num_blocks_peak_prefill(self, num_prompt_tokens: int, max_chunk_tokens: int) -> int:
        return sum(g.spec.num_blocks_peak_prefill(num_prompt_tokens, max_chunk_tokens) for g in self.groups)

    def bytes_held(self, num_tokens: int) -> int:
        """Pool bytes one request of `num_tokens` tokens holds: blocks summed over the groups (a
        sliding group's and a state group's flat in L), times the bytes of a block."""
        return self.num_blocks_held(num_tokens) * self.bytes_per_block

    def bytes_held_by_kind(self, num_tokens: int) -> dict[str, int]:
        """bytes_held split by cache kind (full_attention, sliding_attention, mla, linear_attention)."""
        out: dict[str, int] = {}
        for g in self.groups:
            kind = g.spec.kind
            out[kind] = out.get(kind, 0) + g.spec.num_blocks_held(num_tokens) * self.bytes_per_block
        return out

    def layers_by_kind(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for g in self.groups:
            out[g.spec.kind] = out.get(g.spec.kind, 0) + len(g.layer_ids)
        return out


def group_size_for(counts: Sequence[int]) -> int:
    smallest, largest = min(counts), max(counts)
    return largest if largest < smallest * GROUP_SIZE_SLACK else smallest


def build_kv_cache_config(
    layer_kinds: Sequence[str],
    *,
    block_size: int,
    token_bytes: int,
    token_data_bytes: int | None = None,
    sliding_window: int | None = None,
    state_bytes: int = 0,
    enable_prefix_caching: bool = True,
    checkpoint_interval: int | None = None,
) -> KVCacheConfig:
    """The groups of a model whose layer i is of kind `layer_kinds[i]` (LAYER_KINDS).

    token_bytes: one token's K/V (or latent) in one attention layer, scales included (the page of
    every kind is block_size x token_bytes); token_data_bytes: the part of it a state can use (K/V
    data without scales; defaults to token_bytes); state_bytes: one linear-attention layer's state;
    checkpoint_interval: tokens between state checkpoints (None: the CHECKPOINT_COST_RATIO rule).
    """
    if not layer_kinds:
        raise ConfigError("a model needs at least one layer to size its KV cache")
    unknown = sorted(set(layer_kinds) - set(LAYER_KINDS))
    if unknown:
        raise ConfigError(f"unknown layer kinds {unknown}; kvflow caches {', '.join(LAYER_KINDS)}")
    if "sliding_attention" in layer_kinds and (sliding_window is None or sliding_window < 1):
        raise ConfigError(f"sliding-window layers need a sliding_window >= 1, got {sliding_window}")
    page_bytes = block_size * token_bytes
    by_kind: dict[str, list[int]] = {}
    for layer, kind in enumerate(layer_kinds):
        by_kind.setdefault(kind, []).append(layer)
    size = group_size_for([len(layers) for layers in by_kind.values()])
    num_full_groups = sum(cdiv(len(v), size) for k, v in by_kind.items() if k in ("full_attention", "mla"))
    num_linear_groups = cdiv(len(by_kind.get("linear_attention", [])), size)
    specs: dict[str, KVCacheSpec] = {
        "full_attention": FullAttentionSpec(block_size, page_bytes),
        "mla": MLAAttentionSpec(block_size, page_bytes),
        "sliding_attention": SlidingWindowSpec(block_size, page_bytes, sliding_window or 0),
    }
    if num_linear_groups:
        pages = cdiv(state_bytes, block_size * (token_data_bytes or token_bytes))
        interval = checkpoint_interval
        if interval is None:
            # A checkpoint takes pages x linear groups blocks; C tokens of full attention take
            # C / block_size x full groups: the smallest block multiple C where the first is at most
            # CHECKPOINT_COST_RATIO times the second.
            blocks = cdiv(round(pages * num_linear_groups / CHECKPOINT_COST_RATIO), max(1, num_full_groups))
            interval = max(1, blocks) * block_size
        elif interval < block_size or interval % block_size:
            raise ConfigError(
                f"linear_state_checkpoint_interval must be a positive multiple of block_size "
                f"({block_size}), got {interval}"
            )
        specs["linear_attention"] = LinearAttentionSpec(
            block_size,
            page_bytes,
            state_bytes=state_bytes,
            pages_per_state=pages,
            checkpoint_interval=interval if enable_prefix_caching else None,
        )
    return lay_out_groups(by_kind, specs, size)


def lay_out_groups(by_kind: dict[str, list[int]], specs: dict[str, KVCacheSpec], size: int) -> KVCacheConfig:
    """Layers of each kind (by_kind: kind -> its layers, in order) cut into groups of `size`, the
    i-th layer of a group in layer slot i (module docstring)."""
    num_layers = sum(len(layers) for layers in by_kind.values())
    groups: list[KVCacheGroup] = []
    layer_group = [0] * num_layers
    layer_slot = [0] * num_layers
    for kind, layers in by_kind.items():
        for start in range(0, len(layers), size):
            members = tuple(layers[start : start + size])
            for slot, layer in enumerate(members):
                layer_group[layer], layer_slot[layer] = len(groups), slot
            groups.append(KVCacheGroup(specs[kind], members))
    return KVCacheConfig(tuple(groups), size, tuple(layer_group), tuple(layer_slot))
