"""One layer's latent pool for multi-head latent attention (DeepSeek V2/V3): one "head" per token.

Per token the pool holds [c_kv | k_pe]: the normed KV latent (kv_lora_rank values, position-free)
and the rotated shared key part (qk_rope_head_dim values), L = kv_lora_rank + qk_rope_head_dim in
all. K and V of every head are up-projections of c_kv (kvflow/attention/mla_attention.py), so
nothing else is cached: L values per token per layer instead of 2 x heads x head_dim.

Formats (kv_cache_dtype, as kvflow/attention/kv_layer.py): plain = L values in the model dtype (or
float16/bfloat16); int8 / fp8_e4m3 / int4 quantize c_kv and k_pe separately, each with its own
scale per token (the two parts have different ranges: c_kv is RMS-normed, k_pe is not), so
L + 4 bytes per token for int8/fp8. Slot 0 stays zero in every format.
DeepSeek-V3.2's lightning indexer caches one more key per token and layer (`index_dim` values,
kvflow/attention/indexer.py) in a pool of its own beside the latents, in the same format: a decode
step reads every index key but only the latents the indexer selects.
"""

from __future__ import annotations

import torch

from kvflow.attention.kv_layer import (
    KV_CACHE_DTYPES,
    QUANTIZED_KV_DTYPES,
    _QuantizedPool,
    kv_bytes_per_token_head,
    plain_dtype,
)


def latent_bytes_per_token(
    kv_cache_dtype: str, kv_lora_rank: int, rope_dim: int, model_dtype: torch.dtype
) -> float:
    """Bytes one token's latent costs in one layer (data + scales + zero points)."""
    # kv_bytes_per_token_head counts a K and a V of head_dim values: half of it is one part.
    parts = (kv_lora_rank, rope_dim) if kv_cache_dtype in QUANTIZED_KV_DTYPES else (kv_lora_rank + rope_dim,)
    return sum(kv_bytes_per_token_head(kv_cache_dtype, width, model_dtype) / 2 for width in parts)


class LatentKVLayer:
    def __init__(
        self,
        kv_cache_dtype: str,
        num_slots: int,
        kv_lora_rank: int,
        rope_dim: int,
        model_dtype: torch.dtype,
        index_dim: int = 0,
    ) -> None:
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}"
            )
        self.kv_lora_rank = kv_lora_rank
        self.latent_dim = kv_lora_rank + rope_dim
        self.model_dtype = model_dtype
        self.cache: torch.Tensor | None = None
        self.parts: list[_QuantizedPool] = []
        if kv_cache_dtype in QUANTIZED_KV_DTYPES:
            if kv_cache_dtype == "int4" and (kv_lora_rank % 2 or rope_dim % 2):
                raise ValueError(
                    "int4 KV packs two values per byte: kv_lora_rank and qk_rope_head_dim must be even"
                )
            self.parts = [
                _QuantizedPool(kv_cache_dtype, num_slots, 1, width, model_dtype)
                for width in (kv_lora_rank, rope_dim)
            ]
        else:
            dtype = plain_dtype(kv_cache_dtype, model_dtype)
            self.cache = torch.zeros((num_slots, self.latent_dim), dtype=dtype)
        # The indexer's keys [slots, index_dim] (V3.2), in the latents' format; None without an indexer.
        self.index_keys: torch.Tensor | _QuantizedPool | None = None
        if index_dim and kv_cache_dtype in QUANTIZED_KV_DTYPES:
            self.index_keys = _QuantizedPool(kv_cache_dtype, num_slots, 1, index_dim, model_dtype)
        elif index_dim:
            plain = plain_dtype(kv_cache_dtype, model_dtype)
            self.index_keys = torch.zeros((num_slots, index_dim), dtype=plain)

    def write(
        self, latent: torch.Tensor, slot_mapping: torch.Tensor, index_keys: torch.Tensor | None = None
    ) -> None:
        """latent [T, L] (and the indexer's keys [T, index_dim]) -> pool rows `slot_mapping` [T]."""
        if isinstance(self.index_keys, torch.Tensor) and index_keys is not None:
            self.index_keys.index_copy_(0, slot_mapping, index_keys.to(self.index_keys.dtype))
        elif isinstance(self.index_keys, _QuantizedPool) and index_keys is not None:
            self.index_keys.write(index_keys.unsqueeze(1), slot_mapping)
        if self.cache is not None:
            self.cache.index_copy_(0, slot_mapping, latent.to(self.cache.dtype))
            return
        c_kv, k_pe = latent.split([self.kv_lora_rank, self.latent_dim - self.kv_lora_rank], dim=-1)
        self.parts[0].write(c_kv.unsqueeze(1), slot_mapping)  # [T, 1, kv_lora_rank]
        self.parts[1].write(k_pe.unsqueeze(1), slot_mapping)

    def gather_index_keys(self, slots: torch.Tensor) -> torch.Tensor:
        """The indexer's keys of `slots` [N] as [N, index_dim] in the model dtype."""
        if self.index_keys is None:
            raise ValueError("this latent pool holds no indexer keys")
        if isinstance(self.index_keys, torch.Tensor):
            return self.index_keys.index_select(0, slots).to(self.model_dtype)
        return self.index_keys.gather(slots)[:, 0]

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        """The latents of `slots` [N] as [N, L] in the model dtype (dequantized if the pool is)."""
        if self.cache is not None:
            return self.cache.index_select(0, slots).to(self.model_dtype)
        return torch.cat([part.gather(slots)[:, 0] for part in self.parts], dim=-1)

    @property
    def tensors(self) -> list[torch.Tensor]:
        own = [self.cache] if self.cache is not None else [t for part in self.parts for t in part.tensors]
        if isinstance(self.index_keys, torch.Tensor):
            return [*own, self.index_keys]
        return own + ([] if self.index_keys is None else self.index_keys.tensors)
