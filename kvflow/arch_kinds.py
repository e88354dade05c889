"""Per-layer attention kinds and the switches of the families that mix them (config.json -> plain values).

    gpt-oss     sliding-window (`sliding_window`, 128 released) and full-attention layers alternate
                (`layer_types`); a learned sink logit per query head; MoE on every layer with router
                and expert biases and a clamped SwiGLU (`swiglu_limit`, alpha 1.702); YaRN rope.
    Gemma 3     5 local (sliding) layers to 1 global (`layer_types`, or the older
                `sliding_window_pattern`); the local layers' rope (rope_parameters.sliding_attention,
                or `rope_local_base_freq`); softmax scale query_pre_attn_scalar^-0.5; q/k norms;
                RMSNorms of weight (1 + w); four norms per layer (before and after attention and MLP);
                embeddings scaled by sqrt(hidden); gelu (tanh) MLP.
    Qwen3-Next  3 Gated DeltaNet (linear attention) layers to 1 gated full-attention layer
                (`layer_types`, or `full_attention_interval`); partial rotary (a quarter of head_dim);
                RMSNorms of weight (1 + w); MoE with a sigmoid-gated shared expert.
Layer kinds are those of the KV cache (kvflow/kv_cache/kv_cache_config.py LAYER_KINDS). An unsupported
variant gets a ModelLoadError naming the config key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvflow.errors import ModelLoadError

FULL, SLIDING, LINEAR = "full_attention", "sliding_attention", "linear_attention"
# Hub configs of Gemma 3 predate layer_types: every sliding_window_pattern-th layer is global.
GEMMA3_DEFAULT_PATTERN = 6
QWEN3_NEXT_DEFAULT_INTERVAL = 4  # transformers' default full_attention_interval
GPT_OSS_SWIGLU_ALPHA = 1.702  # the sigmoid gain of gpt-oss's SwiGLU (transformers' default)


@dataclass(frozen=True)
class LinearAttentionConfig:
    """Gated DeltaNet (Qwen3-Next's linear attention): per token q, k [Hk, dk], v [Hv, dv] through a
    short causal depthwise convolution over their concatenation (conv_dim channels)."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel_size: int

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim


def _checked_types(
    types: list[Any], num_layers: int, allowed: tuple[str, ...], source: str
) -> tuple[str, ...]:
    if len(types) != num_layers:
        raise ModelLoadError(f"{source}: layer_types has {len(types)} entries for {num_layers} layers")
    unknown = sorted({str(t) for t in types} - set(allowed))
    if unknown:
        raise ModelLoadError(
            f"{source}: layer_types {unknown} are not supported (this architecture: {allowed})"
        )
    return tuple(str(t) for t in types)


def layer_types(cfg: dict[str, Any], arch: str, num_layers: int, source: str) -> tuple[str, ...]:
    """The cache kind of every layer of a mixing family (gpt-oss, Gemma 3, Qwen3-Next)."""
    explicit = cfg.get("layer_types")
    if arch == "Qwen3NextForCausalLM":
        if explicit is not None:
            return _checked_types(explicit, num_layers, (FULL, LINEAR), source)
        interval = int(cfg.get("full_attention_interval") or QWEN3_NEXT_DEFAULT_INTERVAL)
        return tuple(LINEAR if (i + 1) % interval else FULL for i in range(num_layers))
    if explicit is not None:
        return _checked_types(explicit, num_layers, (FULL, SLIDING), source)
    if arch == "Gemma3ForCausalLM":
        pattern = int(cfg.get("sliding_window_pattern") or GEMMA3_DEFAULT_PATTERN)
        return tuple(SLIDING if (i + 1) % pattern else FULL for i in range(num_layers))
    return tuple(SLIDING if (i + 1) % 2 else FULL for i in range(num_layers))  # gpt-oss's default


def linear_attention_config(cfg: dict[str, Any], source: str) -> LinearAttentionConfig:
    def count(key: str) -> int:
        value = cfg.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ModelLoadError(f"{source}: field {key!r} must be a positive integer, got {value!r}")
        return value

    linear = LinearAttentionConfig(
        num_key_heads=count("linear_num_key_heads"),
        num_value_heads=count("linear_num_value_heads"),
        key_head_dim=count("linear_key_head_dim"),
        value_head_dim=count("linear_value_head_dim"),
        conv_kernel_size=count("linear_conv_kernel_dim"),
    )
    if linear.num_value_heads % linear.num_key_heads:
        raise ModelLoadError(
            f"{source}: linear_num_value_heads {linear.num_value_heads} is not a multiple of "
            f"linear_num_key_heads {linear.num_key_heads}"
        )
    return linear


def refuse_gemma3_variants(cfg: dict[str, Any], source: str) -> None:
    """Gemma 3's switches kvflow does not run (none of the released text models sets them)."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(key) is not None:
            raise ModelLoadError(f"{source}: {key}={cfg[key]!r} is not supported (Gemma 3 ships it null)")
    if cfg.get("use_bidirectional_attention"):
        raise ModelLoadError(f"{source}: use_bidirectional_attention=true is not supported (causal LM only)")
