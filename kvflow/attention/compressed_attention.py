"""DeepSeek-V4's attention over a sliding window and compressed entries, from the paged pool.

A query at position t (H heads of d; the K=V vectors are one head of d) attends
    window    the K=V vectors of positions (t - W, t]                 (every layer)
    HCA       every entry e with e < (t + 1) // m' (windows wholly at or before t)
    CSA       the entries e < (t + 1) // m the indexer selects: its top index_topk by
              Σ_h w(t, h) ReLU(q_I(t, h) · k_I(e)) / sqrt(d_I) (kvflow/attention/indexer.py)
one softmax over all of them plus a learned sink logit per head, scale d^-0.5, values = keys.
A decode step therefore reads W vectors + index_topk entries (CSA; plus every index key to score
them) or W + L / m' entries (HCA): never the whole compressed context's entries for CSA.
"""

from __future__ import annotations

import torch


def attend(
    q: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor | None, sinks: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [n, H, d], keys [L, d] (K = V), visible [n, L] bool or None (all) -> [n, H, d] in q's dtype.

    float32 scores and softmax, the sink a softmax column of its own that takes weight but gives
    no value (transformers' eager V4 attention, which runs in the model dtype)."""
    scores = torch.einsum("nhd,ld->nhl", q.float(), keys.float()) * scale  # [n, H, L]
    if visible is not None:
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    sink = sinks.float().view(1, -1, 1).expand(scores.shape[0], -1, 1)
    probs = torch.cat((scores, sink), dim=-1).softmax(dim=-1)[..., :-1]
    return torch.einsum("nhl,ld->nhd", probs, keys.float()).to(q.dtype)


def causal_entries(positions: torch.Tensor, num_entries: int, rate: int) -> torch.Tensor:
    """positions [n] -> [n, num_entries] bool: entry e pools positions up to (e + 1) m - 1 <= t."""
    return torch.arange(num_entries)[None, :] < ((positions + 1) // rate)[:, None]
