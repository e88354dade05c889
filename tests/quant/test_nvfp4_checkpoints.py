"""compressed-tensors NVFP4 checkpoints (format nvfp4-pack-quantized: e2m1 codes, an e4m3 scale per
16 inputs, a global scale per tensor), written in the test by compressed-tensors' own compressor from
a tiny Llama's weights. Its decompression is the reference: kvflow's unpacking equals it bit for bit;
greedy tokens in float32 identical to transformers on those dequantized weights; in bf16 the
projections compute on their 4.5-bit codes (GGUFLinear, gemv_ggml.cpp) and agree with the
dequantized bf16 model, teacher-forced."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvflow import LLM, SamplingParams
from kvflow.errors import ModelLoadError
from kvflow.quant.gguf_linear import GGUFLinear, unpack_nvfp4_packed

ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor  # noqa: E402
from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8  # noqa: E402
from compressed_tensors.quantization import preset_name_to_scheme  # noqa: E402
from compressed_tensors.quantization.lifecycle.forward import dequantize  # noqa: E402

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
E4M3_MAX, E2M1_MAX = 448.0, 6.0
GROUP = 16


def _scheme() -> Any:
    return preset_name_to_scheme("NVFP4A16", ["Linear"])


def _compress(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """w [N, K] -> compressed-tensors' NVFP4 tensors, with the observers' min-max rule: the global
    scale maps the tensor's absmax onto e4m3 x e2m1's range, each 16's scale its absmax / 6."""
    n, k = w.shape
    global_scale = (E4M3_MAX * E2M1_MAX / w.abs().max()).reshape(1).float()
    group_scale = (w.reshape(n, k // GROUP, GROUP).abs().amax(-1) / E2M1_MAX * global_scale).clamp(
        max=E4M3_MAX
    )
    scale = group_scale.to(torch.float8_e4m3fn).float()
    state = {"weight": w.float(), "weight_scale": scale, "weight_global_scale": global_scale}
    return dict(NVFP4PackedCompressor.compress(state, _scheme()))


def _reference_dequantize(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """compressed-tensors' decompression, in float32."""
    packed = tensors["weight_packed"]
    n, half = packed.shape
    codes = unpack_fp4_from_uint8(packed, n, 2 * half, dtype=torch.float32)
    scale = tensors["weight_scale"].float()
    args = _scheme().weights
    return dequantize(
        codes, scale, args=args, global_scale=tensors["weight_global_scale"], dtype=torch.float32
    )


def _write_pair(source: Path, out: Path) -> tuple[Path, Path]:
    """(nvfp4 checkpoint, the same weights dequantized by compressed-tensors in float32)."""
    quantized, dequantized = out / "nvfp4", out / "dequantized"
    for d in (quantized, dequantized):
        shutil.copytree(source, d)
    tensors = load_file(source / "model.safetensors")
    q_tensors: dict[str, torch.Tensor] = {}
    d_tensors: dict[str, torch.Tensor] = {}
    for name, w in tensors.items():
        if not any(f".{p}.weight" in name for p in PROJECTIONS):
            q_tensors[name] = d_tensors[name] = w
            continue
        base = name.removesuffix(".weight")
        compressed = _compress(w)
        for suffix, t in compressed.items():
            q_tensors[f"{base}.{suffix}"] = t.contiguous()
        d_tensors[name] = _reference_dequantize(compressed)
    save_file(q_tensors, quantized / "model.safetensors")
    save_file(d_tensors, dequantized / "model.safetensors")
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "nvfp4-pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": _scheme().model_dump(mode="json")},
        "ignore": ["lm_head"],
    }
    (quantized / "config.json").write_text(json.dumps(config))
    return quantized, dequantized


def test_unpacking_equals_compressed_tensors_decompression() -> None:
    torch.manual_seed(0)
    w = torch.randn(40, 96)
    w[3, 7] = 40.0  # an outlier: its group's scale is coarse, the rest of the tensor's fine
    w[5] *= 1e-4  # a row of tiny values: subnormal e4m3 scales
    tensors = _compress(w)
    assert (tensors["weight_scale"].view(torch.uint8)[5] < 8).any()  # the subnormal scales are there
    ours = unpack_nvfp4_packed(
        tensors["weight_packed"], tensors["weight_scale"], tensors["weight_global_scale"]
    )
    assert torch.equal(ours.dequantize(), _reference_dequantize(tensors))


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])  # qwen3_moe: the experts' projections too
def test_nvfp4_checkpoints_match_transformers_on_the_dequantized_weights(
    tiny_checkpoint_factory: Callable[..., Path], tmp_path: Path, arch: str
) -> None:
    from models.test_hf_equivalence import _check, _params, hf_reference

    quantized, dequantized = _write_pair(tiny_checkpoint_factory(arch), tmp_path)
    reference = hf_reference(dequantized)
    outputs = LLM(str(quantized), dtype="float32").generate(reference["prompts"], _params())
    _check(reference, outputs)


def test_bf16_decode_computes_on_the_codes_and_agrees_with_the_dequantized_model(
    tiny_checkpoint_factory: Callable[..., Path], tmp_path: Path
) -> None:
    from kvflow.kernels import ggml_weight_kernels

    if ggml_weight_kernels() is None:
        pytest.skip("native kernels unavailable on this machine")
    from quant.test_kv_quant import teacher_forced_agreement

    quantized, dequantized = _write_pair(tiny_checkpoint_factory("llama"), tmp_path)
    prompts = [[5 + i, 17, 42 + i, 99, 7] * 4 for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    reference = [
        o.outputs[0].token_ids for o in LLM(str(dequantized), dtype="bfloat16").generate(prompts, params)
    ]
    llm = LLM(str(quantized), dtype="bfloat16", max_num_batched_tokens=4, enable_prefix_caching=False)
    model: Any = llm.llm_engine.model_runner.model
    layers = [m for m in model.modules() if isinstance(m, GGUFLinear)]
    assert len(layers) == 4 * len(model.layers)  # qkv, o, gate_up, down: merged as kvflow merges them
    assert all(m.type_name == "NVFP4" and m.values.dtype == torch.uint8 for m in layers)
    agree, total = teacher_forced_agreement(llm, prompts, reference)
    print(f"NVFP4 GEMV vs dequantized bf16: teacher-forced top-1 agreement {agree}/{total}")
    # The GEMV rounds activations to int8 per 32 (as llama.cpp's q8 products do); the tiny random
    # model's near-tied logits flip under that: 43/48 measured (tests/models/test_gguf_equivalence.py).
    assert agree / total >= 0.8


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("negative_scale", "negative or NaN e4m3 scales"),
        ("short_scale", r"NVFP4 weight_packed .* and weight_scale"),
        ("two_global_scales", "weight_global_scale must be one positive number"),
    ],
)
def test_damaged_nvfp4_tensors_name_the_projection(
    tiny_checkpoint_factory: Callable[..., Path], tmp_path: Path, damage: str, message: str
) -> None:
    quantized, _ = _write_pair(tiny_checkpoint_factory("llama"), tmp_path)
    tensors = load_file(quantized / "model.safetensors")
    base = next(n for n in tensors if n.endswith("o_proj.weight_scale")).removesuffix(".weight_scale")
    if damage == "negative_scale":
        raw = tensors[f"{base}.weight_scale"].view(torch.uint8).clone()
        raw[0, 0] |= 0x80
        tensors[f"{base}.weight_scale"] = raw.view(torch.float8_e4m3fn)
    elif damage == "short_scale":
        tensors[f"{base}.weight_scale"] = tensors[f"{base}.weight_scale"][:, :1].contiguous()
    else:
        tensors[f"{base}.weight_global_scale"] = torch.ones(2)
    save_file(tensors, quantized / "model.safetensors")
    with pytest.raises(ModelLoadError, match=message) as info:
        LLM(str(quantized), dtype="float32")
    assert "o_proj" in str(info.value)
