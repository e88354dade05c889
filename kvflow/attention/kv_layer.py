"""One layer's K/V pool behind write / gather, plain or quantized per token and head.

Formats (D = head_dim; scales and zero points in float16, one per token per KV head):
    plain      the model dtype (or float16/bfloat16 if asked): 2 x D bytes per token-head
    int8       symmetric: s = max|x| / 127, q = round(x / s);              D + 2 bytes
    fp8_e4m3   s = max|x| / 448 (e4m3's largest normal), q = fp8(x / s);    D + 2 bytes
    int4       asymmetric: s = (max - min) / 15, z = min, q = round((x - z) / s), two per byte;
               D / 2 + 4 bytes
Decode attention in bf16 reads quantized pools in place and dequantizes in registers
(kvflow/kernels/paged_decode_attention.cpp, through `quantized_pools`); the other paths dequantize
only the slots a step gathers (never the whole pool), into the model dtype, and attend on those.
Slot 0 (the null block's first slot) stays all zeros in every format, so padded reads are finite.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Protocol

import torch

from kvflow.config import KVCacheDType, QuantizedKVDType
from kvflow.kernels import zeros_on_huge_pages

KV_CACHE_DTYPES: tuple[str, ...] = typing.get_args(KVCacheDType)  # one source: kvflow/config.py
QUANTIZED_KV_DTYPES: tuple[str, ...] = typing.get_args(QuantizedKVDType)
SCALE_DTYPE = torch.float16
SCALE_BYTES = 2
INT8_MAX = 127.0
FP8_E4M3_MAX = 448.0
INT4_LEVELS = 15.0
# Scales never drop below this: an all-zero token-head (padding, the null slot) stays exactly zero.
MIN_SCALE = 1e-8


def kv_bytes_per_token_head(kv_cache_dtype: str, head_dim: int, model_dtype: torch.dtype) -> float:
    """Bytes one token costs per KV head for K and V together (data + scales + zero points)."""
    if kv_cache_dtype in ("int8", "fp8_e4m3"):
        return 2 * (head_dim + SCALE_BYTES)
    if kv_cache_dtype == "int4":
        return 2 * (head_dim / 2 + 2 * SCALE_BYTES)
    return 2 * head_dim * plain_dtype(kv_cache_dtype, model_dtype).itemsize


def plain_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    return {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(kv_cache_dtype, model_dtype)


@dataclass(frozen=True)
class QuantizedPools:
    """A quantized layer's storage as the native decode kernel reads it (shapes in _QuantizedPool)."""

    kind: str  # "int8" | "fp8_e4m3" | "int4"
    key_data: torch.Tensor
    key_scale: torch.Tensor
    key_zero: torch.Tensor  # int4 only; the scales stand in otherwise (unread)
    value_data: torch.Tensor
    value_scale: torch.Tensor
    value_zero: torch.Tensor


class KVLayer(Protocol):
    def write(self, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """key/value [T, Hkv, D] -> pool rows `slot_mapping` [T]."""

    def gather(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `slots` [N] as [N, Hkv, D] in the model dtype."""

    def in_place(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The raw pools for kernels that read them in place (plain pools only)."""

    def quantized_pools(self) -> QuantizedPools | None:
        """The raw quantized pools for kernels that dequantize as they read (quantized pools only)."""


class PlainKVLayer:
    def __init__(
        self, num_slots: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, model_dtype: torch.dtype
    ):
        shape = (num_slots, num_kv_heads, head_dim)
        # On huge pages: decode attention reads each sequence's blocks scattered over the pool.
        self.key_cache = zeros_on_huge_pages(shape, dtype)
        self.value_cache = zeros_on_huge_pages(shape, dtype)
        self.model_dtype = model_dtype

    def write(self, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        self.key_cache.index_copy_(0, slot_mapping, key.to(self.key_cache.dtype))
        self.value_cache.index_copy_(0, slot_mapping, value.to(self.value_cache.dtype))

    def gather(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # index_select on a flat slot list: ~3x faster than advanced indexing on CPU (NOTES.md).
        k = self.key_cache.index_select(0, slots).to(self.model_dtype)
        return k, self.value_cache.index_select(0, slots).to(self.model_dtype)

    def in_place(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.key_cache.dtype != self.model_dtype:
            return None
        return self.key_cache, self.value_cache

    def quantized_pools(self) -> QuantizedPools | None:
        return None

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [self.key_cache, self.value_cache]

    @property
    def data_tensors(self) -> list[torch.Tensor]:
        """K and V data [num_slots, ...]: where a linear-attention state lays its bytes (state_pool.py)."""
        return self.tensors


def quantize_8bit(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (int8, or fp8_e4m3 as its uint8 bytes, [..., D]; its float32 scale [...]): one
    absmax scale per row, so that the row's largest magnitude maps to the format's largest value."""
    x = x.float()
    top = INT8_MAX if kind == "int8" else FP8_E4M3_MAX
    scale = (x.abs().amax(dim=-1) / top).clamp(min=MIN_SCALE)
    scaled = x / scale[..., None]
    if kind == "int8":
        return torch.round(scaled).clamp(-top, top).to(torch.int8), scale
    return scaled.to(torch.float8_e4m3fn).view(torch.uint8), scale


def dequantize_8bit(data: torch.Tensor, scale: torch.Tensor, kind: str) -> torch.Tensor:
    """quantize_8bit's rows back to float32; scale broadcast against data ([..., 1])."""
    if kind == "fp8_e4m3":
        return data.view(torch.float8_e4m3fn).float() * scale
    return data.view(torch.int8).float() * scale


class _QuantizedPool:
    """One quantized pool (K or V): data [slots, Hkv, D or D/2], scale [and zero] [slots, Hkv]."""

    def __init__(self, kind: str, num_slots: int, num_kv_heads: int, head_dim: int, model_dtype: torch.dtype):
        self.kind = kind
        self.model_dtype = model_dtype
        width = head_dim // 2 if kind == "int4" else head_dim
        # fp8 is stored as its bytes (uint8): CPU index_copy/index_select do not take float8 tensors.
        data_dtype = {"int8": torch.int8, "fp8_e4m3": torch.uint8, "int4": torch.uint8}[kind]
        self.data = zeros_on_huge_pages((num_slots, num_kv_heads, width), data_dtype)
        self.scale = torch.zeros((num_slots, num_kv_heads), dtype=SCALE_DTYPE)
        self.zero = torch.zeros((num_slots, num_kv_heads), dtype=SCALE_DTYPE) if kind == "int4" else None

    def write(self, x: torch.Tensor, slots: torch.Tensor) -> None:
        x = x.float()
        if self.kind == "int4":
            assert self.zero is not None
            lo, hi = x.amin(dim=-1), x.amax(dim=-1)
            scale = ((hi - lo) / INT4_LEVELS).clamp(min=MIN_SCALE)
            q = torch.round((x - lo[..., None]) / scale[..., None]).clamp(0, INT4_LEVELS).to(torch.uint8)
            packed = q[..., 0::2] | (q[..., 1::2] << 4)  # element 2i in the low nibble, 2i+1 high
            self.data.index_copy_(0, slots, packed)
            self.zero.index_copy_(0, slots, lo.to(SCALE_DTYPE))
        else:
            q, scale = quantize_8bit(x, self.kind)
            self.data.index_copy_(0, slots, q)
        self.scale.index_copy_(0, slots, scale.to(SCALE_DTYPE))

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        data = self.data.index_select(0, slots)
        scale = self.scale.index_select(0, slots).float()[..., None]
        if self.kind == "int4":
            assert self.zero is not None
            q = torch.stack([data & 0xF, data >> 4], dim=-1).flatten(-2).float()
            x = q * scale + self.zero.index_select(0, slots).float()[..., None]
        else:
            x = dequantize_8bit(data, scale, self.kind)
        return x.to(self.model_dtype)

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [self.data, self.scale] + ([self.zero] if self.zero is not None else [])


class QuantizedKVLayer:
    def __init__(self, kind: str, num_slots: int, num_kv_heads: int, head_dim: int, model_dtype: torch.dtype):
        if kind == "int4" and head_dim % 2:
            raise ValueError(f"int4 KV packs two values per byte: head_dim {head_dim} must be even")
        self.keys = _QuantizedPool(kind, num_slots, num_kv_heads, head_dim, model_dtype)
        self.values = _QuantizedPool(kind, num_slots, num_kv_heads, head_dim, model_dtype)

    def write(self, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        self.keys.write(key, slot_mapping)
        self.values.write(value, slot_mapping)

    def gather(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys.gather(slots), self.values.gather(slots)

    def in_place(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None

    def quantized_pools(self) -> QuantizedPools | None:
        k, v = self.keys, self.values
        return QuantizedPools(
            k.kind,
            k.data,
            k.scale,
            k.scale if k.zero is None else k.zero,
            v.data,
            v.scale,
            v.scale if v.zero is None else v.zero,
        )

    @property
    def tensors(self) -> list[torch.Tensor]:
        return self.keys.tensors + self.values.tensors

    @property
    def data_tensors(self) -> list[torch.Tensor]:
        """K and V data [num_slots, ...] (not the scales): where a linear-attention state lays its
        bytes (state_pool.py)."""
        return [self.keys.data, self.values.data]


def make_kv_layer(
    kv_cache_dtype: str, num_slots: int, num_kv_heads: int, head_dim: int, model_dtype: torch.dtype
) -> PlainKVLayer | QuantizedKVLayer:
    if kv_cache_dtype in QUANTIZED_KV_DTYPES:
        return QuantizedKVLayer(kv_cache_dtype, num_slots, num_kv_heads, head_dim, model_dtype)
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}"
        )
    return PlainKVLayer(
        num_slots, num_kv_heads, head_dim, plain_dtype(kv_cache_dtype, model_dtype), model_dtype
    )
