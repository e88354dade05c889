"""The paged K/V tensors: one K and one V pool per layer, addressed by slot.

Layout per layer: [num_blocks, block_size, num_kv_heads, head_dim], viewed flat as
[num_slots, num_kv_heads, head_dim] with slot = block_id * block_size + offset. Block 0 is the
null block (never allocated): padded gathers read it, so the pool starts zeroed (finite values:
a masked score gets weight 0, but 0 * NaN would still poison the output).
Latent attention (DeepSeek MLA) stores one latent per token and layer instead of K and V
(kvflow/attention/latent_kv_layer.py): `latent=(kv_lora_rank, qk_rope_head_dim)`, read through
`latent_layer(i)`.

Cache groups (kvflow/kv_cache/kv_cache_config.py): the store holds one pool per layer *slot*, not
per layer; model layer i uses slot `layer_slot[i]`, and layers of different groups share a slot's
blocks (a block id belongs to one group at a time). Without a config every layer has its own slot.
A linear-attention layer's state lives in its slot's K/V data pages (`state_layer(i)`,
kvflow/attention/state_pool.py).
"""

from __future__ import annotations

import torch

from kvflow.arch_config import ArchConfig
from kvflow.attention.compressed_store import CompressedPages
from kvflow.attention.kv_layer import PlainKVLayer, QuantizedKVLayer, kv_bytes_per_token_head, make_kv_layer
from kvflow.attention.latent_kv_layer import LatentKVLayer, latent_bytes_per_token
from kvflow.attention.state_pool import PagedStateLayer, StateLayout, page_views
from kvflow.config import CacheConfig, ConfigError
from kvflow.kv_cache.cache_bytes import model_kv_cache_config, state_bytes
from kvflow.kv_cache.kv_cache_config import KVCacheConfig


def kv_bytes_per_token(
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    kv_cache_dtype: str = "auto",
    latent: tuple[int, int] | None = None,
) -> int:
    """2 (K and V) x layers x kv_heads x head_dim x bytes per element (+ scales when quantized);
    with a latent (kv_lora_rank, rope_dim): layers x (kv_lora_rank + rope_dim) x bytes (+ scales)."""
    if latent is not None:
        return round(num_layers * latent_bytes_per_token(kv_cache_dtype, *latent, dtype))
    return round(num_layers * num_kv_heads * kv_bytes_per_token_head(kv_cache_dtype, head_dim, dtype))


class KVStore:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        kv_cache_dtype: str = "auto",
        latent: tuple[int, int] | None = None,
        kv_cache_config: KVCacheConfig | None = None,
        state_layout: StateLayout | None = None,
        index_dim: int = 0,
        compressed: bool = False,
    ) -> None:
        """`index_dim`: DeepSeek-V3.2's indexer keys beside each latent (0: none); `compressed`:
        DeepSeek-V4's cache layers, one page tensor per layer slot (`compressed_pages`)."""
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.kv_cache_dtype = kv_cache_dtype
        self.dtype = dtype
        self.kv_cache_config = kv_cache_config
        num_slots = num_blocks * block_size
        num_layer_slots = num_layers if kv_cache_config is None else kv_cache_config.num_layer_slots
        self.layer_slot = tuple(range(num_layers)) if kv_cache_config is None else kv_cache_config.layer_slot
        # A latent-attention model's store has latent layers only (and no K/V layers).
        self.latent_layers = (
            [
                LatentKVLayer(kv_cache_dtype, num_slots, *latent, dtype, index_dim)
                for _ in range(num_layer_slots)
            ]
            if latent is not None
            else []
        )
        self.compressed_pages: CompressedPages | None = None
        if compressed:
            if kv_cache_config is None:
                raise ValueError("DeepSeek-V4's compressed cache needs its cache config (its page bytes)")
            self.compressed_pages = CompressedPages(
                num_layer_slots, num_blocks, kv_cache_config.page_bytes, dtype, kv_cache_dtype
            )
        self.layers = [
            make_kv_layer(kv_cache_dtype, num_slots, num_kv_heads, head_dim, dtype)
            for _ in range(num_layer_slots if latent is None and not compressed else 0)
        ]
        self.state_layout = state_layout
        self._state_layers: dict[int, PagedStateLayer] = {}

    def layer(self, index: int) -> PlainKVLayer | QuantizedKVLayer:
        """Model layer `index`'s pool (write / gather; plain pools also expose the raw tensors)."""
        return self.layers[self.layer_slot[index]]

    def latent_layer(self, index: int) -> LatentKVLayer:
        """Model layer `index`'s latent pool (latent-attention models)."""
        return self.latent_layers[self.layer_slot[index]]

    def state_layer(self, index: int) -> PagedStateLayer:
        """Model layer `index`'s linear-attention states, over its slot's K/V data pages."""
        slot = self.layer_slot[index]
        if slot not in self._state_layers:
            if self.state_layout is None:
                raise ValueError("this KV store was built without a linear-attention state layout")
            pages = page_views(self.layers[slot].data_tensors, self.num_blocks)
            self._state_layers[slot] = PagedStateLayer(pages, self.state_layout, self.dtype)
        return self._state_layers[slot]

    @property
    def num_bytes(self) -> int:
        layers: list[PlainKVLayer | QuantizedKVLayer | LatentKVLayer] = [*self.layers, *self.latent_layers]
        pages = [] if self.compressed_pages is None else self.compressed_pages.tensors
        tensors = [t for layer in layers for t in layer.tensors] + pages
        return sum(t.numel() * t.element_size() for t in tensors)


def kv_cache_config_for(
    cfg: ArchConfig, dtype: torch.dtype, cache: CacheConfig
) -> tuple[KVCacheConfig, StateLayout | None]:
    """The model's cache groups (kvflow/kv_cache/kv_cache_config.py) for `cfg` (with tensor
    parallelism: this rank's heads), and its linear-attention state layout if it has such layers.
    Byte sizes come from kvflow/kv_cache/cache_bytes.py, which the doctor's calculator shares."""
    model_dtype = str(dtype).removeprefix("torch.")
    if cfg.compressed is not None and cache.kv_cache_dtype == "int4":
        raise ConfigError(
            "kv_cache_dtype 'int4' is not supported for DeepSeek-V4's compressed cache (auto, bfloat16, "
            "float16, int8 and fp8_e4m3 are)"
        )
    config = model_kv_cache_config(
        cfg,
        cache.kv_cache_dtype,
        model_dtype,
        cache.block_size,
        cache.enable_prefix_caching,
        cache.linear_state_checkpoint_interval,
    )
    layout = None
    if cfg.linear is not None:
        lin = cfg.linear
        layout = StateLayout(
            (lin.num_value_heads, lin.key_head_dim, lin.value_head_dim),
            (lin.conv_dim, lin.conv_kernel_size - 1),
            dtype.itemsize,
        )
        assert layout.num_bytes == state_bytes(cfg, model_dtype), "state_pool.py and cache_bytes.py disagree"
    return config, layout
