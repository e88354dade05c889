"""The sampler against direct computations on small vocabularies, plus distribution and seeding checks."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch

import kvflow.sample.sampler as sampler_module
from kvflow.sample.sampler import (
    Sampler,
    SamplerOutput,
    SamplingBatch,
    apply_top_k_only,
    apply_top_k_top_p,
    filtered_probs,
)
from kvflow.sampling_params import SamplingParams

NEG_INF = float("-inf")


# ---------------------------------------------------------------------------------------------------
# Helpers


def make_batch(
    params: Sequence[SamplingParams],
    *,
    prompts: Sequence[list[int]] | None = None,
    outputs: Sequence[list[int]] | None = None,
    generators: Sequence[torch.Generator | None] | None = None,
    banned: Sequence[list[int]] | None = None,
) -> SamplingBatch:
    num_rows = len(params)
    return SamplingBatch(
        params=list(params),
        prompt_token_ids=list(prompts) if prompts is not None else [[] for _ in range(num_rows)],
        output_token_ids=list(outputs) if outputs is not None else [[] for _ in range(num_rows)],
        generators=list(generators) if generators is not None else [None] * num_rows,
        banned_token_ids=list(banned) if banned is not None else [[] for _ in range(num_rows)],
    )


def make_sampler(seed: int = 0) -> Sampler:
    return Sampler(torch.Generator().manual_seed(seed))


def probs_of(logits: Sequence[float], params: SamplingParams) -> list[float]:
    return filtered_probs(torch.tensor([list(logits)]), [params])[0].tolist()


def kept(probs: Sequence[float]) -> list[int]:
    return [i for i, p in enumerate(probs) if p > 0.0]


def log_list(probs: Sequence[float]) -> list[float]:
    return [math.log(p) for p in probs]


def reference_probs(logits: Sequence[float], params: SamplingParams) -> list[float]:
    """Direct float64 computation of the documented order: T, min_p, top_k, top_p, softmax."""

    def softmax(values: list[float]) -> list[float]:
        top = max(values)
        exps = [math.exp(v - top) if v != NEG_INF else 0.0 for v in values]
        total = sum(exps)
        return [e / total for e in exps]

    values = [v / params.temperature for v in logits]
    if params.min_p > 0:
        probs = softmax(values)
        values = [
            v if p >= params.min_p * max(probs) else NEG_INF for v, p in zip(values, probs, strict=True)
        ]
    if 0 < params.top_k < len(values):
        kth = sorted(values, reverse=True)[params.top_k - 1]
        values = [v if v >= kth else NEG_INF for v in values]
    if params.top_p < 1.0:
        probs = softmax(values)
        # Descending order (ties: higher id first, the mirror of an ascending stable sort).
        order = sorted(range(len(values)), key=lambda i: (probs[i], i), reverse=True)
        mass_before = 0.0
        for i in order:
            if mass_before >= params.top_p:
                values[i] = NEG_INF
            mass_before += probs[i]
    return softmax(values)


def chi_square_p_value(observed: Sequence[int], expected_probs: Sequence[float]) -> float:
    """Pearson chi-square goodness of fit over the tokens with non-zero expected probability."""
    total = sum(observed)
    cells = [(o, total * p) for o, p in zip(observed, expected_probs, strict=True) if p > 0]
    statistic = sum((o - e) ** 2 / e for o, e in cells)
    dof = len(cells) - 1
    try:
        from scipy.stats import chi2
    except ImportError:  # Wilson-Hilferty normal approximation of the chi-square tail
        z = ((statistic / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
        return 0.5 * math.erfc(z / math.sqrt(2))
    return float(chi2.sf(statistic, dof))


# ---------------------------------------------------------------------------------------------------
# Filters against direct computations


def test_temperature_scales_logits() -> None:
    logits = [2.0, 1.0, 0.0, -1.0, 0.5, 3.0, -2.0, 1.5]
    probs = probs_of(logits, SamplingParams(temperature=2.0))
    expected = torch.softmax(torch.tensor(logits) / 2.0, dim=-1).tolist()
    assert probs == pytest.approx(expected, abs=1e-7)


def test_min_p_drops_tokens_below_fraction_of_max() -> None:
    # probs 0.4, 0.3, 0.2, 0.06, 0.04; min_p = 0.2 -> threshold 0.08: keep tokens 0, 1, 2.
    logits = log_list([0.4, 0.3, 0.2, 0.06, 0.04])
    probs = probs_of(logits, SamplingParams(min_p=0.2))
    assert probs == pytest.approx([0.4 / 0.9, 0.3 / 0.9, 0.2 / 0.9, 0.0, 0.0], abs=1e-6)


def test_min_p_applies_after_temperature() -> None:
    # At T=1 probs ~ (0.665, 0.245, 0.090): min_p=0.2 drops token 2. At T=10 they are almost
    # uniform and all three survive, which proves min_p sees the tempered distribution.
    logits = [2.0, 1.0, 0.0]
    assert kept(probs_of(logits, SamplingParams(min_p=0.2))) == [0, 1]
    assert kept(probs_of(logits, SamplingParams(min_p=0.2, temperature=10.0))) == [0, 1, 2]


def test_top_k_keeps_k_largest() -> None:
    logits = [0.1, 3.0, -1.0, 2.0, 0.5, 2.5, -3.0, 1.0, 0.0, 0.2, 0.3, -0.5]
    probs = probs_of(logits, SamplingParams(top_k=3))
    assert kept(probs) == [1, 3, 5]
    expected = torch.softmax(torch.tensor([3.0, 2.0, 2.5]), dim=-1).tolist()
    assert [probs[1], probs[3], probs[5]] == pytest.approx(expected, abs=1e-7)


def test_top_k_keeps_ties_with_kth_value() -> None:
    assert kept(probs_of([3.0, 2.0, 2.0, 1.0, 0.0], SamplingParams(top_k=2))) == [0, 1, 2]


@pytest.mark.parametrize("top_k", [0, -1, 5, 100])
def test_top_k_disabled_or_oversized_keeps_all(top_k: int) -> None:
    assert kept(probs_of([1.0, 2.0, 3.0, 4.0, 5.0], SamplingParams(top_k=top_k))) == [0, 1, 2, 3, 4]


def test_top_k_only_path_equals_sort_path() -> None:
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 16, generator=generator)
    top_k = torch.tensor([1, 3, 16, 7, 16, 2])
    fast = logits.clone()
    apply_top_k_only(fast, top_k)
    sorted_path = apply_top_k_top_p(logits, top_k, torch.ones(6))
    assert torch.equal(fast, sorted_path)


@pytest.mark.parametrize(
    ("top_p", "expected_kept"),
    [
        (0.7, [0, 1]),  # descending 0.5, 0.25 reaches 0.75 >= 0.7
        (0.8, [0, 1, 3]),  # needs one of the tied 0.125 tokens: the sorted-order cut keeps id 3
        (0.9, [0, 1, 2, 3]),
        (1e-6, [0]),  # tiny top_p: only the argmax survives
    ],
)
def test_top_p_keeps_smallest_prefix_reaching_p(top_p: float, expected_kept: list[int]) -> None:
    logits = log_list([0.5, 0.25, 0.125, 0.125])
    probs = probs_of(logits, SamplingParams(top_p=top_p))
    assert kept(probs) == expected_kept
    mass = sum([0.5, 0.25, 0.125, 0.125][i] for i in expected_kept)
    assert probs == pytest.approx(
        [(0.5, 0.25, 0.125, 0.125)[i] / mass if i in expected_kept else 0.0 for i in range(4)], abs=1e-6
    )


@pytest.mark.parametrize(("top_p", "expected_kept"), [(0.5, [2, 3]), (0.2, [3]), (0.51, [1, 2, 3])])
def test_top_p_ties_cut_in_sorted_order(top_p: float, expected_kept: list[int]) -> None:
    # Four equal tokens (exactly 0.25 each): the ascending cumulative mass is 0.25, 0.5, 0.75, 1.0 and
    # tokens with c <= 1 - top_p are dropped, lowest ids first.
    assert kept(probs_of([1.0, 1.0, 1.0, 1.0], SamplingParams(top_p=top_p))) == expected_kept


def test_top_p_tiny_samples_argmax() -> None:
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(32, 16, generator=generator)
    out = make_sampler()(logits, make_batch([SamplingParams(top_p=1e-9)] * 32))
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_top_k_applies_before_top_p() -> None:
    # top_k=2 renormalises (0.4, 0.3) to (4/7, 3/7); top_p=0.5 then keeps only token 0. The other
    # order would keep tokens 0 and 1 (0.4 < 0.5 on the unfiltered distribution).
    probs = probs_of(log_list([0.4, 0.3, 0.2, 0.1]), SamplingParams(top_k=2, top_p=0.5))
    assert probs == pytest.approx([1.0, 0.0, 0.0, 0.0], abs=1e-6)


def test_combined_filters_match_direct_computation() -> None:
    generator = torch.Generator().manual_seed(4)
    settings = [
        SamplingParams(temperature=0.7, min_p=0.05, top_k=6, top_p=0.8),
        SamplingParams(temperature=1.3, top_k=4),
        SamplingParams(temperature=0.5, top_p=0.6),
        SamplingParams(min_p=0.1),
        SamplingParams(temperature=2.0, min_p=0.02, top_p=0.95),
        SamplingParams(),
    ]
    for _ in range(10):
        logits = torch.randn(len(settings), 16, generator=generator) * 2
        # One batched call mixing all settings (one row's filters must not leak into another's).
        probs = filtered_probs(logits, settings)
        for row, params in enumerate(settings):
            expected = reference_probs(logits[row].tolist(), params)
            assert probs[row].tolist() == pytest.approx(expected, abs=1e-5)


# ---------------------------------------------------------------------------------------------------
# Sampling distribution


def test_empirical_distribution_matches_filtered_probs_default_generator() -> None:
    params = SamplingParams(temperature=0.8, min_p=0.02, top_k=7, top_p=0.92)
    logits_row = [1.0, 0.3, -0.5, 2.0, 0.0, 1.5, -2.0, 0.8, -1.0, 0.6]
    expected = reference_probs(logits_row, params)
    num_draws = 20_000
    logits = torch.tensor([logits_row]).expand(num_draws, -1)
    out = make_sampler(seed=123)(logits, make_batch([params] * num_draws))
    observed = torch.bincount(torch.tensor(out.token_ids), minlength=len(logits_row)).tolist()
    assert all(o == 0 for o, p in zip(observed, expected, strict=True) if p == 0.0)
    assert chi_square_p_value(observed, expected) > 1e-3


def test_empirical_distribution_matches_with_per_row_generators() -> None:
    params = SamplingParams(temperature=1.2, top_k=5)
    logits_row = [0.5, -0.2, 1.1, 0.0, 2.0, -1.0, 0.7, 0.3]
    expected = reference_probs(logits_row, params)
    num_draws = 20_000
    generators: list[torch.Generator | None] = [torch.Generator().manual_seed(s) for s in range(num_draws)]
    logits = torch.tensor([logits_row]).expand(num_draws, -1)
    out = make_sampler()(logits, make_batch([params] * num_draws, generators=generators))
    observed = torch.bincount(torch.tensor(out.token_ids), minlength=len(logits_row)).tolist()
    assert all(o == 0 for o, p in zip(observed, expected, strict=True) if p == 0.0)
    assert chi_square_p_value(observed, expected) > 1e-3


def test_unrestricted_sampling_matches_softmax() -> None:
    logits_row = [0.0, 1.0, 2.0, 0.5, -1.0, 1.5, 0.2, -0.3]
    num_draws = 20_000
    logits = torch.tensor([logits_row]).expand(num_draws, -1)
    out = make_sampler(seed=9)(logits, make_batch([SamplingParams()] * num_draws))
    observed = torch.bincount(torch.tensor(out.token_ids), minlength=len(logits_row)).tolist()
    expected = torch.softmax(torch.tensor(logits_row, dtype=torch.float64), dim=-1).tolist()
    assert chi_square_p_value(observed, expected) > 1e-3


# ---------------------------------------------------------------------------------------------------
# Seeded reproducibility, whatever the batch


SEEDED = SamplingParams(temperature=1.0, top_k=8, top_p=0.95, seed=7)
VOCAB = 40
NUM_STEPS = 8


def step_logits(step: int) -> torch.Tensor:
    """The seeded request's logits at a step (a function of the step only).  [VOCAB]"""
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(1000 + step))


def run_seeded(
    others: Sequence[SamplingParams], row: int, seeded: SamplingParams = SEEDED, sampler_seed: int = 0
) -> list[int]:
    """Decode NUM_STEPS with the seeded request at `row` among `others`; return its tokens."""
    sampler = make_sampler(sampler_seed)
    params = [*others[:row], seeded, *others[row:]]
    generators: list[torch.Generator | None] = [
        torch.Generator().manual_seed(p.seed) if p.seed is not None else None for p in params
    ]
    outputs: list[list[int]] = [[] for _ in params]
    noise = torch.Generator().manual_seed(sampler_seed + 1)
    for step in range(NUM_STEPS):
        logits = torch.randn(len(params), VOCAB, generator=noise) * 3
        logits[row] = step_logits(step)
        out = sampler(logits, make_batch(params, outputs=outputs, generators=generators))
        for tokens, token in zip(outputs, out.token_ids, strict=True):
            tokens.append(token)
    return outputs[row]


def test_seeded_row_is_independent_of_batch_composition() -> None:
    alone = run_seeded([], row=0)
    neighbours = [
        SamplingParams(),  # unseeded, default generator
        SamplingParams(temperature=0.0),  # greedy
        SamplingParams(seed=99, min_p=0.1),  # another seeded row with min_p
        SamplingParams(top_k=3, presence_penalty=1.0),  # top_k only + penalties
    ]
    assert run_seeded(neighbours, row=0) == alone
    assert run_seeded(neighbours, row=2, sampler_seed=5) == alone
    assert run_seeded(neighbours, row=4, sampler_seed=6) == alone
    assert run_seeded(neighbours[:1], row=1, sampler_seed=7) == alone
    assert len(set(alone)) > 1  # the sequence is really sampled, not constant


def test_different_seeds_give_different_sequences() -> None:
    other_seed = SamplingParams(temperature=1.0, top_k=8, top_p=0.95, seed=8)
    assert run_seeded([], row=0, seeded=other_seed) != run_seeded([], row=0)


# ---------------------------------------------------------------------------------------------------
# Greedy, banned tokens, penalties in the sampler


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_equals_argmax(dtype: torch.dtype) -> None:
    logits = torch.randn(16, 64, generator=torch.Generator().manual_seed(5)).to(dtype)
    out = make_sampler()(logits, make_batch([SamplingParams(temperature=0.0)] * 16))
    assert out.token_ids == logits.float().argmax(dim=-1).tolist()
    assert out.logprobs is None


def test_greedy_and_random_rows_mixed() -> None:
    logits = torch.randn(8, 32, generator=torch.Generator().manual_seed(6))
    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 1.0, top_p=1e-9) for i in range(8)]
    out = make_sampler()(logits, make_batch(params))
    # top_p tiny makes the random rows deterministic too: every row is the argmax.
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_greedy_uses_penalised_logits() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0, 1.0]])
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.2)]
    out = make_sampler()(logits, make_batch(params, outputs=[[0]]))
    assert out.token_ids == [1]  # 3.0 / 1.2 = 2.5 < 2.9


def test_banned_tokens_never_sampled() -> None:
    num_rows = 2000
    logits = torch.zeros(num_rows, 12)
    logits[:, [2, 7]] = 20.0  # the favourites, banned
    params = [
        SamplingParams(temperature=t, top_k=k)
        for t, k in [(0.0, 0), (1.0, 0), (0.5, 3), (2.0, 0)] * (num_rows // 4)
    ]
    out = make_sampler()(logits, make_batch(params, banned=[[2, 7, 1000]] * num_rows))
    assert not {2, 7} & set(out.token_ids)
    assert len(set(out.token_ids)) > 5


def test_sampler_does_not_modify_logits() -> None:
    logits = torch.randn(4, 16, generator=torch.Generator().manual_seed(7))
    before = logits.clone()
    params = [
        SamplingParams(temperature=0.5, repetition_penalty=1.5, top_p=0.9),
        SamplingParams(temperature=0.0, frequency_penalty=1.0),
        SamplingParams(top_k=2, min_p=0.1),
        SamplingParams(temperature=3.0),
    ]
    make_sampler()(
        logits, make_batch(params, prompts=[[1, 2]] * 4, outputs=[[3]] * 4, banned=[[0], [], [], [5]])
    )
    assert torch.equal(logits, before)
    # And without bans or penalties (where the working tensor may alias the input).
    make_sampler()(logits, make_batch([SamplingParams(temperature=0.7, top_k=3, top_p=0.8)] * 4))
    assert torch.equal(logits, before)


def test_rejects_mismatched_batch() -> None:
    batch = make_batch([SamplingParams()] * 2)
    with pytest.raises(ValueError, match="rows"):
        make_sampler()(torch.zeros(3, 8), batch)
    with pytest.raises(ValueError, match="2-D"):
        make_sampler()(torch.zeros(8), batch)


# ---------------------------------------------------------------------------------------------------
# Fast paths


def test_all_greedy_does_no_softmax_and_no_random_draw(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("the all-greedy path must not filter or sample")

    monkeypatch.setattr(sampler_module, "filtered_probs", fail)
    monkeypatch.setattr(sampler_module, "exponential_race", fail)
    generator = torch.Generator().manual_seed(0)
    state = generator.get_state()
    logits = torch.randn(4, 100)
    Sampler(generator)(logits, make_batch([SamplingParams(temperature=0.0)] * 4))
    assert torch.equal(generator.get_state(), state)


def test_filters_skipped_when_unused(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    for name in ("apply_min_p", "apply_top_k_only", "apply_top_k_top_p"):
        original = getattr(sampler_module, name)

        def spy(*args: object, _name: str = name, _original: object = original) -> object:
            calls.append(_name)
            return _original(*args)  # type: ignore[operator]

        monkeypatch.setattr(sampler_module, name, spy)
    sampler = make_sampler()
    logits = torch.randn(3, 50)
    sampler(logits, make_batch([SamplingParams(temperature=0.8)] * 3))
    assert calls == []
    sampler(logits, make_batch([SamplingParams(top_k=5), SamplingParams(), SamplingParams(top_k=50)]))
    assert calls == ["apply_top_k_only"]  # no full sort for top_k alone
    calls.clear()
    sampler(logits[:2], make_batch([SamplingParams(top_p=0.5, min_p=0.1), SamplingParams()]))
    assert calls == ["apply_min_p", "apply_top_k_top_p"]


# ---------------------------------------------------------------------------------------------------
# Logprobs


def brute_force_rank(logprobs: list[float], token: int) -> int:
    return 1 + sum(1 for lp in logprobs if lp > logprobs[token])


def test_logprobs_are_raw_log_softmax_with_ranks() -> None:
    logits = torch.randn(3, 16, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    params = [
        SamplingParams(temperature=0.3, top_k=2, repetition_penalty=2.0, logprobs=4),
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(logprobs=None),
    ]
    out = make_sampler()(logits, make_batch(params, prompts=[[0, 1, 2]] * 3))
    assert out.logprobs is not None
    raw = torch.log_softmax(logits.float(), dim=-1)

    top4 = raw[0].topk(4).indices.tolist()
    assert set(out.logprobs[0]) == {*top4, out.token_ids[0]}
    assert list(out.logprobs[1]) == [out.token_ids[1]]
    assert out.logprobs[2] == {}
    for row in (0, 1):
        for token, entry in out.logprobs[row].items():
            assert entry.logprob == pytest.approx(raw[row, token].item(), abs=1e-6)
            assert entry.rank == brute_force_rank(raw[row].tolist(), token)
            assert entry.decoded_token is None
    assert out.logprobs[1][out.token_ids[1]].rank == 1  # greedy, no penalties: the top token


def test_logprobs_include_sampled_token_outside_top_n() -> None:
    logits = torch.arange(8, dtype=torch.float32).flip(0).unsqueeze(0)  # token 7 is the least likely
    batch = make_batch([SamplingParams(logprobs=2)], banned=[list(range(7))])
    out = make_sampler()(logits, batch)
    assert out.token_ids == [7]
    assert out.logprobs is not None
    entry = out.logprobs[0]
    assert list(entry) == [7, 0, 1]  # the sampled token first, then the top-n in rank order
    assert [entry[t].rank for t in (0, 1, 7)] == [1, 2, 8]
    raw = torch.log_softmax(logits, dim=-1)[0]
    assert entry[7].logprob == pytest.approx(raw[7].item(), abs=1e-6)


def test_logprob_ranks_share_ties() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0, 0.0]])
    out = make_sampler()(logits, make_batch([SamplingParams(temperature=0.0, logprobs=5)]))
    assert out.logprobs is not None
    ranks = {token: entry.rank for token, entry in out.logprobs[0].items()}
    assert ranks == {1: 1, 2: 1, 4: 1, 3: 4, 0: 5}
    assert out.token_ids == [1]  # argmax picks the first of the tied maxima


def test_logprobs_more_than_vocab_is_whole_vocab() -> None:
    logits = torch.randn(1, 6)
    out = make_sampler()(logits, make_batch([SamplingParams(logprobs=20)]))
    assert out.logprobs is not None
    assert sorted(out.logprobs[0]) == list(range(6))
    assert sorted(e.rank for e in out.logprobs[0].values()) == list(range(1, 7))


def test_output_types() -> None:
    out = make_sampler()(torch.randn(2, 10), make_batch([SamplingParams()] * 2))
    assert isinstance(out, SamplerOutput)
    assert all(isinstance(t, int) for t in out.token_ids)
    assert out.logprobs is None
