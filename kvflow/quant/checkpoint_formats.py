"""Pre-quantized checkpoints: GPTQ, AWQ (GEMM) and compressed-tensors pack-quantized, unpacked into
one form kvflow's kernels take. Detected from `quantization_config` in config.json.

The common form of a 4-bit projection [N out, K in] with groups of g inputs:
    q [N, K] integer levels 0..15, scale [N, K/g], min [N, K/g]:   w = q x scale + min
    perm [K] or None: with act-order (GPTQ desc_act), groups are contiguous only after the input
    features are permuted; the layer then computes x[:, perm] @ w_perm^T.
8-bit per-channel projections: q [N, K] int8 (signed), scale [N]: w = q x scale.

Formats (each unpacking is checked against the reference library in tests/quant):
    GPTQ       qweight int32 [K/8, N]: level of input k = row 8r + j sits in bits 4j..4j+3 of row r
               qzeros int32 [G, N/8]: same packing along N; scales [G, N]; g_idx [K] (group of k).
               w[n, k] = (q - z[g_idx[k], n]) x s[g_idx[k], n]; the original (v1) checkpoint format
               stores z - 1, so z = stored + 1 (gptqmodel's "v1 -> v2" conversion).
    AWQ GEMM   qweight int32 [K, N/8] packed along N in the interleaved order 0 2 4 6 1 3 5 7;
               qzeros int32 [G, N/8] likewise; scales [G, N]; w[k, n] = (q - z) x s.
    compressed-tensors pack-quantized
               weight_packed int32 [N, K x bits / 32], element j of a word at bits j x bits, stored
               as q + 2^(bits-1); weight_scale [N, G] (group) or [N, 1] (channel);
               optional weight_zero_point int32 [N x bits / 32, G] (packed along N, + 2^(bits-1));
               w = (q - zp) x scale.
    compressed-tensors nvfp4-pack-quantized (NVFP4, llm-compressor's NVFP4 and NVFP4A16 schemes)
               weight_packed uint8 [N, K / 2] of e2m1 codes, weight_scale float8_e4m3fn [N, K / 16],
               weight_global_scale [1]: w = e2m1 x scale / global_scale, kept on its codes
               (kvflow/quant/gguf_linear.py, unpack_nvfp4_packed). Weight-only here: a W4A4
               checkpoint's input_global_scale is not used (activations stay bf16), as vLLM runs
               NVFP4 on GPUs without FP4 arithmetic.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from kvflow.errors import ModelLoadError
from kvflow.quant.fp8 import UnpackedFp8, unpack_fp8_block, unpack_fp8_channel
from kvflow.quant.gguf_linear import NVFP4_GROUP, UnpackedGGML, unpack_nvfp4_packed

AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # position j of a word holds column AWQ_PACK_ORDER[j]
BITS_PER_WORD = 32


@dataclass(frozen=True)
class CheckpointQuant:
    method: str  # "gptq", "awq", "compressed-tensors"
    bits: int
    group_size: int  # -1: one group per row (per channel)
    symmetric: bool
    desc_act: bool = False
    gptq_v1: bool = True  # GPTQ's zeros stored minus one (AutoGPTQ's original format)
    block_rows: int = 1  # fp8 block scales: output rows per block (weight_block_size[0])


@dataclass(frozen=True)
class UnpackedInt4:
    q: torch.Tensor  # [N, K] int32 levels 0..15 (after `perm`)
    scale: torch.Tensor  # [N, K / g] float32
    min: torch.Tensor  # [N, K / g] float32
    group_size: int
    perm: torch.Tensor | None  # [K] int64 input order, or None

    def dequantize(self) -> torch.Tensor:
        """[N, K] in the checkpoint's input order."""
        n, k = self.q.shape
        groups = self.q.reshape(n, k // self.group_size, self.group_size).float()
        w = (groups * self.scale[..., None] + self.min[..., None]).reshape(n, k)
        if self.perm is None:
            return w
        out = torch.empty_like(w)
        out[:, self.perm] = w
        return out


@dataclass(frozen=True)
class UnpackedInt8:
    q: torch.Tensor  # [N, K] int8
    scale: torch.Tensor  # [N] float32

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.scale[:, None]


def parse_quantization_config(config: Mapping[str, Any]) -> CheckpointQuant | None:
    qc = config.get("quantization_config")
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method == "gptq":
        fmt = str(qc.get("checkpoint_format", "gptq")).lower()
        return CheckpointQuant(
            "gptq", int(qc["bits"]), int(qc.get("group_size", -1)), bool(qc.get("sym", True)),
            bool(qc.get("desc_act", False)), gptq_v1=fmt != "gptq_v2",
        )  # fmt: skip
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ModelLoadError(f"AWQ version {version!r} is not supported (GEMM packing only)")
        bits = int(qc.get("w_bit", qc.get("bits", 4)))
        group_size = int(qc.get("q_group_size", qc.get("group_size", -1)))
        return CheckpointQuant("awq", bits, group_size, symmetric=not qc.get("zero_point", True))
    if method == "compressed-tensors":
        return _compressed_tensors_config(qc)
    if method == "fp8":  # DeepSeek's and Qwen3-FP8's block-scaled e4m3 (kvflow/quant/fp8.py)
        fmt = str(qc.get("fmt", "e4m3")).lower()
        block = qc.get("weight_block_size")
        if fmt != "e4m3" or not block or len(block) != 2:
            raise ModelLoadError(
                f"quantization_config fp8: fmt {fmt!r}, weight_block_size {block!r}: kvflow reads e4m3 "
                "weights with [rows, cols] block scales"
            )
        return CheckpointQuant("fp8", 8, int(block[1]), True, block_rows=int(block[0]))
    if method == "mxfp4":  # gpt-oss's experts (kvflow/models/gpt_oss.py reads them); the rest is bf16
        return CheckpointQuant("mxfp4", 4, 32, True)
    raise ModelLoadError(
        f"quantization_config.quant_method {method!r} is not supported (gptq, awq, compressed-tensors, fp8, "
        "mxfp4)"
    )


def _compressed_tensors_config(qc: Mapping[str, Any]) -> CheckpointQuant:
    fmt = qc.get("format")
    if fmt not in ("pack-quantized", "float-quantized", "nvfp4-pack-quantized"):
        raise ModelLoadError(
            f"compressed-tensors format {fmt!r} is not supported (pack-quantized, float-quantized, "
            "nvfp4-pack-quantized)"
        )
    groups = list((qc.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise ModelLoadError(
            "compressed-tensors: exactly one config group (all linear layers alike) is supported"
        )
    weights = groups[0]["weights"]
    if fmt == "nvfp4-pack-quantized":
        group_size = int(weights.get("group_size") or 0)
        if (
            weights.get("type") != "float"
            or int(weights.get("num_bits", 0)) != 4
            or group_size != NVFP4_GROUP
        ):
            raise ModelLoadError(
                "compressed-tensors nvfp4-pack-quantized: "
                f"{weights.get('num_bits')}-bit {weights.get('type')} weights in groups of {group_size} "
                f"are not NVFP4 (4-bit float, groups of {NVFP4_GROUP})"
            )
        return CheckpointQuant("compressed-tensors-nvfp4", 4, NVFP4_GROUP, True)
    if fmt == "float-quantized":  # FP8 e4m3 per channel or per tensor (kvflow/quant/fp8.py)
        strategy = weights.get("strategy", "channel")
        if (
            weights.get("type") != "float"
            or int(weights.get("num_bits", 0)) != 8
            or strategy
            not in (
                "channel",
                "tensor",
            )
        ):
            raise ModelLoadError(
                f"compressed-tensors float-quantized: {weights.get('num_bits')}-bit {weights.get('type')} "
                f"weights by {strategy!r} are not supported (8-bit float, channel or tensor)"
            )
        return CheckpointQuant("compressed-tensors-fp8", 8, -1, True)
    strategy = weights.get("strategy", "group")
    group_size = int(weights["group_size"]) if strategy == "group" else -1
    return CheckpointQuant(
        "compressed-tensors", int(weights["num_bits"]), group_size, bool(weights["symmetric"])
    )


# ----------------------------------------------------------------------------------- unpacking


def unpack_int32_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """[R, C] int32 -> [R * 32/bits, C]: element j of each word becomes row r * (32/bits) + j."""
    per_word = BITS_PER_WORD // bits
    shifts = torch.arange(0, BITS_PER_WORD, bits, dtype=torch.int32)
    levels = (packed[:, None, :] >> shifts[None, :, None]) & ((1 << bits) - 1)
    return levels.reshape(packed.shape[0] * per_word, packed.shape[1])


def unpack_int32_cols(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """[R, C] int32 -> [R, C * 32/bits]: element j of each word becomes column c * (32/bits) + j."""
    return unpack_int32_rows(packed.t().contiguous(), bits).t().contiguous()


def _to_common_int4(
    q_nk: torch.Tensor, zero_gn: torch.Tensor, scale_gn: torch.Tensor, g_idx: torch.Tensor
) -> UnpackedInt4:
    """q [N, K], zero and scale [G, N] indexed by g_idx [K] -> the common form (w = q s + min)."""
    k = q_nk.shape[1]
    num_groups = scale_gn.shape[0]
    group_size = k // num_groups
    contiguous = torch.equal(g_idx, torch.arange(k) // group_size)
    perm = None if contiguous else torch.argsort(g_idx, stable=True)
    q = q_nk if perm is None else q_nk[:, perm]
    scale = scale_gn.t().float().contiguous()  # [N, G]
    return UnpackedInt4(q.to(torch.int32).contiguous(), scale, -zero_gn.t().float() * scale, group_size, perm)


def unpack_gptq(tensors: Mapping[str, torch.Tensor], quant: CheckpointQuant) -> UnpackedInt4:
    if quant.bits != 4:
        raise ModelLoadError(f"GPTQ with {quant.bits} bits is not supported (4 only)")
    q = unpack_int32_rows(tensors["qweight"], 4).t()  # [N, K]
    zeros = unpack_int32_cols(tensors["qzeros"], 4)[:, : q.shape[0]]  # [G, N]
    if quant.gptq_v1:
        zeros = zeros + 1
    k = q.shape[1]
    group_size = quant.group_size if quant.group_size > 0 else k
    g_idx = tensors.get("g_idx")
    g_idx = torch.arange(k) // group_size if g_idx is None else g_idx.long()
    return _to_common_int4(q, zeros, tensors["scales"], g_idx)


def unpack_awq(tensors: Mapping[str, torch.Tensor], quant: CheckpointQuant) -> UnpackedInt4:
    if quant.bits != 4:
        raise ModelLoadError(f"AWQ with {quant.bits} bits is not supported (4 only)")
    order = torch.tensor(AWQ_PACK_ORDER)
    inverse = torch.argsort(order)  # word position holding column j of the group of 8

    def cols(packed: torch.Tensor) -> torch.Tensor:
        raw = unpack_int32_cols(packed, 4)  # [R, C * 8] in packing order
        r, c8 = raw.shape
        return raw.reshape(r, c8 // 8, 8)[:, :, inverse].reshape(r, c8)

    q_kn = cols(tensors["qweight"])  # [K, N]
    zeros = cols(tensors["qzeros"])  # [G, N]
    k = q_kn.shape[0]
    return _to_common_int4(q_kn.t(), zeros, tensors["scales"], torch.arange(k) // (k // zeros.shape[0]))


def unpack_compressed_tensors(
    tensors: Mapping[str, torch.Tensor], quant: CheckpointQuant
) -> UnpackedInt4 | UnpackedInt8:
    k = int(tensors["weight_shape"][1])
    offset = 1 << (quant.bits - 1)
    levels = unpack_int32_cols(tensors["weight_packed"], quant.bits)[:, :k]  # [N, K] unsigned
    scale = tensors["weight_scale"].float()  # [N, G]
    zp = tensors.get("weight_zero_point")
    zero_point = torch.zeros_like(scale)
    if zp is not None:  # asymmetric: packed along the output dim (packed_dim=0), stored + offset
        n = scale.shape[0]
        zero_point = (unpack_int32_rows(zp, quant.bits)[:n] - offset).float()
    if quant.bits == 8:
        if scale.shape[1] != 1 or zp is not None:
            raise ModelLoadError("compressed-tensors 8-bit weights: only symmetric per-channel is supported")
        return UnpackedInt8((levels - offset).to(torch.int8), scale[:, 0].contiguous())
    if quant.bits != 4:
        raise ModelLoadError(f"compressed-tensors with {quant.bits} bits is not supported (4 or 8)")
    num_groups = scale.shape[1]
    # w = (u - offset - zp) x scale with u the stored unsigned level: min = -(offset + zp) x scale.
    g_idx = torch.arange(k) // (k // num_groups)
    return _to_common_int4(levels, (offset + zero_point).t(), scale.t(), g_idx)


def _unpack_fp8_block(tensors: Mapping[str, torch.Tensor], quant: CheckpointQuant) -> UnpackedFp8:
    return unpack_fp8_block(tensors, quant.block_rows, quant.group_size)


def _unpack_fp8_channel(tensors: Mapping[str, torch.Tensor], quant: CheckpointQuant) -> UnpackedFp8:
    return unpack_fp8_channel(tensors)


def _unpack_nvfp4(tensors: Mapping[str, torch.Tensor], quant: CheckpointQuant) -> UnpackedGGML:
    return unpack_nvfp4_packed(
        tensors["weight_packed"], tensors["weight_scale"], tensors["weight_global_scale"]
    )


Unpacked = UnpackedInt4 | UnpackedInt8 | UnpackedFp8 | UnpackedGGML
UNPACKERS: dict[str, Callable[[Mapping[str, torch.Tensor], CheckpointQuant], Unpacked]] = {
    "gptq": unpack_gptq,
    "awq": unpack_awq,
    "compressed-tensors": unpack_compressed_tensors,
    "fp8": _unpack_fp8_block,
    "compressed-tensors-fp8": _unpack_fp8_channel,
    "compressed-tensors-nvfp4": _unpack_nvfp4,
}
# The checkpoint tensors of one quantized projection, by format (suffixes after "<proj>.").
TENSOR_SUFFIXES = {
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "awq": ("qweight", "qzeros", "scales"),
    "compressed-tensors": ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape"),
    # fp8: the scale first, since it marks a quantized projection (every projection has a `weight`).
    "fp8": ("weight_scale_inv", "weight"),
    "compressed-tensors-fp8": ("weight_scale", "weight"),
    # input_global_scale: a W4A4 checkpoint's activation scale, read as used and not applied (above).
    "compressed-tensors-nvfp4": (
        "weight_packed",
        "weight_scale",
        "weight_global_scale",
        "input_global_scale",
    ),
}
