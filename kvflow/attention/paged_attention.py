"""Attention over the paged KV store for a mixed batch of prefill chunks and decode tokens.

Shapes: T flat tokens, Hq query heads, Hkv KV heads, G = Hq / Hkv, D head dim.
1. Every token's K/V is written into the pool through `slot_mapping` (all of a layer's writes
   precede its attention, so a chunk sees its own keys and a prefix cached in this same step).
2. Single-token query rows (decodes, and each token of a short chunk such as a speculative
   step's verification tokens; kvflow/worker/input_batch.py) are one batched call: in bf16 the
   native kernel reads each row's K/V in place through its slots, bf16 or quantized (dequantized
   in registers; kvflow/kernels/paged_decode_attention.cpp); otherwise SDPA over gathered K/V.
   GQA without repeating K/V either way: the G query heads sharing a KV head are folded into the
   query-length axis, q: [B, Hkv, G, D] against k: [B, Hkv, L, D], so no [B, Hq, L, D] copy of
   K/V is ever made.
3. A prefill chunk whose queries each see a leading run of its keys (causal, no sliding window
   cutting any; `leading_keys`) goes through the native flash-style kernel
   (kvflow/kernels/prefill_attention.cpp) with bf16 queries: in place over a bf16 pool, or over
   the dequantized gather of a quantized one. Other chunks are one SDPA call over their keys: the
   chunk's own fresh K/V when it has no cached context, else the gathered context plus itself
   under an explicit mask (bottom-right causal, sliding window).
Quantized KV pools (kvflow/attention/kv_layer.py) are otherwise dequantized for the gathered slots
only.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from kvflow.attention.kv_layer import KVLayer
from kvflow.attention.metadata import AttentionMetadata, PrefillChunkMetadata
from kvflow.kernels import (
    paged_decode_attention_bf16,
    paged_decode_attention_quantized,
    prefill_attention_bf16,
)


def _decode_attention(query: torch.Tensor, kv: KVLayer, meta: AttentionMetadata) -> torch.Tensor:
    assert meta.decode_kv_slots is not None and meta.decode_num_keys is not None
    num_decodes, num_heads, head_dim = query.shape
    scale = head_dim**-0.5
    if query.dtype == torch.bfloat16:  # native kernels read K/V in place through the slots: no gather
        pools, native = kv.in_place(), paged_decode_attention_bf16()
        if native is not None and pools is not None:
            return native(query, pools[0], pools[1], meta.decode_kv_slots, meta.decode_num_keys, scale)
        quantized, native_quantized = kv.quantized_pools(), paged_decode_attention_quantized()
        if native_quantized is not None and quantized is not None:
            p = quantized
            return native_quantized(
                query, p.key_data, p.key_scale, p.key_zero, p.value_data, p.value_scale, p.value_zero,
                meta.decode_kv_slots, meta.decode_num_keys, scale, p.kind,
            )  # fmt: skip
    slots = meta.decode_kv_slots  # [B, L]
    k_flat, v_flat = kv.gather(slots.reshape(-1))  # [B * L, Hkv, D] (dequantized if the pool is)
    num_kv_heads = k_flat.shape[1]
    q = query.view(num_decodes, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [B, Hkv, G, D]
    # [B * L, Hkv, D] -> [B, L, Hkv, D] -> [B, Hkv, L, D]
    k = k_flat.view(*slots.shape, num_kv_heads, head_dim).transpose(1, 2)
    v = v_flat.view(*slots.shape, num_kv_heads, head_dim).transpose(1, 2)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=meta.decode_attend)  # [B, Hkv, G, D]
    return out.reshape(num_decodes, num_heads, head_dim)


def _prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv: KVLayer,
    chunk: PrefillChunkMetadata,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    s, e = chunk.token_start, chunk.token_end
    flash = prefill_attention_bf16()
    even_head_dim = query.shape[-1] % 2 == 0
    if chunk.leading_keys and query.dtype == torch.bfloat16 and even_head_dim and flash is not None:
        # Query i sees the first L - n + i + 1 keys: the native flash kernel (bf16 pairs: even
        # head_dim), 3.7-4.6x the per-row decode kernel at 512-4,096 tokens, which itself was
        # 1.6x SDPA at 512 and on par at 2,048 (benchmarks/NOTES.md).
        scale = query.shape[-1] ** -0.5
        pools = kv.in_place()
        if pools is not None:  # read in place (the chunk's own K/V were written first)
            slots = slot_mapping[s:e] if chunk.kv_slots is None else chunk.kv_slots  # [L]
            return flash(query[s:e], pools[0], pools[1], slots, scale)
        # A quantized pool (or one in another dtype): its keys gathered in the model's dtype once,
        # read through identity slots.
        k, v = (key[s:e], value[s:e]) if chunk.kv_slots is None else kv.gather(chunk.kv_slots)
        identity = torch.arange(k.shape[0])
        return flash(query[s:e], k.contiguous(), v.contiguous(), identity, scale)
    if chunk.kv_slots is None:
        k, v = key[s:e], value[s:e]  # [n, Hkv, D]: the chunk is its whole context
    else:
        k, v = kv.gather(chunk.kv_slots)  # [L, Hkv, D]
    return chunk_sdpa(query[s:e], k, v, chunk, enable_gqa=True)


def chunk_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: PrefillChunkMetadata, **sdpa: Any
) -> torch.Tensor:
    """SDPA of one prefill chunk on token-major tensors: q [n, Hq, D], k [L, Hk, D], v [L, Hk, Dv]
    -> [n, Hq, Dv], under the chunk's mask (plain causal when it has none). `sdpa`: SDPA's options
    (enable_gqa, scale). Shared with latent attention (mla_attention.py)."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        attn_mask=chunk.attend,
        is_causal=chunk.attend is None,
        **sdpa,
    )  # [1, Hq, n, Dv]
    return out[0].transpose(0, 1)


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv: KVLayer,
    meta: AttentionMetadata,
) -> torch.Tensor:
    """query [T, Hq, D], key/value [T, Hkv, D] (already rotated) -> attention output [T, Hq, D]."""
    kv.write(key, value, meta.slot_mapping)
    nd = meta.num_decode_tokens
    if not meta.prefills:
        return _decode_attention(query, kv, meta)
    out = torch.empty_like(query)
    if nd:
        out[:nd] = _decode_attention(query[:nd], kv, meta)
    for chunk in meta.prefills:
        out[chunk.token_start : chunk.token_end] = _prefill_attention(
            query, key, value, kv, chunk, meta.slot_mapping
        )
    return out
