"""Attention sinks (gpt-oss) and an explicit softmax scale (Gemma 3) on every paged attention path:
native decode (bf16 and int8 / fp8_e4m3 / int4 pools), the native flash prefill, and the torch
paths (SDPA over gathered K/V, `chunk_sdpa`), in steps shaped as the model runner builds them
(decode rows, short chunks as query rows, chunks with and without cached context, sliding windows;
the metadata by the rules of kvflow/worker/input_batch.py), against the eager formula of
transformers' gpt-oss attention on the K/V the pool holds (dequantized for quantized pools).
Without sinks every path stays bit for bit as before."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TypeVar

import pytest
import torch

import kvflow.attention.paged_attention as paged
from kvflow.attention.kv_layer import KVLayer, PlainKVLayer, QuantizedKVLayer
from kvflow.attention.metadata import AttentionMetadata, PrefillChunkMetadata
from kvflow.attention.paged_attention import chunk_sdpa, paged_attention
from kvflow.kernels import (
    paged_decode_attention_bf16,
    paged_decode_attention_quantized,
    prefill_attention_bf16,
)
from kvflow.worker.input_batch import MAX_QUERY_ROWS_PER_CHUNK

KernelT = TypeVar("KernelT")
BLOCK_SIZE = 16
NUM_BLOCKS = 48  # block 0 is the null block: never in a block table
HEAD_DIM = 64
SCALE = 0.2  # not head_dim**-0.5 (0.125), as Gemma 3's query_pre_attn_scalar**-0.5 is not
# A step as the scheduler hands it over, in flat-batch order: (tokens already in the cache, tokens
# scheduled now). Decodes of different lengths, a 3-token chunk (attended as query rows, as a
# speculative verification is), a chunk after cached context and one from scratch (prefill chunks).
STEP = [(70, 1), (5, 1), (33, 3), (40, 30), (0, 60)]
WINDOW = 24  # shorter than most requests: windowed decode rows, masked chunks, keys left behind
POOL_KINDS = ["plain", "int8", "fp8_e4m3", "int4"]
# (model dtype, native kernels): bf16 takes the native kernels where built; "torch" forces the SDPA
# paths in bf16 too; float32 always takes them.
PATHS = [(torch.bfloat16, True), (torch.bfloat16, False), (torch.float32, False)]


def _built(kernel: KernelT | None) -> KernelT:
    if kernel is None:
        pytest.skip("native kernels unavailable on this CPU/toolchain")
    return kernel


def _reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, sinks: torch.Tensor | None
) -> torch.Tensor:
    """transformers' gpt-oss eager attention for one query token: q [Hq, D], k/v [L, Hkv, D] ->
    [Hq, D] fp32. Scores in fp32, the sink logit as one more column, softmax, the column dropped."""
    g = q.shape[0] // k.shape[1]
    k, v = k.float().repeat_interleave(g, dim=1), v.float().repeat_interleave(g, dim=1)  # [L, Hq, D]
    scores = torch.einsum("hd,lhd->hl", q.float(), k) * scale  # [Hq, L]
    if sinks is not None:
        scores = torch.cat([scores, sinks.float()[:, None]], dim=-1)
    probs = (scores - scores.amax(-1, keepdim=True)).softmax(-1)[:, : k.shape[0]]
    return torch.einsum("hl,lhd->hd", probs, v)


def _sinks(num_heads: int, seed: int = 7) -> torch.Tensor:
    """Per-head sink logits around the scores' range, with one far above (its rows' outputs nearly
    vanish) and one far below (its rows nearly unchanged)."""
    sinks = 2 * torch.randn(num_heads, generator=torch.Generator().manual_seed(seed))
    sinks[0], sinks[-1] = 12.0, -30.0
    return sinks


def _pool(kind: str, num_kv_heads: int, dtype: torch.dtype) -> KVLayer:
    num_slots = NUM_BLOCKS * BLOCK_SIZE
    if kind == "plain":
        return PlainKVLayer(num_slots, num_kv_heads, HEAD_DIM, dtype, dtype)
    return QuantizedKVLayer(kind, num_slots, num_kv_heads, HEAD_DIM, dtype)


def _slots(block_ids: list[int], positions: range) -> torch.Tensor:
    return torch.tensor(
        [block_ids[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in positions], dtype=torch.int64
    )


def _visible(position: int, window: int | None) -> range:
    """Key positions a query at `position` sees: q - W < k <= q (HF's sliding window), or all."""
    return range(0 if window is None else max(0, position - window + 1), position + 1)


def _step_metadata(requests: list[tuple[list[int], int, int]], window: int | None) -> AttentionMetadata:
    """What kvflow/worker/input_batch.py builds for (block table, cached, scheduled) requests:
    requests of at most MAX_QUERY_ROWS_PER_CHUNK tokens first, one query row per token (key slots
    padded with slot 0), then a prefill chunk per longer request: without context and window its
    own keys, plain causal; else a mask over its visible key positions, read from the pool when it
    has context (kv_slots), and `leading_keys` while no key has left any query's window."""
    positions: list[int] = []
    slot_mapping: list[torch.Tensor] = []
    rows: list[torch.Tensor] = []
    prefills = []
    for table, cached, n in requests:
        token_start, query_pos = len(positions), range(cached, cached + n)
        positions += query_pos
        slot_mapping.append(_slots(table, query_pos))
        if n <= MAX_QUERY_ROWS_PER_CHUNK:
            rows += [_slots(table, _visible(p, window)) for p in query_pos]
            continue
        keys = range(_visible(cached, window).start, cached + n)
        q_pos, k_pos = torch.tensor(query_pos)[:, None], torch.tensor(keys)[None, :]
        attend = k_pos <= q_pos
        if window is not None:
            attend &= k_pos > q_pos - window
        chunk_end = token_start + n
        if cached == 0 and (window is None or n <= window):
            prefills.append(PrefillChunkMetadata(token_start, chunk_end, None, None, leading_keys=True))
        else:
            kv_slots = None if cached == 0 else _slots(table, keys)
            leading = window is None or cached + n <= window
            prefills.append(
                PrefillChunkMetadata(token_start, chunk_end, kv_slots, attend, leading_keys=leading)
            )
    num_keys = torch.tensor([len(r) for r in rows])
    decode_slots = torch.zeros(len(rows), int(num_keys.max()), dtype=torch.int64)
    for i, r in enumerate(rows):
        decode_slots[i, : len(r)] = r
    valid = torch.arange(decode_slots.shape[1])[None, :] < num_keys[:, None]
    return AttentionMetadata(
        positions=torch.tensor(positions),
        slot_mapping=torch.cat(slot_mapping),
        num_decode_tokens=len(rows),
        decode_kv_slots=decode_slots,
        decode_attend=valid[:, None, None, :],
        decode_num_keys=num_keys,
        prefills=prefills,
    )


class _Step:
    """One scheduled step (STEP, in flat-batch order) over a pool whose cached context is already
    written: its metadata, fresh q/k/v for the scheduled tokens, and the keys each token reads."""

    def __init__(self, kv: KVLayer, hq: int, hkv: int, dtype: torch.dtype, window: int | None) -> None:
        gen = torch.Generator().manual_seed(1)
        blocks = (torch.randperm(NUM_BLOCKS - 1, generator=gen) + 1).tolist()
        requests = []
        for cached, n in STEP:
            table = [blocks.pop() for _ in range(math.ceil((cached + n) / BLOCK_SIZE))]
            k, v = torch.randn(2, cached, hkv, HEAD_DIM, generator=gen).to(dtype)
            kv.write(k, v, _slots(table, range(cached)))  # the context earlier steps cached
            requests.append((table, cached, n))
        self.meta = _step_metadata(requests, window)
        # Each token reads its visible positions from the pool or, in a chunk without cached
        # context, from the chunk's own fresh K/V (which a quantized pool holds only rounded).
        self.keys: list[tuple[bool, torch.Tensor]] = []  # (from fresh K/V, slots or flat indices)
        for table, cached, n in requests:
            token_start = len(self.keys)
            for p in range(cached, cached + n):
                visible = _visible(p, window)
                if cached == 0 and n > MAX_QUERY_ROWS_PER_CHUNK:
                    self.keys.append((True, torch.tensor([token_start + k for k in visible])))
                else:
                    self.keys.append((False, _slots(table, visible)))
        num_tokens = len(self.keys)
        self.q = torch.randn(num_tokens, hq, HEAD_DIM, generator=gen).to(dtype)
        self.k, self.v = torch.randn(2, num_tokens, hkv, HEAD_DIM, generator=gen).to(dtype)

    def reference(self, kv: KVLayer, scale: float, sinks: torch.Tensor | None) -> torch.Tensor:
        """[T, Hq, D] fp32 over the K/V each token reads (after the step wrote its own)."""
        rows = []
        for t, (from_fresh, index) in enumerate(self.keys):
            # The pool's K/V dequantized for quantized pools.
            k, v = (self.k[index], self.v[index]) if from_fresh else kv.gather(index)
            rows.append(_reference(self.q[t], k, v, scale, sinks))
        return torch.stack(rows)


@pytest.fixture
def torch_paths(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The native attention kernels reported missing: bf16 takes the SDPA paths."""
    for name in ("paged_decode_attention_bf16", "paged_decode_attention_quantized", "prefill_attention_bf16"):
        monkeypatch.setattr(paged, name, lambda: None)
    yield


def _select_path(native: bool, request: pytest.FixtureRequest) -> None:
    if native:
        _built(paged_decode_attention_bf16())
    else:
        request.getfixturevalue("torch_paths")


def _check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        return
    # bf16 queries and outputs (2^-9 relative), bf16 probabilities in the flash kernel's P.V and
    # SDPA's, one more rounding where the torch paths rescale: values ~1.
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2)
    assert (out.float() - ref).abs().mean() < 2e-3  # a wrong mask or sink is far larger


@pytest.mark.parametrize(("dtype", "native"), PATHS)
@pytest.mark.parametrize("kind", POOL_KINDS)
@pytest.mark.parametrize("window", [None, WINDOW])
@pytest.mark.parametrize("gqa", [2, 4])
def test_step_with_sinks_matches_the_eager_reference(
    dtype: torch.dtype, native: bool, kind: str, window: int | None, gqa: int, request: pytest.FixtureRequest
) -> None:
    """A whole mixed step (decode rows, query rows of a short chunk, prefill chunks with and without
    context, sliding window or not) with sinks and a custom scale, every path and pool format."""
    _select_path(native, request)
    hkv = 2
    kv = _pool(kind, hkv, dtype)
    step = _Step(kv, hkv * gqa, hkv, dtype, window)
    sinks = _sinks(hkv * gqa)
    out = paged_attention(step.q, step.k, step.v, kv, step.meta, scale=SCALE, sinks=sinks)
    ref = step.reference(kv, SCALE, sinks)
    _check(out, ref, dtype)
    # The sinks matter here: the same step without them is far from it.
    assert (step.reference(kv, SCALE, None) - ref).abs().max() > 0.1


@pytest.mark.parametrize(("dtype", "native"), PATHS)
@pytest.mark.parametrize("kind", POOL_KINDS)
def test_custom_scale_without_sinks_matches_the_reference(
    dtype: torch.dtype, native: bool, kind: str, request: pytest.FixtureRequest
) -> None:
    _select_path(native, request)
    kv = _pool(kind, 2, dtype)
    step = _Step(kv, 8, 2, dtype, WINDOW)
    out = paged_attention(step.q, step.k, step.v, kv, step.meta, scale=SCALE)
    _check(out, step.reference(kv, SCALE, None), dtype)


@pytest.mark.parametrize(("dtype", "native"), PATHS)
@pytest.mark.parametrize("kind", POOL_KINDS)
@pytest.mark.parametrize("window", [None, WINDOW])
def test_no_sinks_and_minus_infinity_sinks_are_the_previous_call_bit_for_bit(
    dtype: torch.dtype, native: bool, kind: str, window: int | None, request: pytest.FixtureRequest
) -> None:
    """sinks=None, scale=None is the call without them; a sink of -inf takes the sink paths (the
    kernels' start values, SDPA's rescale by sigmoid(+inf) = 1) and changes no bit either."""
    _select_path(native, request)
    outs = []
    for kwargs in ({}, {"sinks": None, "scale": None}, {"sinks": torch.full((8,), -math.inf)}):
        kv = _pool(kind, 2, dtype)
        step = _Step(kv, 8, 2, dtype, window)
        outs.append(paged_attention(step.q, step.k, step.v, kv, step.meta, **kwargs))
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(outs[0], outs[2])


def _decode_problem(
    hkv: int, g: int, d: int, lens: list[int], seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    num_slots = 1024
    kc, vc = torch.randn(2, num_slots, hkv, d, generator=gen).to(torch.bfloat16)
    q = torch.randn(len(lens), hkv * g, d, generator=gen).to(torch.bfloat16)
    slots = torch.zeros(len(lens), max(lens), dtype=torch.int64)
    for b, n in enumerate(lens):
        slots[b, :n] = torch.randperm(num_slots - 1, generator=gen)[:n] + 1  # scattered, never 0
    return q, kc, vc, slots, torch.tensor(lens)


KERNEL_CASES = [  # (num_kv_heads, queries per kv head, head_dim)
    (2, 7, 64),
    (1, 16, 96),  # more heads than one score pass (8) or value pass (7) takes
    (2, 3, 18),  # a partial 32-dim block
    (1, 2, 17),  # odd head_dim: the row-reader path
]


@pytest.mark.parametrize(("hkv", "g", "d"), KERNEL_CASES)
def test_native_decode_kernel_with_sinks(hkv: int, g: int, d: int) -> None:
    """The bf16 decode kernel called directly: rows of different lengths, rows sharing one slot list
    (grouped), and the old positional signature equal to sinks=None bit for bit."""
    kernel = _built(paged_decode_attention_bf16())
    q, kc, vc, slots, num_keys = _decode_problem(hkv, g, d, [1, 37, 600, 5])
    shared = slots[2:3].expand(4, -1)  # one request's verification rows: leading keys of one list
    causal = torch.tensor([597, 598, 599, 600])
    sinks = _sinks(hkv * g)
    for sl, nk in ((slots, num_keys), (shared, causal)):
        out = kernel(q, kc, vc, sl, nk, SCALE, sinks)
        for b in range(q.shape[0]):
            idx = sl[b, : nk[b]]
            ref = _reference(q[b], kc[idx], vc[idx], SCALE, sinks)
            torch.testing.assert_close(out[b].float(), ref, rtol=1e-2, atol=1e-2)
        assert torch.equal(kernel(q, kc, vc, sl, nk, SCALE), kernel(q, kc, vc, sl, nk, SCALE, None))


@pytest.mark.parametrize("kind", ["int8", "fp8_e4m3", "int4"])
def test_native_quantized_decode_kernel_with_sinks(kind: str) -> None:
    kernel = _built(paged_decode_attention_quantized())
    hkv, g, lens = 2, 4, [1, 37, 600, 5]
    kv = QuantizedKVLayer(kind, 1024, hkv, HEAD_DIM, torch.bfloat16)
    gen = torch.Generator().manual_seed(2)
    k, v = torch.randn(2, 1023, hkv, HEAD_DIM, generator=gen)
    kv.write(k, v, torch.arange(1, 1024))
    q, _, _, slots, num_keys = _decode_problem(hkv, g, HEAD_DIM, lens)
    p = kv.quantized_pools()
    assert p is not None
    pools = (p.key_data, p.key_scale, p.key_zero, p.value_data, p.value_scale, p.value_zero)
    sinks = _sinks(hkv * g)
    out = kernel(q, *pools, slots, num_keys, SCALE, kind, sinks)
    for b in range(len(lens)):
        k, v = kv.gather(slots[b, : lens[b]])
        torch.testing.assert_close(out[b].float(), _reference(q[b], k, v, SCALE, sinks), rtol=1e-2, atol=1e-2)
    assert torch.equal(
        kernel(q, *pools, slots, num_keys, SCALE, kind), kernel(q, *pools, slots, num_keys, SCALE, kind, None)
    )


@pytest.mark.parametrize(("n", "num_keys"), [(40, 40), (100, 300), (9, 600)])
def test_native_prefill_kernel_with_sinks(n: int, num_keys: int) -> None:
    """The flash kernel over several key tiles (the sink's start value rescaled tile by tile) and
    query tiles, after cached context."""
    kernel = _built(prefill_attention_bf16())
    hkv, g = 2, 7
    _, kc, vc, _, _ = _decode_problem(hkv, g, HEAD_DIM, [1])
    gen = torch.Generator().manual_seed(3)
    slots = torch.randperm(kc.shape[0] - 1, generator=gen)[:num_keys] + 1
    q = (2 * torch.randn(n, hkv * g, HEAD_DIM, generator=gen)).to(torch.bfloat16)  # peaked softmaxes too
    sinks = _sinks(hkv * g)
    out = kernel(q, kc, vc, slots, SCALE, sinks)
    for i in range(n):
        idx = slots[: num_keys - n + i + 1]
        ref = _reference(q[i], kc[idx], vc[idx], SCALE, sinks)
        torch.testing.assert_close(out[i].float(), ref, rtol=1e-2, atol=1e-2)
    assert torch.equal(kernel(q, kc, vc, slots, SCALE), kernel(q, kc, vc, slots, SCALE, None))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_chunk_sdpa_with_sinks_and_value_heads_of_another_size(dtype: torch.dtype) -> None:
    """chunk_sdpa as latent attention calls it (one K/V head per query head, Dv != D: the explicit
    form), under a causal mask after cached context."""
    gen = torch.Generator().manual_seed(4)
    n, cached, h, d, dv = 12, 20, 4, 48, 32
    q = torch.randn(n, h, d, generator=gen).to(dtype)
    k = torch.randn(cached + n, h, d, generator=gen).to(dtype)
    v = torch.randn(cached + n, h, dv, generator=gen).to(dtype)
    attend = torch.ones(n, cached + n, dtype=torch.bool).tril(cached)
    chunk = PrefillChunkMetadata(0, n, torch.arange(cached + n), attend)
    sinks = _sinks(h)
    out = chunk_sdpa(q, k, v, chunk, scale=SCALE, sinks=sinks)
    ref = torch.stack(
        [_reference(q[i], k[: cached + i + 1], v[: cached + i + 1], SCALE, sinks) for i in range(n)]
    )
    _check(out, ref, dtype)


def test_decode_rows_with_sinks_through_sdpa_match_the_explicit_form() -> None:
    """sdpa_with_sinks's two forms (the flash kernel's lse, explicit fp32 scores) agree on decode
    rows folded as the decode path folds them (q [B, Hkv, G, D], sinks [Hkv, G])."""
    gen = torch.Generator().manual_seed(5)
    b, hkv, g, length = 3, 2, 4, 50
    q = torch.randn(b, hkv, g, HEAD_DIM, generator=gen)
    k, v = torch.randn(2, b, hkv, length, HEAD_DIM, generator=gen)
    attend = (torch.arange(length) < torch.tensor([50, 7, 31])[:, None])[:, None, None, :]
    sinks = _sinks(hkv * g).view(hkv, g)
    flash = paged.sdpa_with_sinks(q, k, v, attend, sinks, SCALE)
    explicit = paged._explicit_attention_with_sinks(q, k, v, attend, sinks, SCALE)
    torch.testing.assert_close(flash, explicit, rtol=1e-5, atol=1e-5)
