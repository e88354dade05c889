"""The rejection sampler reproduces the target distribution: exactly (composing its acceptance
and residual functions over every draft outcome of a small vocabulary) and empirically (chi-square
on many seeded samples of the sampler itself, first token and the first two tokens jointly)."""

from __future__ import annotations

import itertools

import pytest
import torch

from kvflow.sample.rejection_sampler import (
    acceptance_probs,
    one_hot_probs,
    residual_distribution,
    sample_one,
)
from kvflow.spec_decode.ngram_proposer import propose_ngram

V = 5


def dist(seed: int, peaked: float = 1.0) -> torch.Tensor:
    logits = torch.randn(V, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * peaked
    return logits.softmax(-1)


@pytest.mark.parametrize("seed", range(6))
def test_exact_marginal_equals_the_target(seed: int) -> None:
    p, q = dist(seed, 2.0), dist(100 + seed, 2.0)
    if seed == 0:
        q = torch.zeros(V, dtype=torch.float64)
        q[0] = 1.0  # a deterministic proposer
    if seed == 1:
        q = p.clone()  # a perfect draft: always accepted
    emitted = torch.zeros(V, dtype=torch.float64)
    for d in range(V):  # the draft token is drawn from q ...
        a = float(acceptance_probs(p[None], q[None], torch.tensor([d]))[0])
        emitted[d] += q[d] * a  # ... accepted,
        emitted += q[d] * (1 - a) * residual_distribution(p, q)  # ... or replaced from the residual
    torch.testing.assert_close(emitted, p, rtol=0, atol=1e-12)


def test_exact_two_position_sequence_distribution() -> None:
    """Two drafts: P(emitted prefix) for every outcome equals the target's sequence probability."""
    p0, p1 = dist(1), dist(2)  # target at the two draft positions (the bonus token is not reached)
    q0, q1 = dist(11), dist(12)
    seq = torch.zeros(V, V, dtype=torch.float64)  # P(first two emitted tokens = x, y)
    first_only = torch.zeros(V, dtype=torch.float64)  # P(step emits only one token, x)
    for d0, d1 in itertools.product(range(V), repeat=2):
        w = q0[d0] * q1[d1]
        a0 = float(acceptance_probs(p0[None], q0[None], torch.tensor([d0]))[0])
        a1 = float(acceptance_probs(p1[None], q1[None], torch.tensor([d1]))[0])
        first_only += w * (1 - a0) * residual_distribution(p0, q0)
        seq[d0, d1] += w * a0 * a1
        seq[d0] += w * a0 * (1 - a1) * residual_distribution(p1, q1)
    # Emitted first token ~ p0; when a second is emitted too, it is ~ p1 (p1 scores the drafted
    # prefix, which the accepted first token equals): summed over the cases, P(x, y) = p0(x) p1(y)
    # for the part that continues, and the first-token marginal is p0 overall.
    torch.testing.assert_close(first_only + seq.sum(1), p0, rtol=0, atol=1e-12)
    continued = seq.sum()
    torch.testing.assert_close(seq / continued, torch.outer(seq.sum(1) / continued, p1), rtol=0, atol=1e-12)


def chi_square(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    n = counts.sum()
    expected = expected_probs * n
    return float(((counts - expected) ** 2 / expected).sum())


# 99.9th percentile of chi-square with V - 1 = 4 and V*V - 1 = 24 degrees of freedom: a correct
# sampler fails this about once in a thousand seeds; the seeds are fixed, so the test is stable.
CHI2_999 = {4: 18.47, 24: 51.18}
NUM_SAMPLES = 20_000


def test_sampler_first_token_chi_square() -> None:
    p = dist(7, 1.5).float()
    q = dist(8, 1.5).float()
    gen = torch.Generator().manual_seed(1234)
    drafts = torch.multinomial(q, NUM_SAMPLES, replacement=True, generator=gen).tolist()
    counts = torch.zeros(V)
    for d in drafts:
        emitted, _ = sample_one(torch.stack([p, p]), [d], q[None], greedy=False, generator=gen)
        counts[emitted[0]] += 1
    assert chi_square(counts, p.double()) < CHI2_999[4]


def test_sampler_two_token_joint_chi_square_with_ngram_drafts() -> None:
    """Deterministic drafts (q one-hot): the emitted pair, when two come out, is ~ p0 x p1."""
    p0, p1, bonus = dist(21, 1.0).float(), dist(22, 1.0).float(), dist(23, 1.0).float()
    gen = torch.Generator().manual_seed(99)
    first = torch.zeros(V)
    for _ in range(NUM_SAMPLES):
        emitted, accepted = sample_one(
            torch.stack([p0, p1, bonus]), [2, 3], None, greedy=False, generator=gen
        )
        first[emitted[0]] += 1
        assert len(emitted) == accepted + 1
    assert chi_square(first, p0.double()) < CHI2_999[4]


def test_greedy_accepts_the_argmax_prefix() -> None:
    probs = torch.zeros(4, V)
    probs[0, 1] = probs[1, 2] = probs[2, 0] = probs[3, 4] = 1.0
    assert sample_one(probs, [1, 2, 3], None, greedy=True) == ([1, 2, 0], 2)
    assert sample_one(probs, [1, 2, 0], None, greedy=True) == ([1, 2, 0, 4], 3)  # all accepted + bonus
    assert sample_one(probs, [3, 2, 0], None, greedy=True) == ([1], 0)  # never agrees: still correct
    assert sample_one(probs[:1], [], None, greedy=True) == ([1], 0)


def test_one_hot_and_degenerate_residual() -> None:
    assert one_hot_probs(torch.tensor([2]), V)[0].tolist() == [0, 0, 1, 0, 0]
    p = dist(5)
    torch.testing.assert_close(residual_distribution(p, p), p)  # no residual mass: falls back to p


def test_ngram_proposer() -> None:
    ids = [1, 2, 3, 4, 9, 9, 1, 2, 3]
    assert propose_ngram(ids, 3) == [4, 9, 9]  # "1 2 3" occurred before, followed by 4 9 9
    assert propose_ngram(ids, 1) == [4]
    assert propose_ngram([5, 6, 7], 2) == []  # nothing recurs
    assert propose_ngram([1, 2, 1, 2, 1], 2, max_n=2) == [2, 1]  # the most recent occurrence
    assert propose_ngram(ids, 0) == []


def _propose_ngram_by_definition(ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The definition, slice by slice: for n from max_n down, the most recent earlier occurrence."""
    for n in range(min(max_n, len(ids) - 1), min_n - 1, -1):
        for start in range(len(ids) - n - 1, -1, -1):
            if ids[start : start + n] == ids[len(ids) - n :]:
                return ids[start + n : start + n + k]
    return []


@pytest.mark.parametrize("seed", range(5))
def test_ngram_proposer_matches_its_definition_on_random_sequences(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(200):
        length = int(torch.randint(1, 40, (1,), generator=gen))
        ids = torch.randint(0, 4, (length,), generator=gen).tolist()  # small alphabet: many repeats
        for min_n, max_n in ((1, 4), (2, 3), (3, 3)):
            assert propose_ngram(ids, 3, min_n, max_n) == _propose_ngram_by_definition(ids, 3, min_n, max_n)
