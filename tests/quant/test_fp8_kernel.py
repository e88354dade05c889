"""The FP8 decode GEMV (kvflow/kernels/gemv_fp8.cpp) against dequantize-then-matmul: every e4m3
byte (subnormals, both zeros, the largest 448), awkward shapes (K not a multiple of 16 or of the
block, one row to eight, outputs split across threads), with and without a bias. Both of its forms
run here on a CPU with AVX512-VBMI: the table form for blocks of whole 64-input chunks or one block
per row (block 64, 128, K), the bit-manipulation form for the others (16, 32, 40)."""

from __future__ import annotations

import pytest
import torch

from kvflow.kernels import fp8_weight_kernel
from kvflow.quant.fp8 import FP8_DTYPE, UnpackedFp8

NAN_BYTES = (0x7F, 0xFF)  # e4m3's NaNs: never in a checkpoint


def _bytes(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    q = torch.randint(0, 256, (n, k), generator=gen, dtype=torch.int64)
    q[(q == NAN_BYTES[0]) | (q == NAN_BYTES[1])] = 0
    return q.to(torch.uint8)


@pytest.mark.parametrize("k", [16, 64, 130])
def test_every_finite_e4m3_byte_widens_exactly(k: int) -> None:
    kernel = fp8_weight_kernel()
    if kernel is None:
        pytest.skip("native kernels unavailable on this machine")
    codes = torch.tensor([b for b in range(256) if b not in NAN_BYTES], dtype=torch.uint8)
    # One output row per code, x = e_k picks it out (the last input: a masked tail chunk where K is
    # not a multiple of 64): y[0, n] = e4m3(code_n) * 1.
    q = torch.zeros(len(codes), k, dtype=torch.uint8)
    q[:, k - 1] = codes
    x = torch.zeros(1, k, dtype=torch.bfloat16)
    x[0, k - 1] = 1.0
    y = kernel(x, q, torch.ones(len(codes), 1), k, None)
    expected = codes.view(FP8_DTYPE).float().to(torch.bfloat16)
    assert torch.equal(y[0], expected)


@pytest.mark.parametrize(
    ("n", "k", "block"),
    [(1, 16, 16), (17, 40, 32), (64, 130, 128), (33, 257, 40), (3, 64, 64), (70, 300, 128), (9, 200, 200)],
)
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_matches_dequantize_then_matmul(n: int, k: int, block: int, rows: int, with_bias: bool) -> None:
    kernel = fp8_weight_kernel()
    if kernel is None:
        pytest.skip("native kernels unavailable on this machine")
    gen = torch.Generator().manual_seed(n * 1000 + k)
    q = _bytes(n, k, gen)
    scale = torch.rand(n, -(-k // block), generator=gen) * 0.01 + 1e-4
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16) if with_bias else None
    w = UnpackedFp8(q, scale, block).dequantize()  # [n, k] float32
    expected = x.float() @ w.t() + (bias.float() if bias is not None else 0.0)
    got = kernel(x, q, scale, block, bias)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    torch.testing.assert_close(got.float(), expected, rtol=1e-2, atol=1e-2 * float(expected.abs().max()))
