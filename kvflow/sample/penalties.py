"""Repetition, frequency and presence penalties, vectorised over the batch (vLLM v1 semantics).

For row b, token v, logit l = logits[b, v], with
    c_out[b, v] = number of times v occurs in the row's OUTPUT tokens,
    seen[b, v]  = v occurs in the row's prompt OR output,
the penalties are applied in this order (vLLM's `apply_penalties`):
    repetition (CTRL paper, HF/vLLM):  l <- l / r if l > 0 else l * r      where seen[b, v]
    frequency  (OpenAI, additive):     l <- l - f * c_out[b, v]
    presence   (OpenAI, additive):     l <- l - p * [c_out[b, v] > 0]
r = 1, f = 0, p = 0 leave a logit unchanged; rows whose params use none of them are skipped.

Only (row, token) pairs that occur can change, so the work is sparse: every occurrence becomes a key
row * V + token; one `torch.unique` (with counts for c_out) over the keys of all penalised rows gives
the distinct pairs, and one gather / scatter updates them. No [B, V] pass, no Python loop over
the vocabulary; the cost is O(prompt + output tokens of the penalised rows).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import torch

from kvflow.sampling_params import SamplingParams


def apply_penalties(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
) -> None:
    """Penalise `logits` [B, V] (float32, modified in place) for the rows whose params ask for it."""
    rows = [b for b, p in enumerate(params) if p.has_penalties]
    if not rows:
        return
    vocab_size, device = logits.shape[1], logits.device
    output_keys = token_keys(rows, [output_token_ids[b] for b in rows], vocab_size, device)  # [N_out]

    repetition_rows = [b for b in rows if params[b].repetition_penalty != 1.0]
    if repetition_rows:
        # The prompt is only read for the repetition penalty, and only for the rows that use it.
        prompts = [prompt_token_ids[b] for b in repetition_rows]
        prompt_keys = token_keys(repetition_rows, prompts, vocab_size, device)  # [N_prompt]
        seen = torch.unique(torch.cat([output_keys, prompt_keys]))  # [S] distinct (row, token) keys
        penalty = _per_row(params, "repetition_penalty", device)  # [B]; 1 (no-op) on other rows
        apply_repetition_penalty(logits, seen // vocab_size, seen % vocab_size, penalty)

    if any(params[b].frequency_penalty != 0.0 or params[b].presence_penalty != 0.0 for b in rows):
        keys, counts = torch.unique(output_keys, return_counts=True)  # [U], [U]: c_out of each pair
        apply_additive_penalties(
            logits,
            keys // vocab_size,
            keys % vocab_size,
            counts,
            _per_row(params, "frequency_penalty", device),
            _per_row(params, "presence_penalty", device),
        )


def token_keys(
    rows: Sequence[int], token_ids: Sequence[Sequence[int]], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """key = rows[i] * V + t for every t in token_ids[i].  -> [N] int64 (duplicates kept).

    Ids outside [0, V) are dropped: prompt ids are user data, and a model vocabulary smaller than the
    tokenizer's must not crash a step.
    """
    lengths = torch.tensor([len(ids) for ids in token_ids], dtype=torch.long, device=device)  # [R]
    tokens = torch.tensor(list(chain.from_iterable(token_ids)), dtype=torch.long, device=device)  # [N]
    row_ids = torch.repeat_interleave(torch.tensor(list(rows), dtype=torch.long, device=device), lengths)
    valid = (tokens >= 0) & (tokens < vocab_size)
    return row_ids[valid] * vocab_size + tokens[valid]


def apply_repetition_penalty(
    logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor, penalty: torch.Tensor
) -> None:
    """CTRL penalty on the seen pairs, in place: l <- l / r if l > 0 else l * r.

    logits [B, V]; rows, tokens [S] (distinct pairs); penalty [B] (r > 1 always lowers a logit).
    """
    values = logits[rows, tokens]  # [S]
    r = penalty[rows]  # [S]
    logits[rows, tokens] = torch.where(values > 0, values / r, values * r)


def apply_additive_penalties(
    logits: torch.Tensor,
    rows: torch.Tensor,
    tokens: torch.Tensor,
    counts: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> None:
    """OpenAI penalties on the output pairs, in place: l <- l - f * c_out - p * [c_out > 0].

    logits [B, V]; rows, tokens, counts [U] (distinct pairs, counts >= 1); frequency, presence [B].
    """
    penalty = frequency[rows] * counts.to(logits.dtype) + presence[rows]  # [U]
    logits[rows, tokens] = logits[rows, tokens] - penalty


def _per_row(params: Sequence[SamplingParams], name: str, device: torch.device) -> torch.Tensor:
    """One SamplingParams field per row as a float32 [B] tensor."""
    return torch.tensor([getattr(p, name) for p in params], dtype=torch.float32, device=device)
