"""Latent attention (DeepSeek V2/V3) beyond the float32 equivalence: the pool holds one latent per
token, decode with absorbed weights equals decode over re-expanded K/V, and quantized latents
(int8 / fp8 / int4) stay close to the model-dtype pool."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from quant.test_kv_quant import teacher_forced_agreement
from test_hf_equivalence import _prompts

from kvflow import LLM, SamplingParams
from kvflow.attention.latent_kv_layer import LatentKVLayer, latent_bytes_per_token
from kvflow.models.deepseek_v2 import DeepseekV2ForCausalLM

NUM_TOKENS = 12
# Teacher-forced top-1 agreement of a bf16 model reading a quantized latent pool with the bf16 pool
# (the dense models' floors, tests/quant/test_kv_quant.py; the test prints the measured value).
KV_AGREEMENT_FLOOR = {"int8": 0.9, "fp8_e4m3": 0.75, "int4": 0.5}


@pytest.mark.parametrize(
    ("kv_cache_dtype", "per_layer"), [("auto", 40 * 4), ("int8", 40 + 4), ("int4", 20 + 8)]
)
def test_the_pool_holds_one_latent_per_token(
    tiny_checkpoint_factory: Callable[..., Path],
    caplog: pytest.LogCaptureFixture,
    kv_cache_dtype: str,
    per_layer: int,
) -> None:
    # deepseek_v3 fixture: 2 layers, kv_lora_rank 32 + qk_rope_head_dim 8 = 40 values per token;
    # quantized: c_kv and k_pe each with their own fp16 scale (and zero point for int4).
    with caplog.at_level(logging.INFO, logger="kvflow"):
        llm = LLM(str(tiny_checkpoint_factory("deepseek_v3")), dtype="float32", kv_cache_dtype=kv_cache_dtype)
    engine = llm.llm_engine
    assert engine.kv_bytes_per_token == 2 * per_layer
    store = engine.model_runner.kv_store
    assert store.layers == [] and len(store.latent_layers) == 2
    assert store.num_bytes == pytest.approx(engine.kv_bytes_per_token * store.num_blocks * store.block_size)
    # MHA of the same shape: 2 layers x 4 heads x (K 16 + 8, V 16) float32 values.
    mha = 2 * 4 * (24 + 16) * 4
    assert any(f"would need {mha} bytes/token" in r.message for r in caplog.records)


def test_latent_bytes_per_token_of_the_published_shapes() -> None:
    # DeepSeek-V2-Lite / V3: kv_lora_rank 512 + qk_rope_head_dim 64 per layer, bf16.
    assert latent_bytes_per_token("auto", 512, 64, torch.bfloat16) == 1152
    assert 27 * latent_bytes_per_token("auto", 512, 64, torch.bfloat16) == 31_104
    assert 61 * latent_bytes_per_token("auto", 512, 64, torch.bfloat16) == 70_272
    assert latent_bytes_per_token("fp8_e4m3", 512, 64, torch.bfloat16) == 576 + 4


@pytest.mark.parametrize("kind", ["auto", "int8", "fp8_e4m3", "int4"])
def test_latent_round_trip(kind: str) -> None:
    layer = LatentKVLayer(kind, 8, 32, 8, torch.float32)
    latent = torch.randn(3, 40)
    latent[:, 32:] *= 10  # k_pe of another range than the normed c_kv: each part has its own scale
    slots = torch.tensor([5, 1, 6])
    layer.write(latent, slots)
    got = layer.gather(slots)
    assert layer.gather(torch.tensor([0])).abs().max() == 0  # the null slot stays zero
    if kind == "auto":
        assert torch.equal(got, latent)
        return
    step = {"int8": 1 / 127, "fp8_e4m3": 1 / 16, "int4": 2 / 15}[kind]
    for part in (slice(0, 32), slice(32, 40)):
        amax = latent[:, part].abs().amax(dim=-1, keepdim=True)
        assert ((got[:, part] - latent[:, part]).abs() <= step * amax).all()


@pytest.mark.parametrize("kind", ["auto", "int8", "fp8_e4m3", "int4"])
def test_indexer_keys_round_trip_beside_the_latents(kind: str) -> None:
    layer = LatentKVLayer(kind, 8, 32, 8, torch.float32, index_dim=16)
    latent, keys = torch.randn(3, 40), torch.randn(3, 16)
    slots = torch.tensor([5, 1, 6])
    layer.write(latent, slots, keys)
    got = layer.gather_index_keys(slots)
    assert layer.gather_index_keys(torch.tensor([0])).abs().max() == 0
    step = {"auto": 0.0, "int8": 1 / 127, "fp8_e4m3": 1 / 16, "int4": 2 / 15}[kind]
    assert ((got - keys).abs() <= step * keys.abs().amax(dim=-1, keepdim=True)).all()
    assert layer.gather(slots).shape == (3, 40)


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3", "deepseek_v32"])
def test_absorbed_decode_equals_expanded_decode(
    tiny_checkpoint_factory: Callable[..., Path], arch: str
) -> None:
    path = str(tiny_checkpoint_factory(arch))
    prompts = _prompts(512)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS, logprobs=5)
    absorbed = LLM(path, dtype="float32").generate(prompts, params)
    expanded_llm = LLM(path, dtype="float32")
    model = expanded_llm.llm_engine.model_runner.model
    assert isinstance(model, DeepseekV2ForCausalLM)
    model.set_weight_absorption(False)
    expanded = expanded_llm.generate(prompts, params)
    for a, e in zip(absorbed, expanded, strict=True):
        assert a.outputs[0].token_ids == e.outputs[0].token_ids
        a_lp, e_lp = a.outputs[0].logprobs, e.outputs[0].logprobs
        assert a_lp is not None and e_lp is not None
        for a_step, e_step in zip(a_lp, e_lp, strict=True):
            for token, lp in a_step.items():
                assert lp.logprob == pytest.approx(e_step[token].logprob, abs=1e-4)


@pytest.mark.parametrize(
    ("kind", "arch"),
    [("int8", "deepseek_v3"), ("fp8_e4m3", "deepseek_v3"), ("int4", "deepseek_v3"), ("int8", "deepseek_v32")],
)
def test_quantized_latent_kv_is_close_to_bf16(
    tiny_checkpoint_factory: Callable[..., Path], kind: str, arch: str
) -> None:
    """As tests/quant/test_kv_quant.py measures dense models: the next-token argmax at each position
    of the bf16-pool greedy continuation, predicted from a context read back from the quantized
    latent pool (4-token chunks attend to the cached context); teacher forcing keeps one early flip
    from turning the rest of the comparison into noise. DeepSeek-V3.2's indexer keys are quantized
    beside the latents, so its top-16 selection reads them back too."""
    path = str(tiny_checkpoint_factory(arch))
    prompts = [[5 + i, 17, 42 + i, 99, 7] * 4 for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    bf16 = LLM(path, dtype="bfloat16", max_model_len=128)
    reference = [o.outputs[0].token_ids for o in bf16.generate(prompts, params)]
    llm = LLM(
        path,
        dtype="bfloat16",
        max_model_len=128,
        kv_cache_dtype=kind,
        max_num_batched_tokens=4,
        enable_prefix_caching=False,
    )
    agree, total = teacher_forced_agreement(llm, prompts, reference)
    print(f"{arch} {kind} latent KV: teacher-forced top-1 agreement with bf16 KV {agree}/{total}")
    assert agree / total >= KV_AGREEMENT_FLOOR[kind]


def test_int8_latent_kv_under_preemption(tiny_checkpoint_factory: Callable[..., Path]) -> None:
    """Preempted requests recompute into the quantized pool; the block accounting stays whole."""
    llm = LLM(
        str(tiny_checkpoint_factory("deepseek_v2")), dtype="bfloat16", kv_cache_dtype="int8", num_kv_blocks=24
    )
    outputs = llm.generate(
        _prompts(512), SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    )
    assert all(len(o.outputs[0].token_ids) == NUM_TOKENS for o in outputs)
    assert sum(o.metrics.num_preemptions for o in outputs) > 0
    llm.llm_engine.scheduler.check_integrity()


def test_speculative_decoding_with_a_latent_attention_draft(
    tiny_checkpoint_factory: Callable[..., Path],
) -> None:
    """Verification rows (several single-query rows per request) attend over the latent pool, and a
    latent-attention draft model keeps its own latent pool: greedy outputs as without speculation."""
    path = str(tiny_checkpoint_factory("deepseek_v3"))
    prompts = [[5, 6, 7, 8, 9] * 6, [1, 2, 3]]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(path, dtype="float32").generate(prompts, params)]
    llm = LLM(path, dtype="float32", speculative_method="draft", draft_model=path, num_speculative_tokens=3)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == plain
    stats = llm.llm_engine.spec_stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0  # the draft is the target: accepted
