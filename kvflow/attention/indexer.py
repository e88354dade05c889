"""DeepSeek-V3.2's lightning indexer: which cached positions each query attends (DeepSeek Sparse
Attention), computed over the paged pool's indexer keys.

Per query t (Hi indexer heads of Di dims, rotated like the keys) and cached position s:
    score(t, s) = Σ_h w(t, h) · ReLU(scale · q(t, h) · k(s))     w(t, h) = weights_proj(x_t)_h / sqrt(Hi)
as transformers computes it (float32; ReLU after the scaled product). The query then attends only
the `topk` positions of highest score among those it may see (causal: its own and earlier ones);
with no more than `topk` of those, all of them. Ties go to the earlier position (a stable sort):
torch.topk leaves their order to the implementation, and what a query attends must not depend on
it (transformers' reference uses torch.topk; random-weight tests keep ties away from the cut-off).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class IndexerInputs:
    """One step's indexer tensors over its T flat tokens."""

    queries: torch.Tensor  # [T, Hi, Di], rotated
    keys: torch.Tensor  # [T, Di], rotated: written into the pool beside each token's latent
    head_weights: torch.Tensor  # [T, Hi] float32: w(t, h)
    scale: float  # Di ** -0.5
    topk: int


def index_scores(
    queries: torch.Tensor, keys: torch.Tensor, head_weights: torch.Tensor, scale: float
) -> torch.Tensor:
    """queries [R, Hi, Di], keys [R, L, Di] (or [L, Di], shared by the rows), head_weights [R, Hi]
    -> score of every row against every key [R, L] float32 (module docstring)."""
    keys_t = keys.float().transpose(-1, -2)  # [R, Di, L] or [Di, L]
    scores = torch.relu(torch.matmul(queries.float(), keys_t) * scale)  # [R, Hi, L]
    return torch.matmul(head_weights.float().unsqueeze(-2), scores).squeeze(-2)


def selected_keys(scores: torch.Tensor, visible: torch.Tensor, topk: int) -> torch.Tensor:
    """scores [R, L], visible [R, L] bool (the keys each row may attend) -> [R, L] bool: each row's
    top `topk` visible keys by score, ties to the earlier key; every visible key when there are no
    more than `topk`."""
    if scores.shape[-1] <= topk:
        return visible
    masked = scores.masked_fill(~visible, float("-inf"))
    # torch.topk of topk + 1: the top-k set is unique unless the k-th and (k+1)-th values tie; only
    # such rows (and rows with fewer visible keys than topk, which keep them all) need the stable
    # sort, whose O(L log L) per row cost 2 ms a layer at 32k index keys where topk costs 0.2.
    values, order = masked.topk(topk + 1, dim=-1)  # [R, k + 1], descending
    chosen = torch.zeros_like(visible).scatter_(-1, order[..., :topk], True)
    few = visible.sum(dim=-1) <= topk
    tied = (values[..., topk - 1] == values[..., topk]) & ~few
    if bool(tied.any()):
        rows = tied.nonzero().squeeze(-1)
        stable = torch.sort(masked[rows], dim=-1, descending=True, stable=True).indices[..., :topk]
        chosen[rows] = torch.zeros_like(visible[rows]).scatter_(-1, stable, True)
    chosen[few] = visible[few]
    return chosen & visible
