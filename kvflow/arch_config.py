"""Parse a Hugging Face `config.json` into the switches of kvflow's llama-family model.

One model class covers Llama, Mistral, Qwen2 and Qwen3; they differ only in these switches:
    Llama    attention_bias (q/k/v/o), mlp_bias, rope_scaling (llama3, linear, yarn)
    Mistral  sliding_window on every layer
    Qwen2    q/k/v bias (o without), optional sliding window (use_sliding_window)
    Qwen3    explicit head_dim, RMSNorm on q and k per head, attention_bias
Mixture-of-experts variants of these (Mixtral, Qwen2MoE, Qwen3MoE) and DeepSeek V2/V3 with
multi-head latent attention add a MoEConfig / MLAConfig (parsed below, with an error naming the
config key for each variant kvflow does not run).
Both spellings of RoPE are accepted: hub checkpoints' top-level `rope_theta` + `rope_scaling`
and transformers 5's `rope_parameters`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvflow.arch_kinds import (
    FULL,
    GPT_OSS_SWIGLU_ALPHA,
    SLIDING,
    LinearAttentionConfig,
    layer_types,
    linear_attention_config,
    refuse_gemma3_variants,
)
from kvflow.compressed_config import (
    DEFAULT_COMPRESS_ROPE_THETA,
    V4_ARCHITECTURE,
    CompressedAttentionConfig,
    cache_layers,
    compressed_attention_config,
)
from kvflow.errors import ModelLoadError
from kvflow.gguf.gguf_config import gguf_hf_config
from kvflow.gguf.gguf_file import is_gguf_path, open_gguf

DENSE_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
# Llama-family attention with a mixture-of-experts MLP (kvflow/models/moe.py).
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
# Multi-head latent attention + DeepSeekMoE (kvflow/models/deepseek_v2.py).
# DeepSeek-V3.2 adds a lightning indexer: each query attends its top index_topk positions only.
MLA_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM")
# Families that mix layer kinds (kvflow/arch_kinds.py; models in kvflow/models/gpt_oss.py, gemma3.py,
# qwen3_next.py).
HYBRID_ARCHITECTURES = ("GptOssForCausalLM", "Gemma3ForCausalLM", "Qwen3NextForCausalLM")
# DeepSeek-V4: compressed sparse / heavily compressed attention (kvflow/compressed_config.py).
SUPPORTED_ARCHITECTURES = (
    DENSE_ARCHITECTURES + MOE_ARCHITECTURES + MLA_ARCHITECTURES + HYBRID_ARCHITECTURES + (V4_ARCHITECTURE,)
)
DEFAULT_ROPE_THETA = 10000.0  # the RoPE paper's base, HF's default when a config omits it


@dataclass(frozen=True)
class RopeConfig:
    """RoPE as the checkpoint asks for it; kvflow/layers/rotary.py turns it into frequencies."""

    head_dim: int
    rope_theta: float
    max_position_embeddings: int
    rope_type: str = "default"
    params: dict[str, Any] = field(default_factory=dict)  # the rest of rope_parameters / rope_scaling


# The group-limited routers: how a group of experts is scored before the top groups are kept.
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
SCORING_FUNCS = ("softmax", "sigmoid", "sqrtsoftplus")
# How a clamped SwiGLU combines its clamped halves: gpt-oss's (up + 1) * gate * sigmoid(alpha * gate),
# or DeepSeek-V4's plain silu(gate) * up.
SWIGLU_STYLES = ("gpt_oss", "silu")


@dataclass(frozen=True)
class MoEConfig:
    """The router and experts of a mixture-of-experts MLP (kvflow/layers/moe_routing.py, fused_moe.py).

    Routing per token: scores = softmax or sigmoid of the router logits (float32); with groups, only
    experts of the `topk_group` best of `num_groups` groups compete (a group scores its best expert:
    group_limited_greedy, or its two best after adding the correction bias: noaux_tc); the top_k
    experts are chosen (by score + bias under noaux_tc), their scores optionally renormalised to sum
    to 1 and multiplied by routed_scaling_factor.
    """

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    scoring_func: str = "softmax"  # one of SCORING_FUNCS
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    topk_method: str = "greedy"  # one of TOPK_METHODS
    num_groups: int = 1
    topk_group: int = 1
    # Shared experts run on every token (Qwen2MoE: one, gated by sigmoid(shared_expert_gate(x));
    # DeepSeek: n_shared_experts fused into one MLP of n x moe_intermediate_size, ungated). 0 = none.
    shared_intermediate_size: int = 0
    shared_expert_gate: bool = False
    sparse_layers: tuple[bool, ...] = ()  # per layer: MoE (True) or the dense MLP (False)
    router_bias: bool = False  # gpt-oss: the router's logits carry a bias
    expert_bias: bool = False  # gpt-oss: every expert projection carries a bias
    # gpt-oss's clamped SwiGLU: gate <= limit, |up| <= limit, out = (up + 1) * gate * sigmoid(alpha * gate);
    # None: the plain silu(gate) * up.
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.0
    swiglu_style: str = "gpt_oss"  # one of SWIGLU_STYLES, when swiglu_limit is set
    # DeepSeek-V4: a choice-steering bias without grouped routing; the first layers route by a
    # token-id table (hash_layers) and have no bias.
    score_correction_bias: bool = False
    hash_layers: tuple[bool, ...] = ()

    @property
    def has_score_correction_bias(self) -> bool:
        return self.topk_method == "noaux_tc" or self.score_correction_bias


@dataclass(frozen=True)
class IndexerConfig:
    """DeepSeek-V3.2's lightning indexer (kvflow/attention/indexer.py): per token a key of head_dim
    values cached beside the latent; a query scores every cached key with num_heads heads and
    attends its `topk` best positions only."""

    num_heads: int
    head_dim: int
    topk: int


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention: K and V are up-projected from one latent per token, of which the
    KV pool stores kv_lora_rank (normed, position-free) + qk_rope_head_dim (rotated key) values."""

    kv_lora_rank: int
    q_lora_rank: int | None  # None: q comes from hidden by one projection (DeepSeek-V2-Lite)
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # rotary pairs are (x0, x1), (x2, x3), ... instead of the two halves
    softmax_scale: float  # qk_head_dim^-0.5, times mscale^2 under YaRN with mscale_all_dim
    indexer: IndexerConfig | None = None  # DeepSeek-V3.2's sparse attention (DSA), else None

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class ArchConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_window: int | None  # same window on every layer, or None
    rope: RopeConfig
    torch_dtype: str | None
    moe: MoEConfig | None = None  # mixture-of-experts MLP on the layers `moe.sparse_layers` marks
    mla: MLAConfig | None = None  # multi-head latent attention (DeepSeek V2/V3) instead of q/k/v heads
    # Families mixing layer kinds (kvflow/arch_kinds.py). layer_types: each layer's cache kind
    # (full_attention, sliding_attention with `sliding_window`, linear_attention); () = uniform.
    layer_types: tuple[str, ...] = ()
    attention_sinks: bool = False  # gpt-oss: one learned sink logit per query head
    attention_scale: float | None = None  # the softmax scale; None: head_dim ** -0.5
    local_rope: RopeConfig | None = None  # the sliding layers' rope where it differs (Gemma 3)
    linear: LinearAttentionConfig | None = None  # Gated DeltaNet layers' shapes (Qwen3-Next)
    attn_output_gate: bool = False  # Qwen3-Next: q_proj also gives a per-head gate on the output
    # RMSNorm weights stored as w and applied as (offset + w) (Gemma, Qwen3-Next: 1.0); the loader
    # adds the offset once.
    norm_weight_offset: float = 0.0
    sandwich_norm: bool = False  # Gemma 3: norms after attention and MLP as well as before
    embed_scale: float | None = None  # Gemma: embeddings times sqrt(hidden_size), in the model dtype
    mlp_act: str = "silu"  # or gelu_pytorch_tanh (Gemma)
    # DeepSeek-V4's compressed attention and hyper-connections; its compressed layers' rope.
    compressed: CompressedAttentionConfig | None = None
    compress_rope: RopeConfig | None = None

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def cache_layer_kinds(self) -> tuple[str, ...]:
        """Every layer's KV cache kind (kvflow/kv_cache/kv_cache_config.py LAYER_KINDS)."""
        if self.compressed is not None:  # one entry per cache layer (kvflow/compressed_config.py)
            return tuple(kind for _, kind in cache_layers(self.compressed))
        if self.layer_types:
            return self.layer_types
        kind = "mla" if self.mla is not None else SLIDING if self.sliding_window is not None else FULL
        return (kind,) * self.num_hidden_layers

    @property
    def kv_index_dim(self) -> int:
        """Values of DeepSeek-V3.2's indexer key cached per token and layer beside the latent (else 0)."""
        return 0 if self.mla is None or self.mla.indexer is None else self.mla.indexer.head_dim

    @property
    def kv_latent(self) -> tuple[int, int] | None:
        """(kv_lora_rank, qk_rope_head_dim) when the KV pool holds one latent per token and layer
        instead of K and V (latent attention), else None."""
        return None if self.mla is None else (self.mla.kv_lora_rank, self.mla.qk_rope_head_dim)


def load_hf_config(model_dir: Path) -> dict[str, Any]:
    """config.json of a checkpoint directory, or the same fields read from a GGUF file's metadata."""
    if is_gguf_path(model_dir):
        return gguf_hf_config(open_gguf(model_dir))
    path = model_dir / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{path}: missing config.json (is {model_dir} a Hugging Face checkpoint?)")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path}: invalid JSON: {e}") from e
    if not isinstance(config, dict):
        raise ModelLoadError(f"{path}: must hold a JSON object, got {type(config).__name__}")
    return config


def _rope_config(
    cfg: dict[str, Any],
    head_dim: int,
    max_pos: int,
    source: str,
    rope: Any = None,
    theta_key: str = "rope_theta",
    partial_rotary: bool = False,
) -> RopeConfig:
    """`rope`: the rope parameters when they are not the config's top level ones (Gemma 3's per
    layer type); `theta_key`: the top-level key of the base they fall back to; `partial_rotary`:
    the architecture rotates only partial_rotary_factor x head_dim dims (Qwen3-Next)."""
    if rope is None:
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ModelLoadError(f"{source}: rope_scaling / rope_parameters must be an object, got {rope!r}")
    params = dict(rope)
    theta = params.pop("rope_theta", None) or cfg.get(theta_key) or DEFAULT_ROPE_THETA
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    factor = params.pop("partial_rotary_factor", None) or cfg.get("partial_rotary_factor") or 1.0
    if factor != 1.0 and not partial_rotary:
        raise ModelLoadError(f"{source}: partial_rotary_factor != 1 is not supported for this architecture")
    rotary_dim = int(head_dim * _as_float(factor, "partial_rotary_factor", source))
    if rotary_dim < 2 or rotary_dim % 2 or rotary_dim > head_dim:
        raise ModelLoadError(f"{source}: partial_rotary_factor {factor} gives rotary dim {rotary_dim}")
    return RopeConfig(rotary_dim, _as_float(theta, "rope_theta", source), max_pos, str(rope_type), params)


def _sliding_window(cfg: dict[str, Any], arch: str, num_layers: int, source: str) -> int | None:
    window = cfg.get("sliding_window")
    if arch.startswith("Qwen") and not cfg.get("use_sliding_window", False):
        window = None
    layer_types = cfg.get("layer_types")
    if window is not None and layer_types is not None and len(set(layer_types)) > 1:
        raise ModelLoadError(
            f"{source}: a mix of sliding-window and full-attention layers is not supported yet "
            f"(layer_types={sorted(set(layer_types))})"
        )
    if window is not None and arch.startswith("Qwen"):
        max_window_layers = cfg.get("max_window_layers", num_layers)
        if 0 < max_window_layers < num_layers:
            raise ModelLoadError(
                f"{source}: sliding window on only some layers (max_window_layers) is not supported yet"
            )
    return _as_int(window, "sliding_window", source) if window is not None else None


_REQUIRED = object()


def _int(cfg: dict[str, Any], key: str, source: str, default: Any = _REQUIRED) -> int:
    """cfg[key] as an int, or a ModelLoadError naming the file and the field."""
    if key not in cfg and default is _REQUIRED:
        raise ModelLoadError(f"{source}: missing required field {key!r}")
    return _as_int(cfg.get(key, default), key, source)


def _as_int(value: Any, key: str, source: str) -> int:
    # bool is an int to Python, never a count to a config; 4096.0 is an integer, 4096.5 is not.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
        raise ModelLoadError(f"{source}: field {key!r} must be an integer, got {value!r}")
    return int(value)


def _as_float(value: Any, key: str, source: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ModelLoadError(f"{source}: field {key!r} must be a number, got {value!r}")
    return float(value)


def _architecture(cfg: dict[str, Any], source: str) -> str:
    """The supported architecture `architectures` names, its activation checked."""
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None) if isinstance(archs, list) else None
    if arch is None:
        raise ModelLoadError(
            f"{source}: unsupported architecture {archs!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    act = cfg.get("hidden_activation") if arch == "Gemma3ForCausalLM" else cfg.get("hidden_act", "silu")
    if act != ("gelu_pytorch_tanh" if arch == "Gemma3ForCausalLM" else "silu"):
        raise ModelLoadError(f"{source}: hidden activation {act!r} is not supported for {arch}")
    return arch


def _head_counts(cfg: dict[str, Any], source: str) -> tuple[int, int, int]:
    """(hidden_size, attention heads, KV heads), each positive, the heads divisible by the KV heads."""
    hidden = _int(cfg, "hidden_size", source)
    num_heads = _int(cfg, "num_attention_heads", source)
    num_kv_heads = (
        _int(cfg, "num_key_value_heads", source, None) if cfg.get("num_key_value_heads") else num_heads
    )
    for key, value in (
        ("hidden_size", hidden),
        ("num_attention_heads", num_heads),
        ("num_key_value_heads", num_kv_heads),
    ):
        if value < 1:
            raise ModelLoadError(f"{source}: field {key!r} must be positive, got {value}")
    if num_heads % num_kv_heads:
        raise ModelLoadError(
            f"{source}: {num_heads} attention heads not divisible by {num_kv_heads} KV heads"
        )
    return hidden, num_heads, num_kv_heads


def parse_arch_config(cfg: dict[str, Any], source: str = "config.json") -> ArchConfig:
    """`source` names the file in errors (the full path when the caller has it)."""
    arch = _architecture(cfg, source)
    hidden, num_heads, num_kv_heads = _head_counts(cfg, source)
    head_dim = _int(cfg, "head_dim", source) if cfg.get("head_dim") else hidden // num_heads
    num_layers = _int(cfg, "num_hidden_layers", source)
    max_pos = _int(cfg, "max_position_embeddings", source, 2048)
    is_qwen2 = arch in ("Qwen2ForCausalLM",)
    attention_bias = bool(cfg.get("attention_bias", False))
    mla = _mla_config(cfg, arch, source)
    if arch == "Qwen2MoeForCausalLM":  # q/k/v bias by its own switch, o without
        is_qwen2 = bool(cfg.get("qkv_bias", True))
    if mla is not None and attention_bias:
        raise ModelLoadError(f"{source}: attention_bias=true is not supported with latent attention")
    hybrid = (
        _hybrid_fields(cfg, arch, num_layers, head_dim, max_pos, source)
        if arch in HYBRID_ARCHITECTURES
        else {}
    )
    if arch == V4_ARCHITECTURE:
        hybrid = _v4_fields(cfg, num_layers, head_dim, max_pos, source)
    rope = hybrid.pop("rope", None) or _rope_config(
        cfg, head_dim if mla is None else mla.qk_rope_head_dim, max_pos, source
    )
    return ArchConfig(
        architecture=arch,
        vocab_size=_int(cfg, "vocab_size", source),
        hidden_size=hidden,
        intermediate_size=_int(
            cfg, "moe_intermediate_size" if arch == V4_ARCHITECTURE else "intermediate_size", source
        ),
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=_as_float(cfg.get("rms_norm_eps", 1e-6), "rms_norm_eps", source),
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=True if is_qwen2 else attention_bias,
        o_bias=False if is_qwen2 else attention_bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm=arch
        in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM", "Qwen3NextForCausalLM"),
        sliding_window=hybrid.pop("sliding_window")
        if "sliding_window" in hybrid
        else _sliding_window(cfg, arch, num_layers, source),
        rope=rope,
        torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
        moe=_moe_config(cfg, arch, num_layers, source),
        mla=mla,
        **hybrid,
    )


def _v4_fields(
    cfg: dict[str, Any], num_layers: int, head_dim: int, max_pos: int, source: str
) -> dict[str, Any]:
    """DeepSeek-V4's ArchConfig fields: its compressed attention and the two ropes (sliding-only
    layers': rope_theta, plain; compressed layers': compress_rope_theta with the checkpoint's YaRN,
    attention factor 1: the reference rotates without YaRN's cos/sin scale)."""
    compressed = compressed_attention_config(cfg, num_layers, source)
    partial = compressed.rope_dim / head_dim
    rope = cfg.get("rope_parameters") or {}
    if isinstance(rope.get("main"), dict) and isinstance(rope.get("compress"), dict):
        main, compress = dict(rope["main"]), dict(rope["compress"])
    else:  # the Hub spelling: rope_theta, rope_scaling (the compressed layers'), compress_rope_theta
        scaling = cfg.get("rope_scaling") or {k: v for k, v in rope.items() if k not in ("main", "compress")}
        main = {"rope_type": "default", "rope_theta": cfg.get("rope_theta", DEFAULT_ROPE_THETA)}
        compress = {**scaling, "rope_theta": cfg.get("compress_rope_theta", DEFAULT_COMPRESS_ROPE_THETA)}
    for params in (main, compress):
        params["partial_rotary_factor"] = partial
        if (params.get("rope_type") or params.get("type")) == "yarn":
            params["attention_factor"] = 1.0
    return {
        "rope": _rope_config(cfg, head_dim, max_pos, source, rope=main, partial_rotary=True),
        "compress_rope": _rope_config(cfg, head_dim, max_pos, source, rope=compress, partial_rotary=True),
        "compressed": compressed,
        "sliding_window": compressed.sliding_window,
        "attention_sinks": True,
    }


def _hybrid_fields(
    cfg: dict[str, Any], arch: str, num_layers: int, head_dim: int, max_pos: int, source: str
) -> dict[str, Any]:
    """The ArchConfig fields of the families mixing layer kinds (kvflow/arch_kinds.py)."""
    types = layer_types(cfg, arch, num_layers, source)
    window = None
    if SLIDING in types:
        window = _int(cfg, "sliding_window", source)
        if window < 1:
            raise ModelLoadError(f"{source}: field 'sliding_window' must be positive, got {window}")
    fields: dict[str, Any] = {"layer_types": types, "sliding_window": window}
    if arch == "GptOssForCausalLM":
        fields["attention_sinks"] = True
    elif arch == "Gemma3ForCausalLM":
        refuse_gemma3_variants(cfg, source)
        scalar = _as_float(cfg.get("query_pre_attn_scalar", head_dim), "query_pre_attn_scalar", source)
        rope = cfg.get("rope_parameters")
        if isinstance(rope, dict) and SLIDING in rope:  # transformers 5: one entry per layer type
            global_rope, local_rope = rope.get(FULL), rope.get(SLIDING)
        else:  # the Hub's: rope_theta + rope_scaling for the global layers, rope_local_base_freq
            global_rope, local_rope = cfg.get("rope_scaling"), {"rope_theta": cfg.get("rope_local_base_freq")}
        hidden = _int(cfg, "hidden_size", source)
        fields.update(
            attention_scale=scalar**-0.5,
            rope=_rope_config(cfg, head_dim, max_pos, source, rope=global_rope or {}),
            local_rope=_rope_config(cfg, head_dim, max_pos, source, rope=local_rope or {}, theta_key="_"),
            norm_weight_offset=1.0,
            sandwich_norm=True,
            embed_scale=hidden**0.5,
            mlp_act="gelu_pytorch_tanh",
        )
    else:  # Qwen3-Next
        fields.update(
            rope=_rope_config(cfg, head_dim, max_pos, source, partial_rotary=True),
            linear=linear_attention_config(cfg, source),
            attn_output_gate=True,
            norm_weight_offset=1.0,
        )
    return fields


def _moe_config(cfg: dict[str, Any], arch: str, num_layers: int, source: str) -> MoEConfig | None:
    """The MoE switches of `arch`'s config.json; an unsupported variant names its config key."""
    reader = _MOE_READERS.get(arch)
    if reader is None:
        if arch not in MLA_ARCHITECTURES:
            return None
        reader = _deepseek_moe  # DeepSeek V2 / V3 / V3.2
    if cfg.get("mlp_bias"):
        raise ModelLoadError(f"{source}: mlp_bias=true is not supported for mixture-of-experts models")
    moe, sparse = reader(cfg, arch, num_layers, source)
    return _checked_moe(moe, sparse, source)


MoEReading = tuple[MoEConfig, tuple[bool, ...]]  # the config and which layers route


def _mixtral_moe(cfg: dict[str, Any], arch: str, num_layers: int, source: str) -> MoEReading:
    num_experts = _int(cfg, "num_local_experts", source)
    top_k = _int(cfg, "num_experts_per_tok", source)
    moe = MoEConfig(num_experts, top_k, _int(cfg, "intermediate_size", source), norm_topk_prob=True)
    return moe, (True,) * num_layers


def _gpt_oss_moe(cfg: dict[str, Any], arch: str, num_layers: int, source: str) -> MoEReading:
    # Routing: the top-k router logits (with bias), softmaxed among themselves: the same weights as
    # a softmax over all experts renormalised over the top k (norm_topk_prob).
    moe = MoEConfig(
        _int(cfg, "num_local_experts", source),
        _int(cfg, "num_experts_per_tok", source),
        _int(cfg, "intermediate_size", source),
        norm_topk_prob=True,
        router_bias=True,
        expert_bias=True,
        swiglu_limit=_as_float(cfg.get("swiglu_limit", 7.0), "swiglu_limit", source),
        swiglu_alpha=_as_float(cfg.get("swiglu_alpha", GPT_OSS_SWIGLU_ALPHA), "swiglu_alpha", source),
    )
    return moe, (True,) * num_layers


def _qwen_moe(cfg: dict[str, Any], arch: str, num_layers: int, source: str) -> MoEReading:
    # Hub configs say num_experts; transformers 5 writes Qwen3-MoE's as num_local_experts.
    num_experts = _int(cfg, "num_experts" if "num_experts" in cfg else "num_local_experts", source)
    step = _int(cfg, "decoder_sparse_step", source, 1)
    if step < 1:
        raise ModelLoadError(f"{source}: field 'decoder_sparse_step' must be positive, got {step}")
    dense = set(cfg.get("mlp_only_layers") or [])
    sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
    has_shared = arch in ("Qwen2MoeForCausalLM", "Qwen3NextForCausalLM")
    shared = _int(cfg, "shared_expert_intermediate_size", source, 0) if has_shared else 0
    moe = MoEConfig(
        num_experts,
        _int(cfg, "num_experts_per_tok", source),
        _int(cfg, "moe_intermediate_size", source),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        shared_intermediate_size=shared,
        shared_expert_gate=shared > 0,
    )
    return moe, sparse


def _v4_moe(cfg: dict[str, Any], arch: str, num_layers: int, source: str) -> MoEReading:
    # Every layer routed: the top k of score + correction bias, weights renormalised (always,
    # as the reference does) and scaled; the first hash layers choose by a token-id table.
    scoring = str(cfg.get("scoring_func") or "sqrtsoftplus")
    if scoring not in SCORING_FUNCS:
        raise ModelLoadError(f"{source}: scoring_func {scoring!r} is not supported ({SCORING_FUNCS})")
    expert_size = _int(cfg, "moe_intermediate_size", source)
    limit = cfg.get("swiglu_limit")
    moe = MoEConfig(
        _int(cfg, "n_routed_experts", source),
        _int(cfg, "num_experts_per_tok", source),
        expert_size,
        scoring_func=scoring,
        norm_topk_prob=True,
        routed_scaling_factor=_as_float(
            cfg.get("routed_scaling_factor", 1.0), "routed_scaling_factor", source
        ),
        shared_intermediate_size=expert_size * _int(cfg, "n_shared_experts", source, 0),
        swiglu_limit=None if not limit else _as_float(limit, "swiglu_limit", source),
        swiglu_style="silu",
        score_correction_bias=True,
        hash_layers=compressed_attention_config(cfg, num_layers, source).hash_layers,
    )
    return moe, (True,) * num_layers


def _deepseek_moe(cfg: dict[str, Any], arch: str, num_layers: int, source: str) -> MoEReading:
    # DeepSeek V2 / V3. V3 always routes by sigmoid scores with a correction bias (noaux_tc).
    is_v3 = arch in ("DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM")
    topk_method = str(cfg.get("topk_method") or ("noaux_tc" if is_v3 else "greedy"))
    scoring = str(cfg.get("scoring_func") or ("sigmoid" if is_v3 else "softmax"))
    if topk_method not in TOPK_METHODS or (is_v3 and topk_method != "noaux_tc"):
        raise ModelLoadError(
            f"{source}: topk_method {topk_method!r} is not supported ({arch}: {TOPK_METHODS})"
        )
    if scoring != ("sigmoid" if topk_method == "noaux_tc" else "softmax"):
        raise ModelLoadError(f"{source}: scoring_func {scoring!r} is not supported with {topk_method}")
    expert_size = _int(cfg, "moe_intermediate_size", source)
    grouped = topk_method != "greedy"
    moe = MoEConfig(
        _int(cfg, "n_routed_experts", source),
        _int(cfg, "num_experts_per_tok", source),
        expert_size,
        scoring_func=scoring,
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        routed_scaling_factor=_as_float(
            cfg.get("routed_scaling_factor", 1.0), "routed_scaling_factor", source
        ),
        topk_method=topk_method,
        num_groups=_int(cfg, "n_group", source, 1) if grouped and cfg.get("n_group") else 1,
        topk_group=_int(cfg, "topk_group", source, 1) if grouped and cfg.get("topk_group") else 1,
        shared_intermediate_size=expert_size * _int(cfg, "n_shared_experts", source, 0),
    )
    return moe, _deepseek_sparse_layers(cfg, num_layers, source)


def _deepseek_sparse_layers(cfg: dict[str, Any], num_layers: int, source: str) -> tuple[bool, ...]:
    first_dense = _int(cfg, "first_k_dense_replace", source, 0)
    freq = _int(cfg, "moe_layer_freq", source, 1)
    if freq < 1:
        raise ModelLoadError(f"{source}: field 'moe_layer_freq' must be positive, got {freq}")
    mlp_types = cfg.get("mlp_layer_types")  # V3.2 spells the same schedule out per layer
    if mlp_types is None:
        return tuple(i >= first_dense and i % freq == 0 for i in range(num_layers))
    if len(mlp_types) != num_layers or set(mlp_types) - {"dense", "sparse"}:
        raise ModelLoadError(
            f"{source}: mlp_layer_types must be dense/sparse for each of {num_layers} layers"
        )
    return tuple(t == "sparse" for t in mlp_types)


_MOE_READERS = {
    "MixtralForCausalLM": _mixtral_moe,
    "GptOssForCausalLM": _gpt_oss_moe,
    "Qwen2MoeForCausalLM": _qwen_moe,
    "Qwen3MoeForCausalLM": _qwen_moe,
    "Qwen3NextForCausalLM": _qwen_moe,
    V4_ARCHITECTURE: _v4_moe,
}


def _checked_moe(moe: MoEConfig, sparse: tuple[bool, ...], source: str) -> MoEConfig:
    if moe.num_experts < 1 or not 1 <= moe.top_k <= moe.num_experts:
        raise ModelLoadError(
            f"{source}: num_experts_per_tok={moe.top_k} must be between 1 and the {moe.num_experts} experts"
        )
    if moe.num_experts % moe.num_groups:
        raise ModelLoadError(f"{source}: n_group={moe.num_groups} does not divide {moe.num_experts} experts")
    if not 1 <= moe.topk_group <= moe.num_groups:
        raise ModelLoadError(f"{source}: topk_group={moe.topk_group} must be between 1 and n_group")
    per_group = moe.num_experts // moe.num_groups
    if moe.top_k > moe.topk_group * per_group:
        raise ModelLoadError(
            f"{source}: num_experts_per_tok={moe.top_k} exceeds the experts of topk_group={moe.topk_group} "
            f"groups ({per_group} each)"
        )
    if moe.topk_method == "noaux_tc" and per_group < 2:
        raise ModelLoadError(f"{source}: n_group={moe.num_groups} leaves fewer than 2 experts per group")
    return MoEConfig(**{**moe.__dict__, "sparse_layers": sparse})


def _mla_config(cfg: dict[str, Any], arch: str, source: str) -> MLAConfig | None:
    if arch not in MLA_ARCHITECTURES:
        return None
    nope, rope_dim = _int(cfg, "qk_nope_head_dim", source), _int(cfg, "qk_rope_head_dim", source)
    if rope_dim % 2:
        raise ModelLoadError(f"{source}: qk_rope_head_dim must be even, got {rope_dim}")
    q_lora = _int(cfg, "q_lora_rank", source) if cfg.get("q_lora_rank") else None
    scale = (nope + rope_dim) ** -0.5
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = (
        rope.get("rope_type") or rope.get("type") or "default" if isinstance(rope, dict) else "default"
    )
    if rope_type != "default" and rope.get("mscale_all_dim"):
        # DeepSeek's YaRN: the softmax scale grows with the context extension (transformers'
        # yarn_apply_mscale), on top of the cos/sin attention_factor kvflow/layers/rotary.py applies.
        factor = _as_float(rope.get("factor"), "factor", source)
        mscale = _yarn_mscale(factor, _as_float(rope["mscale_all_dim"], "mscale_all_dim", source))
        scale *= mscale * mscale
    return MLAConfig(
        kv_lora_rank=_int(cfg, "kv_lora_rank", source),
        q_lora_rank=q_lora,
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope_dim,
        v_head_dim=_int(cfg, "v_head_dim", source),
        # V2 rotates by complex multiplication of consecutive pairs; V3 by its rope_interleave switch.
        rope_interleave=arch == "DeepseekV2ForCausalLM" or bool(cfg.get("rope_interleave", True)),
        softmax_scale=scale,
        indexer=_indexer_config(cfg, rope_dim, source) if arch == "DeepseekV32ForCausalLM" else None,
    )


def _indexer_config(cfg: dict[str, Any], rope_dim: int, source: str) -> IndexerConfig:
    indexer = IndexerConfig(
        _int(cfg, "index_n_heads", source),
        _int(cfg, "index_head_dim", source),
        _int(cfg, "index_topk", source),
    )
    if min(indexer.num_heads, indexer.topk) < 1 or indexer.head_dim < rope_dim:
        raise ModelLoadError(
            f"{source}: index_n_heads and index_topk must be positive and index_head_dim >= "
            f"qk_rope_head_dim ({rope_dim}), got {indexer}"
        )
    if not cfg.get("q_lora_rank"):
        raise ModelLoadError(f"{source}: the indexer reads q through q_lora_rank, which must be set")
    return indexer


def _yarn_mscale(scale: float, mscale: float) -> float:
    """YaRN's attention temperature (kvflow/layers/rotary.py has the same for cos/sin)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def load_arch_config(model_dir: Path) -> ArchConfig:
    """config.json of a checkpoint directory (or a GGUF file's metadata) -> ArchConfig; errors name
    the file's full path."""
    source = model_dir if is_gguf_path(model_dir) else model_dir / "config.json"
    return parse_arch_config(load_hf_config(model_dir), source=str(source))
