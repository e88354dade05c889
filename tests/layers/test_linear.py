"""The bf16 linear fast paths (the native GEMV for few rows; oneDNN blocked weights for more, or an
fp32 GEMM where oneDNN has no bf16 one) agree with a float32 reference to bf16 rounding, for awkward
shapes too."""

from __future__ import annotations

import pytest
import torch

from kvflow.kernels import skinny_linear_bf16
from kvflow.layers import bf16_gemm
from kvflow.layers.linear import SKINNY_MAX_ROWS, Linear

# (rows M, out N, in K): K not a multiple of 32 exercises the masked tail, N of the thread split.
SHAPES = [(1, 1152, 896), (2, 7, 37), (3, 96, 64), (1, 13, 300), (5, 33, 4864), (64, 40, 96)]


def _relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).abs().max() / ref.abs().max())


@pytest.fixture(params=["cpu", "no_bf16_gemm"])
def gemm_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """This CPU's GEMM for many rows, and the fp32 one an AVX2 CPU (no oneDNN bf16 GEMM) takes."""
    if request.param == "no_bf16_gemm":
        monkeypatch.setattr(bf16_gemm, "onednn_bf16_gemm", lambda: False)
        monkeypatch.setattr("kvflow.layers.linear.onednn_bf16_gemm", lambda: False)
    return str(request.param)


@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_linear_matches_float_reference(m: int, n: int, k: int, bias: bool, gemm_kind: str) -> None:
    torch.manual_seed(m * 1000 + n + k)
    layer = Linear(k, n, bias, torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(n, k))
        if layer.bias is not None:
            layer.bias.copy_(torch.randn(n))
    w = layer.weight.detach().float().clone()
    b = layer.bias.detach().float().clone() if layer.bias is not None else None
    layer.prepare_for_inference()
    x = torch.randn(m, k, dtype=torch.bfloat16)
    ref = torch.nn.functional.linear(x.float(), w, b)
    # Products of bf16 values are exact in fp32; the error is accumulation order plus one bf16
    # rounding of the output (relative 2^-9).
    assert _relative_error(layer(x), ref) < 8e-3


def test_native_kernel_handles_every_row_count_up_to_the_threshold() -> None:
    native = skinny_linear_bf16()
    if native is None:
        pytest.skip("native kernel unavailable on this CPU/toolchain")
    kernel, tile = native
    w = torch.randn(50, 130, dtype=torch.bfloat16)  # 50 rows: 3 whole 16-row tiles and a partial one
    tiles = tile(w)
    assert tiles.shape == (4, 65, 16, 2)
    bias = torch.randn(50, dtype=torch.bfloat16)
    # Past 8 rows the kernel takes more passes over the weights (batch-invariant mode asks for that).
    for m in range(1, 2 * SKINNY_MAX_ROWS + 3):
        x = torch.randn(m, 130, dtype=torch.bfloat16)
        y = kernel(x, tiles, 50, bias)
        assert _relative_error(y, x.float() @ w.float().T + bias.float()) < 8e-3
        assert torch.equal(kernel(x[-1:], tiles, 50, bias)[0], y[-1])  # batch-invariant


@pytest.mark.parametrize("num_tiles", range(1, 10))
def test_native_kernel_gives_every_tile_count_the_same_bits(num_tiles: int) -> None:
    """At few rows a thread streams several tiles side by side (gemv_bf16.cpp kTileStreams) and the
    rest one by one: every tile count, row count and thread split gives each output the same bits,
    and the float reference to bf16 rounding."""
    native = skinny_linear_bf16()
    if native is None:
        pytest.skip("native kernel unavailable on this CPU/toolchain")
    kernel, tile = native
    torch.manual_seed(num_tiles)
    n, k = 16 * num_tiles - 3, 94  # a partial last tile; an odd number of input pairs
    w = torch.randn(n, k, dtype=torch.bfloat16)
    tiles = tile(w)
    threads = torch.get_num_threads()
    for m in range(1, 10):
        x = torch.randn(m, k, dtype=torch.bfloat16)
        y = kernel(x, tiles, n, None)
        assert _relative_error(y, x.float() @ w.float().T) < 8e-3
        for row in range(m):
            assert torch.equal(kernel(x[row : row + 1], tiles, n, None)[0], y[row])
        torch.set_num_threads(1 if threads > 1 else 2)
        try:
            assert torch.equal(kernel(x, tiles, n, None), y)
        finally:
            torch.set_num_threads(threads)


@pytest.mark.parametrize(("amx", "limit"), [(True, 8), (False, SKINNY_MAX_ROWS)])
def test_gemv_row_limit_follows_amx(amx: bool, limit: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where oneDNN multiplies on AMX tiles it takes over from 9 rows, else from 33 (linear.py)."""
    monkeypatch.setattr("kvflow.layers.linear.onednn_amx_bf16", lambda: amx)
    layer = Linear(64, 40, False, torch.bfloat16)
    assert layer.max_gemv_rows == limit
    layer.weight.data.copy_(torch.randn(40, 64))
    w = layer.weight.detach().float().clone()
    layer.prepare_for_inference()
    for m in (limit, limit + 1):  # the last GEMV row count and the first GEMM one
        x = torch.randn(m, 64, dtype=torch.bfloat16)
        assert _relative_error(layer(x), x.float() @ w.T) < 8e-3
