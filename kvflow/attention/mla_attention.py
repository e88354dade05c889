"""Multi-head latent attention (DeepSeek V2/V3) over the paged latent pool.

Shapes: T flat tokens, H heads, dn = qk_nope_head_dim, dr = qk_rope_head_dim, dv = v_head_dim,
C = kv_lora_rank, L = C + dr (one latent per token: [c_kv | k_pe], kvflow/attention/latent_kv_layer.py).
kv_b_proj's weight W [H * (dn + dv), C] up-projects c_kv into every head's k_nope (W_UK [H, dn, C])
and v (W_UV [H, dv, C]); k_pe is shared by all heads. For a query q = [q_nope | q_pe] of head h:
    score(j) = q_nope . (W_UK[h] c_j) + q_pe . k_pe_j = (W_UK[h]^T q_nope) . c_j + q_pe . k_pe_j
    out      = Σ_j p_j W_UV[h] c_j = W_UV[h] (Σ_j p_j c_j)
1. Every token's latent is written through `slot_mapping` before any attention (a chunk sees itself).
2. Decode rows, absorbed (the serving engines' way): the query is moved into latent space once,
   q_lat = [W_UK^T q_nope | q_pe] [B, H, L], attention runs over the cached latents directly as one
   "KV head" of width L whose value is the c_kv part (the H heads folded into the query-length
   axis), and W_UV is applied to the [B, H, C] result. The context's K/V are never materialised:
   a step reads L values per context token per layer, whatever H is. W_UK and W_UV^T are kept
   contiguous next to kv_b (absorbed_weights: half of kv_b's bytes again).
   Unabsorbed (no `absorbed` weights, the reference and the benchmark's baseline): the context latents
   are up-projected to per-head K/V [B, Lk, H, dn + dr] / [.., dv] every step.
3. Prefill chunks expand (compute-bound, so the up-projection is cheap next to attention): their
   context latents -> K/V of every head, one SDPA call per chunk with the explicit mask.
DeepSeek-V3.2 (DSA): a lightning indexer picks each query's top `index_topk` positions
(kvflow/attention/indexer.py); decode rows then gather only those latents, and prefill chunks mask
the rest out of the expanded attention.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from kvflow.attention.indexer import IndexerInputs, index_scores, selected_keys
from kvflow.attention.latent_kv_layer import LatentKVLayer
from kvflow.attention.metadata import AttentionMetadata, PrefillChunkMetadata
from kvflow.attention.paged_attention import chunk_sdpa


def _expand(
    latent: torch.Tensor, kv_b: torch.Tensor, num_heads: int, dn: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """latent [N, L] -> keys [N, H, dn + dr] and values [N, H, dv] of every head."""
    c = kv_b.shape[1]  # kv_lora_rank
    c_kv, k_pe = latent[:, :c], latent[:, c:]
    kv = F.linear(c_kv, kv_b).view(latent.shape[0], num_heads, -1)  # [N, H, dn + dv]
    k_nope, v = kv[..., :dn], kv[..., dn:]
    k = torch.cat((k_nope, k_pe.unsqueeze(1).expand(-1, num_heads, -1)), dim=-1)
    return k, v


def absorbed_weights(kv_b: torch.Tensor, num_heads: int, dn: int) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b [H * (dn + dv), C] -> (W_UK [H, dn, C], W_UV^T [H, C, dv]), contiguous: the batched
    matmuls of absorbed decode run ~10x slower on the strided views of kv_b (measured, bf16)."""
    w = kv_b.view(num_heads, -1, kv_b.shape[1])  # [H, dn + dv, C]
    return w[:, :dn].contiguous(), w[:, dn:].transpose(1, 2).contiguous()


def _decode_keys(
    kv: LatentKVLayer, meta: AttentionMetadata, indexer: IndexerInputs | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys each decode row attends: slots [B, K] and attend [B, K] (False on padding). Every
    cached position, or with DeepSeek-V3.2's indexer only each row's top `topk` of them (the rest
    of the latents are never read: a step reads every indexer key and topk latents)."""
    assert meta.decode_kv_slots is not None and meta.decode_attend is not None
    slots = meta.decode_kv_slots  # [B, Lk]
    attend = meta.decode_attend.view(slots.shape)  # [B, Lk]
    if indexer is None or slots.shape[1] <= indexer.topk:
        return slots, attend
    nd = slots.shape[0]
    keys = kv.gather_index_keys(slots.reshape(-1)).view(*slots.shape, -1)  # [B, Lk, Di]
    scores = index_scores(indexer.queries[:nd], keys, indexer.head_weights[:nd], indexer.scale)  # [B, Lk]
    chosen = selected_keys(scores, attend, indexer.topk)
    # Each row's chosen positions in position order, padded with the null slot: [B, topk].
    order = torch.sort(chosen.to(torch.int8), dim=-1, descending=True, stable=True).indices[:, : indexer.topk]
    return slots.gather(1, order), chosen.gather(1, order)


def _decode_absorbed(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv: LatentKVLayer,
    slots: torch.Tensor,
    attend: torch.Tensor,
    weights: tuple[torch.Tensor, torch.Tensor],
    scale: float,
) -> torch.Tensor:
    w_uk, w_uv_t = weights  # [H, dn, C], [H, C, dv]
    c = kv.kv_lora_rank
    q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [B, H, C]
    q = torch.cat((q_lat, q_pe), dim=-1)  # [B, H, L]
    latent = kv.gather(slots.reshape(-1)).view(*slots.shape, -1)  # [B, Lk, L]
    # Scores and softmax written out (as transformers' eager attention: matmul in the model dtype,
    # softmax in float32): SDPA with the H heads on the query axis and L = 576 is ~10x slower on CPU.
    scores = torch.bmm(q, latent.transpose(1, 2)).float() * scale  # [B, H, Lk]
    scores.masked_fill_(~attend.view(slots.shape[0], 1, -1), float("-inf"))
    probs = scores.softmax(dim=-1).to(latent.dtype)
    o_lat = torch.bmm(probs, latent[..., :c])  # [B, H, C]
    return torch.bmm(o_lat.transpose(0, 1), w_uv_t).transpose(0, 1)  # [B, H, dv]


def _decode_expanded(
    q: torch.Tensor,
    kv: LatentKVLayer,
    slots: torch.Tensor,
    attend: torch.Tensor,
    kv_b: torch.Tensor,
    scale: float,
    dn: int,
) -> torch.Tensor:
    num_heads = q.shape[1]
    k, v = _expand(kv.gather(slots.reshape(-1)), kv_b, num_heads, dn)  # [B * Lk, H, .]
    k = k.view(*slots.shape, num_heads, -1).transpose(1, 2)  # [B, H, Lk, dn + dr]
    v = v.view(*slots.shape, num_heads, -1).transpose(1, 2)
    mask = attend.view(slots.shape[0], 1, 1, -1)
    out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask, scale=scale)
    return out[:, :, 0]  # [B, H, dv]


def _prefill(
    q: torch.Tensor,
    latent: torch.Tensor,
    kv: LatentKVLayer,
    chunk: PrefillChunkMetadata,
    kv_b: torch.Tensor,
    scale: float,
    dn: int,
    indexer: IndexerInputs | None,
) -> torch.Tensor:
    s, e = chunk.token_start, chunk.token_end
    context = latent[s:e] if chunk.kv_slots is None else kv.gather(chunk.kv_slots)  # [N, L]
    if indexer is not None:  # V3.2: each query attends its top positions only (an explicit mask)
        keys = indexer.keys[s:e] if chunk.kv_slots is None else kv.gather_index_keys(chunk.kv_slots)
        scores = index_scores(indexer.queries[s:e], keys, indexer.head_weights[s:e], indexer.scale)
        visible = chunk.attend
        if visible is None:  # the chunk is its whole context: plain causal
            visible = torch.ones(e - s, e - s, dtype=torch.bool).tril()
        chunk = dataclasses.replace(chunk, attend=selected_keys(scores, visible, indexer.topk))
    k, v = _expand(context, kv_b, q.shape[1], dn)
    return chunk_sdpa(q[s:e], k, v, chunk, scale=scale)  # [n, H, dv]


def mla_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latent: torch.Tensor,
    kv: LatentKVLayer,
    meta: AttentionMetadata,
    kv_b: torch.Tensor,
    scale: float,
    absorbed: tuple[torch.Tensor, torch.Tensor] | None = None,
    indexer: IndexerInputs | None = None,
) -> torch.Tensor:
    """q_nope [T, H, dn], q_pe [T, H, dr] (rotated), latent [T, L] (k_pe rotated), kv_b [H*(dn+dv), C]
    -> attention output [T, H, dv]. Decode rows use `absorbed` (absorbed_weights(kv_b)) when given,
    else re-expand their context. `indexer` (DeepSeek-V3.2): its keys are cached beside the
    latents and every query attends only its top positions (kvflow/attention/indexer.py)."""
    kv.write(latent, meta.slot_mapping, None if indexer is None else indexer.keys)
    nd, dn = meta.num_decode_tokens, q_nope.shape[-1]
    num_tokens, num_heads = q_nope.shape[:2]
    dv = kv_b.shape[0] // num_heads - dn
    out = q_nope.new_empty(num_tokens, num_heads, dv)
    if nd:
        slots, attend = _decode_keys(kv, meta, indexer)
        if absorbed is not None:
            out[:nd] = _decode_absorbed(q_nope[:nd], q_pe[:nd], kv, slots, attend, absorbed, scale)
        else:
            q = torch.cat((q_nope[:nd], q_pe[:nd]), dim=-1)
            out[:nd] = _decode_expanded(q, kv, slots, attend, kv_b, scale, dn)
    if meta.prefills:
        q = torch.cat((q_nope, q_pe), dim=-1)  # [T, H, dn + dr]
        for chunk in meta.prefills:
            out[chunk.token_start : chunk.token_end] = _prefill(
                q, latent, kv, chunk, kv_b, scale, dn, indexer
            )
    return out
