"""FP8 (e4m3) weights as checkpoints ship them, kept at one byte per weight (weight-only).

Two layouts, one common form (UnpackedFp8: q [N, K] e4m3 bytes, scale [N, ceil(K / block)] float32,
W[n, k] = e4m3(q[n, k]) x scale[n, k // block]):
    fp8 (DeepSeek-V3/R1/V3.2/V4, Qwen3 "-FP8")   quantization_config {quant_method: fp8,
        weight_block_size: [bn, bk]}; tensors `weight` float8_e4m3fn [N, K] and `weight_scale_inv`
        float32 [ceil(N / bn), ceil(K / bk)] (despite its name, a multiplier: W = w x s, as
        transformers' FP8 dequantization and DeepSeek's weight_dequant compute it); the block scales
        are expanded to one row each so that merged projections (q/k/v) concatenate along N.
    compressed-tensors float-quantized           `weight` float8_e4m3fn, `weight_scale` [N, 1]
        (strategy channel) or [1] (tensor): block = K.
Fp8Linear holds 1 byte per weight (+ 4 bytes per row and K block of scales). Activations stay in
the model dtype (there is no FP8 arithmetic on these CPUs). bf16 decode rows (up to
FP8_GEMV_MAX_ROWS) take the native GEMV, which widens the bytes in registers
(kvflow/kernels/gemv_fp8.cpp); longer chunks and float32 multiply by row blocks dequantized to the
activation dtype as they are needed (a prefill chunk is compute-bound: the widening is amortized
over its rows).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kvflow.errors import ModelLoadError
from kvflow.kernels import NativeDecoderClasses, fp8_weight_kernel
from kvflow.layers.bf16_gemm import bf16_linear_blocks

FP8_DTYPE = torch.float8_e4m3fn
# Weights widened at once by a step: bounds the temporary copy (4M values = 8 MiB in bf16).
WIDEN_ELEMENTS = 1 << 22
FP8_GEMV_MAX_ROWS = 8  # the native GEMV's row limit (gemv_fp8.cpp kMaxRows)


@dataclass(frozen=True)
class UnpackedFp8:
    q: torch.Tensor  # [N, K] uint8: the e4m3 bytes
    scale: torch.Tensor  # [N, ceil(K / block)] float32
    block: int  # inputs per scale column

    def rows(self, n0: int, n1: int, dtype: torch.dtype) -> torch.Tensor:
        """W[n0:n1] [rows, K] in `dtype`: e4m3 widened to float32, times its scale, rounded once."""
        k = self.q.shape[1]
        w = self.q[n0:n1].view(FP8_DTYPE).float()
        scale = self.scale[n0:n1].repeat_interleave(self.block, dim=1)[:, :k]
        return (w * scale).to(dtype)

    def dequantize(self) -> torch.Tensor:
        return self.rows(0, self.q.shape[0], torch.float32)


def _fp8_bytes(weight: torch.Tensor, name: str) -> torch.Tensor:
    if weight.dtype != FP8_DTYPE:
        raise ModelLoadError(f"{name}: expected float8_e4m3fn weights, got {weight.dtype}")
    return weight.view(torch.uint8).contiguous()


def unpack_fp8_block(tensors: Mapping[str, torch.Tensor], block_rows: int, block_cols: int) -> UnpackedFp8:
    q = _fp8_bytes(tensors["weight"], "weight")
    n, k = q.shape
    s = tensors["weight_scale_inv"].float()
    expected = (-(-n // block_rows), -(-k // block_cols))
    if tuple(s.shape) != expected:
        raise ModelLoadError(
            f"weight_scale_inv has shape {tuple(s.shape)}, expected {expected} for a [{n}, {k}] weight in "
            f"blocks of {block_rows} x {block_cols}"
        )
    return UnpackedFp8(q, s.repeat_interleave(block_rows, dim=0)[:n].contiguous(), block_cols)


def unpack_fp8_channel(tensors: Mapping[str, torch.Tensor]) -> UnpackedFp8:
    q = _fp8_bytes(tensors["weight"], "weight")
    n, k = q.shape
    s = tensors["weight_scale"].float().reshape(-1)
    if s.numel() == 1:  # strategy tensor
        s = s.expand(n)
    if s.numel() != n:
        raise ModelLoadError(f"weight_scale has {s.numel()} values for {n} output channels")
    return UnpackedFp8(q, s.reshape(n, 1).contiguous(), k)


class Fp8Linear(nn.Module):
    """y = x @ W^T (+ bias) over FP8 weights (module docstring)."""

    qweight: torch.Tensor  # [out, in] uint8: e4m3 bytes
    scales: torch.Tensor  # [out, ceil(in / block)] float32
    bias: torch.Tensor | None

    def __init__(self, weight: UnpackedFp8, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.q.shape
        self.block = weight.block
        self.dtype = dtype
        self.register_buffer("qweight", weight.q)
        self.register_buffer("scales", weight.scale)
        self.register_buffer("bias", None if bias is None else bias.to(dtype))
        self._gemv = fp8_weight_kernel() if dtype == torch.bfloat16 else None

    def _weight(self) -> UnpackedFp8:
        return UnpackedFp8(self.qweight, self.scales, self.block)

    def _blocks(self, dtype: torch.dtype) -> Iterator[torch.Tensor]:
        rows = max(1, WIDEN_ELEMENTS // self.in_features)
        w = self._weight()
        for n0 in range(0, self.out_features, rows):
            yield w.rows(n0, min(self.out_features, n0 + rows), dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        if self._gemv is not None and x.dtype == torch.bfloat16 and x.shape[0] <= FP8_GEMV_MAX_ROWS:
            return self._gemv(x, self.qweight, self.scales, self.block, self.bias)
        if x.dtype == torch.bfloat16:
            y = bf16_linear_blocks(x, self._blocks(x.dtype))
        else:
            y = torch.cat([x @ rows.t() for rows in self._blocks(x.dtype)], dim=-1)
        return y if self.bias is None else y + self.bias

    def prepare_for_inference(self) -> None:
        """Nothing to lay out: the bytes are read as the checkpoint stores them."""

    def native(self, classes: NativeDecoderClasses) -> Any | None:
        """This layer for the native decode forward (the GEMV up to FP8_GEMV_MAX_ROWS rows, widened
        row blocks past it, as `forward`), or None without the kernel."""
        if self._gemv is None:
            return None
        return classes.linear.fp8(self.qweight, self.scales, self.block, self.bias)

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features}, fp8 e4m3, scale per row x {self.block} inputs"
        )
