"""Checkpoint spellings that must load to the same model: hub-style `rope_theta`/`rope_scaling`
vs transformers 5's `rope_parameters`, and single-file vs sharded safetensors."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from kvflow import LLM, SamplingParams

PROMPTS = [[5, 6, 7, 8, 9] * 20, [11, 12, 13]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3)


def _run(path: Path) -> list[list[int]]:
    outs = LLM(str(path), dtype="float32").generate(PROMPTS, GREEDY)
    return [o.outputs[0].token_ids for o in outs]


def test_legacy_rope_keys_load_the_same_model(tiny_checkpoint_factory: Callable[..., Path]) -> None:
    modern = tiny_checkpoint_factory("llama")
    legacy = tiny_checkpoint_factory("llama", legacy_rope_keys=True)
    legacy_cfg = json.loads((legacy / "config.json").read_text())
    assert "rope_parameters" not in legacy_cfg and legacy_cfg["rope_scaling"]["rope_type"] == "llama3"
    assert _run(modern) == _run(legacy)


def test_sharded_checkpoint_loads_the_same_model(tiny_checkpoint_factory: Callable[..., Path]) -> None:
    single = tiny_checkpoint_factory("qwen3")
    sharded = tiny_checkpoint_factory("qwen3", max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    assert _run(single) == _run(sharded)
