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
    q: torch.Tensor,
    keys: torch.Tensor,
    visible: torch.Tensor | None,
    sinks: torch.Tensor,
    scale: float,
    own_keys: torch.Tensor | None = None,
    own_valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [n, H, d] over keys [L, d] shared by the queries (K = V; visible [n, L] bool, None: all)
    and, per query, its own keys own_keys [n, k, d] (CSA's selected entries; own_valid [n, k]) ->
    [n, H, d] in q's dtype. One float32 softmax over both and the sink, a column of its own that
    takes weight but gives no value (transformers' eager V4 attention runs in the model dtype)."""
    qf, keys = q.float(), keys.float()  # no copy where they are float32 already
    scores = torch.einsum("nhd,ld->nhl", qf, keys) * scale  # [n, H, L]
    if visible is not None:
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    parts = [scores]
    if own_keys is not None:
        own_keys = own_keys.float()
        own = torch.einsum("nhd,nkd->nhk", qf, own_keys) * scale  # [n, H, k]
        if own_valid is not None:
            own = own.masked_fill(~own_valid[:, None, :], float("-inf"))
        parts.append(own)
    sink = sinks.float().view(1, -1, 1).expand(scores.shape[0], -1, 1)
    probs = torch.cat((*parts, sink), dim=-1).softmax(dim=-1)
    length = keys.shape[0]
    out = torch.einsum("nhl,ld->nhd", probs[..., :length], keys)
    if own_keys is not None:
        out = out + torch.einsum("nhk,nkd->nhd", probs[..., length:-1], own_keys)
    return out.to(q.dtype)


def selected_indices(selected: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """selected [n, L] bool (at most topk True a row) -> (indices [n, k], valid [n, k]) of its True
    entries, k = min(topk, L): what a query gathers instead of masking all L."""
    k = min(topk, selected.shape[-1])
    idx = selected.to(torch.int8).topk(k, dim=-1).indices
    return idx, selected.gather(-1, idx)


def causal_entries(positions: torch.Tensor, num_entries: int, rate: int) -> torch.Tensor:
    """positions [n] -> [n, num_entries] bool: entry e pools positions up to (e + 1) m - 1 <= t."""
    return torch.arange(num_entries)[None, :] < ((positions + 1) // rate)[:, None]
