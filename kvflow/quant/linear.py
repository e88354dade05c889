"""Quantized linear layers that read packed weights directly.

Never dequantize a whole matrix per step: decode is bandwidth-bound, and the point of int8/int4 is
to stream fewer bytes.
- int8, bf16 models with kvflow's native kernels (kvflow/kernels/gemv_int8.cpp), by row count M
  (measured on 9728 x 896 matrices, benchmarks/NOTES.md):
  M <= 8 (decode): the native int8 GEMV, 1.6-2x PyTorch's `_weight_int8pack_mm` and ~2x the bf16
  GEMV at M = 1 (it reads half the bytes);
  M > 8 (prefill chunks, compute-bound): blocks of rows dequantized to bf16 and multiplied with
  oneDNN's GEMM, ~1.1x the bf16 model's time against ~3x for `_weight_int8pack_mm` at M = 512.
  A block is at most PREFILL_TILE_ELEMENTS weights, so it stays in cache between its
  dequantization and its use and no whole bf16 matrix is ever held.
- int8 otherwise: `aten._weight_int8pack_mm` (int8 [out, in], one scale per row).
- int4, bf16 models with the native kernels (gemv_int4.cpp; in_features a multiple of 128): the
  same two paths on kvflow's own nibble layout (`pack_int4_blocks`): the GEMV for M <= 8 (~1.3x
  PyTorch's int4 kernel, ~3.5x the bf16 GEMV at M = 1) and blockwise dequantize-and-GEMM above.
- int4 otherwise: `aten._weight_int4pack_mm_for_cpu` reads nibble-packed weights with per-group
  (scale, zero) pairs, computing w = (q - 8) x scale + zero, so zero = min + 8 x scale in our
  asymmetric convention. Float32 models run it in bf16 (its supported dtype).
All take activations [T, in].
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvflow.kernels import (
    DequantizeInt4Rows,
    DequantizeInt8Rows,
    NativeDecoderClasses,
    SkinnyLinearInt4,
    SkinnyLinearInt8,
    int4_weight_kernels,
    int8_weight_kernels,
)
from kvflow.quant.weights import Int4Weight, Int8Weight

# Up to this many rows the native int8/int4 GEMVs beat dequantize-and-GEMM (measured at M = 4..16).
NATIVE_GEMV_MAX_ROWS = 8
# The native int4 layout packs blocks of this many inputs (one 64-byte line) per row.
INT4_NATIVE_BLOCK = 128
# Weights per dequantized block in prefill: 4 Mi bf16 = 8 MiB, within this EPYC's L3 slice and
# large enough (e.g. 4,681 rows of 896) that oneDNN runs at full speed on it.
PREFILL_TILE_ELEMENTS = 4 * 2**20

# The int4 kernel's signed offset: it subtracts 8 from every unsigned nibble.
INT4_KERNEL_OFFSET = 8
# Inner K tiles of the int4 packing on CPU (its kernel reads 2 tiles of 32 elements per step).
INT4_INNER_K_TILES = 2


class Int8Linear(nn.Module):
    qweight: torch.Tensor  # [out, in] int8
    scales: torch.Tensor  # [out]: float32 for the native kernels, else the activation dtype
    bias: torch.Tensor | None

    def __init__(self, weight: Int8Weight, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.qweight.shape
        self._native: tuple[SkinnyLinearInt8, DequantizeInt8Rows] | None = (
            int8_weight_kernels() if dtype == torch.bfloat16 else None
        )
        scale_dtype = torch.float32 if self._native is not None else dtype
        self.register_buffer("qweight", weight.qweight.contiguous())
        self.register_buffer("scales", weight.scales.to(scale_dtype).contiguous())
        self.register_buffer("bias", None if bias is None else bias.to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        if self._native is not None:
            gemv, dequantize_rows = self._native
            if x.shape[0] <= NATIVE_GEMV_MAX_ROWS:
                return gemv(x, self.qweight, self.scales, self.bias)
            tiles = (
                dequantize_rows(self.qweight, self.scales, n0, n1)
                for n0, n1 in _row_blocks(self.out_features, self.in_features)
            )
            return _gemm_over_tiles(x, tiles, self.bias)
        y = torch._weight_int8pack_mm(x, self.qweight, self.scales)
        return y if self.bias is None else y + self.bias

    def native(self, classes: NativeDecoderClasses) -> Any | None:
        """This layer for the native decode forward: the same kernels as `forward` (None: torch only)."""
        if self._native is None:
            return None
        return classes.linear.int8(self.qweight, self.scales, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, int8 per channel"


def _row_blocks(out_features: int, in_features: int) -> list[tuple[int, int]]:
    """[n0, n1) row ranges of at most PREFILL_TILE_ELEMENTS weights covering the output rows."""
    rows = max(1, PREFILL_TILE_ELEMENTS // in_features)
    return [(n0, min(out_features, n0 + rows)) for n0 in range(0, out_features, rows)]


def _gemm_over_tiles(
    x: torch.Tensor, tiles: Iterator[torch.Tensor], bias: torch.Tensor | None
) -> torch.Tensor:
    """Prefill: x [T, in] times each bf16 row block [rows, in] through oneDNN, as it is produced."""
    parts = [F.linear(x, tile) for tile in tiles]
    y = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    return y if bias is None else y + bias


def pack_int4_blocks(q: torch.Tensor) -> torch.Tensor:
    """q [out, in] holding 0..15 -> the native kernel's [out, in / 2] uint8 layout: per block of
    128 inputs, little-endian u16 lane i = q[i] | q[32 + i] << 4 | q[64 + i] << 8 | q[96 + i] << 12."""
    out, inp = q.shape
    chunks = q.to(torch.uint8).reshape(out, inp // INT4_NATIVE_BLOCK, 4, INT4_NATIVE_BLOCK // 4)
    low_byte = chunks[:, :, 0] | (chunks[:, :, 1] << 4)
    high_byte = chunks[:, :, 2] | (chunks[:, :, 3] << 4)
    return torch.stack([low_byte, high_byte], dim=-1).reshape(out, inp // 2).contiguous()


class Int4Linear(nn.Module):
    qweight: torch.Tensor  # [out, in / 2] uint8, the chosen kernel's packed layout
    scales_and_zeros: torch.Tensor  # torch kernel: [in / group, out, 2] bf16
    scales: torch.Tensor  # native kernel: [out, in / group] bf16
    mins: torch.Tensor  # native kernel: [out, in / group] bf16
    bias: torch.Tensor | None
    perm: torch.Tensor | None  # [in]: act-order checkpoints' input order (groups contiguous after it)

    def __init__(
        self,
        weight: Int4Weight,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        perm: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.register_buffer("perm", perm)
        self.out_features, self.in_features = weight.qweight.shape
        self.group_size = weight.group_size
        self.dtype = dtype
        self.register_buffer("bias", None if bias is None else bias.to(dtype))
        native_layout = self.in_features % INT4_NATIVE_BLOCK == 0 and self.group_size % 32 == 0
        self._native: tuple[SkinnyLinearInt4, DequantizeInt4Rows] | None = (
            int4_weight_kernels() if dtype == torch.bfloat16 and native_layout else None
        )
        if self._native is not None:
            self.register_buffer("qweight", pack_int4_blocks(weight.qweight))
            self.register_buffer("scales", weight.scales.to(torch.bfloat16).contiguous())  # [out, in / group]
            self.register_buffer("mins", weight.mins.to(torch.bfloat16).contiguous())
            return
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            weight.qweight.contiguous(), INT4_INNER_K_TILES
        )
        zeros = weight.mins + INT4_KERNEL_OFFSET * weight.scales
        # [in / group, out, 2]: the kernel's layout of (scale, zero) per group and output.
        scales_and_zeros = torch.stack([weight.scales.t(), zeros.t()], dim=-1).to(torch.bfloat16).contiguous()
        self.register_buffer("qweight", packed)
        self.register_buffer("scales_and_zeros", scales_and_zeros)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        if self.perm is not None:
            x = x.index_select(1, self.perm)
        if self._native is not None:
            gemv, dequantize_rows = self._native
            g = self.group_size
            if x.shape[0] <= NATIVE_GEMV_MAX_ROWS:
                return gemv(x, self.qweight, self.scales, self.mins, g, self.bias)
            blocks = _row_blocks(self.out_features, self.in_features)
            tiles = (dequantize_rows(self.qweight, self.scales, self.mins, g, n0, n1) for n0, n1 in blocks)
            return _gemm_over_tiles(x, tiles, self.bias)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(torch.bfloat16), self.qweight, self.group_size, self.scales_and_zeros
        ).to(self.dtype)
        return y if self.bias is None else y + self.bias

    def native(self, classes: NativeDecoderClasses) -> Any | None:
        """This layer for the native decode forward: the same kernels as `forward` (None: torch only)."""
        if self._native is None:
            return None
        g = self.group_size
        return classes.linear.int4(self.qweight, self.scales, self.mins, g, self.bias, self.perm)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, int4 group {self.group_size}"


class ConcatLinear(nn.Module):
    """Several linear layers over the same input, outputs concatenated: a merged projection (qkv,
    gate/up) whose parts cannot share one packed matrix (act-order parts with different orders)."""

    def __init__(self, parts: list[nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, sum of outs]
        return torch.cat([part(x) for part in self.parts], dim=-1)

    def native(self, classes: NativeDecoderClasses) -> Any | None:
        return None  # parts with their own input orders: the torch path concatenates them
