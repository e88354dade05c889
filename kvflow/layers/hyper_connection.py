"""Manifold-constrained hyper-connections (DeepSeek-V4): `hc` residual streams instead of one.

Around each block (attention, MoE), from the streams S [T, hc, D] (float32 weights, as
transformers' DeepseekV4HyperConnection computes them):
    m = RMSNorm(flatten S) (no weight) · fn^T              [T, (2 + hc) hc]
    pre  = sigmoid(m_pre  s_0 + b_pre) + eps               [T, hc]   the block's input Σ_j pre_j S_j
    post = 2 sigmoid(m_post s_1 + b_post)                  [T, hc]   how its output fans out
    comb = Sinkhorn(softmax(m_comb s_2 + b_comb) + eps)    [T, hc, hc]  doubly stochastic mixing
    S <- post ⊗ block_out + comb^T S
Sinkhorn: columns then rows normalised alternately (`iters` column passes), each sum + eps.
The head (`hc_head`) collapses the streams once more by a sigmoid-weighted sum before the norm.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _flat_norm(streams: torch.Tensor, eps: float) -> torch.Tensor:
    flat = streams.reshape(streams.shape[0], -1).float()
    return flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + eps)


def hyper_weights(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    iters: int,
    hc_eps: float,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [T, hc, D] -> (post [T, hc], comb [T, hc, hc], the block's input [T, D] in streams' dtype)."""
    hc = streams.shape[1]
    mixes = F.linear(_flat_norm(streams, norm_eps), fn.float())
    pre_w, post_w, comb_w = mixes.split([hc, hc, hc * hc], dim=-1)
    pre_b, post_b, comb_b = base.float().split([hc, hc, hc * hc])
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.view(-1, hc, hc) * scale[2] + comb_b.view(hc, hc), dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
    return post, comb, collapsed


def hyper_merge(
    streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """S <- post ⊗ block_out + comb^T S, in streams' dtype: [T, hc, D]."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + torch.matmul(
        comb.to(dtype).transpose(-1, -2), streams
    )


def hyper_head(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    hc_eps: float,
    norm_eps: float,
) -> torch.Tensor:
    """The last streams [T, hc, D] -> [T, D]: Σ_j (sigmoid(m_j s + b_j) + eps) S_j."""
    mixes = F.linear(_flat_norm(streams, norm_eps), fn.float())
    pre = torch.sigmoid(mixes * scale.float() + base.float()) + hc_eps
    return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
