"""The gated delta rule of Qwen3-Next's linear-attention layers (Gated DeltaNet), state carried in and out.

Shapes: T tokens of one request's chunk, B decode requests, Hk q/k heads, Hv = m x Hk value heads (q/k
head i serves v heads [i*m, (i+1)*m), HF's repeat_interleave), dk / dv the key / value head dims.
Per v head the state is a matrix S [dk, dv], float32, and every token t updates and then reads it:
    S_t = e^{g_t} S_{t-1} + k_t δ_t^T,   δ_t = β_t (v_t - e^{g_t} S_{t-1}^T k_t)   (the delta rule)
    o_t = S_t^T q_t
with q, k L2-normalised per head (Qwen3-Next asks it) and q scaled by dk^-1/2, g_t <= 0 the log decay and
β_t in (0, 1) the write strength (gdn_gating). A request's whole context lives in S: Hv x dk x dv floats
per layer whatever its length (2 MiB at Qwen3-Next-80B's 32 x 128 x 128).

Two forms, as HF (transformers' modeling_qwen3_next) and FLA have them:
- chunk_gated_delta_rule: a prefill chunk, by chunks of CHUNK_SIZE tokens (the WY/UT form: within a
  chunk the T sequential rank-1 updates become matmuls and two triangular solves; across chunks a scan
  of T / 64 state updates). The arithmetic is HF's torch_chunk_gated_delta_rule, step for step.
- recurrent_gated_delta_rule_step: one decode token for B requests, O(B x Hv x dk x dv), independent of
  the context length.
Both compute in float32 whatever the input dtype; outputs come back in q's dtype, states stay float32.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

# HF's and FLA's l2norm epsilon (inside the square root).
L2NORM_EPS = 1e-6
# HF's and FLA's chunk length: the intra-chunk systems are [64, 64] per head.
CHUNK_SIZE = 64


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """x / sqrt(Σ x² + eps) over the last dim, as HF (and FLA) write it."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3NextRMSNormGated: x, gate [..., dv], weight [dv] -> [..., dv] in x's dtype.
    The norm in float32, rounded to x's dtype before the weight multiply (in that dtype), then times
    silu(gate) in float32 and rounded again: HF's chain, rounding included, so bf16 outputs match it."""
    dtype = x.dtype
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return ((weight * normed.to(dtype)) * F.silu(gate.float())).to(dtype)


def gdn_gating(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """a, b [..., Hv] (the in_proj_ba outputs), A_log, dt_bias [Hv] -> (g [..., Hv] float32, beta [..., Hv]).
    g = -exp(A_log) · softplus(a + dt_bias) <= 0, in float32 (HF: in fp16 exp(A_log) could overflow);
    beta = sigmoid(b) in b's dtype, as HF (and vLLM's fused_gdn_gating) round it."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, b.sigmoid()


def _normed_qk(q: torch.Tensor, k: torch.Tensor, use_qk_l2norm: bool) -> torch.Tensor:
    """q, k [..., Hk, dk] -> qk [..., Hk, 2, dk] float32: per q/k head [q; k], normalised if asked, q
    also scaled by dk^-1/2. Stacked so both are normalised (and in decode read the state) in one op."""
    qk = torch.stack((q, k), dim=-2).float()
    if use_qk_l2norm:
        qk = l2norm(qk)
    return qk * qk.new_tensor([[k.shape[-1] ** -0.5], [1.0]])  # q by dk^-1/2, k as is


# ---------------------------------------------------------------------------------------------------
# Prefill: the chunked form.


class ChunkResult(NamedTuple):
    out: torch.Tensor  # [T, Hv, dv], q's dtype
    final_state: torch.Tensor  # [Hv, dk, dv] float32
    checkpoint_states: list[torch.Tensor]  # [Hv, dk, dv] float32 each, after the first j tokens


class _ChunkLayout(NamedTuple):
    segments: list[tuple[int, int, int]]  # (first token, end token, its slot in the padded layout)
    num_chunks: int  # N: slots = N x chunk_size
    checkpoint_chunks: list[int]  # per checkpoint, the chunk it ends


def _chunk_layout(num_tokens: int, checkpoints: Sequence[int], chunk_size: int) -> _ChunkLayout:
    """Cut the tokens into segments at every checkpoint, each padded to whole chunks, so that every
    checkpoint ends a chunk and its state is one the inter-chunk scan computes anyway.
    Why not one call per segment: the intra-chunk phase stays one batched set of matmuls and solves
    over all chunks, and a checkpoint off the 64-token grid costs only one more partial chunk.
    Padding at a chunk's end is exact: k = v = β = 0 write nothing and g = 0 decays nothing.
    Without checkpoints this is HF's grid (one segment padded at its end): the same sums in the same order."""
    for j in checkpoints:
        if not 0 < j <= num_tokens:
            raise ValueError(f"checkpoints must be in (0, {num_tokens}], got {j}")
    segments: list[tuple[int, int, int]] = []
    end_chunk: dict[int, int] = {}
    start, slot = 0, 0
    for cut in sorted({*checkpoints, num_tokens}):
        segments.append((start, cut, slot))
        slot += -(-(cut - start) // chunk_size) * chunk_size  # rounded up to whole chunks
        end_chunk[cut] = slot // chunk_size - 1
        start = cut
    return _ChunkLayout(segments, slot // chunk_size, [end_chunk[j] for j in checkpoints])


def _to_chunks(x: torch.Tensor, layout: _ChunkLayout, num_heads: int, chunk_size: int) -> torch.Tensor:
    """x [T, Hx, ...] -> [H, N, C, ...] float32, padding slots zero; with H = m x Hx each head is
    repeated m times (HF's repeat_interleave): one copy per segment does layout, repeat and dtype."""
    m = num_heads // x.shape[1]
    dst = x.new_zeros((x.shape[1], m, layout.num_chunks * chunk_size, *x.shape[2:]), dtype=torch.float32)
    for start, end, slot in layout.segments:
        dst[:, :, slot : slot + end - start] = x[start:end].transpose(0, 1).unsqueeze(1)
    return dst.view(num_heads, layout.num_chunks, chunk_size, *x.shape[2:])


def _from_chunks(
    out: torch.Tensor, layout: _ChunkLayout, num_tokens: int, dtype: torch.dtype
) -> torch.Tensor:
    """out [H, N, C, dv] -> [T, H, dv] in dtype: the padding slots dropped."""
    flat = out.flatten(1, 2)  # [H, N * C, dv]
    tokens = flat.new_empty((num_tokens, *flat.shape[::2]), dtype=dtype)
    for start, end, slot in layout.segments:
        tokens[start:end] = flat[:, slot : slot + end - start].transpose(0, 1)
    return tokens


def _intra_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """Phase 1, all chunks at once. q, k [H, N, C, dk], v [H, N, C, dv], g, beta [H, N, C] ->
    (u [H, N, C, dv], w [H, N, C, dk], attn [H, N, C, C], q_dec, k_dec, chunk_decay [H, N, 1, 1]).
    With γ_i = Σ_{s<=i} g_s the in-chunk cumulative log decay and A_ij = β_i e^{γ_i - γ_j} k_i·k_j (i > j),
    the chunk's rank-1 updates condense into (I + A) u = β v and (I + A) w = β e^γ k (the UT transform):
    u are the values the chunk writes from a zero entry state, w @ S the part of them the entry state S
    already predicts (subtracted in the scan: the delta rule across chunks)."""
    c = q.shape[-2]
    upper = torch.ones(c, c, dtype=torch.bool).triu(1)
    cum = g.cumsum(dim=-1)  # γ [H, N, C]
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()  # e^{γ_i - γ_j}
    k_beta = k * beta.unsqueeze(-1)
    system = (k_beta @ k.transpose(-1, -2)) * decay  # the diagonal is ignored: unitriangular
    attn = (q @ k.transpose(-1, -2)) * decay  # causal q_i·k_j e^{γ_i - γ_j}, diagonal included
    u = torch.linalg.solve_triangular(system, v * beta.unsqueeze(-1), upper=False, unitriangular=True)
    w_rhs = k_beta * cum.exp().unsqueeze(-1)
    w = torch.linalg.solve_triangular(system, w_rhs, upper=False, unitriangular=True)
    q_dec = q * cum.exp().unsqueeze(-1)  # q_i e^{γ_i}: reads the entry state
    k_dec = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)  # k_i e^{γ_C - γ_i}: writes the exit state
    return u, w, attn, q_dec, k_dec, cum[..., -1].exp()[..., None, None]


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    checkpoints: Sequence[int] = (),
    use_qk_l2norm: bool = True,
    chunk_size: int = CHUNK_SIZE,
) -> ChunkResult:
    """One request's prefill chunk. q, k [T, Hk, dk], v [T, Hv, dv], g, beta [T, Hv], initial_state
    [Hv, dk, dv] float32 (None: zeros, a fresh request) -> ChunkResult(out [T, Hv, dv] in q's dtype,
    final_state [Hv, dk, dv], checkpoint_states: the state after the first j tokens for each j of
    `checkpoints` (0 < j <= T), in the order given)."""
    num_tokens, num_v_heads, dk, dv = v.shape[0], v.shape[1], k.shape[-1], v.shape[-1]
    layout = _chunk_layout(num_tokens, checkpoints, chunk_size)
    qk = _normed_qk(q, k, use_qk_l2norm)  # [T, Hk, 2, dk]
    qc, kc = (_to_chunks(qk[:, :, i], layout, num_v_heads, chunk_size) for i in (0, 1))  # [Hv, N, C, dk]
    vc, gc, bc = (_to_chunks(x, layout, num_v_heads, chunk_size) for x in (v, g, beta))  # [Hv, N, C(, dv)]
    u, w, attn, q_dec, k_dec, chunk_decay = _intra_chunk(qc, kc, vc, gc, bc)
    state = (
        torch.zeros(num_v_heads, dk, dv, dtype=torch.float32)
        if initial_state is None
        else initial_state.to(torch.float32)
    )
    # Phase 2, the scan: per chunk, the values left to write once the entry state's prediction is
    # subtracted (the delta rule), the output (entry state read + in-chunk attention), the exit state.
    out = torch.empty_like(u)  # [Hv, N, C, dv]
    kept: dict[int, torch.Tensor] = {}
    for n in range(layout.num_chunks):
        v_new = u[:, n] - w[:, n] @ state  # [Hv, C, dv]
        out[:, n] = q_dec[:, n] @ state + attn[:, n] @ v_new
        state = state * chunk_decay[:, n] + k_dec[:, n].transpose(-1, -2) @ v_new
        if n in layout.checkpoint_chunks:
            kept[n] = state  # a new tensor each chunk: nothing later writes into it
    checkpoint_states = [kept[n] for n in layout.checkpoint_chunks]
    return ChunkResult(_from_chunks(out, layout, num_tokens, q.dtype), state, checkpoint_states)


# ---------------------------------------------------------------------------------------------------
# Decode: one recurrent step for a batch.
#
# Measured at Qwen3-Next-80B's shape (Hk 16, Hv 32, dk = dv = 128; bf16 q/k/v) on this repository's
# 2-core Xeon (AVX512, 4 MiB L2 per core), 2 threads, median of 9 rounds of 40 steps, inputs cycled
# over 256 random tokens; the state is 2 MiB per request, "GB/s" counts it read and written once:
#     B = 1: in place (out_state=state) 246-263 us (16-17 GB/s); a separate out_state 359-425 us; a new
#            tensor 355-369 us; HF's torch_recurrent_gated_delta_rule (T = 1) 0.86-1.9 ms.
#     B = 8: in place 1.71-1.80 ms (19-20 GB/s); separate out_state 2.3-2.5 ms; HF's 22-30 ms.
# At B = 1 about 110 us are the three passes over the state and the rest is ~25 small ops at ~5 us
# each. Op by op (B = 1): the reads [q; k] @ S as one matmul 34 us, einsum("bhik,bhkv->bhiv") 45-54 us,
# bmm(S^T, [q k]) 110-133 us, HF's (S * k).sum(-2) ~150 us per vector; the update mul_ 34 us then
# addcmul_ 35-44 us (baddbmm_ the same; an outer product materialised, then add_, 157-184 us).
# Denormals: a state component that no key refreshes decays geometrically through float32's denormal
# range, and each pass over the state then ran ~7 ms instead of ~50 us (seen with 16 keys repeated);
# benchmark with varied keys, and torch.set_flush_denormal(True) removes the cliff if real traffic
# ever hits it.


def recurrent_gated_delta_rule_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    use_qk_l2norm: bool = True,
    out_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of B requests. q, k [B, Hk, dk], v [B, Hv, dv], g, beta [B, Hv], state
    [B, Hv, dk, dv] float32 -> (out [B, Hv, dv] in q's dtype, new state [B, Hv, dk, dv] float32).
    The new state is written into out_state when given, else into a new tensor; out_state=state
    updates in place (it is read in full before it is written) and is the fastest (measured above).
    The state is read once for both of its reads, by expanding o = S_t^T q around S_{t-1}:
        [r_q; r_k] = [q; k] S_{t-1}           (one batched matmul, [2, dk] @ [dk, dv] per head)
        δ = β (v - e^g r_k),   o = e^g r_q + (q·k) δ,   S_t = e^g S_{t-1} + k δ^T
    then updated in two in-place passes (mul, addcmul): 3 reads + 2 writes of the state in all, the
    least that stock torch ops give (no fused "scale, then rank-1 add" op exists)."""
    qk = _normed_qk(q, k, use_qk_l2norm).repeat_interleave(v.shape[1] // k.shape[1], dim=1)  # [B, Hv, 2, dk]
    q32, k32 = qk[:, :, 0], qk[:, :, 1]
    state = state.to(torch.float32)
    reads = torch.matmul(qk, state)  # [B, Hv, 2, dv]
    decay = g.float().exp().unsqueeze(-1)  # [B, Hv, 1]
    delta = (v.float() - decay * reads[:, :, 1]) * beta.float().unsqueeze(-1)  # [B, Hv, dv]
    out = decay * reads[:, :, 0] + (q32 * k32).sum(-1, keepdim=True) * delta
    new_state = torch.mul(state, decay.unsqueeze(-1), out=out_state)
    new_state.addcmul_(k32.unsqueeze(-1), delta.unsqueeze(-2))
    return out.to(q.dtype), new_state
