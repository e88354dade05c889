"""Quantized linear layers that read packed weights directly.

Never dequantize a whole matrix per step: decode is bandwidth-bound, and the point of int8/int4 is
to stream fewer bytes.
- int8, bf16 models with kvflow's native kernels (kvflow/kernels/gemv_int8.cpp), on its 16-row
  tiles of unsigned bytes q + 128 (`pack_int8_tiles`), by row count M (benchmarks/NOTES.md):
  M <= 8 (decode): the native GEMV, which quantizes the activations to int8 per 32 inputs and
  multiplies them with VNNI as llama.cpp's q8_0 x q8_0 does (its quality cost in NOTES.md): at
  M = 1 it streams at the memory's pace, at M = 8 it is no longer compute-bound on widening
  weights to bf16 (the previous kernel's ~13 GB/s);
  M > 8 (prefill chunks, compute-bound): blocks of rows dequantized to bf16 and multiplied with
  oneDNN's GEMM, ~1.1x the bf16 model's time against ~3x for `_weight_int8pack_mm` at M = 512.
  A block is at most PREFILL_TILE_ELEMENTS weights, so it stays in cache between its
  dequantization and its use and no whole bf16 matrix is ever held.
  Where oneDNN has no bf16 GEMM (AVX2 CPUs), that GEMM would widen both operands to fp32 (8
  multiply-adds per instruction); the GEMV's int8 x int8 products (32 per vpmaddubsw) are faster at
  every M, so it takes every row (`native_gemv_max_rows`), as llama.cpp's q8_0 / q4_0 prefill
  does: 512 rows, int4 g32 gate_up, 1.5-2x (benchmarks/NOTES.md, session 14). The rows' results are
  then those of decode, whatever the chunk. With oneDNN's bf16 GEMM (AVX512-BF16, Zen 5) the blocks
  win: 512 rows, 574-626 GOP/s against the GEMV's 452-528 on gate_up (session 15).
- int8 otherwise: `aten._weight_int8pack_mm` (int8 [out, in], one scale per row).
- int4, bf16 models with the native kernels (gemv_int4.cpp; group size 32, 64 or 128): the same
  two paths on kvflow's own layout of 16-row tiles (`pack_int4_tiles`): for M <= 8 the GEMV, which
  quantizes the activations to int8 per 32 inputs and multiplies them with VNNI as llama.cpp's
  q4 x q8 does (its quality cost in benchmarks/NOTES.md), and blockwise dequantize-and-GEMM with
  bf16 activations above (the GEMV at every M on AVX2, as for int8).
- int4 otherwise: `aten._weight_int4pack_mm_for_cpu` reads nibble-packed weights with per-group
  (scale, zero) pairs, computing w = (q - 8) x scale + zero, so zero = min + 8 x scale in our
  asymmetric convention. Float32 models run it in bf16 (its supported dtype).
All take activations [T, in].
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from kvflow.kernels import (
    DequantizeInt4Rows,
    DequantizeInt8Rows,
    NativeDecoderClasses,
    SkinnyLinearInt4,
    SkinnyLinearInt8,
    int4_weight_kernels,
    int8_weight_kernels,
    on_huge_pages,
)
from kvflow.layers.bf16_gemm import bf16_linear_blocks, onednn_bf16_gemm
from kvflow.layers.linear import ALL_ROWS
from kvflow.quant.weights import Int4Weight, Int8Weight

# Up to this many rows the native int8/int4 GEMVs beat dequantize-and-GEMM (measured at M = 4..16).
NATIVE_GEMV_MAX_ROWS = 8
# The native int8 layout (kvflow/kernels/gemv_int8.cpp): tiles of 16 output rows, per input quad
# 16 rows x 4 bytes (one VNNI register), inputs padded to whole 32-input activation blocks.
INT8_TILE_ROWS = 16
INT8_TILE_QUAD = 4
INT8_ACTIVATION_BLOCK = 32
INT8_WEIGHT_OFFSET = 128  # stored byte = q + 128 (vpdpbusd multiplies unsigned by signed bytes)
# The native int4 layout (kvflow/kernels/gemv_int4.cpp): tiles of 16 output rows, one per 32-bit
# lane of a VNNI register, each 32 inputs of a tile in 4 quarters of 16 x 8 nibbles.
INT4_TILE_ROWS = 16
INT4_TILE_INPUTS = 32  # inputs per block (and per int8 activation scale)
INT4_TILE_LANE_BYTES = 4  # bytes of one row in one quarter: 4 low + 4 high nibbles = 8 weights
# Group sizes the native int4 GEMV takes; others keep torch's kernel.
INT4_NATIVE_GROUP_SIZES = (32, 64, 128)
# Weights per dequantized block in prefill: 4 Mi bf16 = 8 MiB, within this EPYC's L3 slice and
# large enough (e.g. 4,681 rows of 896) that oneDNN runs at full speed on it.
PREFILL_TILE_ELEMENTS = 4 * 2**20

# The int4 kernel's signed offset: it subtracts 8 from every unsigned nibble.
INT4_KERNEL_OFFSET = 8
# Inner K tiles of the int4 packing on CPU (its kernel reads 2 tiles of 32 elements per step).
INT4_INNER_K_TILES = 2


# Overrides the routing of prefill chunks (M > NATIVE_GEMV_MAX_ROWS): "dequantize" sends them through
# the dequantized blocks with bf16 activations, "gemv" through the int8 x int8 GEMV, whatever the
# CPU. To A/B their quality and speed (benchmarks/quantized_prefill.py, benchmarks/NOTES.md), and
# for tests whose tolerances assume bf16 activations. An environment variable so that
# tensor-parallel workers, separate processes, follow it too.
QUANTIZED_PREFILL_ENV = "KVFLOW_QUANTIZED_PREFILL"
QUANTIZED_PREFILL_ROUTINGS = ("dequantize", "gemv")


def native_gemv_max_rows() -> int:
    """Rows up to which the native int8 / int4 GEMVs run: QUANTIZED_PREFILL_ENV's choice if set;
    else NATIVE_GEMV_MAX_ROWS where oneDNN has a bf16 GEMM for the dequantized blocks, every row
    where it has none (module docstring)."""
    routing = os.environ.get(QUANTIZED_PREFILL_ENV, "")
    if routing and routing not in QUANTIZED_PREFILL_ROUTINGS:
        raise ValueError(
            f"{QUANTIZED_PREFILL_ENV}={routing!r}: expected one of {', '.join(QUANTIZED_PREFILL_ROUTINGS)}"
        )
    if not routing:
        routing = "dequantize" if onednn_bf16_gemm() else "gemv"
    return ALL_ROWS if routing == "gemv" else NATIVE_GEMV_MAX_ROWS


def pack_int8_tiles(q: torch.Tensor) -> torch.Tensor:
    """q [out, in] int8 -> the native kernel's tiles [ceil(out / 16), in_pad / 4, 16, 4] uint8 of
    q + 128 (kvflow/kernels/gemv_int8.cpp), in_pad = in rounded up to 32. Padding weights are 0."""
    out, inp = q.shape
    tiles, padded_in = -(-out // INT8_TILE_ROWS), -(-inp // INT8_ACTIVATION_BLOCK) * INT8_ACTIVATION_BLOCK
    # q + 128 as a byte is q's two's-complement byte with its top bit flipped (no int16 detour).
    unsigned = torch.full((tiles * INT8_TILE_ROWS, padded_in), INT8_WEIGHT_OFFSET, dtype=torch.uint8)
    unsigned[:out, :inp] = q.contiguous().view(torch.uint8) ^ INT8_WEIGHT_OFFSET
    # [t, l, p, i] (row 16t + l, input 4p + i) -> [t, p, l, i]
    quads = unsigned.view(tiles, INT8_TILE_ROWS, padded_in // INT8_TILE_QUAD, INT8_TILE_QUAD)
    return quads.permute(0, 2, 1, 3).contiguous()


class Int8Linear(nn.Module):
    qweight: torch.Tensor  # native: pack_int8_tiles(q); otherwise q [out, in] int8
    scales: torch.Tensor  # [out]: float32 for the native kernels, else the activation dtype
    bias: torch.Tensor | None

    def __init__(self, weight: Int8Weight, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.qweight.shape
        self._native: tuple[SkinnyLinearInt8, DequantizeInt8Rows] | None = (
            int8_weight_kernels() if dtype == torch.bfloat16 else None
        )
        scale_dtype = torch.float32 if self._native is not None else dtype
        self.max_gemv_rows = native_gemv_max_rows()  # ALL_ROWS in batch-invariant mode
        qweight = weight.qweight.contiguous()
        # The tiles are read in full every decode step: on huge pages (kvflow/kernels/huge_pages.cpp).
        self.register_buffer(
            "qweight", on_huge_pages(pack_int8_tiles(qweight)) if self._native is not None else qweight
        )
        self.register_buffer("scales", weight.scales.to(scale_dtype).contiguous())
        self.register_buffer("bias", None if bias is None else bias.to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        if self._native is not None:
            gemv, dequantize_rows = self._native
            if x.shape[0] <= self.max_gemv_rows:
                return gemv(x, self.qweight, self.scales, self.bias)
            blocks = _row_blocks(self.out_features, self.in_features, INT8_TILE_ROWS)
            tiles = (
                dequantize_rows(self.qweight, self.scales, self.in_features, n0, n1) for n0, n1 in blocks
            )
            return _gemm_over_tiles(x, tiles, self.bias)
        y = torch._weight_int8pack_mm(x, self.qweight, self.scales)
        return y if self.bias is None else y + self.bias

    def native(self, classes: NativeDecoderClasses) -> Any | None:
        """This layer for the native decode forward: the same kernels as `forward` (None: torch only)."""
        if self._native is None:
            return None
        return classes.linear.int8(self.qweight, self.scales, self.in_features, self.bias, self.max_gemv_rows)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, int8 per channel"


def _row_blocks(out_features: int, in_features: int, multiple: int = 1) -> list[tuple[int, int]]:
    """[n0, n1) row ranges of at most PREFILL_TILE_ELEMENTS weights (a multiple of `multiple` rows,
    int4's tiles; at least one multiple) covering the output rows. kvflow/kernels/decode_forward.cpp
    cuts the same blocks, so both paths give the same numbers."""
    rows = max(multiple, PREFILL_TILE_ELEMENTS // in_features // multiple * multiple)
    return [(n0, min(out_features, n0 + rows)) for n0 in range(0, out_features, rows)]


def _gemm_over_tiles(
    x: torch.Tensor, tiles: Iterator[torch.Tensor], bias: torch.Tensor | None
) -> torch.Tensor:
    """Prefill: x [T, in] times each bf16 row block [rows, in] through oneDNN (fp32 where the CPU has
    no bf16 GEMM: kvflow/layers/bf16_gemm.py), as it is produced."""
    y = bf16_linear_blocks(x, tiles)
    return y if bias is None else y + bias


def pack_int4_tiles(q: torch.Tensor) -> torch.Tensor:
    """q [out, in] holding 0..15 -> the native kernel's 16-row tiles, [ceil(out / 16), 8 * in] uint8
    (kvflow/kernels/gemv_int4.cpp): per tile t, block b of 32 inputs, quarter c (0..3), byte 4l + i
    = q[16t + l, 32b + 8c + i] | q[16t + l, 32b + 8c + 4 + i] << 4. Padding rows are zero."""
    out, inp = q.shape
    tiles = -(-out // INT4_TILE_ROWS)
    padded = torch.zeros(tiles * INT4_TILE_ROWS, inp, dtype=torch.uint8)
    padded[:out] = q.to(torch.uint8)
    # [t, l, b, c, half, i]: row 16t + l, input 32b + 8c + 4 * half + i
    v = padded.reshape(tiles, INT4_TILE_ROWS, inp // INT4_TILE_INPUTS, 4, 2, INT4_TILE_LANE_BYTES)
    nibbles = v[..., 0, :] | (v[..., 1, :] << 4)  # [t, l, b, c, i]
    return nibbles.permute(0, 2, 3, 1, 4).reshape(tiles, 8 * inp).contiguous()  # [t, b, c, l, i]


def tile_group_params(p: torch.Tensor) -> torch.Tensor:
    """Per-group scales or mins [out, in / g] -> the tiles' [ceil(out / 16), in / g, 16] bf16."""
    out, groups = p.shape
    tiles = -(-out // INT4_TILE_ROWS)
    padded = torch.zeros(tiles * INT4_TILE_ROWS, groups, dtype=torch.bfloat16)
    padded[:out] = p.to(torch.bfloat16)
    return padded.reshape(tiles, INT4_TILE_ROWS, groups).transpose(1, 2).contiguous()


class Int4Linear(nn.Module):
    qweight: torch.Tensor  # the chosen kernel's packing: native [out / 16, 8 in] tiles, torch's own
    scales_and_zeros: torch.Tensor  # torch kernel: [in / group, out, 2] bf16
    scales: torch.Tensor  # native kernel: [out / 16, in / group, 16] bf16 (tile_group_params)
    mins: torch.Tensor  # native kernel: [out / 16, in / group, 16] bf16
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
        self.max_gemv_rows = native_gemv_max_rows()  # ALL_ROWS in batch-invariant mode
        self.register_buffer("bias", None if bias is None else bias.to(dtype))
        native_layout = self.group_size in INT4_NATIVE_GROUP_SIZES
        self._native: tuple[SkinnyLinearInt4, DequantizeInt4Rows] | None = (
            int4_weight_kernels() if dtype == torch.bfloat16 and native_layout else None
        )
        if self._native is not None:
            self.register_buffer("qweight", on_huge_pages(pack_int4_tiles(weight.qweight)))
            self.register_buffer("scales", tile_group_params(weight.scales))
            self.register_buffer("mins", tile_group_params(weight.mins))
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
            n = self.out_features
            if x.shape[0] <= self.max_gemv_rows:
                return gemv(x, self.qweight, self.scales, self.mins, g, n, self.bias)
            blocks = _row_blocks(n, self.in_features, INT4_TILE_ROWS)
            tiles = (dequantize_rows(self.qweight, self.scales, self.mins, g, n, n0, n1) for n0, n1 in blocks)
            return _gemm_over_tiles(x, tiles, self.bias)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(torch.bfloat16), self.qweight, self.group_size, self.scales_and_zeros
        ).to(self.dtype)
        return y if self.bias is None else y + self.bias

    def native(self, classes: NativeDecoderClasses) -> Any | None:
        """This layer for the native decode forward: the same kernels as `forward` (None: torch only)."""
        if self._native is None:
            return None
        g, n = self.group_size, self.out_features
        rows = self.max_gemv_rows
        return classes.linear.int4(self.qweight, self.scales, self.mins, g, n, self.bias, self.perm, rows)

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
        """The parts concatenated in the native forward (GGUF parts of different types; act-order
        int4 parts, each applying its own input order), None where a part has only a torch path."""
        natives = [getattr(part, "native", lambda _: None)(classes) for part in self.parts]
        return None if any(n is None for n in natives) else classes.linear.concat(natives)
