"""RMSNorm as Llama/Qwen define it: normalise in float32, cast back, then scale (HF order).

y = weight * (x / sqrt(mean(x^2) + eps)).to(x.dtype); the normalisation runs in torch's fused
`F.rms_norm` (bit-identical in float32 to HF's pow/mean/rsqrt chain, one kernel instead of four).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.eps = eps
        self.hidden_size = hidden_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., hidden] -> same
        normed = F.rms_norm(x.float(), (self.hidden_size,), eps=self.eps)
        return self.weight * normed.to(x.dtype)
