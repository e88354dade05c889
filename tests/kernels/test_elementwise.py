"""The native bf16 RMSNorm and SiLU-and-mul against ATen's ops (which the Python layers used before):
the same bf16 values except where the fp32 mean of squares, summed in another order, lands on the
other side of a rounding boundary (at most one bf16 ulp, on a tiny fraction of elements)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvflow.kernels import elementwise_kernels

BF16_ULP = 2.0**-7  # spacing of bf16 values in [1, 2): relative, at most one step apart


@pytest.mark.parametrize(("rows", "hidden"), [(1, 896), (7, 130), (64, 17)])
def test_rms_norm_matches_aten(rows: int, hidden: int) -> None:
    kernels = elementwise_kernels()
    if kernels is None:
        pytest.skip("native kernels unavailable on this CPU/toolchain")
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(rows, 2 * hidden, generator=gen) * 3).to(torch.bfloat16)[:, :hidden]  # row stride 2H
    w = torch.randn(hidden, generator=gen).to(torch.bfloat16)
    got, want = kernels.rms_norm(x, w, 1e-6).float(), F.rms_norm(x, (hidden,), w, 1e-6).float()
    differ = got != want
    assert differ.float().mean() < 1e-3
    assert bool(((got - want).abs() <= BF16_ULP * want.abs())[differ].all())


@pytest.mark.parametrize(("rows", "inter"), [(1, 4864), (5, 40), (3, 7)])
def test_silu_and_mul_matches_aten(rows: int, inter: int) -> None:
    kernels = elementwise_kernels()
    if kernels is None:
        pytest.skip("native kernels unavailable on this CPU/toolchain")
    gen = torch.Generator().manual_seed(1)
    gate_up = (torch.randn(rows, 2 * inter, generator=gen) * 4).to(torch.bfloat16)
    gate_up[0, 0], gate_up[0, inter] = -100.0, 3.0  # exp(-x) past fp32's range: silu ~ 0
    gate, up = gate_up.chunk(2, dim=-1)
    got, want = kernels.silu_and_mul(gate_up).float(), (F.silu(gate) * up).float()
    differ = got != want
    assert differ.float().mean() < 1e-3
    assert bool(((got - want).abs() <= BF16_ULP * want.abs() + 1e-30)[differ].all())
