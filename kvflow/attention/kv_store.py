"""The paged K/V tensors: one K and one V pool per layer, addressed by slot.

Layout per layer: [num_blocks, block_size, num_kv_heads, head_dim], viewed flat as
[num_slots, num_kv_heads, head_dim] with slot = block_id * block_size + offset. Block 0 is the
null block (never allocated): padded gathers read it, so the pool starts zeroed (finite values:
a masked score gets weight 0, but 0 * NaN would still poison the output).
Latent attention (DeepSeek MLA) stores one latent per token and layer instead of K and V
(kvflow/attention/latent_kv_layer.py): `latent=(kv_lora_rank, qk_rope_head_dim)`, read through
`latent_layer(i)`.
"""

from __future__ import annotations

import torch

from kvflow.attention.kv_layer import PlainKVLayer, QuantizedKVLayer, kv_bytes_per_token_head, make_kv_layer
from kvflow.attention.latent_kv_layer import LatentKVLayer, latent_bytes_per_token


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
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.kv_cache_dtype = kv_cache_dtype
        num_slots = num_blocks * block_size
        # A latent-attention model's store has latent layers only (and no K/V layers).
        self.latent_layers = (
            [LatentKVLayer(kv_cache_dtype, num_slots, *latent, dtype) for _ in range(num_layers)]
            if latent is not None
            else []
        )
        self.layers = [
            make_kv_layer(kv_cache_dtype, num_slots, num_kv_heads, head_dim, dtype)
            for _ in range(num_layers if latent is None else 0)
        ]

    def layer(self, index: int) -> PlainKVLayer | QuantizedKVLayer:
        """One layer's pool (write / gather; plain pools also expose the raw tensors)."""
        return self.layers[index]

    def latent_layer(self, index: int) -> LatentKVLayer:
        """One layer's latent pool (latent-attention models)."""
        return self.latent_layers[index]

    @property
    def num_bytes(self) -> int:
        layers: list[PlainKVLayer | QuantizedKVLayer | LatentKVLayer] = [*self.layers, *self.latent_layers]
        return sum(t.numel() * t.element_size() for layer in layers for t in layer.tensors)
