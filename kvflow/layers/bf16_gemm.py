"""The GEMM of many bf16 rows (prefill chunks, large batches) where the CPU has no bf16 GEMM.

oneDNN multiplies bf16 natively on AVX512-BF16 / AMX / AVX-NE-CONVERT CPUs (and emulates it on
AVX-512 cores). On an AVX2 CPU (Zen 2/3, Intel client cores) it cannot even reorder a bf16
weight, and torch's own bf16 matmul runs at ~18 GFLOP/s there, against ~85-90 for fp32 on the same
two cores (benchmarks/NOTES.md, "AVX2"). So without a native bf16 GEMM, rows past the GEMV's limit
are multiplied in fp32: activations and the weight (or its row block) widened, the product rounded
back to bf16. bf16 -> fp32 is exact, and the GEMMs accumulate in fp32 either way.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch
import torch.nn.functional as F


@functools.cache
def onednn_bf16_gemm() -> bool:
    """Whether oneDNN has a bf16 GEMM on this CPU (and can reorder weights for it)."""
    return (
        bool(torch.backends.mkldnn.is_available())
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    )


@functools.cache
def onednn_amx_bf16() -> bool:
    """Whether oneDNN's bf16 GEMM runs on AMX tiles here (Sapphire / Granite Rapids): 16 x 32 bf16
    products per instruction, so that it overtakes the vdpbf16ps GEMV from a few rows on."""
    return onednn_bf16_gemm() and bool(torch.cpu._is_amx_tile_supported())


def bf16_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, in] bf16 @ weight [out, in] bf16 (+ bias) -> [T, out] bf16, on the CPU's fast GEMM."""
    if onednn_bf16_gemm():
        return F.linear(x, weight, bias)
    y = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    return y.to(x.dtype)


def bf16_linear_blocks(x: torch.Tensor, weights: Iterable[torch.Tensor]) -> torch.Tensor:
    """x [T, in] bf16 times each bf16 row block [rows_i, in] as it is produced -> [T, sum rows_i] bf16,
    the blocks' outputs side by side: bf16_linear per block, with x widened once, not per block."""
    if onednn_bf16_gemm():
        parts = [F.linear(x, w) for w in weights]
    else:
        x_wide = x.float()
        parts = [F.linear(x_wide, w.float()).to(x.dtype) for w in weights]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
