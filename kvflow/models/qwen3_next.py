"""Qwen3-Next (Qwen3NextForCausalLM): 3 Gated DeltaNet (linear attention) layers to 1 gated
full-attention layer, a mixture of experts with a gated shared expert on every layer.

Linear-attention layer (GatedDeltaNet), per token, shapes Hk key heads of dk, Hv value heads of dv:
    in_proj_qkvz -> q, k [Hk, dk], v, z [Hv, dv];  in_proj_ba -> b, a [Hv]   (grouped by key head:
                    key head i's block holds its q, k, then the v and z of its Hv / Hk value heads)
    [q | k | v] -> short causal depthwise conv (kernel 4) + silu, with its state
    g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b)
    gated delta rule over the recurrent state S [Hv, dk, dv] (q, k l2-normed, q / sqrt(dk)):
        prefill chunks in the chunked form, decodes in one batched recurrent step
        (kvflow/attention/gated_delta_net.py, causal_conv.py): O(Hv dk dv) per token, not O(context)
    out_proj(gated RMSNorm(o) * silu(z))
The state lives in the KV pool's pages (kvflow/attention/state_pool.py, a linear-attention cache
group): read from the step's source (a prefix hit's checkpoint, the running state, or zeros), written
back, and at checkpoint offsets also into checkpoint pages for prefix caching.
Full-attention layer: q_proj gives each head's query and an output gate (interleaved per head),
q/k RMSNorm per head, rope on the first quarter of head_dim, o = attention * sigmoid(gate).
RMSNorms of the decoder apply (1 + w) to a stored w (the loader adds the 1); the gated norm inside
the linear layer applies w itself. Decode runs on the Python path (no native kernel for the state).
"""

from __future__ import annotations

import torch
from torch import nn

from kvflow.arch_config import ArchConfig
from kvflow.arch_kinds import LINEAR
from kvflow.attention.causal_conv import causal_conv1d_decode, causal_conv1d_prefill, conv_state_after
from kvflow.attention.gated_delta_net import (
    chunk_gated_delta_rule,
    gated_rms_norm,
    gdn_gating,
    recurrent_gated_delta_rule_step,
)
from kvflow.attention.kv_layer import KVLayer
from kvflow.attention.kv_store import KVStore
from kvflow.attention.metadata import AttentionMetadata, StateMetadata, StateRequest
from kvflow.attention.paged_attention import paged_attention
from kvflow.attention.state_pool import PagedStateLayer
from kvflow.layers.fused_moe import SparseMoE
from kvflow.layers.linear import Linear
from kvflow.layers.norm import RMSNorm
from kvflow.layers.rotary import apply_partial_rotary
from kvflow.models.gemma3 import add_norm_offset
from kvflow.models.llama import MLP, LlamaFamilyForCausalLM
from kvflow.models.moe import checkpoint_sources

NATIVE_DECODE_UNSUPPORTED_QWEN3_NEXT = "linear attention and experts run on the Python path"


class GatedAttention(nn.Module):
    def __init__(self, cfg: ArchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        self.q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, 2 * self.q_size + 2 * kv_size, cfg.qkv_bias, dtype)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, cfg.o_bias, dtype)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype)

    def forward(
        self,
        hidden: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: KVLayer,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        t, hq, hkv, d = hidden.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(hidden)
        q_gate = qkv[:, : 2 * self.q_size].view(t, hq, 2 * d)  # per head: its query, then its gate
        k = qkv[:, 2 * self.q_size : 2 * self.q_size + hkv * d].view(t, hkv, d)
        v = qkv[:, 2 * self.q_size + hkv * d :].view(t, hkv, d)
        q = apply_partial_rotary(self.q_norm(q_gate[..., :d]), *cos_sin)
        k = apply_partial_rotary(self.k_norm(k), *cos_sin)
        out = paged_attention(q, k, v, kv_cache, meta).reshape(t, self.q_size)  # [T, Hq * D]
        return self.o_proj(out * torch.sigmoid(q_gate[..., d:].reshape(t, self.q_size)))


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ArchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        assert cfg.linear is not None
        lin = self.lin = cfg.linear
        h = cfg.hidden_size
        self.eps = cfg.rms_norm_eps
        self.in_proj_qkvz = Linear(h, 2 * lin.key_dim + 2 * lin.value_dim, False, dtype)
        self.in_proj_ba = Linear(h, 2 * lin.num_value_heads, False, dtype)
        self.conv1d = _Conv1dWeight(lin.conv_dim, lin.conv_kernel_size, dtype)
        # float32: g is computed in float32 (HF upcasts both), so nothing is lost keeping them so.
        self.dt_bias = nn.Parameter(
            torch.empty(lin.num_value_heads, dtype=torch.float32), requires_grad=False
        )
        self.A_log = nn.Parameter(torch.empty(lin.num_value_heads, dtype=torch.float32), requires_grad=False)
        self.norm = _NormWeight(lin.value_head_dim, dtype)
        self.out_proj = Linear(lin.value_dim, h, False, dtype)

    def _split(self, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """hidden [T, H] -> mixed [q | k | v] [T, conv_dim], z [T, Hv, dv], b, a [T, Hv] (HF's
        fix_query_key_value_ordering: the projections are grouped by key head)."""
        lin, t = self.lin, hidden.shape[0]
        per = lin.num_value_heads // lin.num_key_heads
        qkvz = self.in_proj_qkvz(hidden).view(t, lin.num_key_heads, -1)
        sizes = [lin.key_head_dim, lin.key_head_dim, per * lin.value_head_dim, per * lin.value_head_dim]
        q, k, v, z = torch.split(qkvz, sizes, dim=-1)
        b, a = torch.split(self.in_proj_ba(hidden).view(t, lin.num_key_heads, 2 * per), [per, per], dim=-1)
        mixed = torch.cat((q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)), dim=-1)
        hv = lin.num_value_heads
        return mixed, z.reshape(t, hv, lin.value_head_dim), b.reshape(t, hv), a.reshape(t, hv)

    def _heads(self, conv_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """conv_out [N, conv_dim] -> q, k [N, Hk, dk], v [N, Hv, dv]."""
        lin, n = self.lin, conv_out.shape[0]
        q, k, v = torch.split(conv_out, [lin.key_dim, lin.key_dim, lin.value_dim], dim=-1)
        return (
            q.reshape(n, lin.num_key_heads, lin.key_head_dim),
            k.reshape(n, lin.num_key_heads, lin.key_head_dim),
            v.reshape(n, lin.num_value_heads, lin.value_head_dim),
        )

    def forward(
        self,
        hidden: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        states: PagedStateLayer,
        meta: StateMetadata,
    ) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        mixed, z, b, a = self._split(hidden)
        g, beta = gdn_gating(a, b, self.A_log, self.dt_bias)
        core = hidden.new_empty(hidden.shape[0], self.lin.num_value_heads, self.lin.value_head_dim)
        if meta.decode_requests:
            self._decode(mixed, g, beta, states, meta, core)
        for request in meta.requests:
            if request.num_tokens > 1:
                self._prefill(mixed, g, beta, states, request, core)
        normed = gated_rms_norm(core, z, self.norm.weight, self.eps)  # [T, Hv, dv]
        return self.out_proj(normed.reshape(hidden.shape[0], self.lin.value_dim))

    def _decode(
        self,
        mixed: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        states: PagedStateLayer,
        meta: StateMetadata,
        core: torch.Tensor,
    ) -> None:
        """Every single-token request in one batched step of the conv and the recurrence."""
        rows = meta.decode_tokens  # [B]
        recurrent, conv = states.read(meta.decode_source)
        if bool(meta.decode_fresh.any()):  # a one-token prompt: its state starts at zero
            recurrent[meta.decode_fresh] = 0.0
            conv[meta.decode_fresh] = 0.0
        conv_out, new_conv = causal_conv1d_decode(mixed.index_select(0, rows), self.conv1d.weight[:, 0], conv)
        q, k, v = self._heads(conv_out)
        out, new_recurrent = recurrent_gated_delta_rule_step(
            q, k, v, g.index_select(0, rows), beta.index_select(0, rows), recurrent, out_state=recurrent
        )
        core.index_copy_(0, rows, out)
        states.write(meta.decode_state, new_recurrent, new_conv)
        for i, index in enumerate(meta.decode_requests):  # a checkpoint right after this token
            for _, pages in meta.requests[index].checkpoints:
                states.write(torch.tensor([pages]), new_recurrent[i : i + 1], new_conv[i : i + 1])

    def _prefill(
        self,
        mixed: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        states: PagedStateLayer,
        request: StateRequest,
        core: torch.Tensor,
    ) -> None:
        """One request's chunk in the chunked form, from its source state, checkpoints included."""
        s, e = request.token_start, request.token_end
        recurrent = conv = None
        if request.source is not None:
            r, c = states.read(torch.tensor([request.source]))
            recurrent, conv = r[0], c[0]
        x = mixed[s:e]
        weight = self.conv1d.weight[:, 0]
        conv_out, new_conv = causal_conv1d_prefill(x, weight, conv)
        q, k, v = self._heads(conv_out)
        offsets = [j for j, _ in request.checkpoints]
        result = chunk_gated_delta_rule(q, k, v, g[s:e], beta[s:e], recurrent, checkpoints=offsets)
        core[s:e] = result.out
        states.write(torch.tensor([request.state]), result.final_state[None], new_conv[None])
        incoming = conv if conv is not None else x.new_zeros(x.shape[1], weight.shape[1] - 1)
        for (j, pages), state in zip(request.checkpoints, result.checkpoint_states, strict=True):
            states.write(torch.tensor([pages]), state[None], conv_state_after(x, incoming, j)[None])


class _Conv1dWeight(nn.Module):
    """The depthwise conv's weight as the checkpoint stores it: [conv_dim, 1, kernel]."""

    def __init__(self, channels: int, kernel: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel, dtype=dtype), requires_grad=False)


class _NormWeight(nn.Module):
    """The gated RMSNorm's weight [dv], applied as stored (no 1 + w)."""

    def __init__(self, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype), requires_grad=False)


class Qwen3NextDecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, dtype: torch.dtype, index: int) -> None:
        super().__init__()
        assert cfg.moe is not None
        self.is_linear = cfg.layer_types[index] == LINEAR
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.linear_attn = GatedDeltaNet(cfg, dtype) if self.is_linear else None
        self.self_attn = None if self.is_linear else GatedAttention(cfg, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        sparse = cfg.moe.sparse_layers[index]
        self.mlp = SparseMoE(cfg.hidden_size, cfg.moe, dtype) if sparse else MLP(cfg, dtype)

    def forward(
        self,
        hidden: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        cache: KVLayer | PagedStateLayer,
        meta: AttentionMetadata | StateMetadata,
    ) -> torch.Tensor:
        x = self.input_layernorm(hidden)
        if self.linear_attn is not None:
            assert isinstance(cache, PagedStateLayer) and isinstance(meta, StateMetadata)
            mixed = self.linear_attn(x, cos_sin, cache, meta)
        else:
            assert self.self_attn is not None and isinstance(meta, AttentionMetadata)
            mixed = self.self_attn(x, cos_sin, cache, meta)
        hidden = hidden + mixed
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Qwen3NextForCausalLM(LlamaFamilyForCausalLM):
    native_decode_unsupported = NATIVE_DECODE_UNSUPPORTED_QWEN3_NEXT

    def make_layer(self, cfg: ArchConfig, dtype: torch.dtype, index: int) -> nn.Module:
        return Qwen3NextDecoderLayer(cfg, dtype, index)

    def layer_cache(self, kv_store: KVStore, index: int) -> KVLayer | PagedStateLayer:
        if self.config.layer_types[index] == LINEAR:
            return kv_store.state_layer(index)
        return kv_store.layer(index)

    def checkpoint_sources(self, param_name: str) -> list[str] | None:
        return checkpoint_sources(param_name)

    def after_load(self) -> None:
        add_norm_offset(self, self.config.norm_weight_offset)
