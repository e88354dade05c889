"""The native decode forward, bound to one model and one KV store (kvflow/kernels/decode_forward.cpp).

A decode-only step (every flat token a single-query row: decodes and speculative verification
rows, no prefill chunk) runs the decoder layers in one C++ call over the same kernels and ATen ops
as the Python layers (kvflow/models/llama.py), bit for bit; prefill chunks, float32 models, and
layers without a native kernel (act-order parts concatenated in torch, torch's int4 layout, a KV
pool in another dtype than the model's) keep the Python path, which is also the reference
(`enforce_eager=True` runs every step through it, as vLLM's flag keeps PyTorch eager).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from kvflow.attention.kv_layer import PlainKVLayer, QuantizedKVLayer
from kvflow.attention.kv_store import KVStore
from kvflow.kernels import NativeDecoderClasses, native_decoder_classes

logger = logging.getLogger("kvflow")

_NO_TENSOR = torch.empty(0)


def _native_linear(module: nn.Module, classes: NativeDecoderClasses) -> Any | None:
    native = getattr(module, "native", None)
    return None if native is None else native(classes)


def _native_kv(layer: PlainKVLayer | QuantizedKVLayer) -> tuple[str, list[torch.Tensor]] | None:
    """(kind, [key data, value data, key scale, value scale, key zero, value zero]) of one layer's pools."""
    plain = layer.in_place()
    if plain is not None:
        if plain[0].dtype != torch.bfloat16:
            return None
        return "plain", [plain[0], plain[1], _NO_TENSOR, _NO_TENSOR, _NO_TENSOR, _NO_TENSOR]
    q = layer.quantized_pools()
    if q is None:
        return None
    return q.kind, [q.key_data, q.value_data, q.key_scale, q.value_scale, q.key_zero, q.value_zero]


def build_native_head(model: Any) -> Any | None:
    """The model's LM head as a native linear, for its greedy GEMV (LlamaFamilyForCausalLM.greedy_tokens),
    or None where the head has only a torch path (float32, a tensor-parallel head, no kernel)."""
    classes = native_decoder_classes()
    return None if classes is None else _native_linear(model.lm_head, classes)


def build_native_decoder(
    model: Any, kv_store: KVStore, all_reduce: Callable[[torch.Tensor], Any] | None = None
) -> Any | None:
    """The model's decoder layers over `kv_store` as one native call, or None (with the reason logged)
    when some part has only a torch path. `model` is a LlamaFamilyForCausalLM (not imported: it imports
    this module). `all_reduce`: a tensor-parallel rank's in-place sum over ranks, called on o_proj's
    and down_proj's outputs (kvflow/parallel/); a model with row-parallel layers needs it."""
    unsupported = getattr(model, "native_decode_unsupported", None)
    if unsupported:  # a family whose layers the C++ forward does not have (MoE, latent attention)
        logger.info("native decode off: %s", unsupported)
        return None
    classes = native_decoder_classes()
    if classes is None or model.dtype != torch.bfloat16:
        return None
    if all_reduce is None and any(getattr(m, "all_reduce_after", False) for m in model.modules()):
        logger.info("native decode off: row-parallel layers and no all-reduce given")
        return None
    cfg = model.config
    decoder = classes.decoder(
        cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps, model.norm.weight
    )
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        modules = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        linears = [_native_linear(m, classes) for m in modules]
        kv = _native_kv(kv_store.layer(i))
        if any(linear is None for linear in linears) or kv is None:
            logger.info("native decode off: layer %d has a part with only a torch path", i)
            return None
        q_norm = None if attn.q_norm is None else attn.q_norm.weight
        k_norm = None if attn.k_norm is None else attn.k_norm.weight
        decoder.add_layer(
            layer.input_layernorm.weight,
            layer.post_attention_layernorm.weight,
            q_norm,
            k_norm,
            *linears,
            kv[0],
            kv[1],
        )
    if all_reduce is not None:
        decoder.set_all_reduce(all_reduce)
    cos, sin_signed = model.rotary_emb.tables(model.dtype)
    decoder.set_paging(cos, sin_signed, kv_store.block_size, cfg.sliding_window or 0)
    if type(model.embed_tokens) is nn.Embedding:  # a plain gather (not a tensor-parallel vocabulary shard)
        decoder.set_embedding(model.embed_tokens.weight)
    return decoder
