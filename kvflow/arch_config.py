"""Parse a Hugging Face `config.json` into the switches of kvflow's llama-family model.

One model class covers Llama, Mistral, Qwen2 and Qwen3; they differ only in these switches:
    Llama    attention_bias (q/k/v/o), mlp_bias, rope_scaling (llama3, linear, yarn)
    Mistral  sliding_window on every layer
    Qwen2    q/k/v bias (o without), optional sliding window (use_sliding_window)
    Qwen3    explicit head_dim, RMSNorm on q and k per head, attention_bias
Both spellings of RoPE are accepted: hub checkpoints' top-level `rope_theta` + `rope_scaling`
and transformers 5's `rope_parameters`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvflow.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
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

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads


def load_hf_config(model_dir: Path) -> dict[str, Any]:
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


def _rope_config(cfg: dict[str, Any], head_dim: int, max_pos: int, source: str) -> RopeConfig:
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ModelLoadError(f"{source}: rope_scaling / rope_parameters must be an object, got {rope!r}")
    params = dict(rope)
    theta = params.pop("rope_theta", None) or cfg.get("rope_theta") or DEFAULT_ROPE_THETA
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ModelLoadError(f"{source}: partial_rotary_factor != 1 is not supported")
    return RopeConfig(head_dim, _as_float(theta, "rope_theta", source), max_pos, str(rope_type), params)


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


def parse_arch_config(cfg: dict[str, Any], source: str = "config.json") -> ArchConfig:
    """`source` names the file in errors (the full path when the caller has it)."""
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None) if isinstance(archs, list) else None
    if arch is None:
        raise ModelLoadError(
            f"{source}: unsupported architecture {archs!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if cfg.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"{source}: hidden_act {cfg['hidden_act']!r} is not supported (silu only)")
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
    head_dim = _int(cfg, "head_dim", source) if cfg.get("head_dim") else hidden // num_heads
    num_layers = _int(cfg, "num_hidden_layers", source)
    max_pos = _int(cfg, "max_position_embeddings", source, 2048)
    is_qwen2 = arch == "Qwen2ForCausalLM"
    attention_bias = bool(cfg.get("attention_bias", False))
    return ArchConfig(
        architecture=arch,
        vocab_size=_int(cfg, "vocab_size", source),
        hidden_size=hidden,
        intermediate_size=_int(cfg, "intermediate_size", source),
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
        qk_norm=arch == "Qwen3ForCausalLM",
        sliding_window=_sliding_window(cfg, arch, num_layers, source),
        rope=_rope_config(cfg, head_dim, max_pos, source),
        torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
    )


def load_arch_config(model_dir: Path) -> ArchConfig:
    """config.json of a checkpoint directory -> ArchConfig; errors name the file's full path."""
    return parse_arch_config(load_hf_config(model_dir), source=str(model_dir / "config.json"))
