"""Pre-quantized checkpoint formats: kvflow's unpacking against each reference library's own
dequantization, where the library installs on this CPU machine (compressed-tensors always: it is
a test dependency; autoawq's packing utilities when installed; gptqmodel when importable), and a
pre-quantized checkpoint loaded end to end."""

from __future__ import annotations

import importlib.util
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvflow import LLM, SamplingParams
from kvflow.quant.checkpoint_formats import (
    CheckpointQuant,
    UnpackedInt4,
    UnpackedInt8,
    unpack_awq,
    unpack_compressed_tensors,
    unpack_gptq,
)
from kvflow.quant.linear import Int4Linear, Int8Linear

N, K = 48, 256


def ct_compress(weight: torch.Tensor, bits: int, group_size: int | None, symmetric: bool) -> dict[str, Any]:
    """Quantize and pack with compressed-tensors itself; returns (its tensors, its dequantization)."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    strategy = "group" if group_size else "channel"
    args = QuantizationArgs(num_bits=bits, symmetric=symmetric, group_size=group_size, strategy=strategy)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    rows, cols = weight.shape
    groups = weight.reshape(rows, -1, group_size or cols)
    lo, hi = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)
    levels = 2**bits - 1
    if symmetric:
        scale = torch.maximum(hi, -lo) / (levels // 2)
        zero_point = torch.zeros_like(scale, dtype=torch.int8)
    else:
        scale = (hi - lo) / levels
        zero_point = (torch.round(-lo / scale) - 2 ** (bits - 1)).to(torch.int8)  # signed domain
    state = {"weight": weight, "weight_scale": scale.to(torch.bfloat16), "weight_zero_point": zero_point}
    packed = PackedQuantizationCompressor.compress(state, scheme)
    reference = PackedQuantizationCompressor.decompress(dict(packed), scheme)["weight"]
    return {"packed": packed, "reference": reference}


@pytest.mark.parametrize(
    ("bits", "group_size", "symmetric"), [(4, 32, True), (4, 64, False), (8, None, True)]
)
def test_compressed_tensors_unpacking_equals_the_library(
    bits: int, group_size: int | None, symmetric: bool
) -> None:
    pytest.importorskip("compressed_tensors", reason="compressed-tensors is a test dependency")
    weight = torch.randn(N, K, generator=torch.Generator().manual_seed(0))
    out = ct_compress(weight, bits, group_size, symmetric)
    quant = CheckpointQuant("compressed-tensors", bits, group_size or -1, symmetric)
    mine = unpack_compressed_tensors(out["packed"], quant)
    assert isinstance(mine, UnpackedInt8 if bits == 8 else UnpackedInt4)
    # Bit for bit: the library rounds (q - zp) x scale once to the scale's dtype (bf16); kvflow's
    # float32 q x scale + min is exact, so one rounding to bf16 gives the same bits.
    reference = out["reference"]
    assert reference.dtype == torch.bfloat16
    assert torch.equal(mine.dequantize().to(torch.bfloat16), reference)


def _awq_reference() -> Any:
    spec = importlib.util.find_spec("awq")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(
            "autoawq is not installed (pip install autoawq --no-deps: its packing_utils need only torch)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "utils" / "packing_utils.py"
    # Loaded by path: the package's __init__ imports accelerate/transformers kernels we do not need.
    module_spec = importlib.util.spec_from_file_location("awq_packing_utils", path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def test_awq_unpacking_equals_autoawq() -> None:
    awq = _awq_reference()
    gen = torch.Generator().manual_seed(1)
    group = 64
    qweight = torch.randint(-(2**31), 2**31 - 1, (K, N // 8), generator=gen, dtype=torch.int64).to(
        torch.int32
    )
    qzeros = torch.randint(-(2**31), 2**31 - 1, (K // group, N // 8), generator=gen, dtype=torch.int64).to(
        torch.int32
    )
    scales = (torch.rand(K // group, N, generator=gen) * 0.01).half()
    reference = awq.dequantize_gemm(qweight, qzeros, scales, 4, group)  # [K, N] fp16
    mine = unpack_awq(
        {"qweight": qweight, "qzeros": qzeros, "scales": scales}, CheckpointQuant("awq", 4, group, False)
    )
    assert torch.equal(mine.dequantize().half(), reference.t())


def test_gptq_unpacking_equals_gptqmodel() -> None:
    try:
        from gptqmodel.nn_modules.qlinear.torch import TorchQuantLinear  # noqa: F401
    except Exception as exc:  # gptqmodel needs CUDA-era dependencies (pcre, device-smi, ...)
        pytest.skip(f"gptqmodel does not import on this machine: {type(exc).__name__}: {exc}")
    # A tripwire, not a pass: where gptqmodel imports, the reference comparison is owed.
    pytest.fail("gptqmodel imports here: compare unpack_gptq with TorchQuantLinear.dequantize_weight()")


def pack_gptq(q_kn: torch.Tensor, zeros_gn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ's packing (the format's definition): 8 levels per int32 along K; zeros along N."""
    shifts = torch.arange(0, 32, 4)
    qweight = (q_kn.reshape(-1, 8, q_kn.shape[1]).long() << shifts[None, :, None]).sum(1)
    qzeros = (zeros_gn.reshape(zeros_gn.shape[0], -1, 8).long() << shifts[None, None, :]).sum(-1)
    return qweight.to(torch.int64).to(torch.int32), qzeros.to(torch.int32)


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_unpacking_follows_the_format(act_order: bool) -> None:
    """Without gptqmodel: pack levels by the format's definition, unpack, compare with the formula
    w[n, k] = (q[k, n] - (z[g_idx[k], n] + 1)) x s[g_idx[k], n] (v1 zeros are stored minus one)."""
    gen = torch.Generator().manual_seed(2)
    group = 32
    q_kn = torch.randint(0, 16, (K, N), generator=gen)
    stored_zeros = torch.randint(0, 15, (K // group, N), generator=gen)
    scales = (torch.rand(K // group, N, generator=gen) * 0.01).half()
    g_idx = torch.arange(K) // group
    if act_order:
        g_idx = g_idx[torch.randperm(K, generator=gen)]
    qweight, qzeros = pack_gptq(q_kn, stored_zeros)
    tensors = {"qweight": qweight, "qzeros": qzeros, "scales": scales, "g_idx": g_idx.to(torch.int32)}
    mine = unpack_gptq(tensors, CheckpointQuant("gptq", 4, group, True, desc_act=act_order))
    assert (mine.perm is not None) == act_order
    expected = ((q_kn - (stored_zeros[g_idx] + 1)) * scales[g_idx].float()).t()
    assert torch.equal(mine.dequantize(), expected)
    # The kernel layer computes x @ w^T with the permutation applied to x.
    layer = Int4Linear(mine_weight(mine), None, torch.bfloat16, mine.perm)
    x = torch.randn(3, K, generator=gen).bfloat16()
    ref = x.float() @ expected.t()
    assert float((layer(x).float() - ref).abs().max()) <= 0.02 * float(ref.abs().max())


def mine_weight(u: UnpackedInt4) -> Any:
    from kvflow.quant.weights import Int4Weight

    return Int4Weight(u.q, u.scale, u.min, u.group_size)


def write_w4a16_checkpoints(src: Path, out_dir: Path) -> tuple[Path, Path]:
    """`src` as llm-compressor's w4a16 writes it (every decoder-layer projection packed by
    compressed-tensors: 4 bits, groups of 32, asymmetric) and, beside it, the same checkpoint with
    those weights replaced by their bf16 dequantization: (packed_dir, dense_dir)."""
    packed_dir, dense_dir = out_dir / "w4a16", out_dir / "dequantized"
    for d in (packed_dir, dense_dir):
        shutil.copytree(src, d)
    packed_tensors, dense_tensors = {}, {}
    for name, tensor in load_file(src / "model.safetensors").items():
        if name.startswith("model.layers.") and name.endswith("proj.weight"):
            out = ct_compress(tensor.float(), 4, 32, False)
            base = name.removesuffix(".weight")
            packed_tensors.update({f"{base}.{k}": v for k, v in out["packed"].items()})
            dense_tensors[name] = out["reference"].to(torch.bfloat16)
        else:
            packed_tensors[name] = dense_tensors[name] = tensor
    save_file(packed_tensors, packed_dir / "model.safetensors")
    save_file(dense_tensors, dense_dir / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "strategy": "group", "group_size": 32, "symmetric": False}}},
    }  # fmt: skip
    (packed_dir / "config.json").write_text(json.dumps(config))
    return packed_dir, dense_dir


def test_compressed_tensors_checkpoint_loads_and_matches_its_dequantization(
    tiny_checkpoint_factory: Callable[..., Path], tmp_path: Path, prefill_through_dequantized_blocks: None
) -> None:
    pytest.importorskip("compressed_tensors", reason="compressed-tensors is a test dependency")
    src = tiny_checkpoint_factory("qwen2", dtype=torch.bfloat16)
    packed_dir, dense_dir = write_w4a16_checkpoints(src, tmp_path)
    quantized = LLM(str(packed_dir), max_model_len=128)
    modules = list(quantized.llm_engine.model_runner.model.modules())
    num_layers = json.loads((src / "config.json").read_text())["num_hidden_layers"]
    assert sum(isinstance(m, Int4Linear) for m in modules) == 4 * num_layers  # qkv, o, gate_up, down
    assert not any(isinstance(m, Int8Linear) for m in modules)
    dense = LLM(str(dense_dir), max_model_len=128)
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=3)
    prompts = ["def main():", "import os"]
    for q, d in zip(quantized.generate(prompts, params), dense.generate(prompts, params), strict=True):
        assert q.outputs[0].token_ids == d.outputs[0].token_ids
        q_lp, d_lp = q.outputs[0].logprobs, d.outputs[0].logprobs
        assert q_lp is not None and d_lp is not None
        token = d.outputs[0].token_ids[0]
        assert abs(q_lp[0][token].logprob - d_lp[0][token].logprob) < 0.05
