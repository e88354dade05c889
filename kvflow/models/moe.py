"""Mixture-of-experts members of the llama family: Mixtral, Qwen2-MoE and Qwen3-MoE.

Attention is the llama family's (Mistral's for Mixtral, Qwen2's q/k/v bias, Qwen3's q/k norm, by
the same ArchConfig switches); the MLP of the layers `moe.sparse_layers` marks is a SparseMoE
(kvflow/layers/fused_moe.py), the others keep the dense MLP (Qwen's mlp_only_layers and
decoder_sparse_step). Decode runs in Python: the native decode forward
(kvflow/kernels/decode_forward.cpp) has dense MLPs only.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from kvflow.arch_config import ArchConfig
from kvflow.layers.fused_moe import SparseMoE
from kvflow.models.llama import DecoderLayer, LlamaFamilyForCausalLM

NATIVE_DECODE_UNSUPPORTED_MOE = "mixture-of-experts layers run on the Python path (no native MoE kernel)"

# kvflow's merged projection -> the checkpoint's two (concatenated along the output dimension).
_GATE_UP = re.compile(r"\.gate_up_proj\.")


def checkpoint_sources(param_name: str, renames: tuple[tuple[str, str], ...] = ()) -> list[str] | None:
    """The checkpoint tensors of an expert / shared-expert parameter, or None for the loader's default
    rules. `renames` rewrite kvflow's module names into a family's (applied in order)."""
    if ".experts." not in param_name and ".shared_expert" not in param_name and ".gate." not in param_name:
        return None
    names = (
        [_GATE_UP.sub(".gate_proj.", param_name), _GATE_UP.sub(".up_proj.", param_name)]
        if _GATE_UP.search(param_name)
        else [param_name]
    )
    for old, new in renames:
        names = [n.replace(old, new) for n in names]
    return ["model." + n for n in names]


class MoEForCausalLM(LlamaFamilyForCausalLM):
    native_decode_unsupported = NATIVE_DECODE_UNSUPPORTED_MOE

    def make_layer(self, cfg: ArchConfig, dtype: torch.dtype, index: int) -> nn.Module:
        assert cfg.moe is not None
        sparse = cfg.moe.sparse_layers[index]
        return DecoderLayer(cfg, dtype, mlp=SparseMoE(cfg.hidden_size, cfg.moe, dtype) if sparse else None)

    def checkpoint_sources(self, param_name: str) -> list[str] | None:
        return checkpoint_sources(param_name)


class MixtralForCausalLM(MoEForCausalLM):
    # Mixtral's checkpoints: block_sparse_moe.{gate, experts.e.w1 (gate), w3 (up), w2 (down)}.
    _RENAMES = (
        (".mlp.", ".block_sparse_moe."),
        (".gate_proj.", ".w1."),
        (".up_proj.", ".w3."),
        (".down_proj.", ".w2."),
    )

    def checkpoint_sources(self, param_name: str) -> list[str] | None:
        return checkpoint_sources(param_name, self._RENAMES)
