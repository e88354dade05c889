"""Expert selection (kvflow/layers/moe_routing.py) against a direct per-token computation and against
transformers' routers: top-k, group-limited routing (V2's best-expert and V3's top-2-sum group
scores, the correction bias), weight normalisation and scaling, exact ties included."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from kvflow.arch_config import MoEConfig
from kvflow.layers.moe_routing import select_experts

transformers = pytest.importorskip("transformers")


def _direct(logits: list[float], moe: MoEConfig, bias: list[float] | None) -> tuple[list[int], list[float]]:
    """One token, in plain Python: the definition, ties to the lower index throughout."""
    if moe.scoring_func == "sigmoid":
        scores = [1 / (1 + math.exp(-x)) for x in logits]
    else:
        top = max(logits)
        exps = [math.exp(x - top) for x in logits]
        scores = [e / sum(exps) for e in exps]
    choice = [s + (bias[i] if bias else 0.0) for i, s in enumerate(scores)]
    allowed = list(range(moe.num_experts))
    if moe.topk_method != "greedy" and moe.num_groups > 1:
        size = moe.num_experts // moe.num_groups
        groups = [choice[g * size : (g + 1) * size] for g in range(moe.num_groups)]
        if moe.topk_method == "noaux_tc":
            group_score = [sum(sorted(g, reverse=True)[:2]) for g in groups]
        else:
            group_score = [max(g) for g in groups]
        kept = sorted(range(moe.num_groups), key=lambda g: (-group_score[g], g))[: moe.topk_group]
        allowed = [e for e in allowed if e // size in kept]
    ids = sorted(allowed, key=lambda e: (-choice[e], e))[: moe.top_k]
    weights = [scores[e] for e in ids]
    if moe.norm_topk_prob:
        total = sum(weights)
        weights = [w / total for w in weights]
    return ids, [w * moe.routed_scaling_factor for w in weights]


QWEN = MoEConfig(num_experts=8, top_k=3, expert_intermediate_size=1, norm_topk_prob=True)
V2 = MoEConfig(
    num_experts=8,
    top_k=2,
    expert_intermediate_size=1,
    topk_method="group_limited_greedy",
    num_groups=4,
    topk_group=2,
    routed_scaling_factor=1.5,
)
V3 = replace(
    V2, scoring_func="sigmoid", topk_method="noaux_tc", norm_topk_prob=True, routed_scaling_factor=2.5
)
CASES = {
    "softmax-greedy": QWEN,
    "group-limited-greedy": V2,
    "noaux-tc": V3,
    "unnormalised": replace(QWEN, norm_topk_prob=False),
}


def _check(logits: torch.Tensor, moe: MoEConfig, bias: torch.Tensor | None) -> None:
    weights, ids = select_experts(logits, moe, bias)
    for t in range(logits.shape[0]):
        ref_ids, ref_weights = _direct(logits[t].tolist(), moe, None if bias is None else bias.tolist())
        assert ids[t].tolist() == ref_ids, t
        assert weights[t].tolist() == pytest.approx(ref_weights, rel=1e-5), t


@pytest.mark.parametrize("case", CASES)
def test_random_logits_match_the_direct_computation(case: str) -> None:
    moe = CASES[case]
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, moe.num_experts, generator=gen) * 2
    bias = torch.randn(moe.num_experts, generator=gen) * 0.1 if moe.has_score_correction_bias else None
    _check(logits, moe, bias)


@pytest.mark.parametrize("case", CASES)
def test_ties_go_to_the_lower_expert_and_group(case: str) -> None:
    moe = CASES[case]
    # Integer logits from a small range: many exact ties among experts and among group scores.
    gen = torch.Generator().manual_seed(1)
    logits = torch.randint(0, 3, (64, moe.num_experts), generator=gen).float()
    logits[0] = 1.0  # every expert equal: the first top_k of the first topk_group groups
    bias = torch.zeros(moe.num_experts) if moe.has_score_correction_bias else None
    _check(logits, moe, bias)
    _, ids = select_experts(logits[:1], moe, bias)
    assert ids[0].tolist() == list(range(moe.top_k))


def test_weights_sum_to_the_scaling_factor_when_normalised() -> None:
    logits = torch.randn(16, 8)
    weights, _ = select_experts(logits, V3, torch.zeros(8))
    assert torch.allclose(weights.sum(-1), torch.full((16,), 2.5))


def test_the_correction_bias_steers_the_choice_not_the_weight() -> None:
    logits = torch.zeros(1, 8)
    bias = torch.zeros(8)
    bias[7] = 1.0  # expert 7's choice score wins; its weight stays its plain sigmoid score
    moe = replace(V3, norm_topk_prob=False, routed_scaling_factor=1.0, num_groups=1, topk_group=1)
    weights, ids = select_experts(logits, moe, bias)
    assert ids[0, 0] == 7 and weights[0, 0] == pytest.approx(0.5)


def _hf_router(class_name: str, **config: object) -> torch.nn.Module:
    module = __import__(f"transformers.models.{class_name[0]}.modeling_{class_name[0]}", fromlist=["x"])
    config_class = getattr(transformers, class_name[1])
    return getattr(module, class_name[2])(
        config_class(hidden_size=16, num_attention_heads=4, **config)
    ).eval()


@pytest.mark.parametrize(
    ("names", "moe", "config"),
    [
        (
            ("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeTopKRouter"),
            QWEN,
            {"num_experts": 8, "num_experts_per_tok": 3, "norm_topk_prob": True},
        ),
        (
            ("deepseek_v2", "DeepseekV2Config", "DeepseekV2TopkRouter"),
            V2,
            {
                "n_routed_experts": 8,
                "num_experts_per_tok": 2,
                "topk_method": "group_limited_greedy",
                "n_group": 4,
                "topk_group": 2,
                "routed_scaling_factor": 1.5,
            },
        ),
        (
            ("deepseek_v3", "DeepseekV3Config", "DeepseekV3TopkRouter"),
            V3,
            {
                "n_routed_experts": 8,
                "num_experts_per_tok": 2,
                "n_group": 4,
                "topk_group": 2,
                "norm_topk_prob": True,
                "routed_scaling_factor": 2.5,
            },
        ),
    ],
)
def test_matches_transformers_routers(
    names: tuple[str, str, str], moe: MoEConfig, config: dict[str, object]
) -> None:
    router = _hf_router(names, **config)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        router.weight.normal_(0, 1, generator=gen)
        bias = getattr(router, "e_score_correction_bias", None)
        if bias is not None:
            bias.normal_(0, 0.1, generator=gen)
        x = torch.randn(32, 16, generator=gen)
        _, hf_weights, hf_ids = router(x)
        weights, ids = select_experts(x @ router.weight.T, moe, bias)
    # transformers' topk is unsorted: compare per token as expert -> weight maps.
    for t in range(32):
        ours = dict(zip(ids[t].tolist(), weights[t].tolist(), strict=True))
        theirs = dict(zip(hf_ids[t].tolist(), hf_weights[t].float().tolist(), strict=True))
        assert ours.keys() == theirs.keys(), t
        assert [ours[e] for e in theirs] == pytest.approx(list(theirs.values()), rel=1e-5)
