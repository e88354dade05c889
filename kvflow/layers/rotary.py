"""Rotary position embeddings (RoPE) with the rope_scaling variants hub checkpoints use.

q/k are rotated in the "rotate_half" convention of Hugging Face Llama: the head dimension is split
into two halves [x1, x2] and (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), with frequency
inv_freq[i] shared by dimension i and i + D/2.

Supported `rope_type`s and their inverse frequencies (D = rotary dim, base = rope_theta):
    default  inv_freq[i] = base^(-2i/D)
    linear   inv_freq / factor                           (position interpolation)
    llama3   low frequencies divided by factor, high kept, a smooth ramp between (Llama 3.1)
    yarn     interpolation/extrapolation ramp by rotation count, cos/sin scaled by attention_factor
    freq_factors  inv_freq[i] / freq_factors[i]: llama.cpp's `rope_freqs` tensor, in which its
             converter stores Llama 3.1's llama3 scaling (kvflow/gguf/gguf_config.py)
`dynamic` and `longrope` change with the sequence length and are refused with a clear error.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from kvflow.arch_config import RopeConfig
from kvflow.errors import ModelLoadError


def _default_inv_freq(cfg: RopeConfig) -> torch.Tensor:  # [D/2]
    exponents = torch.arange(0, cfg.head_dim, 2, dtype=torch.int64).float() / cfg.head_dim
    return 1.0 / (cfg.rope_theta**exponents)


def _llama3_inv_freq(cfg: RopeConfig) -> torch.Tensor:
    inv_freq = _default_inv_freq(cfg)
    factor = float(cfg.params["factor"])
    low_freq_factor = float(cfg.params["low_freq_factor"])
    high_freq_factor = float(cfg.params["high_freq_factor"])
    old_context_len = float(cfg.params["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths (low frequencies) are interpolated by `factor`; short ones are kept.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(cfg: RopeConfig) -> tuple[torch.Tensor, float]:
    p, dim, base = cfg.params, cfg.head_dim, cfg.rope_theta
    original_max = p.get("original_max_position_embeddings") or cfg.max_position_embeddings
    factor = p.get("factor") or cfg.max_position_embeddings / original_max
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        # The dimension whose wavelength completes `num_rotations` turns over the original context.
        return (dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation_weight = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * ramp + (1.0 / pos_freqs) * extrapolation_weight
    return inv_freq, float(attention_factor)


def compute_inv_freq(cfg: RopeConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [D/2] (float32) and the cos/sin scaling factor."""
    if cfg.rope_type == "default":
        return _default_inv_freq(cfg), 1.0
    if cfg.rope_type == "linear":
        return _default_inv_freq(cfg) / float(cfg.params["factor"]), 1.0
    if cfg.rope_type == "llama3":
        return _llama3_inv_freq(cfg), 1.0
    if cfg.rope_type == "yarn":
        return _yarn_inv_freq(cfg)
    if cfg.rope_type == "freq_factors":
        factors = torch.tensor(cfg.params["freq_factors"], dtype=torch.float32)
        if factors.shape != (cfg.head_dim // 2,):
            raise ModelLoadError(f"rope freq_factors: {factors.numel()} values for rotary dim {cfg.head_dim}")
        return _default_inv_freq(cfg) / factors, 1.0
    raise ModelLoadError(
        f"unsupported rope_type {cfg.rope_type!r} (supported: default, linear, llama3, yarn, freq_factors)"
    )


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin for every position up to `max_positions`, applied to flat token batches."""

    def __init__(self, cfg: RopeConfig, max_positions: int) -> None:
        super().__init__()
        inv_freq, scaling = compute_inv_freq(cfg)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)  # [P, D/2], the same float32 products HF computes
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        self.cos_cache: torch.Tensor
        self.sin_cache: torch.Tensor
        self.register_buffer("cos_cache", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin_cache", emb.sin() * scaling, persistent=False)
        self.max_positions = max_positions
        # dtype -> (cos, sin_signed), each [P, D] in that dtype: built on first use (see `tables`).
        self._tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def tables(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin of every position, each [P, D] in `dtype`: the float32 caches
        rounded once, as HF rounds them before multiplying. The sin is [-sin, sin] over the two
        halves, so that rotate_half(x) * sin == roll(x, D/2) * sin_signed (apply_rotary). A step
        then gathers its rows and converts nothing (the native decoder reads them directly)."""
        if dtype not in self._tables:
            half = self.sin_cache.shape[-1] // 2
            sin_signed = torch.cat((-self.sin_cache[:, :half], self.sin_cache[:, half:]), dim=-1)
            self._tables[dtype] = (self.cos_cache.to(dtype), sin_signed.to(dtype))
        return self._tables[dtype]

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin (`tables`) for `positions` [T], each [T, 1, D] in `dtype`."""
        cos, sin_signed = self.tables(dtype)
        return cos.index_select(0, positions).unsqueeze(1), sin_signed.index_select(0, positions).unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos/sin_signed: [T, 1, D] (from `cos_sin`) -> rotated x [T, H, D].

    HF: x * cos + cat(-x2, x1) * sin. Here cat(x2, x1) = roll(x, D/2) and the sign lives in
    sin_signed; (-a) * b == a * (-b) exactly in IEEE arithmetic, so results are bit-identical.
    """
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin_signed


def apply_partial_rotary(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D] with only the first Dr = cos.shape[-1] dims rotated (Qwen3-Next: Dr = D / 4),
    the rest passed through, as transformers' apply_rotary_pos_emb does for a partial rotary."""
    rotary_dim = cos.shape[-1]
    if rotary_dim == x.shape[-1]:
        return apply_rotary(x, cos, sin_signed)
    return torch.cat((apply_rotary(x[..., :rotary_dim], cos, sin_signed), x[..., rotary_dim:]), dim=-1)
