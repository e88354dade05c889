"""DeepSeek-V3.2's lightning indexer: scores as transformers writes them, the top-k selection against a
direct computation (ties to the earlier position), and decode reading only the selected latents."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.attention.indexer import index_scores, selected_keys
from kvflow.attention.latent_kv_layer import LatentKVLayer


def test_scores_are_the_weighted_sum_of_relu_head_products() -> None:
    torch.manual_seed(0)
    q, k, w = torch.randn(3, 4, 8), torch.randn(5, 8), torch.randn(3, 4)
    got = index_scores(q, k, w, 0.5)
    want = torch.stack([sum(w[t, h] * torch.relu(0.5 * q[t, h] @ k.T) for h in range(4)) for t in range(3)])
    torch.testing.assert_close(got, want)
    batched = index_scores(q, k.expand(3, 5, 8), w, 0.5)  # a key set per row
    torch.testing.assert_close(batched, got)


def _direct(scores: torch.Tensor, visible: torch.Tensor, topk: int) -> torch.Tensor:
    """Each row's visible keys ranked by (score descending, position ascending); the first topk."""
    out = torch.zeros_like(visible)
    for r in range(scores.shape[0]):
        ranked = sorted((-float(scores[r, j]), j) for j in range(scores.shape[1]) if visible[r, j])
        for _, j in ranked[:topk]:
            out[r, j] = True
    return out


@pytest.mark.parametrize("topk", [1, 3, 6, 50])
def test_selection_matches_a_direct_ranking_ties_included(topk: int) -> None:
    gen = torch.Generator().manual_seed(1)
    # Scores from few distinct values (ReLU zeros included): ties at the cut-off in most rows.
    scores = torch.randint(0, 3, (40, 12), generator=gen).float()
    visible = torch.rand(40, 12, generator=gen) > 0.3
    visible[:, 0] = True
    assert torch.equal(selected_keys(scores, visible, topk), _direct(scores, visible, topk))
    causal = torch.ones(12, 12, dtype=torch.bool).tril()
    assert torch.equal(selected_keys(scores[:12], causal, topk), _direct(scores[:12], causal, topk))


@pytest.mark.parametrize("topk", [4, 16])
def test_fast_rows_and_tied_rows_in_one_call_match_the_direct_ranking(topk: int) -> None:
    """Rows without a tie at the cut-off take torch.topk, tied ones the stable sort, rows with fewer
    visible keys than topk keep them all: each must agree with the direct ranking."""
    gen = torch.Generator().manual_seed(2)
    scores = (torch.randn(200, 64, generator=gen) * 4).round() / 4  # a quarter-step grid: some ties
    visible = torch.rand(200, 64, generator=gen) > 0.2
    visible[:20, 3:] = False  # 3 or fewer visible keys
    assert torch.equal(selected_keys(scores, visible, topk), _direct(scores, visible, topk))


def test_decode_reads_only_the_selected_latents(
    tiny_checkpoint_factory: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """index_topk 16: after a 90-token prompt each decode step gathers 16 latents per request and
    layer (and every indexer key); with a cut-off above the context, every latent."""
    path = str(tiny_checkpoint_factory("deepseek_v32"))
    gathered: list[int] = []
    original = LatentKVLayer.gather

    def counting(self: LatentKVLayer, slots: torch.Tensor) -> torch.Tensor:
        gathered.append(slots.numel())
        return original(self, slots)

    prompt = list(range(3, 93))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm = LLM(path, dtype="float32", enable_prefix_caching=False)
    monkeypatch.setattr(LatentKVLayer, "gather", counting)
    sparse = llm.generate([prompt], params)[0].outputs[0].token_ids
    decode_gathers = gathered[-6:]  # 2 layers x the last 3 decode steps
    assert decode_gathers == [16] * 6
    dense_dir = tiny_checkpoint_factory("deepseek_v32", index_topk=4096)  # the same weights (seed 0)
    gathered.clear()
    dense = LLM(str(dense_dir), dtype="float32", enable_prefix_caching=False).generate([prompt], params)
    assert gathered[-1] >= 90  # every cached latent
    # The cut-off changes what the queries see, so it changes the model (both match transformers:
    # tests/models/test_hf_equivalence.py runs the top-16 checkpoint).
    assert dense[0].outputs[0].token_ids != sparse
