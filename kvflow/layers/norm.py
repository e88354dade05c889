"""RMSNorm as Llama/Qwen define it: y = weight * x / sqrt(mean(x^2) + eps).

One fused `F.rms_norm` call with the weight: torch computes in float32 internally and rounds once.
In float32 it is bit-identical to HF's chain (pow, mean, rsqrt, multiply, then weight *), since
(x * r) * w == w * (x * r); in bf16 HF rounds the normalised x before the weight multiply and kvflow
does not (at most one bf16 ulp apart), for 1 pass over the activations instead of 4.
bf16 token rows [T, hidden] go to kvflow's native kernel (kvflow/kernels/elementwise.cpp; the same
arithmetic, one pass; the native decode forward calls it too, so both paths agree bit for bit); ATen's
chain of small ops cost ~66 us a call there. Qwen3's per-head norms ([T, heads, head_dim]) stay on
F.rms_norm on both paths.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvflow.kernels import elementwise_kernels


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.eps = eps
        self.hidden_size = hidden_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., hidden] -> same
        native = elementwise_kernels()
        if native is not None and x.dtype == torch.bfloat16 and x.dim() == 2 and x.stride(-1) == 1:
            return native.rms_norm(x, self.weight, self.eps)
        return F.rms_norm(x, (self.hidden_size,), self.weight, self.eps)
