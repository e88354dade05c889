"""Pre-quantized checkpoints under tensor parallelism: a GPTQ (4-bit, group 32) checkpoint of the
tiny llama, packed by the format's definition, read packed slice by slice on two ranks, gives
TP=1's outputs within the bf16 rounding argument of test_tp_equivalence.py (the int4 kernels
compute in bf16); likewise an AWQ (GEMM, zero points) checkpoint, whose qweight is packed along the
outputs, and a compressed-tensors one; FP8 checkpoints (block scales, and compressed-tensors per
channel), whose e4m3 weights slice as dense ones and whose scales by block or by row; NVFP4
(compressed-tensors), whose codes and e4m3 scales slice by row and by 16-input group. Act-order
row-parallel splits, and splits that would cut a packed word, a group or a scale block, are
refused."""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_tp_equivalence import ENGINE, WIDE, _logprob_gaps, _run, _workload

from kvflow.arch_config import load_arch_config
from kvflow.config import ConfigError
from kvflow.engine.engine import LLMEngine
from kvflow.parallel.sharding import ShardLayout
from kvflow.quant.checkpoint_formats import CheckpointQuant, parse_quantization_config
from kvflow.quant.fp8 import FP8_DTYPE, Fp8Linear
from kvflow.quant.linear import Int4Linear

GROUP = 32


def pack_gptq(q_kn: torch.Tensor, zeros_gn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ's packing (tests/quant/test_checkpoint_formats.py): 8 levels per int32 along K, zeros along N."""
    shifts = torch.arange(0, 32, 4)
    qweight = (q_kn.reshape(-1, 8, q_kn.shape[1]).long() << shifts[None, :, None]).sum(1)
    qzeros = (zeros_gn.reshape(zeros_gn.shape[0], -1, 8).long() << shifts[None, None, :]).sum(-1)
    return qweight.to(torch.int32), qzeros.to(torch.int32)


def gptq_tensors(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """w [N, K] -> GPTQ v1 tensors: w ~ (q - z) x s per group of GROUP inputs, z an integer level."""
    n, k = weight.shape
    w = weight.float().reshape(n, k // GROUP, GROUP)
    lo, hi = w.amin(-1), w.amax(-1)
    scale = torch.where(hi > lo, (hi - lo) / 15, torch.ones_like(lo))  # [N, G]
    zero = torch.round(-lo / scale).clamp(1, 15)  # v1 stores zero - 1, which must stay a nibble
    q = torch.round(w / scale[..., None] + zero[..., None]).clamp(0, 15).reshape(n, k)
    qweight, qzeros = pack_gptq(q.t().long(), (zero - 1).t().long())  # v1 stores zeros minus one
    g_idx = (torch.arange(k) // GROUP).to(torch.int32)
    return {"qweight": qweight, "qzeros": qzeros, "scales": scale.t().half().contiguous(), "g_idx": g_idx}


def pack_awq(q_kn: torch.Tensor, zeros_gn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """AWQ GEMM's packing (autoawq's WQLinear_GEMM.from_linear): 8 levels per int32 along N, bits
    4j..4j+3 of word c holding column 8c + (0, 2, 4, 6, 1, 3, 5, 7)[j]; zeros packed the same way."""
    order = torch.tensor([0, 2, 4, 6, 1, 3, 5, 7])
    shifts = torch.arange(0, 32, 4)

    def pack(levels: torch.Tensor) -> torch.Tensor:
        words = levels.long().reshape(levels.shape[0], -1, 8)[:, :, order]
        # A high nibble >= 8 wraps to a negative int32, as checkpoints store it.
        return (words << shifts[None, None, :]).sum(-1).to(torch.int32)

    return pack(q_kn), pack(zeros_gn)


def awq_tensors(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """w [N, K] -> AWQ GEMM tensors (zero_point: true): w[k, n] ~ (q - z) x s per group of GROUP inputs."""
    n, k = weight.shape
    w = weight.float().reshape(n, k // GROUP, GROUP)
    lo, hi = w.amin(-1), w.amax(-1)
    scale = torch.where(hi > lo, (hi - lo) / 15, torch.ones_like(lo))  # [N, G]
    zero = torch.round(-lo / scale).clamp(0, 15)
    q = torch.round(w / scale[..., None] + zero[..., None]).clamp(0, 15).reshape(n, k)
    qweight, qzeros = pack_awq(q.t(), zero.t())
    return {"qweight": qweight, "qzeros": qzeros, "scales": scale.t().half().contiguous()}


def quantized_checkpoint(
    src: Path,
    out: Path,
    tensors_of: Callable[[torch.Tensor], dict[str, torch.Tensor]],
    quantization_config: dict[str, object],
) -> Path:
    """A copy of `src` with every layer projection replaced by `tensors_of(weight)`."""
    shutil.copytree(src, out, dirs_exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in load_file(src / "model.safetensors").items():
        if name.startswith("model.layers.") and name.endswith("proj.weight"):
            base = name.removesuffix(".weight")
            tensors.update({f"{base}.{k}": v for k, v in tensors_of(tensor).items()})
        else:
            tensors[name] = tensor
    save_file(tensors, out / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (out / "config.json").write_text(json.dumps(config))
    return out


# The yardstick is the largest float32-vs-bf16 logprob gap of the dense model (bf16 noise). Decode
# rows of w4a16 layers quantize their activations to int8 per 32 inputs (gemv_int4.cpp), and TP=2's
# reordered bf16 sums can move a value across a quantization step: the largest TP gap over the ~200
# compared logprobs measured 0.32 against a yardstick of 0.38 with torch's SDPA in prefill, and
# 0.41-0.45 against 0.38 with the native prefill attention (itself as close to float32 as SDPA:
# mean gap 0.042 vs 0.043, largest 0.377 vs 0.380). A maximum over a few hundred draws moves that
# much; 1.5x keeps the test meaningful (a sharding bug gives gaps of several nats).
W4A16_NOISE_MARGIN = 1.5


@pytest.fixture(scope="module")
def gptq_checkpoint(
    tiny_checkpoint_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    src = tiny_checkpoint_factory("llama", dtype=torch.bfloat16, **WIDE)
    config = {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False}
    return quantized_checkpoint(src, tmp_path_factory.mktemp("gptq"), gptq_tensors, config)


@pytest.fixture(scope="module")
def awq_checkpoint(
    tiny_checkpoint_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    src = tiny_checkpoint_factory("llama", dtype=torch.bfloat16, **WIDE)
    config = {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"}
    return quantized_checkpoint(src, tmp_path_factory.mktemp("awq"), awq_tensors, config)


@pytest.fixture
def engines() -> Iterator[list[LLMEngine]]:
    made: list[LLMEngine] = []
    yield made
    for engine in made:
        if engine.parallel is not None:
            engine.parallel.shutdown()


@pytest.mark.parametrize("fmt", ["gptq", "awq"])
def test_gptq_and_awq_checkpoints_two_ranks_match_one(
    fmt: str,
    request: pytest.FixtureRequest,
    tiny_checkpoint_factory: Callable[..., Path],
    engines: list[LLMEngine],
    prefill_through_dequantized_blocks: None,
) -> None:
    # Blocks, not the AVX2 GEMV: int8 activations turn the ranks' different fp32 summation orders
    # into whole rounding steps, which this random model amplifies past the float32-vs-bf16 gap.
    checkpoint: Path = request.getfixturevalue(f"{fmt}_checkpoint")
    dense = tiny_checkpoint_factory("llama", dtype=torch.bfloat16, **WIDE)
    work = _workload(512, logprobs=5)
    float32 = _run(LLMEngine.from_kwargs(model=str(dense), dtype="float32", **ENGINE), work)
    bfloat16 = _run(LLMEngine.from_kwargs(model=str(dense), dtype="bfloat16", **ENGINE), work)
    tolerance = max(_logprob_gaps(float32, bfloat16))
    expected = _run(LLMEngine.from_kwargs(model=str(checkpoint), **ENGINE), work)
    engines.append(LLMEngine.from_kwargs(model=str(checkpoint), tensor_parallel_size=2, **ENGINE))
    rank0 = engines[-1].model_runner.model
    assert (
        sum(isinstance(m, Int4Linear) for m in rank0.modules()) == 4 * 2
    )  # qkv, o, gate_up, down x 2 layers
    gaps = _logprob_gaps(expected, _run(engines[-1], work))
    assert len(gaps) > 100
    assert max(gaps) <= W4A16_NOISE_MARGIN * tolerance


def test_act_order_row_parallel_is_refused(gptq_checkpoint: Path) -> None:
    arch = load_arch_config(gptq_checkpoint)
    quant = parse_quantization_config(json.loads((gptq_checkpoint / "config.json").read_text()))
    assert quant is not None
    ShardLayout.plan(arch, 0, 2, checkpoint_quant=quant)  # without act-order: fine
    act_order = CheckpointQuant("gptq", 4, GROUP, True, desc_act=True)
    with pytest.raises(ConfigError, match="act-order"):
        ShardLayout.plan(arch, 0, 2, checkpoint_quant=act_order)
    with pytest.raises(ConfigError, match="groups would be split"):  # 64 columns per rank, groups of 128
        ShardLayout.plan(arch, 0, 2, checkpoint_quant=CheckpointQuant("gptq", 4, 128, True))


def test_awq_splits_that_cut_a_word_or_a_group_are_refused(awq_checkpoint: Path) -> None:
    arch = load_arch_config(awq_checkpoint)
    quant = parse_quantization_config(json.loads((awq_checkpoint / "config.json").read_text()))
    assert quant == CheckpointQuant("awq", 4, GROUP, False)
    ShardLayout.plan(arch, 0, 2, checkpoint_quant=quant)
    with pytest.raises(ConfigError, match="groups would be split"):  # 64 columns per rank, groups of 128
        ShardLayout.plan(arch, 0, 2, checkpoint_quant=CheckpointQuant("awq", 4, 128, False))
    # 136 MLP outputs: 68 per rank would cut gate_proj/up_proj's qweight words (8 columns each).
    odd = dataclasses.replace(arch, intermediate_size=136)
    with pytest.raises(ConfigError, match="gate_proj/up_proj would hold 68 outputs"):
        ShardLayout.plan(odd, 0, 2, checkpoint_quant=quant)


def ct_tensors(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """compressed-tensors' own packing (pack-quantized, 4-bit, asymmetric, group GROUP): zero points
    are packed along the outputs, so each rank reads words of them too."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    args = QuantizationArgs(num_bits=4, symmetric=False, group_size=GROUP, strategy="group")
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    w = weight.float()
    groups = w.reshape(w.shape[0], -1, GROUP)
    lo, hi = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)
    scale = (hi - lo) / 15
    zero_point = (torch.round(-lo / scale) - 8).to(torch.int8)  # the library's signed domain
    state = {"weight": w, "weight_scale": scale.to(torch.bfloat16), "weight_zero_point": zero_point}
    return dict(PackedQuantizationCompressor.compress(state, scheme))


def test_compressed_tensors_checkpoint_two_ranks_match_one(
    tiny_checkpoint_factory: Callable[..., Path], tmp_path: Path, engines: list[LLMEngine]
) -> None:
    pytest.importorskip("compressed_tensors", reason="compressed-tensors is a test dependency")
    src = tiny_checkpoint_factory("qwen2", dtype=torch.bfloat16, **WIDE)
    config = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "strategy": "group", "group_size": GROUP, "symmetric": False}}},
    }  # fmt: skip
    out = quantized_checkpoint(src, tmp_path / "w4a16", ct_tensors, config)
    work = _workload(512, logprobs=5)
    float32 = _run(LLMEngine.from_kwargs(model=str(src), dtype="float32", **ENGINE), work)
    bfloat16 = _run(LLMEngine.from_kwargs(model=str(src), dtype="bfloat16", **ENGINE), work)
    expected = _run(LLMEngine.from_kwargs(model=str(out), **ENGINE), work)
    engines.append(LLMEngine.from_kwargs(model=str(out), tensor_parallel_size=2, **ENGINE))
    gaps = _logprob_gaps(expected, _run(engines[-1], work))
    assert len(gaps) > 100
    assert max(gaps) <= W4A16_NOISE_MARGIN * max(_logprob_gaps(float32, bfloat16))


FP8_MAX = 448.0  # e4m3's largest finite value
FP8_BLOCK = 32  # rows and columns per scale block: each rank's 64-wide slices hold whole blocks


def fp8_block_tensors(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """w [N, K] -> DeepSeek's fp8 tensors: e4m3 `weight` and `weight_scale_inv` [N / b, K / b],
    absmax / 448 per b x b block (N and K multiples of b here)."""
    n, k, b = *weight.shape, FP8_BLOCK
    blocks = weight.float().reshape(n // b, b, k // b, b)
    scale = blocks.abs().amax(dim=(1, 3)) / FP8_MAX  # [N / b, K / b]
    q = (blocks / scale[:, None, :, None]).reshape(n, k).to(FP8_DTYPE)
    return {"weight": q, "weight_scale_inv": scale}


def fp8_channel_tensors(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """w [N, K] -> compressed-tensors float-quantized per channel: `weight` e4m3, `weight_scale` [N, 1]."""
    w = weight.float()
    scale = w.abs().amax(dim=1, keepdim=True) / FP8_MAX
    return {"weight": (w / scale).to(FP8_DTYPE), "weight_scale": scale.to(torch.bfloat16)}


FP8_FORMATS = {
    "block": (
        fp8_block_tensors,
        {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [FP8_BLOCK] * 2},
    ),
    "channel": (
        fp8_channel_tensors,
        {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
                }
            },
        },
    ),
}


@pytest.mark.parametrize("layout", list(FP8_FORMATS))
def test_fp8_checkpoints_two_ranks_match_one(
    layout: str, tiny_checkpoint_factory: Callable[..., Path], tmp_path: Path, engines: list[LLMEngine]
) -> None:
    """The e4m3 bytes are kept on each rank (Fp8Linear, 1 byte per weight); the ranks' different bf16
    summation orders are the only difference from one rank, bounded as for the dense model."""
    tensors_of, config = FP8_FORMATS[layout]
    src = tiny_checkpoint_factory("llama", dtype=torch.bfloat16, **WIDE)
    out = quantized_checkpoint(src, tmp_path / layout, tensors_of, config)
    work = _workload(512, logprobs=5)
    float32 = _run(LLMEngine.from_kwargs(model=str(src), dtype="float32", **ENGINE), work)
    bfloat16 = _run(LLMEngine.from_kwargs(model=str(src), dtype="bfloat16", **ENGINE), work)
    expected = _run(LLMEngine.from_kwargs(model=str(out), **ENGINE), work)
    engines.append(LLMEngine.from_kwargs(model=str(out), tensor_parallel_size=2, **ENGINE))
    rank0 = engines[-1].model_runner.model
    assert sum(isinstance(m, Fp8Linear) for m in rank0.modules()) == 4 * 2  # qkv, o, gate_up, down x 2
    gaps = _logprob_gaps(expected, _run(engines[-1], work))
    assert len(gaps) > 100
    assert max(gaps) <= max(_logprob_gaps(float32, bfloat16))


def test_fp8_splits_that_cut_a_scale_block_are_refused(tiny_checkpoint_factory: Callable[..., Path]) -> None:
    arch = load_arch_config(tiny_checkpoint_factory("llama", dtype=torch.bfloat16, **WIDE))
    # Per rank: 64 query and MLP outputs, 32 KV outputs (one head), 64 o_proj / down_proj inputs.
    ShardLayout.plan(arch, 0, 2, checkpoint_quant=CheckpointQuant("fp8", 8, 64, True, block_rows=32))
    with pytest.raises(ConfigError, match=r"k_proj/v_proj would hold 32 outputs, not a multiple of .* 64"):
        ShardLayout.plan(arch, 0, 2, checkpoint_quant=CheckpointQuant("fp8", 8, 64, True, block_rows=64))
    with pytest.raises(ConfigError, match="64 input columns, not a multiple of the weight_block_size's 128"):
        ShardLayout.plan(arch, 0, 2, checkpoint_quant=CheckpointQuant("fp8", 8, 128, True, block_rows=32))
    ShardLayout.plan(arch, 0, 2, checkpoint_quant=CheckpointQuant("compressed-tensors-fp8", 8, -1, True))


def test_nvfp4_checkpoints_two_ranks_match_one(
    tiny_checkpoint_factory: Callable[..., Path], tmp_path: Path, engines: list[LLMEngine]
) -> None:
    """compressed-tensors NVFP4 (written by compressed-tensors' own compressor): codes and e4m3 scales
    slice by rows and by 16-input groups, the global scale is read whole; each rank's projections
    compute on their codes (GGUFLinear), bounded as the W4A16 formats above."""
    pytest.importorskip("compressed_tensors")
    from quant.test_nvfp4_checkpoints import _compress, _scheme

    from kvflow.quant.gguf_linear import GGUFLinear

    config = {
        "quant_method": "compressed-tensors",
        "format": "nvfp4-pack-quantized",
        "config_groups": {"group_0": _scheme().model_dump(mode="json")},
    }
    src = tiny_checkpoint_factory("llama", dtype=torch.bfloat16, **WIDE)
    out = quantized_checkpoint(src, tmp_path / "nvfp4", _compress, config)
    work = _workload(512, logprobs=5)
    # float32 runs the dequantized weights: TP=2 there equals TP=1 to float32 rounding (the slices
    # are exact); in bf16 the bound is the kernel's own rounding (float32 against bf16 at TP=1).
    float32 = _run(LLMEngine.from_kwargs(model=str(out), dtype="float32", **ENGINE), work)
    engines.append(LLMEngine.from_kwargs(model=str(out), dtype="float32", tensor_parallel_size=2, **ENGINE))
    assert max(_logprob_gaps(float32, _run(engines[-1], work))) < 1e-4
    expected = _run(LLMEngine.from_kwargs(model=str(out), **ENGINE), work)
    engines.append(LLMEngine.from_kwargs(model=str(out), tensor_parallel_size=2, **ENGINE))
    rank0 = engines[-1].model_runner.model
    assert sum(isinstance(m, GGUFLinear) for m in rank0.modules()) == 4 * 2  # qkv, o, gate_up, down x 2
    gaps = _logprob_gaps(expected, _run(engines[-1], work))
    assert len(gaps) > 100
    kernel_rounding = max(_logprob_gaps(float32, expected))
    print(f"NVFP4 TP=2 vs TP=1 in bf16: max gap {max(gaps):.3f}; the kernel's rounding {kernel_rounding:.3f}")
    assert max(gaps) <= W4A16_NOISE_MARGIN * kernel_rounding


def test_nvfp4_splits_that_cut_a_kernel_block_are_refused(
    tiny_checkpoint_factory: Callable[..., Path],
) -> None:
    arch = load_arch_config(tiny_checkpoint_factory("llama", dtype=torch.bfloat16, **WIDE))
    nvfp4 = CheckpointQuant("compressed-tensors-nvfp4", 4, 16, True)
    ShardLayout.plan(arch, 0, 2, checkpoint_quant=nvfp4)  # 64 o_proj / down_proj inputs per rank
    narrow = dataclasses.replace(arch, intermediate_size=48)  # 24 down_proj inputs per rank
    with pytest.raises(ConfigError, match="down_proj would hold 24 input columns, not a multiple of 32"):
        ShardLayout.plan(narrow, 0, 2, checkpoint_quant=nvfp4)
