"""Quantized linear layers that read packed weights in PyTorch's CPU weight-only kernels.

Never dequantize a whole matrix per step: decode is bandwidth-bound, and the point of int8/int4 is
to stream fewer bytes. `aten._weight_int8pack_mm` reads int8 [out, in] with one scale per row;
`aten._weight_int4pack_mm_for_cpu` reads nibble-packed weights with per-group (scale, zero) pairs,
computing w = (q - 8) x scale + zero, so zero = min + 8 x scale in our asymmetric convention.
Both take activations [T, in]; float32 models run the int4 kernel in bf16 (its supported dtype).
"""

from __future__ import annotations

import torch
from torch import nn

from kvflow.quant.weights import Int4Weight, Int8Weight

# The int4 kernel's signed offset: it subtracts 8 from every unsigned nibble.
INT4_KERNEL_OFFSET = 8
# Inner K tiles of the int4 packing on CPU (its kernel reads 2 tiles of 32 elements per step).
INT4_INNER_K_TILES = 2


class Int8Linear(nn.Module):
    qweight: torch.Tensor  # [out, in] int8
    scales: torch.Tensor  # [out], the activation dtype
    bias: torch.Tensor | None

    def __init__(self, weight: Int8Weight, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.qweight.shape
        self.register_buffer("qweight", weight.qweight.contiguous())
        self.register_buffer("scales", weight.scales.to(dtype))
        self.register_buffer("bias", None if bias is None else bias.to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        y = torch._weight_int8pack_mm(x, self.qweight, self.scales)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, int8 per channel"


class Int4Linear(nn.Module):
    qweight: torch.Tensor  # [out, in / 2] uint8, the kernel's packed layout
    scales_and_zeros: torch.Tensor  # [in / group, out, 2] bf16
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
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            weight.qweight.contiguous(), INT4_INNER_K_TILES
        )
        zeros = weight.mins + INT4_KERNEL_OFFSET * weight.scales
        # [in / group, out, 2]: the kernel's layout of (scale, zero) per group and output.
        scales_and_zeros = torch.stack([weight.scales.t(), zeros.t()], dim=-1).to(torch.bfloat16).contiguous()
        self.register_buffer("qweight", packed)
        self.register_buffer("scales_and_zeros", scales_and_zeros)
        self.register_buffer("bias", None if bias is None else bias.to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        if self.perm is not None:
            x = x.index_select(1, self.perm)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(torch.bfloat16), self.qweight, self.group_size, self.scales_and_zeros
        ).to(self.dtype)
        return y if self.bias is None else y + self.bias

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
