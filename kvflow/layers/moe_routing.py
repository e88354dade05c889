"""Top-k expert selection of mixture-of-experts routers (Mixtral, Qwen2/3-MoE, DeepSeek V2/V3).

router_logits [T, E] (float32) -> (weights [T, k] float32, expert ids [T, k] int64), as the
checkpoints' reference code routes (MoEConfig in kvflow/arch_config.py):
    scores   softmax over the E experts, or sigmoid of each logit (DeepSeek-V3), or
             sqrt(softplus) of each (DeepSeek-V4)
    choice   scores (+ e_score_correction_bias under noaux_tc: it steers the choice, never the weight)
    groups   with n_group > 1, experts of the topk_group best groups only: a group scores its best
             choice (group_limited_greedy, V2) or the sum of its two best (noaux_tc, V3)
    top-k    the k best choices; weights = their scores, / their sum if norm_topk_prob, then
             x routed_scaling_factor
Ties go to the lower index (a stable sort): torch.topk leaves the order of equal values to the
implementation, and a router's pick must not depend on it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvflow.arch_config import MoEConfig

# DeepSeek-V3 adds this to the sum of the chosen sigmoid scores before dividing (no 0 / 0).
SIGMOID_NORM_EPS = 1e-20


def topk_stable(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest values along the last dim, ties broken by the lower index: [..., k]."""
    return torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :k]


def _group_mask(choice: torch.Tensor, moe: MoEConfig) -> torch.Tensor:
    """[T, E] bool: the experts of each token's topk_group best groups."""
    num_tokens = choice.shape[0]
    grouped = choice.view(num_tokens, moe.num_groups, -1)  # [T, G, E / G]
    if moe.topk_method == "noaux_tc":
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
    else:
        group_scores = grouped.amax(dim=-1)
    kept = topk_stable(group_scores, moe.topk_group)  # [T, topk_group]
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
    return mask.unsqueeze(-1).expand_as(grouped).reshape(num_tokens, -1)


def select_experts(
    router_logits: torch.Tensor, moe: MoEConfig, correction_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (routing weights [T, k] float32, expert ids [T, k] int64)."""
    scores = expert_scores(router_logits, moe)
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if moe.topk_method != "greedy" and moe.num_groups > 1:
        choice = choice.masked_fill(~_group_mask(choice, moe), float("-inf"))
    return expert_weights(scores, topk_stable(choice, moe.top_k), moe)


def expert_scores(router_logits: torch.Tensor, moe: MoEConfig) -> torch.Tensor:
    """router_logits [T, E] -> float32 scores [T, E] by the config's scoring function."""
    logits = router_logits.float()
    if moe.scoring_func == "sigmoid":
        return logits.sigmoid()
    if moe.scoring_func == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    return logits.softmax(dim=-1)


def expert_weights(
    scores: torch.Tensor, ids: torch.Tensor, moe: MoEConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing weights of the chosen experts `ids` [T, k] (by the router, or DeepSeek-V4's
    token-id table): their scores, renormalised if norm_topk_prob, times routed_scaling_factor."""
    weights = scores.gather(1, ids)
    if moe.norm_topk_prob:
        eps = SIGMOID_NORM_EPS if moe.scoring_func != "softmax" else 0.0
        weights = weights / (weights.sum(dim=-1, keepdim=True) + eps)
    if moe.routed_scaling_factor != 1.0:
        weights = weights * moe.routed_scaling_factor
    return weights, ids
