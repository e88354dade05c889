"""The paged K/V tensors: one K and one V pool per layer, addressed by slot.

Layout per layer: [num_blocks, block_size, num_kv_heads, head_dim], viewed flat as
[num_slots, num_kv_heads, head_dim] with slot = block_id * block_size + offset. Block 0 is the
null block (never allocated): padded gathers read it, so the pool starts zeroed (finite values:
a masked score gets weight 0, but 0 * NaN would still poison the output).
"""

from __future__ import annotations

import torch


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """2 (K and V) x layers x kv_heads x head_dim x bytes per element."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize


class KVStore:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (num_blocks * block_size, num_kv_heads, head_dim)
        self.key_caches = [torch.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self.value_caches = [torch.zeros(shape, dtype=dtype) for _ in range(num_layers)]

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(key, value) pools of one layer, each [num_slots, num_kv_heads, head_dim]."""
        return self.key_caches[index], self.value_caches[index]

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.key_caches + self.value_caches)
