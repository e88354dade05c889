"""The GGUF block types' layers (kvflow/quant/gguf_linear.py): unpacking against the gguf package's
dequantization (llama.cpp's reference), and the kernels (gemv_int8.cpp's Q8_0, gemv_ggml.cpp) against
a dequantize-then-matmul reference over awkward shapes: a partial last 16-row tile, 1-40 rows (the
GEMV's passes of 8, the blockwise prefill past it), several thread splits, a bias; every row's
output bit-identical whatever else shares the call (batch invariance)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fixtures.ggml_quants import K_QUANTIZERS

import kvflow.quant.linear as quant_linear
from kvflow.kernels import ggml_weight_kernels, native_decoder_classes
from kvflow.layers.linear import ALL_ROWS
from kvflow.quant.gguf_linear import KERNEL_TYPES, GGUFLinear, concat_rows, unpack_ggml
from kvflow.quant.linear import ConcatLinear

gguf = pytest.importorskip("gguf")

BF16_RELATIVE = 2.0**-8
TYPES = sorted(KERNEL_TYPES)


def _quantized(type_name: str, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, np.ndarray]:
    """(rows as a GGUF file stores them [n, bytes], their values per gguf.quants.dequantize)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32)
    w[1, 5] = 9.0  # an outlier: its block's scale is coarse
    qtype = gguf.GGMLQuantizationType[type_name]
    data = K_QUANTIZERS[type_name](w) if type_name in K_QUANTIZERS else gguf.quants.quantize(w, qtype)
    return torch.from_numpy(np.array(data)), gguf.quants.dequantize(data, qtype).reshape(n, k)


def _kernels() -> object:
    kernels = ggml_weight_kernels()
    if kernels is None:
        pytest.skip("kvflow's native kernels are unavailable on this CPU")
    return kernels


@pytest.mark.parametrize("type_name", TYPES)
def test_unpacking_matches_the_gguf_reference(type_name: str) -> None:
    data, reference = _quantized(type_name, 20, 512)
    unpacked = unpack_ggml(type_name, data, (20, 512))
    assert torch.equal(unpacked.dequantize(), torch.from_numpy(reference))


def _tolerance(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The GEMV rounds each activation to int8 per 32 inputs (at most max |x_b| / 254 off) and the
    output once to bf16; the blocks round each weight and the output to bf16."""
    m, k = x.shape
    blocks = x.float().abs().reshape(m, k // 32, 32)
    step = blocks.amax(-1, keepdim=True).expand(blocks.shape).reshape(m, k)
    return (step / 254) @ w.abs().t() + 2 * BF16_RELATIVE * (x.float().abs() @ w.abs().t()) + 1e-5


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("shape", [(16, 256), (45, 512), (93, 768)])
def test_gemv_and_blocks_equal_the_dequantized_matmul(
    type_name: str, shape: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    kernels = _kernels()
    n, k = shape
    data, reference = _quantized(type_name, n, k, seed=n)
    w = torch.from_numpy(reference)
    bias = torch.randn(n).to(torch.bfloat16)
    layer = GGUFLinear(unpack_ggml(type_name, data, shape), bias, kernels)  # type: ignore[arg-type]
    monkeypatch.setattr(quant_linear, "PREFILL_TILE_ELEMENTS", 32 * k)  # several row blocks, one partial
    torch.manual_seed(n)
    for rows in (1, 3, 8, 9, 17, 40):
        x = torch.randn(rows, k).to(torch.bfloat16)
        expected = x.float() @ w.t() + bias.float()
        for gemv_rows in (quant_linear.NATIVE_GEMV_MAX_ROWS, ALL_ROWS):
            layer.max_gemv_rows = gemv_rows
            got = layer(x)
            assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
            assert bool(((got.float() - expected).abs() <= _tolerance(x, w)).all()), (rows, gemv_rows)


@pytest.mark.parametrize("type_name", TYPES)
def test_gemv_rows_are_batch_and_thread_invariant(type_name: str) -> None:
    kernels = _kernels()
    n, k = 16 * 9 - 5, 512
    data, _ = _quantized(type_name, n, k)
    layer = GGUFLinear(unpack_ggml(type_name, data, (n, k)), None, kernels)  # type: ignore[arg-type]
    layer.max_gemv_rows = ALL_ROWS
    torch.manual_seed(0)
    x = torch.randn(11, k).to(torch.bfloat16)
    y = layer(x)
    for row in range(11):
        assert torch.equal(layer(x[row : row + 1])[0], y[row])
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if threads > 1 else 2)
    try:
        assert torch.equal(layer(x), y)
    finally:
        torch.set_num_threads(threads)


def test_native_forward_and_greedy_match_the_module() -> None:
    """The native decode forward's NativeLinear over the same tiles: the same outputs, and its
    greedy argmax folded into the GEMV; a concatenation of parts of different types too."""
    kernels, classes = _kernels(), native_decoder_classes()
    assert classes is not None
    k = 512
    parts = []
    for type_name, n in (("Q4_K", 48), ("Q6_K", 40)):
        data, _ = _quantized(type_name, n, k, seed=n)
        parts.append(GGUFLinear(unpack_ggml(type_name, data, (n, k)), None, kernels))  # type: ignore[arg-type]
    torch.manual_seed(3)
    x = torch.randn(4, k).to(torch.bfloat16)
    for layer in (*parts, ConcatLinear(parts)):
        native = layer.native(classes)
        assert native is not None
        assert torch.equal(native.forward(x), layer(x))
        assert torch.equal(native.greedy(x), torch.argmax(layer(x).float(), dim=-1))


def test_gpt_oss_mxfp4_blocks_are_the_ggml_type_in_another_byte_order() -> None:
    """gpt-oss's checkpoint tensors (`*_blocks`: codes 2j and 2j + 1 in byte j; `*_scales`) give
    the same numbers as transformers' dequantization (convert_moe_packed_tensors's rule: the e2m1
    table times 2^(scale - 127))."""
    from kvflow.quant.gguf_linear import unpack_mxfp4_blocks

    torch.manual_seed(0)
    blocks = torch.randint(0, 256, (24, 8, 16), dtype=torch.uint8)
    scales = torch.randint(118, 130, (24, 8), dtype=torch.uint8)
    e2m1 = torch.tensor(
        [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    )
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).reshape(24, 8, 32).long()
    expected = torch.ldexp(e2m1[codes], scales.long()[..., None] - 127).reshape(24, 256)
    assert torch.equal(unpack_mxfp4_blocks(blocks, scales).dequantize(), expected)


def test_merged_parts_of_one_type_stack_their_rows() -> None:
    parts = [unpack_ggml("Q5_K", _quantized("Q5_K", n, 256, seed=n)[0], (n, 256)) for n in (24, 8)]
    merged = concat_rows(parts)
    assert torch.equal(merged.dequantize(), torch.cat([p.dequantize() for p in parts]))


def _int8_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The GEMV's activations (kvflow/kernels/activation_quant.h): per 32 inputs, dx = max |x| / 127
    and q = round-half-even(x * (127 / max |x|)) -> (q [M, K] float, dx [M, K / 32])."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // 32, 32)
    amax = blocks.abs().amax(-1)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    q = torch.round(blocks * inv[..., None])  # torch.round rounds half to even
    return q.reshape(m, k), amax / 127


@pytest.mark.parametrize("type_name", TYPES)
def test_gemv_is_exact_given_its_int8_activations(type_name: str) -> None:
    """With the activations rounded as the kernel rounds them, the GEMV's outputs are the exact sums
    (integer dots, fp32 scales) up to fp32 summation order and the final bf16 rounding: the only
    approximation in the kernel is the activations' int8 rounding, as in llama.cpp."""
    kernels = _kernels()
    n, k = 45, 512
    data, _ = _quantized(type_name, n, k, seed=7)
    unpacked = unpack_ggml(type_name, data, (n, k))
    layer = GGUFLinear(unpacked, None, kernels)  # type: ignore[arg-type]
    layer.max_gemv_rows = ALL_ROWS
    torch.manual_seed(7)
    x = torch.randn(5, k).to(torch.bfloat16)
    xq, dx = _int8_activations(x)
    s, z, g = unpacked.group_affine()
    levels = unpacked.q.view(torch.int8) if type_name == "Q8_0" else unpacked.levels()
    q = levels.double().reshape(n, k // g, g)
    dots = torch.einsum("ngi,mgi->mng", q, xq.double().reshape(5, k // g, g))  # [M, N, groups]
    dx_group = dx.double().repeat_interleave(32 // g if g < 32 else 1, dim=1)  # [M, groups]
    xsum = x.double().reshape(5, k // g, g).sum(-1)
    terms = s.double()[None] * dx_group[:, None] * dots + z.double()[None] * xsum[:, None]
    expected = terms.sum(-1)
    got = layer(x).double()
    tolerance = BF16_RELATIVE * expected.abs() + 1e-5 * terms.abs().sum(-1) + 1e-6
    assert bool(((got - expected).abs() <= tolerance).all())
