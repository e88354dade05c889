"""Dense linear layer with CPU fast paths for bfloat16, chosen per call by the number of rows.

Measured on this 2-core AVX512-BF16 EPYC (benchmarks/NOTES.md), weights streamed per step:
- M <= 4 rows (single-stream decode, and its speculative verification of k <= 3 drafts): kvflow's
  AVX512-BF16 GEMV (kvflow/kernels) reads the plain [out, in] weight as one sequential stream:
  1.3x oneDNN's M=1 path, which stalls near 26 GB/s whatever the machine's bandwidth, equal at
  M=3, 0.9x at M=4. The GEMV is batch-invariant (a row's sum does not depend on the other rows),
  so verifying 4 tokens gives bit for bit the logits of decoding them one by one: that, not speed,
  is why M=3-4 stay on it (measured on the 0.5B shapes, benchmarks/NOTES.md).
- M > 4 (batched decode, prefill chunks): oneDNN matmul on a weight reordered once into its
  blocked layout (`torch.ops.mkldnn._reorder_linear_weight`): 2x `F.linear` at M=4..8, 1.3x at
  M=64, equal from M~256.
With both paths the weight is held twice (plain + blocked); without the native kernel only the
blocked copy is kept. float32/float16 keep `F.linear`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvflow.kernels import NativeDecoderClasses, SkinnyLinear, skinny_linear_bf16

# Up to this many rows the native GEMV runs (module docstring: faster to M=2, batch-invariant to 4).
SKINNY_MAX_ROWS = 4


def _onednn_bf16_available() -> bool:
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")


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
        self._packed_weight: torch.Tensor | None = None
        self._skinny: SkinnyLinear | None = None

    def prepare_for_inference(self) -> None:
        """Pick the bf16 kernels once the weights are loaded (see the module docstring)."""
        if self.weight.dtype != torch.bfloat16 or self.weight.is_meta or not _onednn_bf16_available():
            return
        self._packed_weight = torch.ops.mkldnn._reorder_linear_weight(self.weight.data)
        self._skinny = skinny_linear_bf16()
        if self._skinny is None:  # only the blocked copy is read: drop the plain one
            self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        if self._skinny is not None and x.shape[0] <= SKINNY_MAX_ROWS:
            return self._skinny(x, self.weight, self.bias)
        if self._packed_weight is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed_weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def native(self, classes: NativeDecoderClasses) -> Any | None:
        """This layer for the native decode forward (kvflow/kernels/decode_forward.cpp), or None when
        it runs only in torch (not bf16, or a kernel missing): the same kernels as `forward`."""
        if self._skinny is None or self._packed_weight is None:
            return None
        return classes.linear.bf16(self.weight, self._packed_weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"
