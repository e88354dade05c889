"""Weight quantization: round trips within each format's error bound (random and adversarial
weights), quantized linear layers against the dequantized matmul, and the engine end to end."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvflow import LLM, SamplingParams
from kvflow.config import ConfigError, QuantConfig
from kvflow.kernels import int4_weight_kernels, int8_weight_kernels
from kvflow.layers.linear import ALL_ROWS, Linear
from kvflow.quant import linear as quant_linear
from kvflow.quant.apply import quantize_linear
from kvflow.quant.linear import Int4Linear, Int8Linear
from kvflow.quant.weights import quantize_int4, quantize_int8

# bf16 carries 8 significant bits: the kernels' bf16 scales and outputs add this relative error.
BF16_RELATIVE = 2**-8


def adversarial(out: int = 64, inp: int = 256) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    random = torch.randn(out, inp, generator=gen)
    outliers = random.clone()
    outliers[::7, ::31] *= 100.0  # a few huge values per row and group
    equal = torch.full((out, inp), 0.375)
    zeros = torch.zeros(out, inp)
    mixed = random.clone()
    mixed[:8] = 0.0  # zero rows among ordinary ones
    mixed[8:16, :64] = -2.5  # all-equal groups
    return {"random": random, "outliers": outliers, "equal": equal, "zeros": zeros, "mixed": mixed}


@pytest.mark.parametrize("case", list(adversarial()))
def test_int8_round_trip_within_half_a_step(case: str) -> None:
    w = adversarial()[case]
    q = quantize_int8(w)
    assert q.qweight.dtype == torch.int8 and int(q.qweight.abs().max()) <= 127
    error = (q.dequantize() - w).abs()
    assert bool((error <= q.scales[:, None] / 2 + 1e-6).all())
    if case in ("equal", "zeros"):
        assert torch.equal(q.dequantize(), w)


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("case", list(adversarial()))
def test_int4_round_trip_within_half_a_step(case: str, group_size: int) -> None:
    w = adversarial()[case]
    q = quantize_int4(w, group_size)
    assert int(q.qweight.min()) >= 0 and int(q.qweight.max()) <= 15
    error = (q.dequantize() - w).abs().reshape(w.shape[0], -1, group_size)
    bound = q.scales[..., None] / 2 + 1e-5 * w.abs().max()
    assert bool((error <= bound).all())
    if case in ("equal", "zeros"):
        assert torch.allclose(q.dequantize(), w)


def test_int4_needs_a_dividing_group_size() -> None:
    with pytest.raises(ValueError, match="multiple of the int4 group size"):
        quantize_int4(torch.randn(8, 96), 64)
    with pytest.raises(ConfigError, match="group_size"):
        QuantConfig(quantization="int4", quantization_group_size=48)


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_quantized_linear_equals_dequantized_matmul(method: str, dtype: torch.dtype, rows: int) -> None:
    torch.manual_seed(0)
    linear = Linear(256, 96, bias=True, dtype=dtype)
    linear.weight.data = torch.randn(96, 256).to(dtype)
    assert linear.bias is not None
    linear.bias.data = torch.randn(96).to(dtype)
    config = QuantConfig(quantization=method, quantization_group_size=64)  # type: ignore[arg-type]
    module = quantize_linear(linear, config)
    assert isinstance(module, Int8Linear if method == "int8" else Int4Linear)
    q = quantize_int8(linear.weight.data) if method == "int8" else quantize_int4(linear.weight.data, 64)
    x = torch.randn(rows, 256).to(dtype)
    expected = x.float() @ q.dequantize().t() + linear.bias.float()
    got = module(x)
    assert got.dtype == dtype and got.shape == (rows, 96)
    # Tolerance: bf16 rounding of activations, scales and the output, relative to the result's size.
    tolerance = 4 * BF16_RELATIVE * (x.float().abs() @ q.dequantize().abs().t()).max()
    assert float((got.float() - expected).abs().max()) <= float(tolerance)


@pytest.mark.parametrize("gemv_rows", ["every row", "blocks past 8"])
@pytest.mark.parametrize("rows", [1, 5, 8, 9, 40])
@pytest.mark.parametrize(
    ("method", "in_features", "group_size"),
    [("int8", 200, 0), ("int8", 256, 0), ("int4", 256, 32), ("int4", 256, 128), ("int4", 384, 64)],
)  # int8 at 200: a partial 32-wide tail in the GEMV; int4 needs whole 128-input blocks
def test_native_quantized_paths_equal_the_dequantized_matmul(
    gemv_rows: str,
    rows: int,
    method: str,
    in_features: int,
    group_size: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The bf16 native paths, both forced on every CPU: the GEMV for every row (prefill's routing
    on AVX2, native_gemv_max_rows()) and the blockwise dequantize-and-GEMM past
    NATIVE_GEMV_MAX_ROWS, here cut into several blocks (one of them partial) by a small tile."""
    kernels = int8_weight_kernels() if method == "int8" else int4_weight_kernels()
    if kernels is None:
        pytest.skip(
            "kvflow's native kernels are unavailable on this CPU (no AVX512-BF16 or AVX2, or no compiler)"
        )
    monkeypatch.setattr(quant_linear, "PREFILL_TILE_ELEMENTS", 40 * in_features)  # 40-row blocks
    torch.manual_seed(1)
    weight = torch.randn(96, in_features).to(torch.bfloat16)
    weight[3, 7] = 40.0  # an outlier: its row's (group's) scale is coarse, the others' are not affected
    weight[5, :64] = -0.5  # all-equal groups
    bias = torch.randn(96).to(torch.bfloat16)
    module: Int8Linear | Int4Linear
    if method == "int8":
        q8 = quantize_int8(weight)
        module, reference = Int8Linear(q8, bias, torch.bfloat16), q8.qweight.float() * q8.scales[:, None]
    else:
        q4 = quantize_int4(weight, group_size)
        module = Int4Linear(q4, bias, torch.bfloat16)
        # The kernel's view: scale and minimum held in bf16.
        scale, low = q4.scales.to(torch.bfloat16).float(), q4.mins.to(torch.bfloat16).float()
        groups = q4.qweight.reshape(96, -1, group_size).float()
        reference = (groups * scale[..., None] + low[..., None]).reshape(96, in_features)
    assert module._native is not None
    module.max_gemv_rows = quant_linear.NATIVE_GEMV_MAX_ROWS if gemv_rows == "blocks past 8" else ALL_ROWS
    x = torch.randn(rows, in_features).to(torch.bfloat16)
    expected = x.float() @ reference.t() + bias.float()
    got = module(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 96)
    # The blocks multiply bf16(W): the error is the output's bf16 rounding plus one bf16 rounding of
    # each weight. The GEMVs sum exact integer products of the weights and the activations rounded
    # to int8 per 32 inputs (an error of at most half a level, 1/254 of the block's largest |x|).
    tolerance = 2 * BF16_RELATIVE * (x.float().abs() @ reference.abs().t()) + 1e-6
    assert bool(((got.float() - expected).abs() <= tolerance).all())


@pytest.mark.parametrize(
    ("routing", "expected"),
    [("dequantize", quant_linear.NATIVE_GEMV_MAX_ROWS), ("gemv", ALL_ROWS)],
)
def test_quantized_prefill_routing_follows_the_environment(
    routing: str, expected: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """KVFLOW_QUANTIZED_PREFILL forces either routing whatever the CPU; anything else is refused
    with the accepted values, not silently read as the default."""
    monkeypatch.setenv(quant_linear.QUANTIZED_PREFILL_ENV, routing)
    assert quant_linear.native_gemv_max_rows() == expected
    monkeypatch.setenv(quant_linear.QUANTIZED_PREFILL_ENV, "gemm")
    with pytest.raises(ValueError, match="expected one of dequantize, gemv"):
        quant_linear.native_gemv_max_rows()


def kernel_view(weight: torch.Tensor, method: str, group_size: int) -> torch.Tensor:
    """The weights as the kernels see them. int8: the scale in the model dtype (torch's kernel) or
    fp32 (the native GEMV; the dequantize-and-GEMM blocks round q * s to bf16 once). int4: the
    native kernel keeps (scale, min) in bf16, torch's keeps (scale, zero = min + 8 scale)."""
    if method == "int8":
        q8 = quantize_int8(weight)
        scale_dtype = torch.float32 if int8_weight_kernels() is not None else weight.dtype
        return q8.qweight.float() * q8.scales.to(scale_dtype).float()[:, None]
    q = quantize_int4(weight, group_size)
    scale = q.scales.to(torch.bfloat16).float()
    groups = q.qweight.reshape(weight.shape[0], -1, group_size).float()
    native = int4_weight_kernels() is not None and group_size in quant_linear.INT4_NATIVE_GROUP_SIZES
    if native and weight.dtype == torch.bfloat16:
        return (groups * scale[..., None] + q.mins.to(torch.bfloat16).float()[..., None]).reshape(
            weight.shape
        )
    zero = (q.mins + 8 * q.scales).to(torch.bfloat16).float()
    return ((groups - 8) * scale[..., None] + zero[..., None]).reshape(weight.shape)


def projection_weight(name: str, tensor: torch.Tensor) -> bool:
    """The dense families' quantized weights: every layer projection (q/k/v/o, gate/up/down)."""
    return name.startswith("model.layers.") and name.endswith("proj.weight")


def dequantized_checkpoint(
    src: Path,
    dst: Path,
    method: str,
    group_size: int,
    quantized: Callable[[str, torch.Tensor], bool] = projection_weight,
) -> Path:
    """A copy of `src` whose quantized weights (`quantized(name, tensor)`) are replaced by their
    quantize -> dequantize round trip: what the quantized engine should compute, up to the kernels'
    bf16 rounding. (kvflow fuses q/k/v and gate/up along the output dimension; per-row scales and
    per-row groups are unaffected.)"""
    dst.mkdir()
    for item in src.iterdir():
        if item.name != "model.safetensors":
            shutil.copy(item, dst / item.name)
    tensors = load_file(src / "model.safetensors")
    for name, tensor in tensors.items():
        if quantized(name, tensor):
            tensors[name] = kernel_view(tensor, method, group_size).to(tensor.dtype)
    save_file(tensors, dst / "model.safetensors")
    return dst


# nats: int8 and int4 decode GEMVs quantize activations to int8 per 32 inputs (gemv_int8.cpp,
# gemv_int4.cpp); prefill chunks multiply bf16 activations by dequantized weights. The random model amplifies
# bf16 rounding anywhere upstream: per prompt, int8 measured 0.001-0.030 with torch's SDPA for
# prefill attention and 0.001-0.053 with the native kernel (which is as close to float32
# transformers: mean |logit error| 0.0097 vs 0.0098 on the bundled model), so int8 allows 0.075.
FIRST_TOKEN_LOGPROB_TOLERANCE = {"int8": 0.075, "int4": 0.15}


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_engine_with_quantized_weights_matches_the_dequantized_model(
    tiny_checkpoint_factory: Callable[..., Path],
    tmp_path: Path,
    method: str,
    prefill_through_dequantized_blocks: None,
) -> None:
    """The engine's quantized weights against the dequantized model. Prefill chunks take the
    dequantize-and-GEMM blocks, as on CPUs with a bf16 GEMM: on AVX2 they would take the GEMV,
    whose int8 activations this random model amplifies (int4: 0.29 nats on one prompt). The GEMV's
    error is bounded per output in test_native_quantized_paths_equal_the_dequantized_matmul, and its
    cost on a trained model measured with `kvflow quant-eval` (benchmarks/NOTES.md, session 14)."""
    path = tiny_checkpoint_factory("qwen2", dtype=torch.bfloat16)
    prompts = ["def main():", "import os", "class Stack:", "x = [1, 2"]
    quantized = LLM(str(path), max_model_len=128, quantization=method, quantization_group_size=32)
    modules = list(quantized.llm_engine.model_runner.model.modules())
    assert sum(isinstance(m, Int8Linear if method == "int8" else Int4Linear) for m in modules) == 4 * 2
    reference = LLM(str(dequantized_checkpoint(path, tmp_path / "deq", method, 32)), max_model_len=128)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=5)
    got, expected = quantized.generate(prompts, params), reference.generate(prompts, params)
    agree = total = 0
    for g, e in zip(got, expected, strict=True):
        g_ids, e_ids = g.outputs[0].token_ids, e.outputs[0].token_ids
        agree += sum(a == b for a, b in zip(g_ids, e_ids, strict=True))
        total += len(e_ids)
        # The first token comes from identical inputs: nearly the same logprob for it, and the same
        # argmax unless the reference has a near tie (random weights do: one prompt here has an
        # exact bf16 tie between its top two tokens), in which case ours is the tied one.
        # int4 prompts of <= 8 tokens go through the GEMV, which quantizes activations to int8 per
        # 32 inputs (as llama.cpp's q4 x q8): a further error this random model is sensitive to.
        tolerance = FIRST_TOKEN_LOGPROB_TOLERANCE[method]
        g_lp, e_lp = g.outputs[0].logprobs, e.outputs[0].logprobs
        assert g_lp is not None and e_lp is not None
        assert g_ids[0] in e_lp[0]
        assert abs(g_lp[0][g_ids[0]].logprob - e_lp[0][g_ids[0]].logprob) < tolerance
        assert e_lp[0][g_ids[0]].logprob >= e_lp[0][e_ids[0]].logprob - tolerance
    # Later tokens: a random-weight model's nearly flat distributions let bf16 rounding (different
    # accumulation order in the kernels) flip an argmax, after which the continuation diverges.
    print(f"{method}: greedy agreement with the dequantized model {agree}/{total}")


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("num_tiles", [1, 2, 3, 4, 5, 7, 9])
def test_native_quantized_gemv_gives_every_tile_count_the_same_bits(method: str, num_tiles: int) -> None:
    """At few rows a thread streams several int8 / int4 tiles side by side (simd.h kTileStreams,
    gemv_int4.cpp kInt4TileStreams) and the rest one by one: every tile count, row count and thread
    split gives each output the same bits (batch invariance), and the dequantized reference within
    the activations' int8 rounding."""
    if (int8_weight_kernels() if method == "int8" else int4_weight_kernels()) is None:
        pytest.skip("kvflow's native kernels are unavailable on this CPU")
    torch.manual_seed(num_tiles)
    # A partial last tile; int8: a partial 32-input block; int4: several groups of 32.
    n, k = 16 * num_tiles - 5, 200 if method == "int8" else 128
    weight = torch.randn(n, k).to(torch.bfloat16)
    module: Int8Linear | Int4Linear
    if method == "int8":
        q8 = quantize_int8(weight)
        module, reference = Int8Linear(q8, None, torch.bfloat16), q8.qweight.float() * q8.scales[:, None]
        scaled = reference  # the part multiplied by the int8 activations
    else:
        q4 = quantize_int4(weight, 32)
        module = Int4Linear(q4, None, torch.bfloat16)
        scale, low = q4.scales.to(torch.bfloat16).float(), q4.mins.to(torch.bfloat16).float()
        groups = q4.qweight.reshape(n, -1, 32).float()
        reference = (groups * scale[..., None] + low[..., None]).reshape(n, k)
        scaled = (groups * scale[..., None]).reshape(n, k)  # the minima meet exact sums of x
    module.max_gemv_rows = ALL_ROWS  # the GEMV at every row count (more than one pass from 9)
    threads = torch.get_num_threads()
    for m in range(1, 11):
        x = torch.randn(m, k).to(torch.bfloat16)
        y = module(x)
        # Each activation is off by at most half its 32-input block's step (max |x_b| / 254), each
        # output by one bf16 rounding.
        blocks = torch.nn.functional.pad(x.float().abs(), (0, -k % 32)).reshape(m, -1, 32)
        step = blocks.amax(-1, keepdim=True).expand(blocks.shape).reshape(m, -1)[:, :k]
        rounding = 2 * BF16_RELATIVE * (x.float().abs() @ reference.abs().t())
        tolerance = (step / 254) @ scaled.abs().t() + rounding + 1e-6
        assert bool(((y.float() - x.float() @ reference.t()).abs() <= tolerance).all())
        for row in range(m):
            assert torch.equal(module(x[row : row + 1])[0], y[row])
        torch.set_num_threads(1 if threads > 1 else 2)
        try:
            assert torch.equal(module(x), y)
        finally:
            torch.set_num_threads(threads)
