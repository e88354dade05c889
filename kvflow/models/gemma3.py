"""Gemma 3, text (Gemma3ForCausalLM): 5 local (sliding-window) layers to 1 global, by config switches.

Per layer (ArchConfig, kvflow/arch_kinds.py):
    h += post_attention_norm(attn(input_norm(h)))      q/k RMSNorm per head; softmax scale
                                                        query_pre_attn_scalar^-0.5; a sliding layer
                                                        rotates with the local rope base (10k), a
                                                        global one with the global (1M, linear x8
                                                        on the 4B+ models)
    h += post_feedforward_norm(mlp(pre_feedforward_norm(h)))   gelu(tanh) GeGLU
The embedding rows are scaled by sqrt(hidden) in the model dtype (the tied LM head is not). Every
RMSNorm applies (1 + w) to a stored w: the loader adds the 1 once (after_load), so the norms are
kvflow's plain RMSNorm. Decode runs on the Python path: the native decode forward has neither the
four norms per layer nor gelu.
"""

from __future__ import annotations

import torch
from torch import nn

from kvflow.arch_config import ArchConfig
from kvflow.attention.metadata import AttentionMetadata
from kvflow.layers.activation import gelu_tanh_and_mul
from kvflow.layers.norm import RMSNorm
from kvflow.models.llama import MLP, Attention, LlamaFamilyForCausalLM

NATIVE_DECODE_UNSUPPORTED_GEMMA = "Gemma's four norms per layer and gelu MLP run on the Python path"


class GemmaMLP(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        return self.down_proj(gelu_tanh_and_mul(self.gate_up_proj(x)))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps, dtype)
        self.self_attn = Attention(cfg, dtype)
        self.post_attention_layernorm = RMSNorm(h, eps, dtype)
        self.pre_feedforward_layernorm = RMSNorm(h, eps, dtype)
        self.mlp = GemmaMLP(cfg, dtype)
        self.post_feedforward_layernorm = RMSNorm(h, eps, dtype)

    def forward(
        self,
        hidden: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: object,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(hidden), cos_sin, kv_cache, meta)
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(mlp)


def add_norm_offset(model: nn.Module, offset: float, skip: tuple[str, ...] = ()) -> None:
    """Weights stored as w, applied as (offset + w): add the offset to every RMSNorm's weight once,
    except modules whose name contains one of `skip`."""
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, RMSNorm) and not any(part in name for part in skip):
                module.weight.add_(offset)


class Gemma3ForCausalLM(LlamaFamilyForCausalLM):
    native_decode_unsupported = NATIVE_DECODE_UNSUPPORTED_GEMMA

    def make_layer(self, cfg: ArchConfig, dtype: torch.dtype, index: int) -> nn.Module:
        return Gemma3DecoderLayer(cfg, dtype)

    def after_load(self) -> None:
        add_norm_offset(self, self.config.norm_weight_offset)
