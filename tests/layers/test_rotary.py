"""RoPE inverse frequencies and scaling against transformers' own ROPE_INIT_FUNCTIONS."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvflow.arch_config import RopeConfig
from kvflow.errors import ModelLoadError
from kvflow.layers.rotary import RotaryEmbedding, apply_rotary, compute_inv_freq

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

HEAD_DIM = 64
MAX_POS = 4096

CASES: list[dict[str, Any]] = [
    {"rope_type": "linear", "factor": 4.0},
    {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 1024,
    },
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
    {
        "rope_type": "yarn",
        "factor": 2.0,
        "original_max_position_embeddings": 2048,
        "beta_fast": 16,
        "beta_slow": 2,
        "mscale": 1.0,
        "mscale_all_dim": 0.5,
    },
]


@pytest.mark.parametrize("params", CASES, ids=lambda p: p["rope_type"])
def test_inv_freq_matches_transformers(params: dict[str, Any]) -> None:
    theta = 500000.0
    hf_config = transformers.LlamaConfig(
        hidden_size=HEAD_DIM * 4,
        num_attention_heads=4,
        max_position_embeddings=MAX_POS,
        rope_parameters={"rope_theta": theta, **params},
    )
    ref_inv_freq, ref_scaling = ROPE_INIT_FUNCTIONS[params["rope_type"]](hf_config, torch.device("cpu"))
    extra = {k: v for k, v in params.items() if k != "rope_type"}
    inv_freq, scaling = compute_inv_freq(RopeConfig(HEAD_DIM, theta, MAX_POS, params["rope_type"], extra))
    torch.testing.assert_close(inv_freq, ref_inv_freq.float(), rtol=1e-6, atol=0)
    assert scaling == pytest.approx(ref_scaling)


def test_unsupported_rope_type_is_a_clear_error() -> None:
    with pytest.raises(ModelLoadError, match="unsupported rope_type 'dynamic'"):
        compute_inv_freq(RopeConfig(HEAD_DIM, 10000.0, MAX_POS, "dynamic", {"factor": 2.0}))


def test_apply_rotary_equals_rotate_half_form() -> None:
    """The roll + sign-folded sin form is bit-identical to HF's x*cos + rotate_half(x)*sin."""
    rope = RotaryEmbedding(RopeConfig(HEAD_DIM, 10000.0, MAX_POS), MAX_POS)
    positions = torch.tensor([0, 1, 7, 100, 4095])
    x = torch.randn(5, 3, HEAD_DIM)
    cos, sin_signed = rope.cos_sin(positions, torch.float32)
    sin = rope.sin_cache[positions].unsqueeze(1)
    half = HEAD_DIM // 2
    expected = x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
    assert torch.equal(apply_rotary(x, cos, sin_signed), expected)
