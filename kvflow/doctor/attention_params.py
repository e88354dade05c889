"""Parameters of one decoder layer's token mixer and norms, by layer kind, from config.json alone.

attention (full or sliding)   q: hidden x H x d (x 2 with Qwen3-Next's output gate: q_proj gives a
                              query and a gate per head), k and v: hidden x Hkv x d each,
                              o: H x d x hidden; biases (q/k/v, o) when the architecture has them;
                              one sink logit per query head (gpt-oss)
MLA                           kvflow/doctor/moe_spec.py mla_attention_params
linear attention              Gated DeltaNet (Qwen3-Next), Hk key heads of dk, Hv value heads of dv:
                              in_proj_qkvz hidden x (2 Hk dk + 2 Hv dv), in_proj_ba hidden x 2 Hv,
                              conv1d conv_dim x kernel (depthwise), dt_bias Hv, A_log Hv, the gated
                              norm dv, out_proj Hv dv x hidden
norms                         2 x hidden per layer (4 with Gemma 3's sandwich norms), + 2 x d for
                              the q/k norms of an attention layer that has them
"""

from __future__ import annotations

from kvflow.arch_config import ArchConfig
from kvflow.doctor.moe_spec import mla_attention_params

LINEAR = "linear_attention"
NORMS_PER_LAYER = 2  # before attention and before the MLP
SANDWICH_NORMS_PER_LAYER = 4  # Gemma 3: also after attention and after the MLP
QUERY_AND_GATE = 2  # Qwen3-Next's q_proj: a query and an output gate per head


def mixer_params(arch: ArchConfig, kind: str) -> int:
    """One layer's attention (or linear attention) parameters."""
    if kind == LINEAR:
        return linear_attention_params(arch)
    if arch.mla is not None:
        return mla_attention_params(arch)
    h, q, kv, d = arch.hidden_size, arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim
    q_out = q * d * (QUERY_AND_GATE if arch.attn_output_gate else 1)
    params = h * q_out + 2 * h * kv * d + q * d * h
    if arch.qkv_bias:
        params += q_out + 2 * kv * d
    if arch.o_bias:
        params += h
    if arch.attention_sinks:
        params += q
    return params


def linear_attention_params(arch: ArchConfig) -> int:
    lin = arch.linear
    assert lin is not None
    h, hv = arch.hidden_size, lin.num_value_heads
    in_proj = h * (2 * lin.key_dim + 2 * lin.value_dim) + h * 2 * hv
    conv = lin.conv_dim * lin.conv_kernel_size
    return in_proj + conv + 2 * hv + lin.value_head_dim + lin.value_dim * h


def norm_params(arch: ArchConfig, kind: str) -> int:
    """One layer's RMSNorms (the linear-attention layer's gated norm is in linear_attention_params)."""
    per_layer = SANDWICH_NORMS_PER_LAYER if arch.sandwich_norm else NORMS_PER_LAYER
    qk = 2 * arch.head_dim if arch.qk_norm and kind != LINEAR else 0
    return per_layer * arch.hidden_size + qk
