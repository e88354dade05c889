"""Dense linear layer with CPU fast paths for bfloat16, chosen per call by the number of rows.

Measured on this 2-core AVX512-BF16 EPYC (benchmarks/NOTES.md), weights streamed per step:
- M <= 32 rows (decode: single stream, batches of up to 32 sequences, or speculative verification
  of k drafts for up to 32 / (k + 1) sequences): kvflow's AVX512-BF16 GEMV
  (kvflow/kernels/gemv_bf16.cpp) on the weights re-laid once in tiles of 16 output rows, so that
  one vdpbf16ps per 64 bytes of weights and activation row feeds 16 outputs with no horizontal
  sums. At M = 1 it streams at the memory's pace; up to 8 rows share one pass, and further passes
  re-read the tile from L1/L2, not DRAM. Over the 96 layer matrices of the Qwen2.5-0.5B shape it
  takes 0.86x oneDNN's time at M = 12-16, 0.93x at 24, 0.97x at 32, 1.03x at 40 (NOTES.md). It is
  batch-invariant (a row's sum does not depend on the other rows), so verifying drafts gives bit
  for bit the logits of decoding them one by one.
- M > 32 (prefill chunks, large batches): oneDNN matmul on a weight reordered once into its
  blocked layout (`torch.ops.mkldnn._reorder_linear_weight`): 950 GFLOP/s from M ~ 256, the
  machine's vdpbf16ps peak.
- Where oneDNN runs that matmul on AMX tiles (Sapphire / Granite Rapids), it takes over past
  AMX_SKINNY_MAX_ROWS = 8 rows. Measured on a 2-core AMX Xeon VM (NOTES.md, session 16),
  24 layers' weights streamed, GEMV / oneDNN time: gate_up 0.72x at M = 1, 0.79x at 4, 1.05x at 8,
  2.0x at 16, 3.0x at 32 (down and qkv alike). There the GEMV's 8-row pass is bound by vdpbf16ps
  (~1.4 G/s per core: ~11 GB/s of weights per core at 8 rows), which AMX is not.
Both copies are held (tiles + blocked: twice the model's bf16 bytes), the plain one is dropped.
Without the native kernels only the blocked copy is kept; float32/float16 keep `F.linear`.

On an AVX2 CPU (no AVX-512: Zen 2/3, Intel client cores) the GEMV is the same source built over
256-bit registers (kvflow/kernels/avx512_on_avx2.h), and oneDNN has no bf16 GEMM, so the plain
weight stays in place of the blocked copy and rows past the GEMV's limit are multiplied in fp32
(kvflow/layers/bf16_gemm.py).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvflow.kernels import NativeDecoderClasses, SkinnyLinear, on_huge_pages, skinny_linear_bf16
from kvflow.layers.bf16_gemm import bf16_linear, onednn_amx_bf16, onednn_bf16_gemm

# Up to this many rows the native GEMV runs (module docstring; kvflow/kernels/gemv_bf16.cpp kMaxRows).
SKINNY_MAX_ROWS = 32
# The same limit where oneDNN's GEMM runs on AMX tiles (module docstring).
AMX_SKINNY_MAX_ROWS = 8
# A row limit of "every row": batch-invariant mode runs all rows through the row-invariant GEMVs.
ALL_ROWS = sys.maxsize


def skinny_max_rows() -> int:
    """Rows up to which a bf16 linear runs the native GEMV on this CPU (module docstring)."""
    return AMX_SKINNY_MAX_ROWS if onednn_amx_bf16() else SKINNY_MAX_ROWS


class Linear(nn.Module):
    """y = x @ W^T + b with W: [out_features, in_features] (the Hugging Face layout); x: [T, in]."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias: nn.Parameter | None = (
            nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None
        )
        # The copy rows past the GEMV read: oneDNN's blocked one (_gemm_blocked), or the plain weight
        # where oneDNN has no bf16 GEMM. Held outside the module's tensors, so that those count the
        # bytes decode reads (the tiles) once.
        self._gemm_weight: torch.Tensor | None = None
        self._gemm_blocked = False
        self._skinny: SkinnyLinear | None = None
        # Rows up to which the GEMV runs; ALL_ROWS in batch-invariant mode (set_batch_invariant).
        self.max_gemv_rows = skinny_max_rows()
        # [out_pad / 16, in / 2, 16, 2] for the GEMV; a buffer (not in the state dict) so that the
        # module's tensors count the bytes decode reads.
        self._tiles: torch.Tensor | None
        self.register_buffer("_tiles", None, persistent=False)

    def prepare_for_inference(self) -> None:
        """Lay the bf16 weights out for their kernels once they are loaded (module docstring); the
        plain copy is dropped, as no path reads it afterwards."""
        if self.weight.dtype != torch.bfloat16 or self.weight.is_meta:
            return
        native = skinny_linear_bf16() if self.in_features % 2 == 0 else None
        if native is not None:
            self._skinny, tile = native
            self._tiles = on_huge_pages(tile(self.weight.data))  # read in full every decode step
        if onednn_bf16_gemm():
            self._gemm_weight = torch.ops.mkldnn._reorder_linear_weight(self.weight.data)
            self._gemm_blocked = True
        elif self._tiles is not None:
            self._gemm_weight = self.weight.data  # multiplied in fp32 (kvflow/layers/bf16_gemm.py)
        else:
            return  # no kernel and no bf16 GEMM: the plain weight stays the only copy
        self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        if self._skinny is not None and self._tiles is not None and x.shape[0] <= self.max_gemv_rows:
            return self._skinny(x, self._tiles, self.out_features, self.bias)
        if self._gemm_blocked:
            return torch.ops.mkldnn._linear_pointwise(x, self._gemm_weight, self.bias, "none", [], "")
        weight = self.weight if self._gemm_weight is None else self._gemm_weight
        if weight.dtype == torch.bfloat16:
            return bf16_linear(x, weight, self.bias)
        return F.linear(x, weight, self.bias)

    def native(self, classes: NativeDecoderClasses) -> Any | None:
        """This layer for the native decode forward (kvflow/kernels/decode_forward.cpp), or None when
        it runs only in torch (not bf16, or a kernel missing): the same kernels as `forward`."""
        if self._tiles is None or self._gemm_weight is None:
            return None
        return classes.linear.bf16(
            self._tiles,
            self._gemm_weight,
            self._gemm_blocked,
            self.out_features,
            self.bias,
            self.max_gemv_rows,
        )

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"
