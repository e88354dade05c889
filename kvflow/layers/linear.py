"""Dense linear layer with a CPU fast path for bfloat16 decode.

Measured on this 2-core AVX-512-BF16 EPYC (benchmarks/NOTES.md): a bf16 GEMV through `F.linear`
reads weights at a fraction of memory bandwidth, while oneDNN's matmul on a weight reordered once
into its blocked layout (`torch.ops.mkldnn._reorder_linear_weight`) runs close to it. The reorder
is done once at load time (`prepare_for_inference`); the plain weight is then dropped so the
model's memory is not doubled.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _onednn_bf16_available() -> bool:
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class Linear(nn.Module):
    """y = x @ W^T + b with W: [out_features, in_features] (the Hugging Face layout)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias: nn.Parameter | None = (
            nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None
        )
        self._packed_weight: torch.Tensor | None = None

    def prepare_for_inference(self) -> None:
        """Reorder a bf16 weight for oneDNN once; other dtypes keep `F.linear` (MKL), measured faster."""
        if self.weight.dtype != torch.bfloat16 or not _onednn_bf16_available() or self.weight.is_meta:
            return
        self._packed_weight = torch.ops.mkldnn._reorder_linear_weight(self.weight.data)
        # The packed copy is the only one the forward reads: drop the plain one (keep the shape).
        self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in] -> [..., out]
        if self._packed_weight is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed_weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"
