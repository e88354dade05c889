"""Mixture-of-experts beyond the float32 equivalence: only the routed experts run at decode, weight
quantization reaches the experts, the native decode forward is not chosen (and says why), and
config variants kvflow does not run are refused naming their config key."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from quant.test_weight_quant import dequantized_checkpoint
from test_hf_equivalence import _prompts

from kvflow import LLM, SamplingParams
from kvflow.arch_config import parse_arch_config
from kvflow.config import ConfigError
from kvflow.errors import ModelLoadError
from kvflow.layers.fused_moe import SparseMoE
from kvflow.quant.linear import Int4Linear, Int8Linear

NUM_TOKENS = 8
# float32 activations: the quantized linears then differ from the dequantized model only by
# summation order (int8) and int4's bf16-rounded group parameters, so the check is tight; in bf16,
# kernel rounding flips near-tied expert choices of these random routers (0.17 nats seen).
DTYPE = "float32"
# nats, first token (identical inputs); measured: int8 6e-6, int4 0.018.
FIRST_TOKEN_LOGPROB_TOLERANCE = {"int8": 1e-4, "int4": 0.05}
# Greedy continuations of the quantized engine agree with the dequantized model's on at least this
# share of tokens (the test prints the measured share); random weights have near ties.
QUANT_AGREEMENT_FLOOR = {"int8": 0.95, "int4": 0.8}


def _agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Tokens before each sequence's first divergence, as a share of all tokens (1.0: identical)."""
    matched = 0
    for x, y in zip(a, b, strict=True):
        matched += next((i for i, (s, t) in enumerate(zip(x, y, strict=True)) if s != t), len(x))
    return matched / sum(len(x) for x in a)


def _moe_blocks(llm: LLM) -> list[SparseMoE]:
    model = llm.llm_engine.model_runner.model
    return [m for m in model.modules() if isinstance(m, SparseMoE)]


def test_decode_runs_only_the_routed_experts(tiny_checkpoint_factory: Callable[..., Path]) -> None:
    llm = LLM(str(tiny_checkpoint_factory("qwen3_moe")), dtype="float32")
    calls: list[tuple[int, int]] = []  # (block, rows) of every expert call

    def record(block: int) -> Callable[..., None]:
        return lambda module, args, out: calls.append((block, args[0].shape[0]))

    blocks = _moe_blocks(llm)
    for b, block in enumerate(blocks):
        for expert in block.experts:
            expert.register_forward_hook(record(b))
    prompt = _prompts(512)[2]
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1))  # prefill only
    prefill_calls = len(calls)
    # A prefill of 33 tokens touches many experts, each once with all of its tokens.
    assert 0 < prefill_calls <= len(blocks) * blocks[0].moe.num_experts
    calls.clear()
    # A 1-token prompt and 3 more tokens: 4 single-token steps.
    llm.generate([[5]], SamplingParams(temperature=0.0, max_tokens=4))
    top_k = blocks[0].moe.top_k
    assert all(rows == 1 for _, rows in calls)
    assert len(calls) == 4 * len(blocks) * top_k  # each step: exactly top_k experts per block, once each


# Never quantized: routers (float32) and DeepSeek's kv_b_proj (kept in the model dtype for absorption).
UNQUANTIZED = (".gate.weight", "shared_expert_gate.weight", "kv_b_proj.weight")


def moe_layer_weight(name: str, tensor: torch.Tensor) -> bool:
    """The projections kvflow quantizes in these families: every 2-D layer weight but UNQUANTIZED
    (Mixtral's w1/w2/w3 and DeepSeek's kv_a_proj_with_mqa do not end in proj.weight)."""
    return name.startswith("model.layers.") and tensor.dim() == 2 and not name.endswith(UNQUANTIZED)


# int4 groups of 32 need in_features multiples of 32: qwen2_moe's shared expert (48) and DeepSeek-V3's
# q_b_proj (q_lora_rank 48) are not.
@pytest.mark.parametrize(
    ("method", "arch"),
    [("int8", "qwen2_moe"), ("int8", "mixtral"), ("int8", "deepseek_v3"), ("int4", "qwen3_moe")],
)
def test_weight_quantization_reaches_the_experts(
    tiny_checkpoint_factory: Callable[..., Path], tmp_path: Path, method: str, arch: str
) -> None:
    """As tests/quant/test_weight_quant.py does for dense models: the quantized engine against the
    unquantized engine on the quantize -> dequantize round trip of every projection (experts too)."""
    path = tiny_checkpoint_factory(arch, dtype=getattr(torch, DTYPE))
    llm = LLM(str(path), dtype=DTYPE, quantization=method, quantization_group_size=32)
    kind = Int8Linear if method == "int8" else Int4Linear
    for block in _moe_blocks(llm):
        assert all(isinstance(e.gate_up_proj, kind) and isinstance(e.down_proj, kind) for e in block.experts)
        if block.shared_expert is not None:
            assert isinstance(block.shared_expert.down_proj, kind)
        assert block.gate.weight.dtype == torch.float32  # the router is never quantized
    reference = LLM(
        str(dequantized_checkpoint(path, tmp_path / "deq", method, 32, moe_layer_weight)), dtype=DTYPE
    )
    prompts = _prompts(512)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS, logprobs=5)
    got, expected = llm.generate(prompts, params), reference.generate(prompts, params)
    worst = 0.0
    for g, e in zip(got, expected, strict=True):
        # The first token comes from identical inputs: the same logprob up to kernel rounding.
        g_lp, e_lp = g.outputs[0].logprobs, e.outputs[0].logprobs
        assert g_lp is not None and e_lp is not None
        token = g.outputs[0].token_ids[0]
        assert token in e_lp[0]
        worst = max(worst, abs(g_lp[0][token].logprob - e_lp[0][token].logprob))
    assert worst < FIRST_TOKEN_LOGPROB_TOLERANCE[method]
    agreement = _agreement([e.outputs[0].token_ids for e in expected], [g.outputs[0].token_ids for g in got])
    print(f"{method} {arch}: first-token logprob within {worst:.3f}, greedy agreement {agreement:.2f}")
    assert agreement >= QUANT_AGREEMENT_FLOOR[method]


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_native_decode_is_not_chosen_and_says_why(
    tiny_checkpoint_factory: Callable[..., Path], arch: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="kvflow"):
        llm = LLM(str(tiny_checkpoint_factory(arch)), dtype="bfloat16")
    assert llm.llm_engine.model_runner.native_decode is False
    assert any("native decode off" in r.message and "Python path" in r.message for r in caplog.records)
    with pytest.raises(ConfigError, match=r"batch_invariant is not supported for .*Python path"):
        LLM(str(tiny_checkpoint_factory(arch)), dtype="bfloat16", batch_invariant=True)


def _config(tiny_checkpoint_factory: Callable[..., Path], arch: str) -> dict[str, Any]:
    return json.loads((tiny_checkpoint_factory(arch) / "config.json").read_text())


@pytest.mark.parametrize(
    ("arch", "change", "key"),
    [
        ("deepseek_v2", {"topk_method": "random"}, "topk_method"),
        ("deepseek_v3", {"topk_method": "greedy"}, "topk_method"),
        ("deepseek_v2", {"scoring_func": "sigmoid"}, "scoring_func"),
        ("deepseek_v2", {"n_group": 3}, "n_group"),
        ("deepseek_v3", {"topk_group": 5}, "topk_group"),
        ("deepseek_v2", {"attention_bias": True}, "attention_bias"),
        ("qwen3_moe", {"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ("qwen2_moe", {"decoder_sparse_step": 0}, "decoder_sparse_step"),
        ("mixtral", {"mlp_bias": True}, "mlp_bias"),
        ("deepseek_v3", {"rope_parameters": {"rope_type": "yarn", "mscale_all_dim": 1.0}}, "factor"),
    ],
)
def test_unsupported_variants_name_their_config_key(
    tiny_checkpoint_factory: Callable[..., Path], arch: str, change: dict[str, Any], key: str
) -> None:
    with pytest.raises(ModelLoadError, match=key):
        parse_arch_config({**_config(tiny_checkpoint_factory, arch), **change})


def test_sparse_and_dense_layers_follow_the_config(tiny_checkpoint_factory: Callable[..., Path]) -> None:
    qwen3 = parse_arch_config(_config(tiny_checkpoint_factory, "qwen3_moe"))
    assert qwen3.moe is not None and qwen3.moe.sparse_layers == (False, True)  # decoder_sparse_step 2
    only = parse_arch_config({**_config(tiny_checkpoint_factory, "qwen2_moe"), "mlp_only_layers": [1]})
    assert only.moe is not None and only.moe.sparse_layers == (True, False)
    v3 = parse_arch_config(_config(tiny_checkpoint_factory, "deepseek_v3"))
    assert v3.moe is not None and v3.moe.sparse_layers == (False, True)  # first_k_dense_replace 1


def test_prequantized_expert_checkpoint_loads_packed(
    tiny_checkpoint_factory: Callable[..., Path], tmp_path: Path, prefill_through_dequantized_blocks: None
) -> None:
    """A compressed-tensors w4a16 MoE checkpoint (as llm-compressor writes Qwen3-MoE's): every
    expert's gate/up/down arrive packed and run as Int4Linear; the router stays float32."""
    pytest.importorskip("compressed_tensors", reason="compressed-tensors is a test dependency")
    from quant.test_checkpoint_formats import write_w4a16_checkpoints

    src = tiny_checkpoint_factory("qwen3_moe", dtype=torch.bfloat16)
    packed_dir, dense_dir = write_w4a16_checkpoints(src, tmp_path)
    quantized = LLM(str(packed_dir), max_model_len=256)
    for block in _moe_blocks(quantized):
        assert all(
            isinstance(e.gate_up_proj, Int4Linear) and isinstance(e.down_proj, Int4Linear)
            for e in block.experts
        )
        assert block.gate.weight.dtype == torch.float32
    reference = LLM(str(dense_dir), max_model_len=256)
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=3)
    prompts = [p[:100] for p in _prompts(512)]
    for q, d in zip(quantized.generate(prompts, params), reference.generate(prompts, params), strict=True):
        q_lp, d_lp = q.outputs[0].logprobs, d.outputs[0].logprobs
        assert q_lp is not None and d_lp is not None
        token = d.outputs[0].token_ids[0]
        # bf16 kernels on both sides (measured up to 0.064 nats: a near-tied expert choice can move).
        assert token in q_lp[0] and abs(q_lp[0][token].logprob - d_lp[0][token].logprob) < 0.1
