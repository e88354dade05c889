"""GGUF files (llama.cpp's format) made in the test from tiny checkpoints, run by kvflow: greedy
tokens in float32 identical to transformers on the same dequantized weights, for every ggml type
llama-quantize writes and each architecture's conventions (llama's permuted q/k rows and rope_freqs,
Qwen2's biases, Qwen3's q/k norms, Qwen3-MoE's stacked experts); and transformers' own GGUF loader
(`from_pretrained(dir, gguf_file=...)`) as a second reference on the same file."""

from __future__ import annotations

import random
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from fixtures.gguf_files import TypeRule, q4_k_m, uniform, write_gguf
from fixtures.reference import hf_greedy
from safetensors.torch import load_file, save_file

from kvflow import LLM, SamplingParams

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

# Wide enough for K-quants (rows of 256); qwen3's o_proj (4 heads x 32 = 128 inputs) still falls
# back to another type, as llama-quantize's output does for such rows.
SHAPE = {"hidden_size": 256, "intermediate_size": 512}
PROMPT_LENGTHS = (1, 9, 40)
NUM_NEW_TOKENS = 10
ALL_TYPES = (
    "F32",
    "F16",
    "BF16",
    "Q8_0",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
    "NVFP4",  # llama.cpp's: e4m3 scales per 16, blocks of 64
)


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(vocab) for _ in range(n)] for n in PROMPT_LENGTHS]


def _reference_tokens(checkpoint: Path, weights: dict[str, torch.Tensor], tmp_path: Path) -> list[list[int]]:
    """transformers' greedy tokens on the checkpoint with `weights` (the GGUF's values, by the
    checkpoint's tensor names) in its place."""
    saved = load_file(checkpoint / "model.safetensors")
    assert set(weights) == set(saved), f"the reference misses {sorted(set(saved) - set(weights))[:5]}"
    reference = tmp_path / "dequantized"
    shutil.copytree(checkpoint, reference)
    save_file({n: w.contiguous() for n, w in weights.items()}, reference / "model.safetensors")
    model = transformers.AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    return [hf_greedy(model, p, NUM_NEW_TOKENS)[0] for p in _prompts(model.config.vocab_size)]


def _kvflow_tokens(path: Path, **engine: object) -> list[list[int]]:
    llm = LLM(str(path), dtype="float32", **engine)
    # min_tokens bans EOS exactly as transformers' min_new_tokens does.
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, min_tokens=NUM_NEW_TOKENS)
    vocab = llm.llm_engine.arch.vocab_size
    return [o.outputs[0].token_ids for o in llm.generate(_prompts(vocab), params)]


def _gguf(
    factory: Callable[..., Path], tmp_path: Path, arch: str, types: TypeRule, **overrides: object
) -> tuple[Path, Path, dict[str, torch.Tensor]]:
    checkpoint = factory(arch, **SHAPE, **overrides)
    path = tmp_path / f"{arch}.gguf"
    return checkpoint, path, write_gguf(checkpoint, path, types)


@pytest.mark.parametrize("type_name", ALL_TYPES)
def test_each_ggml_type_matches_transformers(
    type_name: str, tiny_checkpoint_factory: Callable[..., Path], tmp_path: Path
) -> None:
    checkpoint, path, weights = _gguf(tiny_checkpoint_factory, tmp_path, "qwen2", uniform(type_name))
    assert _kvflow_tokens(path) == _reference_tokens(checkpoint, weights, tmp_path)


@pytest.mark.parametrize(
    "arch, overrides",
    [
        ("llama", {}),  # GQA, q/k rows permuted in the file, Llama 3.1 rope as a rope_freqs tensor
        ("mistral", {"sliding_window": None}),  # MQA; llama.cpp converts Mistral to "llama"
        ("qwen3", {}),  # q/k norms, head_dim 32 x 4 heads != hidden
        ("qwen3_moe", {"decoder_sparse_step": 1}),  # experts stacked [8, out, in]; every layer routed
        # Sinks, sliding / full layers, biased experts split gate / up / down, YaRN without truncation;
        # the SwiGLU clamp a GGUF file cannot carry is llama.cpp's fixed 7.0.
        ("gpt_oss", {"swiglu_limit": 7.0}),
    ],
)
def test_architectures_in_a_q4_k_m_mix_match_transformers(
    arch: str, overrides: dict[str, object], tiny_checkpoint_factory: Callable[..., Path], tmp_path: Path
) -> None:
    checkpoint, path, weights = _gguf(tiny_checkpoint_factory, tmp_path, arch, q4_k_m, **overrides)
    assert _kvflow_tokens(path) == _reference_tokens(checkpoint, weights, tmp_path)


def _mxfp4_experts(name: str) -> str:
    """gpt-oss's GGUF files as llama.cpp's converter writes them: MXFP4 experts, Q8_0 elsewhere."""
    return "MXFP4" if "_exps." in name else "Q8_0"


def test_gpt_oss_with_mxfp4_experts_matches_transformers(
    tiny_checkpoint_factory: Callable[..., Path], tmp_path: Path
) -> None:
    checkpoint, path, weights = _gguf(
        tiny_checkpoint_factory, tmp_path, "gpt_oss", _mxfp4_experts, swiglu_limit=7.0
    )
    assert _kvflow_tokens(path) == _reference_tokens(checkpoint, weights, tmp_path)


@pytest.mark.parametrize(
    "arch, overrides",
    [
        ("qwen2", {}),
        # transformers' GGUF loader ignores rope_freqs (Llama 3.1 scaling) and qwen3's
        # attention.key_length (head_dim != hidden / heads): those are checked above only.
        ("llama", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}),
        # Not gpt-oss: transformers 5.24 reads its rope.scaling.* keys from the wrong part of the field
        # (`parts[0]`, the key's length) and fails on every gpt-oss GGUF file.
    ],
)
def test_transformers_gguf_loader_agrees(
    arch: str, overrides: dict[str, object], tiny_checkpoint_factory: Callable[..., Path], tmp_path: Path
) -> None:
    """transformers reads the same file itself (its GGUF integration), dequantizing it on its own."""
    _, path, _ = _gguf(tiny_checkpoint_factory, tmp_path, arch, q4_k_m, **overrides)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    expected = [hf_greedy(model, p, NUM_NEW_TOKENS)[0] for p in _prompts(model.config.vocab_size)]
    assert _kvflow_tokens(path) == expected


def test_chunked_prefill_and_prefix_hits_on_a_gguf_model(
    tiny_checkpoint_factory: Callable[..., Path], tmp_path: Path
) -> None:
    checkpoint, path, weights = _gguf(tiny_checkpoint_factory, tmp_path, "llama", q4_k_m)
    expected = _reference_tokens(checkpoint, weights, tmp_path)
    assert _kvflow_tokens(path, max_num_batched_tokens=8, block_size=4) == expected


# Teacher-forced top-1 agreement floors in bf16, against the dequantized bf16 model. The decode GEMVs
# round the activations to int8 per 32 inputs (as llama.cpp's q8 dot products do), which this random
# model amplifies: Q4_K_M llama measured 40/48 through the GEMV and 48/48 with every row through the
# bf16 blocks (the same bits dequantized); Q8_0 44/48 and 47/48. The kernels' own error is bounded
# per output, and checked exact given those int8 activations, in tests/quant/test_gguf_kernels.py.
AGREEMENT_FLOOR = {"gemv": 0.75, "blocks": 0.95}


# gpt-oss is left out here: its tiny random model routes on near ties, so that even float32 against
# bf16 on the same weights agrees on 37/48 teacher-forced tokens (measured); its GGUF file is checked
# token-exact in float32 above, and its MXFP4 experts in bf16 in tests/quant/test_mxfp4_checkpoints.py.
@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
@pytest.mark.parametrize("path_kind", ["gemv", "blocks"])
def test_bf16_on_the_files_blocks_agrees_with_the_dequantized_model(
    arch: str, path_kind: str, tiny_checkpoint_factory: Callable[..., Path], tmp_path: Path
) -> None:
    """In bf16 every Q4_K / Q6_K / fallback projection computes on the file's blocks (GGUFLinear:
    the GEMV of kvflow/kernels/gemv_ggml.cpp, in the native decode forward for the dense model, or
    every row through the bf16 row blocks): next tokens along the dequantized bf16 model's greedy
    continuation, teacher-forced."""
    from quant.test_kv_quant import teacher_forced_agreement

    from kvflow.kernels import ggml_weight_kernels
    from kvflow.quant.gguf_linear import GGUFLinear

    if ggml_weight_kernels() is None:
        pytest.skip("native kernels unavailable on this machine")
    overrides = {"decoder_sparse_step": 1} if arch == "qwen3_moe" else {}
    checkpoint, path, weights = _gguf(tiny_checkpoint_factory, tmp_path, arch, q4_k_m, **overrides)
    dequantized = tmp_path / "dequantized"
    shutil.copytree(checkpoint, dequantized)
    save_file({n: w.contiguous() for n, w in weights.items()}, dequantized / "model.safetensors")
    prompts = [[5 + i, 17, 42 + i, 99, 7] * 4 for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    reference = [
        o.outputs[0].token_ids for o in LLM(str(dequantized), dtype="bfloat16").generate(prompts, params)
    ]
    llm = LLM(
        str(path),
        dtype="bfloat16",
        max_num_batched_tokens=4,
        enable_prefix_caching=False,
        enforce_eager=path_kind == "blocks",
    )
    layers = [m for m in llm.llm_engine.model_runner.model.modules() if isinstance(m, GGUFLinear)]
    assert {m.type_name for m in layers} >= {"Q4_K", "Q6_K"}
    if path_kind == "blocks":
        for layer in layers:
            layer.max_gemv_rows = 0
    agree, total = teacher_forced_agreement(llm, prompts, reference)
    print(f"{arch} Q4_K_M ({path_kind}) vs dequantized bf16: teacher-forced agreement {agree}/{total}")
    assert agree / total >= AGREEMENT_FLOOR[path_kind]
