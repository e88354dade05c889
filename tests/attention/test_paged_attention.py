"""Decode attention over the paged KV pool: the native bf16 kernel and the SDPA path both equal a
float64 reference computed on explicitly gathered keys/values (GQA ratios, head dims with a
vector tail, scattered slots, ragged lengths)."""

from __future__ import annotations

from typing import TypeVar

import pytest
import torch

from kvflow.attention.kv_layer import PlainKVLayer, QuantizedKVLayer
from kvflow.attention.metadata import AttentionMetadata, PrefillChunkMetadata
from kvflow.attention.paged_attention import paged_attention
from kvflow.kernels import paged_decode_attention_bf16, prefill_attention_bf16

KernelT = TypeVar("KernelT")
CASES = [  # (num_kv_heads, queries per kv head, head_dim)
    (2, 7, 64),
    (1, 4, 16),
    (4, 1, 80),
    (2, 2, 128),
    (1, 16, 96),  # more query heads than one pass scores (8) or accumulates (7); a half 64-dim block
    (2, 3, 18),  # a partial 32-dim block
    (1, 2, 17),  # odd head_dim: the row-reader path
]


def _problem(hkv: int, g: int, d: int, dtype: torch.dtype, seed: int = 0):  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(seed)
    num_slots, lens = 512, [1, 37, 200, 5]
    key_cache = torch.randn(num_slots, hkv, d, generator=gen).to(dtype)
    value_cache = torch.randn(num_slots, hkv, d, generator=gen).to(dtype)
    query = torch.randn(len(lens), hkv * g, d, generator=gen).to(dtype)
    max_len = max(lens)
    slots = torch.zeros(len(lens), max_len, dtype=torch.int64)
    for b, n in enumerate(lens):
        slots[b, :n] = torch.randperm(num_slots - 1, generator=gen)[:n] + 1  # scattered, never 0
    num_keys = torch.tensor(lens)
    return query, key_cache, value_cache, slots, num_keys


def _random_bf16_pools(
    num_slots: int, hkv: int, d: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Key and value pools [num_slots, hkv, d] of standard normal bf16 values."""
    keys = torch.randn(num_slots, hkv, d, generator=gen).to(torch.bfloat16)
    return keys, torch.randn(num_slots, hkv, d, generator=gen).to(torch.bfloat16)


def _built(kernel: KernelT | None) -> KernelT:
    """The native kernel, or skip the test where it is not built (no AVX512-BF16 or AVX2, or no compiler)."""
    if kernel is None:
        pytest.skip("native kernels unavailable on this CPU/toolchain")
    return kernel


def _reference(query, key_cache, value_cache, slots, num_keys):  # type: ignore[no-untyped-def]
    b, hq, d = query.shape
    hkv = key_cache.shape[1]
    out = torch.empty(b, hq, d, dtype=torch.float64)
    for i in range(b):
        idx = slots[i, : num_keys[i]]
        k = key_cache[idx].double().repeat_interleave(hq // hkv, dim=1)  # [L, Hq, D]
        v = value_cache[idx].double().repeat_interleave(hq // hkv, dim=1)
        scores = torch.einsum("hd,lhd->hl", query[i].double(), k) * d**-0.5
        out[i] = torch.einsum("hl,lhd->hd", scores.softmax(-1), v)
    return out


@pytest.mark.parametrize(("hkv", "g", "d"), CASES)
def test_native_kernel_matches_reference(hkv: int, g: int, d: int) -> None:
    kernel = _built(paged_decode_attention_bf16())
    q, kc, vc, slots, num_keys = _problem(hkv, g, d, torch.bfloat16)
    out = kernel(q, kc, vc, slots, num_keys, d**-0.5)
    ref = _reference(q, kc, vc, slots, num_keys)
    # bf16 output rounding (2^-9 relative) on values of magnitude ~1.
    torch.testing.assert_close(out.double(), ref, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize(("hkv", "g", "d"), CASES)
def test_sdpa_decode_path_matches_reference(hkv: int, g: int, d: int) -> None:
    q, kc, vc, slots, num_keys = _problem(hkv, g, d, torch.float32)
    valid = torch.arange(slots.shape[1])[None, :] < num_keys[:, None]
    meta = AttentionMetadata(
        positions=torch.zeros(q.shape[0], dtype=torch.int64),
        slot_mapping=torch.zeros(q.shape[0], dtype=torch.int64),  # writes go to the null slot 0
        num_decode_tokens=q.shape[0],
        decode_kv_slots=slots,
        decode_attend=valid[:, None, None, :],
        decode_num_keys=num_keys,
        prefills=[],
    )
    k_new = torch.zeros(q.shape[0], hkv, d)
    kv = PlainKVLayer(kc.shape[0], hkv, d, torch.float32, torch.float32)
    kv.key_cache, kv.value_cache = kc, vc
    out = paged_attention(q, k_new, k_new.clone(), kv, meta)
    torch.testing.assert_close(out.double(), _reference(q, kc, vc, slots, num_keys), rtol=1e-5, atol=1e-5)


def _chunk_metadata(slots: torch.Tensor, cached: int, leading_keys: bool) -> AttentionMetadata:
    """One causal prefill chunk: the tokens after the first `cached` of `slots` (no decode rows)."""
    n = slots.shape[0] - cached
    attend = torch.ones(n, cached + n, dtype=torch.bool).tril(cached) if cached else None
    chunk = PrefillChunkMetadata(0, n, slots if cached else None, attend, leading_keys=leading_keys)
    return AttentionMetadata(
        positions=torch.arange(cached, cached + n),
        slot_mapping=slots[cached:],
        num_decode_tokens=0,
        decode_kv_slots=None,
        decode_attend=None,
        decode_num_keys=None,
        prefills=[chunk],
    )


@pytest.mark.parametrize("cached", [0, 23])
@pytest.mark.parametrize("leading_keys", [True, False])
def test_prefill_chunk_native_and_sdpa_match_reference(cached: int, leading_keys: bool) -> None:
    """A causal prefill chunk (after `cached` tokens of context already in the pool) through the
    native flash kernel (leading_keys) and through SDPA: both equal the float64 reference of each
    query over its leading keys."""
    hkv, g, d, n = 2, 7, 64, 40
    gen = torch.Generator().manual_seed(3)
    num_slots = 128
    kv = PlainKVLayer(num_slots, hkv, d, torch.bfloat16, torch.bfloat16)
    kv.key_cache = torch.randn(num_slots, hkv, d, generator=gen).to(torch.bfloat16)
    kv.value_cache = torch.randn(num_slots, hkv, d, generator=gen).to(torch.bfloat16)
    slots = torch.randperm(num_slots - 1, generator=gen)[: cached + n] + 1  # scattered, never 0
    q = torch.randn(n, hkv * g, d, generator=gen).to(torch.bfloat16)
    k_new = torch.randn(n, hkv, d, generator=gen).to(torch.bfloat16)
    v_new = torch.randn(n, hkv, d, generator=gen).to(torch.bfloat16)
    meta = _chunk_metadata(slots, cached, leading_keys)
    out = paged_attention(q, k_new, v_new, kv, meta)  # writes the chunk's K/V at its slots first
    rows = slots[None, :].expand(n, -1)
    ref = _reference(q, kv.key_cache, kv.value_cache, rows, torch.arange(cached + 1, cached + n + 1))
    torch.testing.assert_close(out.double(), ref, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize(("hkv", "g", "d"), CASES)
def test_native_rows_sharing_keys_give_each_rows_own_result_bit_for_bit(hkv: int, g: int, d: int) -> None:
    """Rows whose keys are leading entries of one slot list (a request's verification rows, a
    prefill chunk's rows) are attended as a group; each output must equal the same row attended
    alone, bit for bit, whether the rows share the list (stride 0) or carry padded copies of it."""
    kernel = _built(paged_decode_attention_bf16())
    gen = torch.Generator().manual_seed(5)
    num_slots = 512
    kc, vc = _random_bf16_pools(num_slots, hkv, d, gen)
    # Two requests of 5 rows (keys 40..44 and 3..7) and one lone row, then 9 rows of another list.
    lists = [torch.randperm(num_slots - 1, generator=gen)[:60] + 1 for _ in range(4)]
    rows = (
        [(0, n) for n in range(40, 45)]
        + [(1, n) for n in range(3, 8)]
        + [(2, 17)]
        + [(3, n) for n in range(50, 59)]
    )
    max_keys = max(n for _, n in rows)
    padded = torch.zeros(len(rows), max_keys, dtype=torch.int64)  # as build_input_batch pads: zeros
    for i, (which, n) in enumerate(rows):
        padded[i, :n] = lists[which][:n]
    num_keys = torch.tensor([n for _, n in rows])
    q = torch.randn(len(rows), hkv * g, d, generator=gen).to(torch.bfloat16)
    alone = torch.cat(
        [
            kernel(q[i : i + 1], kc, vc, padded[i : i + 1], num_keys[i : i + 1], d**-0.5)
            for i in range(len(rows))
        ]
    )
    assert torch.equal(kernel(q, kc, vc, padded, num_keys, d**-0.5), alone)
    # One list shared by every row of a chunk (stride 0): a prefill chunk's causal rows.
    shared = lists[3][:max_keys].expand(len(rows), max_keys)
    causal = torch.arange(max_keys - len(rows) + 1, max_keys + 1)
    alone = torch.cat(
        [kernel(q[i : i + 1], kc, vc, shared[:1], causal[i : i + 1], d**-0.5) for i in range(len(rows))]
    )
    assert torch.equal(kernel(q, kc, vc, shared, causal, d**-0.5), alone)


def _causal_reference(query, key_cache, value_cache, slots):  # type: ignore[no-untyped-def]
    """Each of the n queries (the last n of the L positions of `slots`) over its leading keys."""
    n, num_keys = query.shape[0], slots.shape[0]
    rows = slots[None, :].expand(n, -1)
    return _reference(query, key_cache, value_cache, rows, torch.arange(num_keys - n + 1, num_keys + 1))


@pytest.mark.parametrize(("hkv", "g", "d"), [c for c in CASES if c[2] % 2 == 0])
@pytest.mark.parametrize(("n", "num_keys"), [(40, 40), (100, 163), (9, 300), (1, 1)])
def test_flash_prefill_kernel_matches_reference(hkv: int, g: int, d: int, n: int, num_keys: int) -> None:
    """The flash-style chunk kernel: several query tiles and key tiles (a partial last one), cached
    context before the chunk (num_keys > n), scattered slots, GQA ratios and head dims with tails."""
    kernel = _built(prefill_attention_bf16())
    gen = torch.Generator().manual_seed(11)
    num_slots = 512
    kc, vc = _random_bf16_pools(num_slots, hkv, d, gen)
    slots = torch.randperm(num_slots - 1, generator=gen)[:num_keys] + 1
    q = (2 * torch.randn(n, hkv * g, d, generator=gen)).to(torch.bfloat16)  # peaked softmaxes too
    out = kernel(q, kc, vc, slots, d**-0.5)
    ref = _causal_reference(q, kc, vc, slots)
    # bf16 output rounding and bf16 probabilities in P.V (2^-9 relative each) on values ~1.
    torch.testing.assert_close(out.double(), ref, rtol=1e-2, atol=1e-2)
    assert (out.double() - ref).abs().mean() < 2e-3  # systematic errors (a wrong mask) are far larger


def test_prefill_chunk_over_a_quantized_pool_matches_reference_on_its_dequantized_keys() -> None:
    """A causal chunk after cached context in an int8 pool (attended over its gathered, dequantized
    keys: the flash kernel where it is built) equals the reference over exactly those keys."""
    hkv, g, d, n, cached = 2, 7, 64, 40, 23
    gen = torch.Generator().manual_seed(4)
    num_slots = 128
    kv = QuantizedKVLayer("int8", num_slots, hkv, d, torch.bfloat16)
    slots = torch.randperm(num_slots - 1, generator=gen)[: cached + n] + 1
    k_cached, v_cached = torch.randn(2, cached, hkv, d, generator=gen)
    kv.write(k_cached, v_cached, slots[:cached])
    q = torch.randn(n, hkv * g, d, generator=gen).to(torch.bfloat16)
    k_new = torch.randn(n, hkv, d, generator=gen).to(torch.bfloat16)
    v_new = torch.randn(n, hkv, d, generator=gen).to(torch.bfloat16)
    out = paged_attention(q, k_new, v_new, kv, _chunk_metadata(slots, cached, leading_keys=True))
    k, v = kv.gather(slots)  # [L, Hkv, D] bf16, dequantized
    identity = torch.arange(cached + n)
    torch.testing.assert_close(out.double(), _causal_reference(q, k, v, identity), rtol=1e-2, atol=1e-2)
