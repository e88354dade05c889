"""The language model inside a multimodal config.json: what the calculator sizes.

Gemma 3's released 4B, 12B and 27B checkpoints are Gemma3ForConditionalGeneration: the text model's
fields sit in `text_config`, and only those that differ from transformers' Gemma3TextConfig defaults
are written (27B: no vocab_size, rope_theta, rms_norm_eps, layer_types or sliding_window_pattern).
`text_model_config` returns that nested config as the Gemma3ForCausalLM config.json it stands for,
with the defaults filled in as transformers fills them. The vision tower (SigLIP, about 0.4B
parameters) and its projector are not counted: an image reaches the text model as
mm_tokens_per_image tokens of the prompt, which is all the KV cache and the roofline see.
"""

from __future__ import annotations

from typing import Any

# transformers' Gemma3TextConfig defaults (4.50, the release's version) for the fields kvflow reads.
GEMMA3_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "rope_theta": 1_000_000.0,  # the global layers' base
    "rope_local_base_freq": 10_000.0,  # the sliding (local) layers' base
    "attention_bias": False,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "sliding_window_pattern": 6,  # every 6th layer global (used when layer_types is absent)
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
}
# Multimodal architecture -> (its text model's architecture, that model's config defaults).
TEXT_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "Gemma3ForConditionalGeneration": ("Gemma3ForCausalLM", GEMMA3_TEXT_DEFAULTS),
}
# Top-level fields that describe the whole checkpoint, the text model included.
INHERITED = ("torch_dtype", "dtype")


def text_model_config(config: dict[str, Any]) -> dict[str, Any]:
    """`config` itself for a text model; the language model's config.json for a multimodal one."""
    archs = config.get("architectures") or []
    wrapper = next((a for a in archs if a in TEXT_MODELS), None) if isinstance(archs, list) else None
    if wrapper is None:
        return config
    text_arch, defaults = TEXT_MODELS[wrapper]
    text = dict(config.get("text_config") or {})
    inherited = {k: config[k] for k in INHERITED if k in config and k not in text}
    return {**defaults, **inherited, **text, "architectures": [text_arch]}
