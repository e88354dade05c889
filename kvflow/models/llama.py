"""The llama-family decoder covering Llama, Mistral, Qwen2 and Qwen3 by config switches.

Forward over a flat token batch (prefill chunks and decodes together), context passed in:
    model(input_ids [T], attn_metadata, kv_store) -> hidden [T, hidden]
q/k/v and gate/up are merged into one projection each (one GEMM instead of three / two); the
loader concatenates the checkpoint's separate weights in that order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from kvflow.arch_config import ArchConfig
from kvflow.arch_kinds import SLIDING
from kvflow.attention.kv_layer import KVLayer
from kvflow.attention.kv_store import KVStore
from kvflow.attention.latent_kv_layer import LatentKVLayer
from kvflow.attention.metadata import AttentionMetadata
from kvflow.attention.paged_attention import paged_attention
from kvflow.layers.activation import silu_and_mul
from kvflow.layers.linear import ALL_ROWS, Linear
from kvflow.layers.norm import RMSNorm
from kvflow.layers.rotary import RotaryEmbedding, apply_rotary
from kvflow.models.native_decoder import build_native_decoder, build_native_head
from kvflow.quant.linear import Int4Linear, Int8Linear


class Attention(nn.Module):
    def __init__(self, cfg: ArchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, cfg.qkv_bias, dtype)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, cfg.o_bias, dtype)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        # gpt-oss: a learned sink logit per query head, float32 (the softmax's extra term).
        self.sinks: nn.Parameter | None = (
            nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32), requires_grad=False)
            if cfg.attention_sinks
            else None
        )
        self.scale = cfg.attention_scale  # Gemma 3: query_pre_attn_scalar ** -0.5; None: head_dim ** -0.5

    def forward(
        self,
        hidden: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: KVLayer,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        num_tokens = hidden.shape[0]
        hq, hkv = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(hidden).view(num_tokens, hq + 2 * hkv, self.head_dim)  # [T, Hq+2Hkv, D]
        v = qkv[:, hq + hkv :]
        if self.q_norm is not None and self.k_norm is not None:  # Qwen3: per-head RMSNorm before RoPE
            qk = torch.cat((self.q_norm(qkv[:, :hq]), self.k_norm(qkv[:, hq : hq + hkv])), dim=1)
        else:
            qk = qkv[:, : hq + hkv]
        cos, sin = cos_sin
        qk = apply_rotary(qk, cos, sin)  # q and k rotated in one pass: [T, Hq+Hkv, D]
        q, k = qk[:, :hq], qk[:, hq:]
        out = paged_attention(q, k, v, kv_cache, meta, scale=self.scale, sinks=self.sinks)  # [T, Hq, D]
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ArchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, cfg.mlp_bias, dtype)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    """Pre-norm residual block: h += attn(norm(h)); h += mlp(norm(h)). The llama family's attention
    and dense MLP unless others are given (a mixture of experts, DeepSeek's latent attention)."""

    def __init__(
        self,
        cfg: ArchConfig,
        dtype: torch.dtype,
        self_attn: nn.Module | None = None,
        mlp: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = self_attn if self_attn is not None else Attention(cfg, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = mlp if mlp is not None else MLP(cfg, dtype)

    def forward(
        self,
        hidden: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: KVLayer | LatentKVLayer,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos_sin, kv_cache, meta)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaFamilyForCausalLM(nn.Module):
    def __init__(self, cfg: ArchConfig, dtype: torch.dtype, max_positions: int) -> None:
        super().__init__()
        self.config = cfg
        self.dtype = dtype
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(self.make_layer(cfg, dtype, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        # Tied checkpoints share the embedding matrix; the loader fills lm_head from it either way,
        # so that the head can be packed for the fast GEMM path independently of the lookup table.
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, False, dtype)
        self.rotary_emb = RotaryEmbedding(cfg.rope, max_positions)
        # Gemma 3's sliding layers rotate with their own base (ArchConfig.local_rope).
        self.local_rotary_emb = RotaryEmbedding(cfg.local_rope, max_positions) if cfg.local_rope else None
        # The native decode forward and the KV store it is bound to (kvflow/models/native_decoder.py).
        self._native_decoder: Any = None
        self._native_kv_store: KVStore | None = None
        self._native_head: Any = None  # the LM head's native GEMV, for greedy_tokens (bound with the decoder)

    def make_layer(self, cfg: ArchConfig, dtype: torch.dtype, index: int) -> nn.Module:
        """Decoder layer `index`; families with another block (kvflow/models/moe.py) override it."""
        return DecoderLayer(cfg, dtype)

    def bind_native_decoder(
        self, kv_store: KVStore, all_reduce: Callable[[torch.Tensor], Any] | None = None
    ) -> bool:
        """Run decode-only steps over `kv_store` natively from now on; False if some part cannot.
        `all_reduce`: a tensor-parallel rank's sum over ranks (kvflow/models/native_decoder.py)."""
        self._native_decoder = build_native_decoder(self, kv_store, all_reduce)
        self._native_kv_store = kv_store if self._native_decoder is not None else None
        self._native_head = build_native_head(self)
        return self._native_decoder is not None

    def reset_rotary(self, max_positions: int) -> None:
        """Recompute the rope tables (the loader builds the model on the meta device, buffers too)."""
        cfg = self.config
        self.rotary_emb = RotaryEmbedding(cfg.rope, max_positions)
        self.local_rotary_emb = RotaryEmbedding(cfg.local_rope, max_positions) if cfg.local_rope else None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> [T, hidden]; Gemma scales the rows by sqrt(hidden), in the model dtype."""
        hidden = self.embed_tokens(input_ids)
        scale = self.config.embed_scale
        return hidden if scale is None else hidden * torch.tensor(scale, dtype=hidden.dtype)

    def layer_cache(self, kv_store: KVStore, index: int) -> Any:
        """What layer `index` reads and writes in the store: its K/V pools (a latent or a
        linear-attention state in the families that have them)."""
        return kv_store.layer(index)

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv_store: KVStore) -> torch.Tensor:
        """input_ids [T] -> final hidden states [T, hidden] (normed). Each layer gets its cache group's
        metadata (meta.for_layer) and, if it slides with a rope of its own, that rope."""
        if self._runs_natively(meta, kv_store):
            return self._native_decoder.forward(*self._native_inputs(input_ids, meta))
        hidden = self.embed(input_ids)
        cos_sin = self.rotary_emb.cos_sin(meta.positions, self.dtype)
        local = cos_sin
        if self.local_rotary_emb is not None:
            local = self.local_rotary_emb.cos_sin(meta.positions, self.dtype)
        kinds = self.config.cache_layer_kinds
        for i, layer in enumerate(self.layers):
            rope = local if kinds[i] == SLIDING else cos_sin
            hidden = layer(hidden, rope, self.layer_cache(kv_store, i), meta.for_layer(i))
        return self.norm(hidden)

    def _runs_natively(self, meta: AttentionMetadata, kv_store: KVStore) -> bool:
        """A decode-only step (no prefill chunk) over the KV store the native decoder is bound to."""
        return kv_store is self._native_kv_store and not meta.prefills

    def _native_inputs(
        self, input_ids: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[torch.Tensor | None, ...]:
        """The native decoder's arguments: embedded hidden [M, H], cos and sin_signed [M, 1, D],
        slot_mapping [M], decode key slots [M, L], keys per row [M]."""
        hidden = self.embed_tokens(input_ids)
        cos, sin_signed = self.rotary_emb.cos_sin(meta.positions, self.dtype)
        return hidden, cos, sin_signed, meta.slot_mapping, meta.decode_kv_slots, meta.decode_num_keys

    def forward_decode_rows(
        self, token_ids: list[int], positions: list[int], block_tables: list[list[int]]
    ) -> torch.Tensor:
        """A decode-only step through the bound native decoder from plain lists (kvflow/worker/
        input_batch.py DecodeRows): token_ids [M] -> final hidden states [M, hidden] (normed), the
        same numbers as forward over build_input_batch's metadata of the same step."""
        if self._native_decoder is None:
            raise ValueError("forward_decode_rows needs a bound native decoder (bind_native_decoder)")
        # The native decoder looks the embedding rows up itself unless the lookup is a module's
        # (a tensor-parallel vocabulary shard, which sums over the ranks: build_native_decoder).
        hidden = None
        if not self._native_decoder.has_embedding:
            hidden = self.embed_tokens(torch.tensor(token_ids, dtype=torch.int64))
        return self._native_decoder.forward_rows(hidden, token_ids, positions, block_tables)

    def profile_native_decode(
        self, input_ids: torch.Tensor, meta: AttentionMetadata, kv_store: KVStore
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """A decode-only step's forward through the native decoder, and the microseconds each piece
        of a layer took, summed over the layers (kvflow/kernels/decode_forward.h DecodePiece): where
        a step's time goes inside the one native call (benchmarks/decode_profile.py). The same
        numbers as forward; raises if this step would not run natively."""
        if not self._runs_natively(meta, kv_store):
            raise ValueError("not a decode-only step over the native decoder's KV store")
        out, piece_us = self._native_decoder.forward_profiled(*self._native_inputs(input_ids, meta))
        return out, dict(zip(self._native_decoder.piece_names, piece_us.tolist(), strict=True))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] logits in the head's dtype. Consumers convert what needs float32
        (log-softmaxes, sampled rows): greedy rows take the argmax of bf16 logits directly."""
        return self.lm_head(hidden)

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[N, hidden] -> [N] int64: each row's argmax of compute_logits(hidden), the first index on
        ties (greedy sampling's token), taken inside the LM head's GEMV as it writes each tile
        (kvflow/kernels/argmax_lanes.h): at single-stream decode the logits would otherwise be read
        back from DRAM, evicted by the head's own weight stream. None when no native head is bound
        (bind_native_decoder): the caller samples from compute_logits."""
        return None if self._native_head is None else self._native_head.greedy(hidden)

    def prepare_for_inference(self) -> None:
        for module in self.modules():
            if isinstance(module, Linear):
                module.prepare_for_inference()

    def set_batch_invariant(self) -> None:
        """Every linear through its row-invariant GEMV, whatever the row count (batch-invariant mode,
        kvflow/worker/input_batch.py has the attention half): a row's result no longer depends on
        how many rows share the call. Call before bind_native_decoder, which copies the limits."""
        for module in self.modules():
            if isinstance(module, Linear | Int8Linear | Int4Linear):
                module.max_gemv_rows = ALL_ROWS
