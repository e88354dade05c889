"""Gated MLP activations over a merged [.., 2 * intermediate] gate/up projection.

SwiGLU's silu(gate) * up: bf16 token rows take kvflow's one-pass kernel (kvflow/kernels/
elementwise.cpp: silu rounded to bf16 before the product, as ATen does; the native decode forward
calls the same kernel). Gemma's GeGLU and gpt-oss's clamped SwiGLU are ATen ops."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvflow.kernels import elementwise_kernels


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    native = elementwise_kernels()
    if (
        native is not None
        and gate_up.dtype == torch.bfloat16
        and gate_up.dim() == 2
        and gate_up.stride(-1) == 1
    ):
        return native.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    """GeGLU with the tanh approximation of gelu (Gemma's `gelu_pytorch_tanh`)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def clamped_swiglu(gate_up: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """gpt-oss's SwiGLU: gate clamped to <= limit, up to [-limit, limit], then
    (up + 1) * gate * sigmoid(alpha * gate). kvflow's merged projection holds gate then up (the
    checkpoint interleaves them; the loader splits them)."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def limited_silu_and_mul(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    """DeepSeek-V4's SwiGLU: gate clamped to <= limit, up to [-limit, limit], then silu(gate) * up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)
