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
Options of every path: `scale` (the softmax scale; None = head_dim**-0.5; Gemma 3 uses
query_pre_attn_scalar**-0.5) and `sinks` ([Hq] per-head sink logits, gpt-oss: each query row's
softmax gets one more logit s_h with no value,
    p_j = exp(score_j - m) / (sum_k exp(score_k - m) + exp(s_h - m)),   out = sum_j p_j V_j).
The native kernels fold s_h into their softmax; the SDPA paths rescale SDPA's output, since with
Z = sum_k exp(score_k) the sink only scales a row by Z / (Z + exp(s_h)) = sigmoid(lse - s_h),
lse = log Z (`sdpa_with_sinks`). Sliding windows come in the masks and key lists of the metadata,
so sinks compose with them unchanged.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kvflow.attention.kv_layer import KVLayer
from kvflow.attention.metadata import AttentionMetadata, PrefillChunkMetadata
from kvflow.kernels import (
    paged_decode_attention_bf16,
    paged_decode_attention_quantized,
    prefill_attention_bf16,
)

# The CPU flash attention kernel behind SDPA, called directly for the row log-sum-exps it also
# returns (logsumexp [B, H, n] fp32). It takes GQA (fewer K/V heads) and float32 / bfloat16, but
# masks only additive in the query's dtype, and needs equal head sizes for Q, K and V.
_flash_attention_with_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def sdpa_with_sinks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attend: torch.Tensor | None,
    sinks: torch.Tensor,
    scale: float | None,
) -> torch.Tensor:
    """Attention with a sink logit in each row's softmax: q [B, H, n, D], k [B, Hk, L, D], v [B, Hk,
    L, Dv] (Hk divides H), attend broadcastable to [B, H, n, L] (bool; None = causal, n == L),
    sinks broadcastable to [B, H, n] (fp32) -> [B, H, n, Dv] in q's dtype.
    out = SDPA(q, k, v) * sigmoid(lse - sink): SDPA's flash kernel returns lse with the output.
    Measured against explicit fp32 scores with a sink column (_explicit_attention_with_sinks), GQA
    64:8, D = 64, 2 threads, medians in ms, bf16 / fp32 (plain SDPA without sinks in brackets):
      512-token chunk, causal                       44 / 28     against 261 / 234    [41 / 25]
      512-token chunk after 512, 128-token window   79 / 53     against 404 / 480    [70 / 53]
      decode over 2,048 keys, 1 row                 0.54 / 0.64 against 1.1 / 0.96   [0.50 / 0.51]
      decode over 2,048 keys, 8 rows                6.4 / 7.9   against 45 / 11      [6.0 / 7.6]
    The explicit form stays for what the kernel refuses (Dv != D: latent attention's values)."""
    if q.device.type != "cpu" or q.shape[-1] != v.shape[-1]:
        return _explicit_attention_with_sinks(q, k, v, attend, sinks, scale)
    mask = None
    if attend is not None:  # additive, in q's dtype, as the kernel takes it
        mask = torch.zeros(attend.shape, dtype=q.dtype).masked_fill_(~attend, -math.inf)
    out, lse = _flash_attention_with_lse(q, k, v, 0.0, attend is None, attn_mask=mask, scale=scale)
    # lse is fp32 for bf16/fp16/fp32 inputs (fp64 for fp64): rescale at that precision, round once.
    return (out.to(lse.dtype) * torch.sigmoid(lse - sinks).unsqueeze(-1)).to(q.dtype)


def _explicit_attention_with_sinks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attend: torch.Tensor | None,
    sinks: torch.Tensor,
    scale: float | None,
) -> torch.Tensor:
    """sdpa_with_sinks from fp32 scores. GQA without repeating K/V: the G query heads of a KV head
    are stacked along the query axis, [B, Hk, G * n, D] against [B, Hk, L, D]."""
    b, h, n, d = q.shape
    hk, length = k.shape[1], k.shape[2]
    acc = torch.promote_types(q.dtype, torch.float32)
    scores = q.to(acc).reshape(b, hk, h // hk * n, d) @ k.to(acc).transpose(-1, -2)  # [B, Hk, G * n, L]
    scores = scores.view(b, h, n, length) * (d**-0.5 if scale is None else scale)
    if attend is None:
        attend = torch.ones(n, length, dtype=torch.bool, device=q.device).tril(length - n)
    scores = scores.masked_fill(~attend, -math.inf)
    sink = sinks.to(acc).expand(b, h, n).unsqueeze(-1)  # [B, H, n, 1]: one more logit per row
    top = torch.maximum(scores.amax(-1, keepdim=True), sink)
    weights = (scores - top).exp()
    weights = weights / (weights.sum(-1, keepdim=True) + (sink - top).exp())
    out = weights.view(b, hk, h // hk * n, length) @ v.to(acc)  # [B, Hk, G * n, Dv]
    return out.view(b, h, n, -1).to(q.dtype)


def _decode_attention(
    query: torch.Tensor,
    kv: KVLayer,
    meta: AttentionMetadata,
    scale: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    assert meta.decode_kv_slots is not None and meta.decode_num_keys is not None
    num_decodes, num_heads, head_dim = query.shape
    if query.dtype == torch.bfloat16:  # native kernels read K/V in place through the slots: no gather
        native_scale = head_dim**-0.5 if scale is None else scale
        pools, native = kv.in_place(), paged_decode_attention_bf16()
        if native is not None and pools is not None:
            slots, num_keys = meta.decode_kv_slots, meta.decode_num_keys
            return native(query, pools[0], pools[1], slots, num_keys, native_scale, sinks)
        quantized, native_quantized = kv.quantized_pools(), paged_decode_attention_quantized()
        if native_quantized is not None and quantized is not None:
            p = quantized
            return native_quantized(
                query, p.key_data, p.key_scale, p.key_zero, p.value_data, p.value_scale, p.value_zero,
                meta.decode_kv_slots, meta.decode_num_keys, native_scale, p.kind, sinks,
            )  # fmt: skip
    slots = meta.decode_kv_slots  # [B, L]
    k_flat, v_flat = kv.gather(slots.reshape(-1))  # [B * L, Hkv, D] (dequantized if the pool is)
    num_kv_heads = k_flat.shape[1]
    q = query.view(num_decodes, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [B, Hkv, G, D]
    # [B * L, Hkv, D] -> [B, L, Hkv, D] -> [B, Hkv, L, D]
    k = k_flat.view(*slots.shape, num_kv_heads, head_dim).transpose(1, 2)
    v = v_flat.view(*slots.shape, num_kv_heads, head_dim).transpose(1, 2)
    if sinks is None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=meta.decode_attend, scale=scale)
    else:  # [B, Hkv, G, D]; the folded G axis is the query axis, so the sinks are [Hkv, G]
        out = sdpa_with_sinks(q, k, v, meta.decode_attend, sinks.view(num_kv_heads, -1), scale)
    return out.reshape(num_decodes, num_heads, head_dim)


def _prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv: KVLayer,
    chunk: PrefillChunkMetadata,
    slot_mapping: torch.Tensor,
    scale: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    s, e = chunk.token_start, chunk.token_end
    flash = prefill_attention_bf16()
    even_head_dim = query.shape[-1] % 2 == 0
    if chunk.leading_keys and query.dtype == torch.bfloat16 and even_head_dim and flash is not None:
        # Query i sees the first L - n + i + 1 keys: the native flash kernel (bf16 pairs: even
        # head_dim), 3.7-4.6x the per-row decode kernel at 512-4,096 tokens, which itself was
        # 1.6x SDPA at 512 and on par at 2,048 (benchmarks/NOTES.md).
        native_scale = query.shape[-1] ** -0.5 if scale is None else scale
        pools = kv.in_place()
        if pools is not None:  # read in place (the chunk's own K/V were written first)
            slots = slot_mapping[s:e] if chunk.kv_slots is None else chunk.kv_slots  # [L]
            return flash(query[s:e], pools[0], pools[1], slots, native_scale, sinks)
        # A quantized pool (or one in another dtype): its keys gathered in the model's dtype once,
        # read through identity slots.
        k, v = (key[s:e], value[s:e]) if chunk.kv_slots is None else kv.gather(chunk.kv_slots)
        identity = torch.arange(k.shape[0])
        return flash(query[s:e], k.contiguous(), v.contiguous(), identity, native_scale, sinks)
    if chunk.kv_slots is None:
        k, v = key[s:e], value[s:e]  # [n, Hkv, D]: the chunk is its whole context
    else:
        k, v = kv.gather(chunk.kv_slots)  # [L, Hkv, D]
    return chunk_sdpa(query[s:e], k, v, chunk, scale=scale, sinks=sinks, enable_gqa=True)


def chunk_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    chunk: PrefillChunkMetadata,
    *,
    scale: float | None = None,
    sinks: torch.Tensor | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """SDPA of one prefill chunk on token-major tensors: q [n, Hq, D], k [L, Hk, D], v [L, Hk, Dv]
    -> [n, Hq, Dv], under the chunk's mask (plain causal when it has none). scale: None =
    head_dim**-0.5; sinks: [Hq] sink logits or None; enable_gqa: Hk < Hq. Shared with latent
    attention (mla_attention.py)."""
    q4, k4, v4 = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, heads, tokens, dim]
    if sinks is None:
        causal = chunk.attend is None
        out = F.scaled_dot_product_attention(
            q4, k4, v4, attn_mask=chunk.attend, is_causal=causal, scale=scale, enable_gqa=enable_gqa
        )  # [1, Hq, n, Dv]
    else:
        out = sdpa_with_sinks(q4, k4, v4, chunk.attend, sinks.view(-1, 1), scale)
    return out[0].transpose(0, 1)


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv: KVLayer,
    meta: AttentionMetadata,
    *,
    scale: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """query [T, Hq, D], key/value [T, Hkv, D] (already rotated) -> attention output [T, Hq, D].
    scale: the softmax scale (None: head_dim**-0.5); sinks: [Hq] per-head sink logits (None: none)."""
    if sinks is not None:  # the kernels read fp32 logits: a model's bf16 parameter is converted here
        if sinks.shape != (query.shape[1],):
            raise ValueError(f"sinks: one logit per query head, [{query.shape[1]}], got {list(sinks.shape)}")
        sinks = sinks.detach().to(torch.float32).contiguous()
    kv.write(key, value, meta.slot_mapping)
    nd = meta.num_decode_tokens
    if not meta.prefills:
        return _decode_attention(query, kv, meta, scale, sinks)
    out = torch.empty_like(query)
    if nd:
        out[:nd] = _decode_attention(query[:nd], kv, meta, scale, sinks)
    for chunk in meta.prefills:
        out[chunk.token_start : chunk.token_end] = _prefill_attention(
            query, key, value, kv, chunk, meta.slot_mapping, scale, sinks
        )
    return out
