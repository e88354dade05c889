"""FP8 checkpoints (kvflow/quant/fp8.py): DeepSeek-style e4m3 weights with block scales
(`quant_method: fp8`, `weight_block_size`) and compressed-tensors float-quantized per channel,
made in the test from a tiny Llama's weights. kvflow keeps them at one byte per weight; greedy tokens
in float32 identical to transformers on the same weights dequantized."""

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
from kvflow.quant.fp8 import FP8_DTYPE, Fp8Linear

FP8_MAX = 448.0
# Blocks that do not divide the tiny model's 64 / 128 / 32-wide projections: partial blocks on both axes.
BLOCK = (48, 40)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _quantize_blocks(w: torch.Tensor, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (e4m3 [N, K], scale [ceil(N / rows), ceil(K / cols)]): absmax / 448 per block."""
    n, k = w.shape
    scale = torch.zeros(-(-n // rows), -(-k // cols))
    q = torch.empty(n, k, dtype=FP8_DTYPE)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            block = w[i * rows : (i + 1) * rows, j * cols : (j + 1) * cols]
            s = float(block.abs().max()) / FP8_MAX
            scale[i, j] = s
            q[i * rows : (i + 1) * rows, j * cols : (j + 1) * cols] = (block / s).to(FP8_DTYPE)
    return q, scale


def _write_pair(source: Path, out: Path, layout: str) -> tuple[Path, Path]:
    """(fp8 checkpoint, the same weights dequantized in float32) from a float32 checkpoint."""
    quantized, dequantized = out / "fp8", out / "dequantized"
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
        if layout == "block":
            q, scale = _quantize_blocks(w.float(), *BLOCK)
            q_tensors[f"{base}.weight_scale_inv"] = scale
            deq = (
                q.float()
                * scale.repeat_interleave(BLOCK[0], 0)[: w.shape[0]].repeat_interleave(BLOCK[1], 1)[
                    :, : w.shape[1]
                ]
            )
        else:  # channel
            q, scale = _quantize_blocks(w.float(), 1, w.shape[1])
            q_tensors[f"{base}.weight_scale"] = scale  # [N, 1]
            deq = q.float() * scale
        q_tensors[name] = q
        d_tensors[name] = deq
    save_file(q_tensors, quantized / "model.safetensors")
    save_file(d_tensors, dequantized / "model.safetensors")
    config = json.loads((quantized / "config.json").read_text())
    if layout == "block":
        config["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": list(BLOCK),
        }
    else:
        config["quantization_config"] = {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True},
                }
            },
            "ignore": ["lm_head"],
        }
    (quantized / "config.json").write_text(json.dumps(config))
    return quantized, dequantized


@pytest.mark.parametrize("layout", ["block", "channel"])
def test_fp8_checkpoints_match_transformers_on_the_dequantized_weights(
    tiny_checkpoint_factory: Callable[..., Path], tmp_path: Path, layout: str
) -> None:
    from models.test_hf_equivalence import _check, _params, hf_reference

    quantized, dequantized = _write_pair(tiny_checkpoint_factory("llama"), tmp_path, layout)
    reference = hf_reference(dequantized)
    llm = LLM(str(quantized), dtype="float32")
    model: Any = llm.llm_engine.model_runner.model
    fp8 = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    assert len(fp8) == 4 * len(model.layers)  # qkv, o, gate_up, down: merged as kvflow merges them
    assert all(m.qweight.dtype == torch.uint8 for m in fp8)  # one byte per weight in memory
    outputs = llm.generate(reference["prompts"], _params())
    _check(reference, outputs)


def test_fp8_block_scales_of_the_wrong_shape_name_the_tensor(
    tiny_checkpoint_factory: Callable[..., Path], tmp_path: Path
) -> None:
    quantized, _ = _write_pair(tiny_checkpoint_factory("llama"), tmp_path, "block")
    tensors = load_file(quantized / "model.safetensors")
    name = next(n for n in tensors if n.endswith("q_proj.weight_scale_inv"))
    tensors[name] = tensors[name][:1]
    save_file(tensors, quantized / "model.safetensors")
    with pytest.raises(ModelLoadError, match="weight_scale_inv has shape"):
        LLM(str(quantized), dtype="float32")


def test_bf16_decode_through_the_fp8_gemv_agrees_with_the_dequantized_model(
    tiny_checkpoint_factory: Callable[..., Path], tmp_path: Path
) -> None:
    """In bf16 the decode rows go through the native GEMV (gemv_fp8.cpp), the prefill through widened
    row blocks: next tokens along the dequantized bf16 model's greedy continuation, teacher-forced."""
    from kvflow.kernels import fp8_weight_kernel

    if fp8_weight_kernel() is None:
        pytest.skip("native kernels unavailable on this machine")
    from quant.test_kv_quant import teacher_forced_agreement

    quantized, dequantized = _write_pair(tiny_checkpoint_factory("llama"), tmp_path, "block")
    prompts = [[5 + i, 17, 42 + i, 99, 7] * 4 for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    reference = [
        o.outputs[0].token_ids for o in LLM(str(dequantized), dtype="bfloat16").generate(prompts, params)
    ]
    llm = LLM(str(quantized), dtype="bfloat16", max_num_batched_tokens=4, enable_prefix_caching=False)
    agree, total = teacher_forced_agreement(llm, prompts, reference)
    print(f"fp8 GEMV vs dequantized bf16: teacher-forced top-1 agreement {agree}/{total}")
    assert agree / total >= 0.9
