"""DeepSeek V2 and V3: multi-head latent attention (MLA) + DeepSeekMoE, by config switches.

Per layer (MLAConfig / MoEConfig in kvflow/arch_config.py; shapes T tokens, H heads):
    q       hidden -> [T, H, dn + dr] by q_proj, or by q_a_proj -> RMSNorm -> q_b_proj (q_lora_rank)
    latent  kv_a_proj_with_mqa: hidden -> [c_kv (C) | k_pe (dr)]; c_kv RMS-normed, k_pe and q's dr
            part rotated (interleaved pairs in V2 and in V3 with rope_interleave; YaRN's attention
            factor in cos/sin, its mscale^2 in the softmax scale)
    attend  over the paged latent pool (kvflow/attention/mla_attention.py: decode absorbs kv_b_proj
            into the query and output, prefill expands) -> [T, H, dv] -> o_proj
    mlp     dense for the first first_k_dense_replace layers, then routed experts + shared experts
V2 routes by softmax (greedy or group_limited_greedy), V3 by sigmoid with a correction bias and
groups scored by their two best experts (noaux_tc), both scaled by routed_scaling_factor.
kv_b_proj stays in the model dtype under weight quantization (decode reads it as W_UK / W_UV, so it
is kept as a plain weight, not a Linear). Decode runs in Python: the native decode forward
(kvflow/kernels/decode_forward.cpp) has neither latent attention nor experts.
"""

from __future__ import annotations

import torch
from torch import nn

from kvflow.arch_config import ArchConfig
from kvflow.attention.indexer import IndexerInputs
from kvflow.attention.kv_store import KVStore
from kvflow.attention.latent_kv_layer import LatentKVLayer
from kvflow.attention.metadata import AttentionMetadata
from kvflow.attention.mla_attention import absorbed_weights, mla_attention
from kvflow.layers.fused_moe import SparseMoE
from kvflow.layers.linear import Linear
from kvflow.layers.norm import RMSNorm
from kvflow.layers.rotary import apply_partial_rotary, apply_rotary
from kvflow.models.llama import DecoderLayer, LlamaFamilyForCausalLM
from kvflow.models.moe import checkpoint_sources

# DeepSeek's q_a_layernorm / kv_a_layernorm use RMSNorm's default eps, not the config's rms_norm_eps.
LATENT_NORM_EPS = 1e-6
INDEXER_NORM_EPS = 1e-6  # V3.2's indexer k_norm: nn.LayerNorm(eps=1e-6) in transformers and DeepSeek's code
NATIVE_DECODE_UNSUPPORTED_MLA = "latent attention and experts run on the Python path (no native MLA kernel)"


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x [T, H, dr] with rotary pairs (x0, x1), (x2, x3), ...; cos/sin_signed [T, 1, dr] from
    RotaryEmbedding.cos_sin. Returns [rotated evens | rotated odds] (transformers' V3 layout; V2's
    complex product keeps the pairs interleaved instead, and since q and k get the same
    permutation, q . k is unchanged)."""
    half = x.shape[-1] // 2
    cos_h, sin_h = cos[..., :half], sin_signed[..., half:]  # sin_signed's second half is +sin
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * cos_h - x2 * sin_h, x2 * cos_h + x1 * sin_h), dim=-1)


class DenseWeight(nn.Module):
    """A weight [out, in] kept in the model dtype (not a Linear: weight quantization leaves it alone)."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)


class LightningIndexer(nn.Module):
    """DeepSeek-V3.2's indexer projections (kvflow/attention/indexer.py has the scoring): queries from
    q's low-rank residual, one key per token (LayerNorm'd), a weight per head from the hidden state.
    RoPE on the first qk_rope_head_dim dims of both, in the two-halves convention (not interleaved,
    unlike the latent's)."""

    def __init__(self, cfg: ArchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        assert cfg.mla is not None and cfg.mla.indexer is not None and cfg.mla.q_lora_rank is not None
        idx = self.config = cfg.mla.indexer
        self.wq_b = Linear(cfg.mla.q_lora_rank, idx.num_heads * idx.head_dim, False, dtype)
        self.wk = Linear(cfg.hidden_size, idx.head_dim, False, dtype)
        self.k_norm = nn.LayerNorm(idx.head_dim, eps=INDEXER_NORM_EPS, dtype=dtype)
        self.k_norm.requires_grad_(False)
        self.weights_proj = Linear(cfg.hidden_size, idx.num_heads, False, dtype)

    def forward(
        self, hidden: torch.Tensor, q_resid: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
    ) -> IndexerInputs:
        idx, t = self.config, hidden.shape[0]
        q = apply_partial_rotary(self.wq_b(q_resid).view(t, idx.num_heads, idx.head_dim), *cos_sin)
        k = apply_partial_rotary(self.k_norm(self.wk(hidden)).unsqueeze(1), *cos_sin)[:, 0]
        weights = self.weights_proj(hidden).float() * idx.num_heads**-0.5
        return IndexerInputs(q, k, weights, idx.head_dim**-0.5, idx.topk)


class MLAAttention(nn.Module):
    def __init__(self, cfg: ArchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        assert cfg.mla is not None
        mla = self.mla = cfg.mla
        h, heads = cfg.hidden_size, cfg.num_attention_heads
        self.num_heads = heads
        self.q_proj: Linear | None = None
        self.q_a_proj: Linear | None = None
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj: Linear | None = None
        if mla.q_lora_rank is None:
            self.q_proj = Linear(h, heads * mla.qk_head_dim, False, dtype)
        else:
            self.q_a_proj = Linear(h, mla.q_lora_rank, False, dtype)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS, dtype)
            self.q_b_proj = Linear(mla.q_lora_rank, heads * mla.qk_head_dim, False, dtype)
        self.kv_a_proj_with_mqa = Linear(h, mla.latent_dim, False, dtype)
        self.indexer = LightningIndexer(cfg, dtype) if mla.indexer is not None else None
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, LATENT_NORM_EPS, dtype)
        self.kv_b_proj = DenseWeight(mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim), dtype)
        self.o_proj = Linear(heads * mla.v_head_dim, h, False, dtype)
        # Decode over the latents with W_UK / W_UV folded into query and output (mla_attention.py);
        # False re-expands the context's K/V every step (the reference; benchmarks/moe_mla.py).
        self.absorb = True
        self._absorbed: tuple[torch.Tensor, torch.Tensor] | None = None  # (W_UK, W_UV^T), once loaded

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._absorbed is None:  # built on first use: kv_b_proj is filled after construction
            mla = self.mla
            self._absorbed = absorbed_weights(self.kv_b_proj.weight, self.num_heads, mla.qk_nope_head_dim)
        return self._absorbed

    def _rotate(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if self.mla.rope_interleave:
            return apply_rotary_interleaved(x, *cos_sin)
        return apply_rotary(x, *cos_sin)

    def forward(
        self,
        hidden: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: LatentKVLayer,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        mla, num_tokens = self.mla, hidden.shape[0]
        q_resid = None
        if self.q_proj is not None:
            q = self.q_proj(hidden)
        else:
            assert self.q_a_proj is not None and self.q_a_layernorm is not None and self.q_b_proj is not None
            q_resid = self.q_a_layernorm(self.q_a_proj(hidden))
            q = self.q_b_proj(q_resid)
        q = q.view(num_tokens, self.num_heads, mla.qk_head_dim)
        q_nope, q_pe = q.split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(hidden).split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        qk_pe = self._rotate(torch.cat((q_pe, k_pe.unsqueeze(1)), dim=1), cos_sin)  # [T, H + 1, dr]
        latent = torch.cat((self.kv_a_layernorm(c_kv), qk_pe[:, -1]), dim=-1)  # [T, C + dr]
        out = mla_attention(
            q_nope,
            qk_pe[:, :-1],
            latent,
            kv_cache,
            meta,
            self.kv_b_proj.weight,
            mla.softmax_scale,
            self.absorbed_weights() if self.absorb else None,
            None if self.indexer is None or q_resid is None else self.indexer(hidden, q_resid, cos_sin),
        )  # [T, H, dv]
        return self.o_proj(out.reshape(num_tokens, -1))


class DeepseekV2ForCausalLM(LlamaFamilyForCausalLM):
    """DeepseekV2ForCausalLM and DeepseekV3ForCausalLM."""

    native_decode_unsupported = NATIVE_DECODE_UNSUPPORTED_MLA
    # kvflow's SparseMoE names its shared MLP shared_expert (Qwen2-MoE's name); DeepSeek's is plural.
    _RENAMES = ((".shared_expert.", ".shared_experts."),)

    def make_layer(self, cfg: ArchConfig, dtype: torch.dtype, index: int) -> nn.Module:
        assert cfg.moe is not None
        sparse = cfg.moe.sparse_layers[index]
        mlp = SparseMoE(cfg.hidden_size, cfg.moe, dtype) if sparse else None
        return DecoderLayer(cfg, dtype, self_attn=MLAAttention(cfg, dtype), mlp=mlp)

    def checkpoint_sources(self, param_name: str) -> list[str] | None:
        return checkpoint_sources(param_name, self._RENAMES)

    def set_weight_absorption(self, absorb: bool) -> None:
        """Decode with W_UK / W_UV absorbed (default) or by re-expanding the context (benchmarks)."""
        for module in self.modules():
            if isinstance(module, MLAAttention):
                module.absorb = absorb

    def layer_cache(self, kv_store: KVStore, index: int) -> LatentKVLayer:
        """Every layer reads and writes the store's latent pools."""
        return kv_store.latent_layer(index)
