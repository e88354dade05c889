"""Linear layers on a GGUF file's block-quantized weights, computing on the file's own bits.

ggml's block types, per row (K inputs), as llama.cpp's ggml-quants.c lays them out:
    Q8_0  34 B / 32: d fp16, 32 x int8 q                          W = d q
    Q4_0  18 B / 32: d, 16 B nibbles (byte j: q[j] | q[j + 16] << 4)      W = d (q - 8)
    Q4_1  20 B / 32: d, m, nibbles                                W = d q + m
    Q5_0  22 B / 32: d, qh (32 bits: bit i is q[i]'s bit 4), nibbles      W = d (q - 16)
    Q5_1  24 B / 32: d, m, qh, nibbles                            W = d q + m
    Q4_K  144 B / 256: d, dmin fp16, 12 B of 6-bit (sc, m) for 8 groups of 32, 128 B nibbles
          (per 64 values: byte j = q[j] | q[j + 32] << 4)         W = d sc q - dmin m
    Q5_K  176 B / 256: d, dmin, scales, qh (byte j bit i: q[32 i + j]'s bit 4), nibbles
    Q6_K  210 B / 256: 128 B low nibbles (per 128: byte j = q[j] | q[j + 64] << 4), 64 B high
          2-bit pairs (per 128: byte j bits 2s: q[32 s + j] >> 4), 16 x int8 sc per 16, d
                                                                  W = d sc (q - 32)
    MXFP4 17 B / 32: e (e8m0), 16 B of e2m1 codes (Q4_0's nibble order)   W = e2m1(q) 2^(e - 127)
          gpt-oss's Hugging Face checkpoint: `*_blocks` [.., N, K / 32, 16] (byte j: codes 2j,
          2j + 1) and `*_scales` [.., N, K / 32] (e): the same numbers (unpack_mxfp4_blocks)
    NVFP4 36 B / 64: 4 x d (unsigned e4m3, one per 16), 32 B of e2m1 codes (per 16: byte j holds
          codes j and j + 8)                                      W = e2m1(q) d / G  (G = 1)
          compressed-tensors' nvfp4-pack-quantized: `weight_packed` [N, K / 2] (byte j: codes 2j,
          2j + 1), `weight_scale` e4m3 [N, K / 16] (d), `weight_global_scale` [1] (G): the same
          numbers with the checkpoint's G (unpack_nvfp4_packed)
Unpacking gives levels q [N, K] and the stored fields per group; packing re-lays them per 16
output rows for the GEMVs (kvflow/kernels/gemv_int8.cpp for Q8_0, gemv_ggml.cpp for the rest), whose
headers give the layouts. The bits are the file's: the GEMV computes with the same (levels, d,
sc, ...) llama.cpp does; only the activations are rounded to int8 per 32 (as llama.cpp's q8 dot
products round them too). Memory per weight: Q8_0 8.5 bits, Q4_0 4.5, Q4_1 5, Q5_0 5.5, Q5_1 6,
Q4_K 4.63 (6-bit sc and m held as bytes), Q5_K 5.63, Q6_K 6.56, MXFP4 4.25, NVFP4 4.5.
Prefill chunks (more than `max_gemv_rows` rows) multiply bf16 row blocks dequantized from the
tiles, as the int8 / int4 layers do (kvflow/quant/linear.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from kvflow.errors import ModelLoadError
from kvflow.kernels import GgmlKernels, NativeDecoderClasses, on_huge_pages
from kvflow.quant.linear import (
    INT4_TILE_ROWS,
    _gemm_over_tiles,
    _row_blocks,
    native_gemv_max_rows,
    pack_int4_tiles,
    pack_int8_tiles,
)

# ggml type ids (gguf.GGMLQuantizationType) of the types with a kernel here.
GGML_TYPE_IDS = {
    **{"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8},
    **{"Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "MXFP4": 39, "NVFP4": 40},
}
KERNEL_TYPES = frozenset(GGML_TYPE_IDS)
# Bytes per block and values per block of each.
_BLOCK_BYTES = {
    "Q4_0": 18,
    "Q4_1": 20,
    "Q5_0": 22,
    "Q5_1": 24,
    "Q8_0": 34,
    "Q4_K": 144,
    "Q5_K": 176,
    "Q6_K": 210,
    "MXFP4": 17,
    "NVFP4": 36,
}
_BLOCK_VALUES = {t: 256 if t.endswith("_K") else 64 if t == "NVFP4" else 32 for t in _BLOCK_BYTES}
# High bit planes beside the nibbles (gemv_ggml.cpp).
_PLANES = {
    "Q4_0": 0,
    "Q4_1": 0,
    "Q4_K": 0,
    "Q5_0": 1,
    "Q5_1": 1,
    "Q5_K": 1,
    "Q6_K": 2,
    "MXFP4": 0,
    "NVFP4": 0,
}
_OFFSETS = {"Q4_0": 8, "Q5_0": 16, "Q6_K": 32, "MXFP4": 12, "NVFP4": 12}  # W = s (level - offset) types
FP4_TYPES = frozenset({"MXFP4", "NVFP4"})  # codes are e2m1 numbers, not levels
NVFP4_GROUP = 16  # inputs per e4m3 scale
E4M3_NAN = 0x7F  # unsigned e4m3's NaN byte: ggml reads the scale as 0
# gemv_ggml.cpp's NVFP4 row factor over G: 2^8 (its e4m3 widening reads d 2^-8) / 2 (doubled levels).
NVFP4_ROW_FACTOR = 128.0
# MXFP4 / NVFP4: e2m1 code -> 2 e2m1 + 12 (gemv_ggml.cpp's byte table): the level the kernel multiplies.
MXFP4_LEVELS = torch.tensor([12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0], dtype=torch.uint8)
E8M0_BIAS = 127
GROUP = 32  # inputs per nibble block and per activation scale
SUPER_BLOCK = 256  # K-quants' QK_K
EMPTY = torch.empty(0, dtype=torch.float16)


@dataclass(frozen=True)
class UnpackedGGML:
    """One projection's ggml blocks unpacked: levels q [N, K] uint8 and the stored fields by row:
    scales [N, G] (d: fp16; sc: uint8, Q6_K int8 per 16; NVFP4 e4m3 bytes per 16), mins [N, K / 32]
    (m: fp16 or uint8; NVFP4: [N] float32, the global scale G), supers [N, K / 256, F] fp16 (K-quants'
    d and dmin; Q6_K's d)."""

    type_name: str
    q: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None = None
    supers: torch.Tensor | None = None

    def levels(self) -> torch.Tensor:
        """The levels the kernels multiply: q, or (MXFP4) its codes through MXFP4_LEVELS."""
        return MXFP4_LEVELS[self.q.long()] if self.type_name in FP4_TYPES else self.q

    def group_affine(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(s, z [N, K / g] float32, g): W = s levels + z per group of g inputs, as the kernels compute."""
        t = self.type_name
        if t == "MXFP4":  # s = 2^(e - 128): e2m1 = (level - 12) / 2
            exponent = self.scales.to(torch.int32) - (E8M0_BIAS + 1)
            s = torch.ldexp(torch.ones(exponent.shape), exponent)
            return s, -_OFFSETS[t] * s, GROUP
        if t == "NVFP4":  # s = (d / G) / 2, in the kernel's order of fp32 operations
            assert self.mins is not None
            s = ue4m3_to_float(self.scales) / self.mins[:, None] * 0.5
            return s, -_OFFSETS[t] * s, NVFP4_GROUP
        if t in ("Q4_K", "Q5_K"):
            assert self.supers is not None and self.mins is not None
            d, dmin = (self.supers[..., i].float().repeat_interleave(SUPER_BLOCK // GROUP, 1) for i in (0, 1))
            return d * self.scales.float(), -(dmin * self.mins.float()), GROUP
        if t == "Q6_K":
            assert self.supers is not None
            s = self.supers[..., 0].float().repeat_interleave(SUPER_BLOCK // 16, 1) * self.scales.float()
            return s, -_OFFSETS[t] * s, 16
        s = self.scales.float()
        if t == "Q8_0":
            return s, torch.zeros_like(s), GROUP
        z = -_OFFSETS[t] * s if t in _OFFSETS else self.mins.float()  # type: ignore[union-attr]
        return s, z, GROUP

    def dequantize(self) -> torch.Tensor:
        """W [N, K] float32 (the reference the kernels are checked against)."""
        s, z, g = self.group_affine()
        n, k = self.q.shape
        q = self.q.view(torch.int8) if self.type_name == "Q8_0" else self.levels()
        groups = q.float().reshape(n, k // g, g)
        if (
            self.type_name in _OFFSETS
        ):  # s (level - offset): one rounding, as ggml (and compressed-tensors) compute
            return ((groups - _OFFSETS[self.type_name]) * s[..., None]).reshape(n, k)
        return (groups * s[..., None] + z[..., None]).reshape(n, k)


def ue4m3_to_float(d: torch.Tensor) -> torch.Tensor:
    """Unsigned e4m3 bytes (any shape, uint8) -> float32; the sign bit is ignored and 0x7F reads as 0,
    as ggml reads NVFP4 scales."""
    magnitude = d & 0x7F
    value = magnitude.view(torch.float8_e4m3fn).float()
    return torch.where(magnitude == E4M3_NAN, torch.zeros_like(value), value)


def _check_rows(type_name: str, data: torch.Tensor, shape: tuple[int, int], name: str) -> torch.Tensor:
    """data [N, bytes per row] -> [N, K / block, block bytes], checked against the type."""
    n, k = shape
    values, size = _BLOCK_VALUES[type_name], _BLOCK_BYTES[type_name]
    if k % values or tuple(data.shape) != (n, k // values * size):
        raise ModelLoadError(
            f"tensor {name!r}: {type_name} rows of {k} values should be {k // values * size} bytes in "
            f"blocks of {values}; found {list(data.shape)}"
        )
    return data.reshape(n, k // values, size)


def _fp16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] bytes -> [...] float16."""
    return b.contiguous().view(torch.float16).squeeze(-1)


def _nibbles_half_split(qs: torch.Tensor) -> torch.Tensor:
    """[..., h] bytes -> [..., 2h] levels: byte j holds value j (low nibble) and j + h (high)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _bits(packed: torch.Tensor, width: int, per_byte: int) -> torch.Tensor:
    """[..., B] bytes -> [..., per_byte x B]: value s B + j = (byte j >> width s) & mask."""
    shifts = torch.arange(per_byte, dtype=torch.uint8) * width
    return ((packed[..., None, :] >> shifts[:, None]) & ((1 << width) - 1)).flatten(-2)


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 bytes of Q4_K / Q5_K scales [..., 12] -> 6-bit (sc, m) [..., 8] each."""
    d, m, md = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def unpack_ggml(type_name: str, data: torch.Tensor, shape: tuple[int, int], name: str = "?") -> UnpackedGGML:
    """A GGUF tensor's rows (`data` [N, bytes per row] uint8) as levels and fields (module docstring)."""
    if type_name not in KERNEL_TYPES:
        raise ModelLoadError(f"tensor {name!r}: no kernel reads {type_name}")
    blocks = _check_rows(type_name, data, shape, name)
    n, k = shape
    t = type_name
    if t == "Q8_0":
        return UnpackedGGML(t, blocks[..., 2:].reshape(n, k).contiguous(), _fp16(blocks[..., :2]))
    if t == "MXFP4":
        return UnpackedGGML(
            t, _nibbles_half_split(blocks[..., 1:]).reshape(n, k).contiguous(), blocks[..., 0]
        )
    if t == "NVFP4":  # per block of 64: 4 scales, then 4 x 8 bytes, each 16's codes j | j + 8 << 4
        codes = _nibbles_half_split(blocks[..., 4:].reshape(n, k // 64, 4, 8))
        scales = blocks[..., :4].reshape(n, k // NVFP4_GROUP).contiguous()
        return UnpackedGGML(t, codes.reshape(n, k).contiguous(), scales, torch.ones(n))
    if t in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        d = _fp16(blocks[..., 0:2])
        has_min = t.endswith("_1")
        m = _fp16(blocks[..., 2:4]) if has_min else None
        at = 4 if has_min else 2
        q = _nibbles_half_split(blocks[..., -16:])
        if t.startswith("Q5"):
            qh = blocks[..., at : at + 4]
            # _bits orders (bit s, byte j); value 8 j + s is bit s of byte j (qh is a little-endian uint32)
            q = q | (_bits(qh, 1, 8).reshape(n, k // 32, 8, 4).transpose(-1, -2).reshape(n, k // 32, 32) << 4)
        return UnpackedGGML(t, q.reshape(n, k).contiguous(), d, m)
    if t in ("Q4_K", "Q5_K"):
        supers = torch.stack([_fp16(blocks[..., 0:2]), _fp16(blocks[..., 2:4])], -1)
        sc, mn = _k_scales(blocks[..., 4:16])
        q = _nibbles_half_split(blocks[..., -128:].reshape(n, k // 256, 4, 32))  # [N, S, 4 x 64]
        if t == "Q5_K":
            hi = _bits(blocks[..., 16:48], 1, 8)  # value 32 i + j = bit i of byte j
            q = q.reshape(n, k // 256, 256) | (hi << 4)
        return UnpackedGGML(t, q.reshape(n, k).contiguous(), sc.reshape(n, -1), mn.reshape(n, -1), supers)
    # Q6_K
    ql = _nibbles_half_split(blocks[..., 0:128].reshape(n, k // 256, 2, 64))  # [N, S, 2, 128]
    qh = _bits(blocks[..., 128:192].reshape(n, k // 256, 2, 32), 2, 4)  # [N, S, 2, 128]
    q = (ql | (qh << 4)).reshape(n, k)
    sc = blocks[..., 192:208].contiguous().view(torch.int8).reshape(n, -1)
    d = _fp16(blocks[..., 208:210])
    return UnpackedGGML(t, q.contiguous(), sc, None, d[..., None])


def unpack_mxfp4_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> UnpackedGGML:
    """gpt-oss's MXFP4 tensors of one projection (blocks [N, K / 32, 16] uint8, byte j holding codes
    2j (low nibble) and 2j + 1; scales [N, K / 32] e8m0) in the common form."""
    n, groups, half = blocks.shape
    if half != GROUP // 2 or tuple(scales.shape) != (n, groups):
        raise ModelLoadError(
            f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)}: expected [N, K / 32, 16] "
            "and [N, K / 32]"
        )
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).reshape(n, groups * GROUP)
    return UnpackedGGML("MXFP4", codes.contiguous(), scales.contiguous())


def unpack_nvfp4_packed(
    packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor
) -> UnpackedGGML:
    """compressed-tensors' NVFP4 tensors of one projection (packed [N, K / 2] uint8, byte j holding
    codes 2j (low nibble) and 2j + 1; scale [N, K / 16] float8_e4m3fn; global_scale [1] float32) in
    the common form: W = e2m1(q) x scale / global_scale, as compressed-tensors dequantizes."""
    n, half = packed.shape
    k = 2 * half
    if packed.dtype != torch.uint8 or k % GROUP or tuple(scale.shape) != (n, k // NVFP4_GROUP):
        raise ModelLoadError(
            f"NVFP4 weight_packed {list(packed.shape)} {packed.dtype} and weight_scale "
            f"{list(scale.shape)}: expected uint8 [N, K / 2] (K a multiple of {GROUP}) and [N, K / 16]"
        )
    d = scale.contiguous().view(torch.uint8)
    if bool(((d & 0x80) != 0).any()) or bool(((d & 0x7F) == E4M3_NAN).any()):
        raise ModelLoadError("NVFP4 weight_scale holds negative or NaN e4m3 scales")
    g = global_scale.float().reshape(-1)
    if g.numel() != 1 or not bool(torch.isfinite(g).all()) or float(g[0]) <= 0:
        raise ModelLoadError(f"NVFP4 weight_global_scale must be one positive number, got {g.tolist()}")
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(n, k)
    return UnpackedGGML("NVFP4", codes.contiguous(), d, g.expand(n).contiguous())


def select_rows(w: UnpackedGGML, rows: torch.Tensor) -> UnpackedGGML:
    """The projection's output rows `rows` [n] in that order (every field is per row)."""

    def pick(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[rows].contiguous()

    return replace(
        w,
        q=w.q[rows].contiguous(),
        scales=w.scales[rows].contiguous(),
        mins=pick(w.mins),
        supers=pick(w.supers),
    )


def concat_rows(parts: list[UnpackedGGML]) -> UnpackedGGML:
    """Parts of one type stacked along N (a merged q/k/v or gate/up)."""
    first = parts[0]
    if any(p.type_name != first.type_name for p in parts):
        raise ModelLoadError("a merged projection's parts differ in ggml type")

    def cat(field: str) -> torch.Tensor | None:
        values = [getattr(p, field) for p in parts]
        return None if values[0] is None else torch.cat(values)

    q, scales = torch.cat([p.q for p in parts]), torch.cat([p.scales for p in parts])
    return replace(first, q=q, scales=scales, mins=cat("mins"), supers=cat("supers"))


def _tile_rows(p: torch.Tensor, fill: float = 0) -> torch.Tensor:
    """Per-row fields [N, G, *F] -> the tiles' [ceil(N / 16), G, *F, 16] (rows of `fill` padding N)."""
    n = p.shape[0]
    tiles = -(-n // INT4_TILE_ROWS)
    padded = torch.full((tiles * INT4_TILE_ROWS, *p.shape[1:]), fill, dtype=p.dtype)
    padded[:n] = p
    v = padded.reshape(tiles, INT4_TILE_ROWS, *p.shape[1:])
    return v.permute(0, *range(2, v.dim()), 1).contiguous()


def _planes(q: torch.Tensor, plane: int) -> torch.Tensor:
    """Bit 4 + plane of the levels [N, K] -> [T, K / 32, 64]: per 16-row tile and block, bit j of
    byte 4l + i = that bit of q[16t + l, 32b + 4j + i] (gemv_ggml.cpp)."""
    n, k = q.shape
    tiles = -(-n // INT4_TILE_ROWS)
    padded = torch.zeros(tiles * INT4_TILE_ROWS, k, dtype=torch.uint8)
    padded[:n] = (q >> (4 + plane)) & 1
    bits = padded.reshape(tiles, INT4_TILE_ROWS, k // GROUP, 8, 4)  # [t, l, b, j, i]
    weights = (1 << torch.arange(8, dtype=torch.uint8)).reshape(1, 1, 1, 8, 1)
    packed = (bits * weights).sum(dim=3, dtype=torch.uint8)  # [t, l, b, i]
    return packed.permute(0, 2, 1, 3).reshape(tiles, k // GROUP, 64).contiguous()


@dataclass(frozen=True)
class GgmlTiles:
    """The kernels' operands (gemv_int8.cpp / gemv_ggml.cpp layouts)."""

    values: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor
    supers: torch.Tensor


def pack_ggml_tiles(w: UnpackedGGML) -> GgmlTiles:
    n, k = w.q.shape
    if w.type_name == "Q8_0":
        return GgmlTiles(pack_int8_tiles(w.q.view(torch.int8)), _tile_rows(w.scales), EMPTY, EMPTY)
    tiles = -(-n // INT4_TILE_ROWS)
    nibbles = pack_int4_tiles(w.q & 0x0F).reshape(tiles, k // GROUP, 256)
    values = torch.cat([nibbles, *(_planes(w.q, p) for p in range(_PLANES[w.type_name]))], dim=-1)
    if w.type_name == "NVFP4":  # the kernel's row factor 128 / G (gemv_ggml.cpp); padding rows 1
        assert w.mins is not None
        mins = _tile_rows(NVFP4_ROW_FACTOR / w.mins, fill=1)
    else:
        mins = EMPTY if w.mins is None else _tile_rows(w.mins)
    supers = EMPTY if w.supers is None else _tile_rows(w.supers)
    return GgmlTiles(values.contiguous(), _tile_rows(w.scales), mins, supers)


class GGUFLinear(nn.Module):
    """y = x @ W^T (+ bias), W a GGUF block type, bf16 activations (module docstring)."""

    values: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor
    supers: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, weight: UnpackedGGML, bias: torch.Tensor | None, kernels: GgmlKernels) -> None:
        super().__init__()
        self.type_name = weight.type_name
        self.ggml_type = GGML_TYPE_IDS[weight.type_name]
        self.out_features, self.in_features = weight.q.shape
        self._kernels = kernels
        self.max_gemv_rows = native_gemv_max_rows()
        tiles = pack_ggml_tiles(weight)
        # The tiles are read in full every decode step: on huge pages (kvflow/kernels/huge_pages.cpp).
        self.register_buffer("values", on_huge_pages(tiles.values))
        self.register_buffer("scales", tiles.scales)
        self.register_buffer("mins", tiles.mins)
        self.register_buffer("supers", tiles.supers)
        self.register_buffer("bias", None if bias is None else bias.to(torch.bfloat16))

    def _dequantize_rows(self, n0: int, n1: int) -> torch.Tensor:
        if self.type_name == "Q8_0":
            return self._kernels.dequantize_q8_0(
                self.values, self.scales, self.in_features, self.out_features, n0, n1
            )
        args = (self.values, self.scales, self.mins, self.supers, self.out_features, n0, n1)
        return self._kernels.dequantize(self.ggml_type, *args)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        x = x.to(torch.bfloat16)
        if x.shape[0] <= self.max_gemv_rows:
            if self.type_name == "Q8_0":
                return self._kernels.q8_0(x, self.values, self.scales, self.out_features, self.bias)
            args = (self.values, self.scales, self.mins, self.supers, self.out_features, self.bias)
            return self._kernels.gemv(x, self.ggml_type, *args)
        blocks = _row_blocks(self.out_features, self.in_features, INT4_TILE_ROWS)
        return _gemm_over_tiles(x, (self._dequantize_rows(n0, n1) for n0, n1 in blocks), self.bias)

    def native(self, classes: NativeDecoderClasses) -> Any | None:
        """This layer for the native decode forward (the same kernels as `forward`)."""
        return classes.linear.ggml(
            self.ggml_type, self.values, self.scales, self.mins, self.supers, self.in_features,
            self.out_features, self.bias, self.max_gemv_rows,
        )  # fmt: skip

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, GGUF {self.type_name}"
