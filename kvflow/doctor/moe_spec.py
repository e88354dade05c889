"""Parameter counts of mixture-of-experts layers and latent attention, from config.json alone.

MoE layer        router E x hidden (+ E correction biases, DeepSeek-V3; + E logit biases, gpt-oss),
                 E routed experts of 3 x hidden x expert_intermediate each (gpt-oss: gate_up
                 [2I, hidden] and down [hidden, I], + their biases 2I + hidden), shared experts
                 3 x hidden x shared_intermediate (+ a 1 x hidden gate, Qwen2-MoE and Qwen3-Next);
                 a token multiplies the router, the shared experts and top_k routed experts
                 ("active" parameters)
MLA attention    q: hidden x H x (dn + dr), or hidden x q_lora + q_lora (norm) + q_lora x H x (dn + dr);
                 kv_a: hidden x (C + dr), its norm C, kv_b: C x H x (dn + dv), o: H x dv x hidden
experts touched  B tokens each picking top_k of E experts, uniformly and independently: an expert
                 is missed by one token with probability 1 - k/E, so E x (1 - (1 - k/E)^B) distinct
                 experts are read per layer and step (k at B = 1, all E as B grows): the weight
                 bytes of a MoE decode step grow with the batch, unlike a dense model's
"""

from __future__ import annotations

from dataclasses import dataclass

from kvflow.arch_config import ArchConfig


def expected_experts_touched(num_experts: int, top_k: int, num_tokens: int) -> float:
    """Expected distinct experts that `num_tokens` tokens' top-k choices cover (uniform routing)."""
    if num_tokens <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** num_tokens)


@dataclass(frozen=True)
class MoEParams:
    """One MoE layer's parameters by role."""

    router: int  # router weight (+ correction bias) and the shared-expert gate
    shared: int  # the shared experts (0 if none)
    per_expert: int  # one routed expert
    num_experts: int
    top_k: int

    @property
    def total(self) -> int:
        return self.router + self.shared + self.num_experts * self.per_expert

    @property
    def active(self) -> int:
        """Multiplied per token: router, shared experts and top_k routed experts."""
        return self.router + self.shared + self.top_k * self.per_expert


def moe_params(arch: ArchConfig) -> MoEParams:
    moe = arch.moe
    assert moe is not None
    h = arch.hidden_size
    e, i = moe.num_experts, moe.expert_intermediate_size
    router = e * h + (e if moe.has_score_correction_bias else 0) + (e if moe.router_bias else 0)
    router += h if moe.shared_expert_gate else 0
    return MoEParams(
        router=router,
        shared=3 * h * moe.shared_intermediate_size,
        per_expert=3 * h * i + (2 * i + h if moe.expert_bias else 0),
        num_experts=moe.num_experts,
        top_k=moe.top_k,
    )


def mla_attention_params(arch: ArchConfig) -> int:
    """One layer's latent attention, its two latent RMSNorms included."""
    m = arch.mla
    assert m is not None
    h, heads = arch.hidden_size, arch.num_attention_heads
    if m.q_lora_rank is None:
        q = h * heads * m.qk_head_dim
    else:
        q = h * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * heads * m.qk_head_dim
    kv = h * m.latent_dim + m.kv_lora_rank + m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim)
    return q + kv + heads * m.v_head_dim * h + indexer_params(arch)


def indexer_params(arch: ArchConfig) -> int:
    """DeepSeek-V3.2's lightning indexer in one layer: wq_b (q_lora_rank -> heads x head_dim), wk
    (hidden -> head_dim) with its LayerNorm (weight and bias), weights_proj (hidden -> heads)."""
    m = arch.mla
    if m is None or m.indexer is None or m.q_lora_rank is None:
        return 0
    idx, h = m.indexer, arch.hidden_size
    return (
        m.q_lora_rank * idx.num_heads * idx.head_dim + h * idx.head_dim + 2 * idx.head_dim + h * idx.num_heads
    )
