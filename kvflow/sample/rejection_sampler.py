"""Speculative sampling that reproduces the target model's distribution exactly.

The rule (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding";
Chen et al. 2023, "Accelerating LLM Decoding with Speculative Sampling"): for draft tokens
d_1..d_k proposed with probabilities q_i and the target's p_i at the same positions,
    accept d_i with probability min(1, p_i(d_i) / q_i(d_i)), in order, stopping at the first
    rejection; at a rejection at position i emit a token drawn from the residual
        r_i(x) = max(0, p_i(x) - q_i(x)) / sum_y max(0, p_i(y) - q_i(y));
    if all k are accepted, emit a bonus token drawn from p_{k+1}.
Then P(emitted token = x) = q(x) min(1, p(x)/q(x)) + (1 - sum_y min(q(y), p(y))) r(x) = p(x):
the sequence is distributed as sampling the target alone. A deterministic proposer (n-gram lookup)
is the case q_i = one-hot(d_i): accept with probability p_i(d_i), else draw from p_i without d_i.
Greedy requests (temperature 0) reduce to: accept while d_i == argmax p_i; emit argmax at the
first mismatch, or the bonus argmax.

Shapes: B requests, K = max drafts per request (shorter ones padded), V vocabulary.
"""

from __future__ import annotations

import torch

from kvflow.sample.sampler import argmax_tokens

# Below this residual mass the target and draft agree everywhere up to rounding: draw from p.
MIN_RESIDUAL_MASS = 1e-12


def acceptance_probs(
    target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_ids: torch.Tensor
) -> torch.Tensor:
    """min(1, p(d) / q(d)) per draft: target/draft_probs [..., V], draft_ids [...] -> [...]."""
    p = target_probs.gather(-1, draft_ids[..., None])[..., 0]
    q = draft_probs.gather(-1, draft_ids[..., None])[..., 0]
    return torch.where(q > 0, (p / q.clamp(min=1e-30)).clamp(max=1.0), torch.ones_like(p))


def residual_distribution(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """max(0, p - q), normalized; where p and q coincide the residual is p itself (never drawn then)."""
    residual = (target_probs - draft_probs).clamp(min=0.0)
    mass = residual.sum(dim=-1, keepdim=True)
    return torch.where(mass > MIN_RESIDUAL_MASS, residual / mass.clamp(min=MIN_RESIDUAL_MASS), target_probs)


def one_hot_probs(draft_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The q of a deterministic proposer: [..., V] with 1 at each draft token."""
    return torch.nn.functional.one_hot(draft_ids, vocab_size).to(torch.float32)


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


def greedy_accept(draft_ids: list[int], best: list[int]) -> list[int]:
    """Greedy verification: best [k + 1] is the target's argmax at each verified position. The
    drafts up to the first one that differs from it, then the target's token there (after k
    agreeing drafts, the bonus token): what plain greedy decoding would have emitted."""
    accepted = 0
    while accepted < len(draft_ids) and draft_ids[accepted] == best[accepted]:
        accepted += 1
    return [*draft_ids[:accepted], best[accepted]]


def sample_one(
    target_probs: torch.Tensor,
    draft_ids: list[int],
    draft_probs: torch.Tensor | None,
    greedy: bool,
    generator: torch.Generator | None = None,
) -> tuple[list[int], int]:
    """One request: target_probs [k + 1, V] (position i scores draft i, the last gives the bonus),
    draft_ids (k), draft_probs [k, V] or None (deterministic proposer).
    Returns (emitted tokens: the accepted drafts + one more, number of drafts accepted)."""
    k = len(draft_ids)
    if greedy:
        emitted = greedy_accept(draft_ids, argmax_tokens(target_probs).tolist())  # torch.argmax's answer
        return emitted, len(emitted) - 1
    if k == 0:
        return [_draw(target_probs[0], generator)], 0
    ids = torch.tensor(draft_ids)
    q = draft_probs if draft_probs is not None else one_hot_probs(ids, target_probs.shape[-1])
    accept = acceptance_probs(target_probs[:k], q, ids)
    uniforms = torch.rand(k, generator=generator)
    for i in range(k):
        if uniforms[i] >= accept[i]:  # rejected: the residual keeps the marginal equal to p
            return [*draft_ids[:i], _draw(residual_distribution(target_probs[i], q[i]), generator)], i
    return [*draft_ids, _draw(target_probs[k], generator)], k
