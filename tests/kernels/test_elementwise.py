"""The native bf16 RMSNorm and SiLU-and-mul against ATen's ops (which the Python layers used before):
the same bf16 values except where the fp32 mean of squares, summed in another order, lands on the
other side of a rounding boundary (at most one bf16 ulp, on a tiny fraction of elements)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvflow.kernels import ElementwiseKernels, elementwise_kernels

BF16_ULP = 2.0**-7  # spacing of bf16 values in [1, 2): relative, at most one step apart


@pytest.fixture
def kernels() -> ElementwiseKernels:
    found = elementwise_kernels()
    if found is None:
        pytest.skip("native kernels unavailable on this CPU/toolchain")
    return found


def assert_within_one_ulp_on_few(got: torch.Tensor, want: torch.Tensor, floor: float = 0.0) -> None:
    """Equal bf16 values except on under 0.1% of elements, which are at most one ulp apart."""
    got, want = got.float(), want.float()
    differ = got != want
    assert differ.float().mean() < 1e-3
    assert bool(((got - want).abs() <= BF16_ULP * want.abs() + floor)[differ].all())


@pytest.mark.parametrize(("rows", "hidden"), [(1, 896), (7, 130), (64, 17)])
def test_rms_norm_matches_aten(kernels: ElementwiseKernels, rows: int, hidden: int) -> None:
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(rows, 2 * hidden, generator=gen) * 3).to(torch.bfloat16)[:, :hidden]  # row stride 2H
    w = torch.randn(hidden, generator=gen).to(torch.bfloat16)
    assert_within_one_ulp_on_few(kernels.rms_norm(x, w, 1e-6), F.rms_norm(x, (hidden,), w, 1e-6))


@pytest.mark.parametrize(("rows", "inter"), [(1, 4864), (5, 40), (3, 7)])
def test_silu_and_mul_matches_aten(kernels: ElementwiseKernels, rows: int, inter: int) -> None:
    gen = torch.Generator().manual_seed(1)
    gate_up = (torch.randn(rows, 2 * inter, generator=gen) * 4).to(torch.bfloat16)
    gate_up[0, 0], gate_up[0, inter] = -100.0, 3.0  # exp(-x) past fp32's range: silu ~ 0
    gate, up = gate_up.chunk(2, dim=-1)
    assert_within_one_ulp_on_few(kernels.silu_and_mul(gate_up), F.silu(gate) * up, floor=1e-30)
