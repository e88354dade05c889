"""SwiGLU's gate: silu(gate) * up over a merged [.., 2 * intermediate] projection.

bf16 token rows take kvflow's one-pass kernel (kvflow/kernels/elementwise.cpp: silu rounded to bf16
before the product, as ATen does; the native decode forward calls the same kernel)."""

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
