"""Mixture-of-experts and latent-attention config variants vs transformers on the same weights.

The default Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2 and DeepSeek-V3 checkpoints run every
scenario of the dense models' test (tests/models/test_hf_equivalence.py: default, chunked prefill,
preemption, prefix hits); here, the config switches those defaults leave out, on the default path:
greedy tokens identical, top-5 logprobs within float32 summation-order differences.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from test_hf_equivalence import _check, _params, hf_reference

from kvflow import LLM

pytest.importorskip("transformers")

# Config variants the fixtures' defaults leave out, each against transformers on the default path.
VARIANTS = [
    ("deepseek_v3", {"rope_interleave": False}),  # rotate_half rope pairs
    ("deepseek_v3", {"q_lora_rank": None, "n_group": 1, "topk_group": 1}),  # no groups
    ("deepseek_v2", {"topk_method": "greedy", "q_lora_rank": 24, "n_group": None, "topk_group": None}),
    ("qwen2_moe", {"mlp_only_layers": [1]}),  # a dense layer after a sparse one
    ("mixtral", {"sliding_window": 32}),
]


@pytest.mark.parametrize(("arch", "overrides"), VARIANTS, ids=[f"{a}-{'-'.join(o)}" for a, o in VARIANTS])
def test_config_variants_match_transformers(
    tiny_checkpoint_factory: Callable[..., Path], arch: str, overrides: dict[str, Any]
) -> None:
    reference = hf_reference(tiny_checkpoint_factory(arch, **overrides), num_prompts=6)
    _check(reference, LLM(str(reference["path"]), dtype="float32").generate(reference["prompts"], _params()))
