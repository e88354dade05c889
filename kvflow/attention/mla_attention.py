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
   a step reads L values per context token per layer, whatever H is.
   Unabsorbed (`absorb=False`, the reference and the benchmark's baseline): the context latents
   are up-projected to per-head K/V [B, Lk, H, dn + dr] / [.., dv] every step.
3. Prefill chunks expand (compute-bound, so the up-projection is cheap next to attention): their
   context latents -> K/V of every head, one SDPA call per chunk with the explicit mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvflow.attention.latent_kv_layer import LatentKVLayer
from kvflow.attention.metadata import AttentionMetadata, PrefillChunkMetadata


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


def _decode_absorbed(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv: LatentKVLayer,
    meta: AttentionMetadata,
    kv_b: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    assert meta.decode_kv_slots is not None
    num_heads, dn = q_nope.shape[1:]
    c = kv.kv_lora_rank
    w = kv_b.view(num_heads, -1, c)  # [H, dn + dv, C]
    w_uk, w_uv = w[:, :dn], w[:, dn:]  # [H, dn, C], [H, dv, C]
    q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [B, H, C]
    q = torch.cat((q_lat, q_pe), dim=-1).unsqueeze(1)  # [B, 1, H, L]: heads on the query axis
    slots = meta.decode_kv_slots  # [B, Lk]
    latent = kv.gather(slots.reshape(-1)).view(*slots.shape, -1).unsqueeze(1)  # [B, 1, Lk, L]
    o_lat = F.scaled_dot_product_attention(
        q, latent, latent[..., :c], attn_mask=meta.decode_attend, scale=scale
    )  # [B, 1, H, C]
    return torch.bmm(o_lat[:, 0].transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [B, H, dv]


def _decode_expanded(
    q: torch.Tensor, kv: LatentKVLayer, meta: AttentionMetadata, kv_b: torch.Tensor, scale: float, dn: int
) -> torch.Tensor:
    assert meta.decode_kv_slots is not None
    num_heads = q.shape[1]
    slots = meta.decode_kv_slots
    k, v = _expand(kv.gather(slots.reshape(-1)), kv_b, num_heads, dn)  # [B * Lk, H, .]
    k = k.view(*slots.shape, num_heads, -1).transpose(1, 2)  # [B, H, Lk, dn + dr]
    v = v.view(*slots.shape, num_heads, -1).transpose(1, 2)
    out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=meta.decode_attend, scale=scale)
    return out[:, :, 0]  # [B, H, dv]


def _prefill(
    q: torch.Tensor,
    latent: torch.Tensor,
    kv: LatentKVLayer,
    chunk: PrefillChunkMetadata,
    kv_b: torch.Tensor,
    scale: float,
    dn: int,
) -> torch.Tensor:
    s, e = chunk.token_start, chunk.token_end
    context = latent[s:e] if chunk.kv_slots is None else kv.gather(chunk.kv_slots)  # [N, L]
    k, v = _expand(context, kv_b, q.shape[1], dn)
    out = F.scaled_dot_product_attention(
        q[s:e].transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        attn_mask=chunk.attend,
        is_causal=chunk.attend is None,
        scale=scale,
    )  # [1, H, n, dv]
    return out[0].transpose(0, 1)


def mla_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latent: torch.Tensor,
    kv: LatentKVLayer,
    meta: AttentionMetadata,
    kv_b: torch.Tensor,
    scale: float,
    absorb: bool = True,
) -> torch.Tensor:
    """q_nope [T, H, dn], q_pe [T, H, dr] (rotated), latent [T, L] (k_pe rotated), kv_b [H*(dn+dv), C]
    -> attention output [T, H, dv]."""
    kv.write(latent, meta.slot_mapping)
    nd, dn = meta.num_decode_tokens, q_nope.shape[-1]
    num_tokens, num_heads = q_nope.shape[:2]
    dv = kv_b.shape[0] // num_heads - dn
    out = q_nope.new_empty(num_tokens, num_heads, dv)
    if nd:
        if absorb:
            out[:nd] = _decode_absorbed(q_nope[:nd], q_pe[:nd], kv, meta, kv_b, scale)
        else:
            q = torch.cat((q_nope[:nd], q_pe[:nd]), dim=-1)
            out[:nd] = _decode_expanded(q, kv, meta, kv_b, scale, dn)
    if meta.prefills:
        q = torch.cat((q_nope, q_pe), dim=-1)  # [T, H, dn + dr]
        for chunk in meta.prefills:
            out[chunk.token_start : chunk.token_end] = _prefill(q, latent, kv, chunk, kv_b, scale, dn)
    return out
