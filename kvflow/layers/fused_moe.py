"""A mixture-of-experts MLP: route each token, group the step's tokens by expert, run each expert once.

    x [T, hidden] -> router (float32) -> top-k (weights, ids) per token (kvflow/layers/moe_routing.py)
    -> the T x k (token, expert) pairs sorted by expert (stable: token order kept within an expert)
    -> for each expert with tokens, in expert order: its SwiGLU MLP on exactly those rows, scaled by
       their routing weights into a float32 row per (token, expert) pair; each token then sums its
       k rows in expert order (a single token skips the grouping: its k experts, in order)
    (+ shared experts on every token: DeepSeek's ungated, Qwen2-MoE's gated by sigmoid(x . w)).
At decode a step touches at most T x k experts, so only their weights are read (an untouched
expert costs nothing); the experts are ordinary Linears, so int8/int4 quantization, the bf16 GEMV
for few rows and oneDNN for many apply to them as to dense layers (kvflow/quant/apply.py swaps them).
Router weights stay float32 and are never quantized: a flipped expert choice is a large error.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvflow.arch_config import MoEConfig
from kvflow.layers.activation import clamped_swiglu, limited_silu_and_mul, silu_and_mul
from kvflow.layers.linear import Linear
from kvflow.layers.moe_routing import expert_scores, expert_weights, select_experts


class ExpertMLP(nn.Module):
    """One SwiGLU expert: gate and up merged into one projection, then down. gpt-oss's experts carry
    biases and clamp their SwiGLU (`swiglu_limit`, activation.clamped_swiglu); DeepSeek-V4's clamp
    it too, in the plain silu form (swiglu_style "silu", activation.limited_silu_and_mul)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        dtype: torch.dtype,
        bias: bool = False,
        swiglu_limit: float | None = None,
        swiglu_alpha: float = 1.0,
        swiglu_style: str = "gpt_oss",
    ) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias, dtype)
        self.down_proj = Linear(intermediate_size, hidden_size, bias, dtype)
        self.swiglu_limit, self.swiglu_alpha, self.swiglu_style = swiglu_limit, swiglu_alpha, swiglu_style

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, hidden]
        gate_up = self.gate_up_proj(x)
        if self.swiglu_limit is None:
            return self.down_proj(silu_and_mul(gate_up))
        if self.swiglu_style == "silu":
            return self.down_proj(limited_silu_and_mul(gate_up, self.swiglu_limit))
        return self.down_proj(clamped_swiglu(gate_up, self.swiglu_limit, self.swiglu_alpha))


class RouterWeight(nn.Module):
    """A router's (or shared-expert gate's) weight [out, hidden], float32 and never quantized."""

    def __init__(
        self, hidden_size: int, num_outputs: int, correction_bias: bool = False, bias: bool = False
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(num_outputs, hidden_size, dtype=torch.float32), requires_grad=False
        )
        # gpt-oss's router adds a bias to its logits.
        self.bias: nn.Parameter | None = (
            nn.Parameter(torch.zeros(num_outputs, dtype=torch.float32), requires_grad=False) if bias else None
        )
        # DeepSeek-V3's per-expert bias on the choice scores (noaux_tc load balancing).
        self.e_score_correction_bias: nn.Parameter | None = (
            nn.Parameter(torch.zeros(num_outputs, dtype=torch.float32), requires_grad=False)
            if correction_bias
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, out] float32
        return F.linear(x.float(), self.weight, self.bias)


class SparseMoE(nn.Module):
    def __init__(self, hidden_size: int, moe: MoEConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.moe = moe
        self.gate = RouterWeight(hidden_size, moe.num_experts, moe.has_score_correction_bias, moe.router_bias)
        self.experts = nn.ModuleList(
            ExpertMLP(
                hidden_size,
                moe.expert_intermediate_size,
                dtype,
                moe.expert_bias,
                moe.swiglu_limit,
                moe.swiglu_alpha,
                moe.swiglu_style,
            )
            for _ in range(moe.num_experts)
        )
        shared = moe.shared_intermediate_size
        # DeepSeek-V4 clamps its shared expert as its routed ones (gpt-oss has none).
        shared_limit = moe.swiglu_limit if moe.swiglu_style == "silu" else None
        self.shared_expert = (
            ExpertMLP(hidden_size, shared, dtype, swiglu_limit=shared_limit, swiglu_style=moe.swiglu_style)
            if shared
            else None
        )
        self.shared_expert_gate = RouterWeight(hidden_size, 1) if moe.shared_expert_gate else None

    def forward(self, x: torch.Tensor, hash_ids: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]. `hash_ids` [T, k]: the experts a token-id table chose
        (DeepSeek-V4's hash layers); the router then only weights them."""
        if hash_ids is None:
            weights, ids = select_experts(self.gate(x), self.moe, self.gate.e_score_correction_bias)
        else:
            weights, ids = expert_weights(expert_scores(self.gate(x), self.moe), hash_ids, self.moe)
        out = self.routed(x, weights, ids)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = (torch.sigmoid(self.shared_expert_gate(x)) * shared.float()).to(x.dtype)
            out = out + shared
        return out

    def routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Σ_k weights[t, k] * expert_{ids[t, k]}(x[t]) for every token t: [T, hidden].

        Each (token, expert) pair's weighted output lands in a float32 row of its own, then each
        token sums its k rows in ascending expert order (transformers' index_add order, so float32
        results match it). No index_add_: on CPU it runs a scalar scatter for bf16 (1.7 ms per call
        measured at hidden 1024, 90% of a decode step)."""
        num_tokens, top_k = ids.shape
        ids, perm = ids.sort(dim=1, stable=True)  # each token's choices in expert order
        weights = weights.gather(1, perm)
        if num_tokens == 1:  # single-stream decode: no grouping to do, fewest ops per expert
            acc = torch.zeros(1, x.shape[1], dtype=torch.float32)
            for expert_id, weight in zip(ids[0].tolist(), weights[0].tolist(), strict=True):
                acc.add_(self.experts[expert_id](x), alpha=weight)  # float32 += weight * expert(x)
            return acc.to(x.dtype)
        flat_ids = ids.reshape(-1)  # [T * k]: pair p is token p // k's choice p % k
        order = torch.argsort(flat_ids, stable=True)  # pairs grouped by expert, tokens in order
        counts = torch.bincount(flat_ids, minlength=len(self.experts)).tolist()
        token_of_pair = order // top_k
        weight_of_pair = weights.reshape(-1).index_select(0, order)
        pair_out = torch.empty(num_tokens * top_k, x.shape[1], dtype=torch.float32)
        start = 0
        for expert_id, count in enumerate(counts):
            if count == 0:
                continue
            rows = slice(start, start + count)
            expert_out = self.experts[expert_id](x.index_select(0, token_of_pair[rows]))  # [count, hidden]
            pair_out.index_copy_(0, order[rows], expert_out.float() * weight_of_pair[rows, None])
            start += count
        return pair_out.view(num_tokens, top_k, -1).sum(dim=1).to(x.dtype)
