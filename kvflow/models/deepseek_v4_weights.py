"""DeepSeek-V4's quantized checkpoint tensors, as the released checkpoints store them.

quantization_config {quant_method: fp8, weight_block_size: [bn, bk], scale_fmt: ue8m0, expert_dtype:
fp4} (V4.1 carries expert_dtype inside quantization_config; V4 beside it, as transformers reads both):
    FP8 projections  `X.weight` float8_e4m3fn [N, K] and its block scales `X.scale` (DeepSeek's own
                     name; `X.weight_scale_inv` in transformers' save) [ceil(N / bn), ceil(K / bk)],
                     float8_e8m0fnu (scale_fmt ue8m0: 2^(e - 127)) or float32:
                     W = e4m3(w) x s[n // bn, k // bk]  (kvflow/quant/fp8.py, Fp8Linear)
    FP4 experts      `X.weight` int8 [N, K / 2], byte j holding the e2m1 codes of inputs 2j (low
                     nibble) and 2j + 1, and `X.scale` [N, K / 32] (one scale per 32 inputs of a row):
                     W = e2m1(code) x s, i.e. MXFP4 (kvflow/quant/gguf_linear.py's GGUFLinear on the
                     codes, 4.25 bits per weight)
as transformers' Fp8Dequantize reads them (its FP4 path: int8 storage, the scale grid's shape gives
the block). A tensor is quantized when such a scale sits beside it; which projections are is the
checkpoint's choice (the release: attention and shared experts FP8, routed experts FP4).
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass

import torch

from kvflow.errors import ModelLoadError
from kvflow.quant.checkpoint_formats import CheckpointQuant
from kvflow.quant.fp8 import FP8_DTYPE, UnpackedFp8, unpack_fp8_block
from kvflow.quant.gguf_linear import E8M0_BIAS, GROUP, UnpackedGGML

SCALE_SUFFIXES = ("scale", "weight_scale_inv")  # DeepSeek's own name, transformers' save
FP4_STORAGE = (torch.int8, torch.uint8)


@dataclass(frozen=True)
class V4Quantized:
    """The block shape of the checkpoint's FP8 projections (quantization_config)."""

    block_rows: int
    block_cols: int

    @classmethod
    def from_quant(cls, quant: CheckpointQuant | None) -> V4Quantized | None:
        if quant is None:
            return None
        if quant.method != "fp8":
            raise ModelLoadError(
                f"DeepSeek-V4 checkpoints quantized as {quant.method!r}: kvflow reads V4's own format "
                "(quant_method fp8 with weight_block_size, FP4 experts)"
            )
        return cls(quant.block_rows, quant.group_size)


def scale_of(source: str, available: Container[str]) -> str | None:
    """The scale tensor stored beside `source` (a `.weight`), or None when it is not quantized."""
    base = source.removesuffix(".weight")
    return next((f"{base}.{s}" for s in SCALE_SUFFIXES if f"{base}.{s}" in available), None)


def _scale_float(scale: torch.Tensor) -> torch.Tensor:
    """Block scales as float32 multipliers: e8m0 (or its bytes stored as uint8) -> 2^(e - 127)."""
    if scale.dtype == torch.uint8:
        return torch.ldexp(torch.ones(scale.shape), scale.to(torch.int32) - E8M0_BIAS)
    return scale.float()


def _e8m0_bytes(scale: torch.Tensor, name: str) -> torch.Tensor:
    """Per-32 FP4 scales as e8m0 exponent bytes (the MXFP4 kernel's); float32 scales must be powers
    of two (they are, in every ue8m0 checkpoint: a float32 copy of one)."""
    if scale.dtype == torch.float8_e8m0fnu:
        return scale.view(torch.uint8).contiguous()
    if scale.dtype == torch.uint8:
        return scale.contiguous()
    mantissa, exponent = torch.frexp(scale.float())
    if not bool((mantissa == 0.5).all()):
        raise ModelLoadError(
            f"{name}: FP4 expert scales must be powers of two (e8m0), got {scale.dtype} values"
        )
    return (exponent - 1 + E8M0_BIAS).clamp(0, 254).to(torch.uint8)


def unpack_v4(
    weight: torch.Tensor, scale: torch.Tensor, layout: V4Quantized, name: str
) -> UnpackedFp8 | UnpackedGGML:
    """One quantized projection's tensors in kvflow's common forms (module docstring)."""
    if weight.dtype == FP8_DTYPE:
        try:
            return unpack_fp8_block(
                {"weight": weight, "weight_scale_inv": _scale_float(scale)},
                layout.block_rows,
                layout.block_cols,
            )
        except ModelLoadError as exc:
            raise ModelLoadError(f"{name}: {exc}") from exc
    if weight.dtype in FP4_STORAGE:
        n, half = weight.shape
        k = 2 * half
        if k % GROUP or tuple(scale.shape) != (n, k // GROUP):
            raise ModelLoadError(
                f"{name}: FP4 weight {list(weight.shape)} (2 codes per byte) needs scales "
                f"[{n}, {k // GROUP}] (one per {GROUP} inputs), got {list(scale.shape)}"
            )
        packed = weight.contiguous().view(torch.uint8)
        codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(n, k)
        return UnpackedGGML("MXFP4", codes.contiguous(), _e8m0_bytes(scale, name))
    raise ModelLoadError(
        f"{name}: a scale sits beside a {weight.dtype} weight (FP8 e4m3 or FP4 in int8 expected)"
    )
