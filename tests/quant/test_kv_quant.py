"""Quantized KV pools: round trips per format, attention on quantized KV against plain KV, and the
engine with int8/fp8/int4 KV (greedy agreement reported, invariants kept under preemption)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.attention.kv_layer import PlainKVLayer, QuantizedKVLayer, kv_bytes_per_token_head, make_kv_layer
from kvflow.attention.metadata import AttentionMetadata
from kvflow.attention.paged_attention import paged_attention
from kvflow.kernels import paged_decode_attention_quantized

HKV, D, SLOTS = 2, 64, 64


def tokens(n: int, seed: int = 0) -> torch.Tensor:
    x = torch.randn(n, HKV, D, generator=torch.Generator().manual_seed(seed))
    x[3, 0, 5] = 40.0  # an outlier channel, as keys have
    x[4] = 0.0  # an all-zero token
    x[5, 1] = 1.5  # an all-equal head
    return x


@pytest.mark.parametrize("kind", ["int8", "fp8_e4m3", "int4"])
def test_round_trip_per_token_and_head(kind: str) -> None:
    layer = QuantizedKVLayer(kind, SLOTS, HKV, D, torch.float32)
    x = tokens(16)
    slots = torch.arange(8, 24)
    layer.write(x, x * 2, slots)
    k, v = layer.gather(slots)
    amax = x.abs().amax(dim=-1, keepdim=True)
    spread = x.amax(dim=-1, keepdim=True) - x.amin(dim=-1, keepdim=True)
    # Half a step of each format (+ the fp16 scale's rounding); fp8 e4m3 keeps 3 mantissa bits.
    bound = {"int8": amax / 127 * 0.51, "int4": spread / 15 * 0.51, "fp8_e4m3": x.abs() / 16 + amax / 448}[
        kind
    ]
    assert bool(((k - x).abs() <= bound + 1e-3 * amax).all())
    assert torch.allclose(v, 2 * k, rtol=1e-2, atol=1e-2 * float(amax.max()))
    assert bool((k[4] == 0).all())  # a zero token stays exactly zero
    null_k, null_v = layer.gather(torch.tensor([0]))
    assert bool((null_k == 0).all() and (null_v == 0).all())  # the null slot is never written


def test_bytes_per_token_head() -> None:
    assert kv_bytes_per_token_head("auto", 64, torch.bfloat16) == 256
    assert kv_bytes_per_token_head("int8", 64, torch.bfloat16) == 2 * (64 + 2)  # 1.94x bf16's tokens
    assert kv_bytes_per_token_head("int4", 64, torch.bfloat16) == 2 * (32 + 4)  # 3.56x
    layer = make_kv_layer("int4", SLOTS, HKV, D, torch.bfloat16)
    assert sum(t.numel() * t.element_size() for t in layer.tensors) == SLOTS * HKV * 72


@pytest.mark.parametrize(("kind", "tolerance"), [("int8", 0.02), ("fp8_e4m3", 0.08), ("int4", 0.2)])
def test_decode_attention_on_quantized_kv_is_close_to_plain(kind: str, tolerance: float) -> None:
    num_decodes, hq, num_keys = 3, 4, 40
    q = torch.randn(num_decodes, hq, D, generator=torch.Generator().manual_seed(1))
    keys = torch.randn(num_keys * num_decodes, HKV, D, generator=torch.Generator().manual_seed(2))
    values = torch.randn(num_keys * num_decodes, HKV, D, generator=torch.Generator().manual_seed(3))
    slots = (torch.arange(num_keys * num_decodes) + 1).view(num_decodes, num_keys)  # slot 0: null
    meta = AttentionMetadata(
        positions=torch.zeros(num_decodes, dtype=torch.int64),
        slot_mapping=torch.zeros(num_decodes, dtype=torch.int64),
        num_decode_tokens=num_decodes,
        decode_kv_slots=slots,
        decode_attend=torch.ones(num_decodes, 1, 1, num_keys, dtype=torch.bool),
        decode_num_keys=torch.full((num_decodes,), num_keys),
        prefills=[],
    )
    outputs = {}
    for name in ("auto", kind):
        layer: PlainKVLayer | QuantizedKVLayer = make_kv_layer(name, 256, HKV, D, torch.float32)
        layer.write(keys, values, slots.view(-1))
        zeros = torch.zeros(num_decodes, HKV, D)
        outputs[name] = paged_attention(q, zeros, zeros, layer, meta)
    error = (outputs[kind] - outputs["auto"]).abs().max() / outputs["auto"].abs().max()
    assert float(error) < tolerance


@pytest.mark.parametrize("kind", ["int8", "fp8_e4m3", "int4"])
@pytest.mark.parametrize("head_dim", [64, 72])  # 72: a partial 16-wide chunk (4 int4 bytes)
def test_native_decode_kernel_dequantizes_pools_like_the_gather_path(kind: str, head_dim: int) -> None:
    """The bf16 decode kernel reads the quantized pool in place (GQA, ragged lengths, padded slot
    lists); the reference is exact attention over the same pool dequantized in fp32."""
    native = paged_decode_attention_quantized()
    if native is None:
        pytest.skip(
            "kvflow's native kernels are unavailable on this CPU (no AVX512-BF16 or AVX2, or no compiler)"
        )
    gen = torch.Generator().manual_seed(4)
    num_heads, lens = 6, [5, 40, 17]
    total = sum(lens)
    keys = torch.randn(total, HKV, head_dim, generator=gen).to(torch.bfloat16)
    values = torch.randn(total, HKV, head_dim, generator=gen).to(torch.bfloat16)
    keys[2, 0, 3] = 30.0  # an outlier channel
    values[7] = 0.0  # an all-zero token
    layer = QuantizedKVLayer(kind, 256, HKV, head_dim, torch.bfloat16)
    twin = QuantizedKVLayer(kind, 256, HKV, head_dim, torch.float32)  # same bytes, fp32 gather
    flat = torch.randperm(255, generator=gen)[:total] + 1  # scattered slots; 0 is the null slot
    for target in (layer, twin):
        target.write(keys, values, flat)
    slots = torch.zeros(len(lens), max(lens), dtype=torch.int64)
    for b, seq in enumerate(flat.split(lens)):
        slots[b, : len(seq)] = seq
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen).to(torch.bfloat16)
    scale = head_dim**-0.5
    pools = layer.quantized_pools()
    assert pools is not None
    got = native(
        q, pools.key_data, pools.key_scale, pools.key_zero, pools.value_data, pools.value_scale,
        pools.value_zero, slots, torch.tensor(lens), scale, kind,
    ).float()  # fmt: skip
    group = num_heads // HKV
    for b, seq in enumerate(flat.split(lens)):
        k, v = twin.gather(seq)  # [L, Hkv, D] fp32
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [L, Hq, D]
        weights = torch.softmax(torch.einsum("hd,lhd->hl", q[b].float(), k) * scale, dim=-1)
        expected = torch.einsum("hl,lhd->hd", weights, v)
        # fp32 arithmetic, then the output's bf16 rounding (2^-9 relative, twice for margin).
        assert torch.allclose(got[b], expected, rtol=2**-8, atol=2**-8 * float(expected.abs().max()))


def teacher_forced_agreement(
    llm: LLM, prompts: list[list[int]], reference: list[list[int]]
) -> tuple[int, int]:
    """(agreeing, total) greedy next tokens of `llm` on every other prefix of the reference outputs:
    each position starts from the reference's own tokens, so one early flip does not decide the rest."""
    contexts, targets = [], []
    for prompt, ref in zip(prompts, reference, strict=True):
        for i in range(0, len(ref), 2):
            contexts.append(prompt + ref[:i])
            targets.append(ref[i])
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    predicted = [o.outputs[0].token_ids[0] for o in llm.generate(contexts, one)]
    return sum(p == t for p, t in zip(predicted, targets, strict=True)), len(targets)


@pytest.mark.parametrize(("kind", "floor"), [("int8", 0.9), ("fp8_e4m3", 0.75), ("int4", 0.5)])
def test_engine_teacher_forced_agreement_with_quantized_kv(
    tiny_checkpoint_factory: Callable[..., Path], kind: str, floor: float
) -> None:
    """Next-token argmax at each position of the bf16-KV greedy continuation, predicted from a
    context read back from the quantized pool (4-token chunks attend to the cached context).
    Teacher forcing keeps one early flip from turning the rest of the comparison into noise."""
    path = str(tiny_checkpoint_factory("llama", dtype=torch.bfloat16))
    prompts = [[5 + i, 17, 42 + i, 99, 7] * 4 for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    reference = [o.outputs[0].token_ids for o in LLM(path, max_model_len=128).generate(prompts, params)]
    llm = LLM(
        path, max_model_len=128, kv_cache_dtype=kind, max_num_batched_tokens=4, enable_prefix_caching=False
    )
    agree, total = teacher_forced_agreement(llm, prompts, reference)
    print(f"{kind} KV: teacher-forced top-1 agreement with bf16 KV {agree}/{total}")
    assert agree / total >= floor


def test_engine_invariants_with_int8_kv_under_preemption(
    tiny_checkpoint_factory: Callable[..., Path],
) -> None:
    path = str(tiny_checkpoint_factory("llama", dtype=torch.bfloat16))
    # 10 blocks of 4 tokens for 4 requests of 12 + 12 tokens: preemption must happen.
    llm = LLM(path, max_model_len=64, kv_cache_dtype="int8", num_kv_blocks=10, block_size=4)
    prompts = [[3 + i] * 12 for i in range(4)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 12 for o in outs)
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    llm.llm_engine.scheduler.check_integrity()
    pool = llm.llm_engine.scheduler.kv_cache_manager.block_pool
    assert pool.usage == 0.0
