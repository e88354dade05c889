"""gpt-oss checkpoints with MXFP4 experts (quantization_config quant_method mxfp4, `*_blocks` /
`*_scales` as the released gpt-oss checkpoints store them), made in the test from a tiny gpt-oss:
greedy tokens in float32 identical to transformers on the same weights dequantized; in bf16 the
experts compute on their 4.25-bit codes (GGUFLinear, gemv_ggml.cpp) and agree with the dequantized
bf16 model, teacher-forced."""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from fixtures.reference import hf_greedy
from safetensors.torch import load_file, save_file

from kvflow import LLM, SamplingParams
from kvflow.quant.gguf_linear import GGUFLinear

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

NUM_NEW_TOKENS = 10


def _mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A fused expert tensor [E, in, out] (x @ W) -> (blocks [E, out, in / 32, 16], scales [E, out,
    in / 32], the values they hold [E, in, out]), quantized by the gguf package's MXFP4 and re-laid
    in the Hugging Face order (byte j: codes 2j, 2j + 1)."""
    rows = weight.transpose(1, 2).float().numpy()  # [E, out, in]
    e, n, k = rows.shape
    packed = gguf.quants.quantize(rows.reshape(-1, k), gguf.GGMLQuantizationType.MXFP4)
    values = gguf.quants.dequantize(packed, gguf.GGMLQuantizationType.MXFP4).reshape(e, n, k)
    blocks = packed.reshape(e, n, k // 32, 17)
    scales, qs = blocks[..., 0], blocks[..., 1:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # ggml: codes j and j + 16 in byte j
    hf = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    as_torch = (torch.from_numpy(np.ascontiguousarray(a)) for a in (hf, scales))
    return *as_torch, torch.from_numpy(values).transpose(1, 2).contiguous()  # type: ignore[return-value]


def _write_pair(source: Path, out: Path) -> tuple[Path, Path]:
    quantized, dequantized = out / "mxfp4", out / "dequantized"
    for d in (quantized, dequantized):
        shutil.copytree(source, d)
    tensors = load_file(source / "model.safetensors")
    q_tensors, d_tensors = {}, {}
    for name, w in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales, values = _mxfp4(w)
            q_tensors[f"{name}_blocks"], q_tensors[f"{name}_scales"] = blocks, scales
            d_tensors[name] = values
        else:
            q_tensors[name] = d_tensors[name] = w
    save_file(q_tensors, quantized / "model.safetensors")
    save_file(d_tensors, dequantized / "model.safetensors")
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    (quantized / "config.json").write_text(json.dumps(config))
    return quantized, dequantized


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(vocab) for _ in range(n)] for n in (1, 9, 30)]


def test_mxfp4_experts_in_float32_match_transformers(
    tiny_checkpoint_factory: Callable[..., Path], tmp_path: Path
) -> None:
    quantized, dequantized = _write_pair(tiny_checkpoint_factory("gpt_oss"), tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(dequantized, dtype=torch.float32).eval()
    prompts = _prompts(model.config.vocab_size)
    expected = [hf_greedy(model, p, NUM_NEW_TOKENS)[0] for p in prompts]
    llm = LLM(str(quantized), dtype="float32")
    # min_tokens bans EOS exactly as transformers' min_new_tokens does.
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, min_tokens=NUM_NEW_TOKENS)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected


def test_mxfp4_experts_compute_on_their_codes_in_bf16(
    tiny_checkpoint_factory: Callable[..., Path], tmp_path: Path
) -> None:
    from quant.test_kv_quant import teacher_forced_agreement

    from kvflow.kernels import ggml_weight_kernels

    if ggml_weight_kernels() is None:
        pytest.skip("native kernels unavailable on this machine")
    quantized, dequantized = _write_pair(tiny_checkpoint_factory("gpt_oss"), tmp_path)
    llm = LLM(str(quantized), dtype="bfloat16", max_num_batched_tokens=4, enable_prefix_caching=False)
    experts = [m for m in llm.llm_engine.model_runner.model.modules() if isinstance(m, GGUFLinear)]
    config = json.loads((quantized / "config.json").read_text())
    assert len(experts) == 2 * config["num_local_experts"] * config["num_hidden_layers"]
    for layer in experts:  # 4.25 bits per weight: codes, one e8m0 byte per 32, padded to 16-row tiles
        tiles = -(-layer.out_features // 16) * 16
        assert layer.values.numel() + layer.scales.numel() == tiles * layer.in_features * 17 // 32
    prompts = [[5 + i, 17, 42 + i, 99, 7] * 4 for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    reference = [
        o.outputs[0].token_ids for o in LLM(str(dequantized), dtype="bfloat16").generate(prompts, params)
    ]
    agree, total = teacher_forced_agreement(llm, prompts, reference)
    print(f"gpt-oss MXFP4 experts vs dequantized bf16: teacher-forced agreement {agree}/{total}")
    assert agree / total >= 0.75  # the GEMV's int8 activations (tests/models/test_gguf_equivalence.py)
