"""The tiny checkpoints of fixtures/checkpoints.py load in transformers and exercise what they claim."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fixtures.checkpoints import ARCHS, SAMPLE_TEXTS, TOKENIZER_VOCAB_SIZE, build_checkpoint
from safetensors import safe_open

transformers = pytest.importorskip("transformers")

Factory = Callable[..., Path]

# The text every model is prompted with (90 tokens, so longer than mistral's 32-token window).
LONG_TEXT = SAMPLE_TEXTS[-1]


@pytest.fixture(autouse=True, scope="module")
def _single_thread() -> Iterator[None]:
    # These models are 64 wide: a second intra-op thread buys nothing, and when another process holds a
    # core, OpenMP's barrier makes each tiny matmul ~1000x slower (measured: 16 ms instead of 10 us).
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


def _load(path: Path, **kwargs: Any) -> Any:
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, output_loading_info=True, **kwargs
    )
    # Every saved tensor is used and every parameter comes from the file (none left randomly initialized).
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()


def _prompt_ids(path: Path, text: str = LONG_TEXT) -> torch.Tensor:
    ids = transformers.AutoTokenizer.from_pretrained(path)(text)["input_ids"]
    return torch.tensor([ids])


def _logits(model: Any, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids).logits[0]  # [seq_len, vocab]


def _greedy(model: Any, prompt_ids: list[int], num_tokens: int) -> list[int]:
    """Plain greedy decoding by full forward passes (no cache, no EOS handling: nothing to trust)."""
    ids = list(prompt_ids)
    for _ in range(num_tokens):
        ids.append(int(_logits(model, torch.tensor([ids]))[-1].argmax()))
    return ids[len(prompt_ids) :]


@pytest.mark.parametrize("arch", ARCHS)
def test_checkpoint_loads_and_is_not_degenerate(tiny_checkpoint_factory: Factory, arch: str) -> None:
    path = tiny_checkpoint_factory(arch)
    model = _load(path)
    assert model.config.model_type == arch
    assert model.config.vocab_size == TOKENIZER_VOCAB_SIZE
    assert len(transformers.AutoTokenizer.from_pretrained(path)) == TOKENIZER_VOCAB_SIZE
    generation = json.loads((path / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (0, 1)
    prompt = _prompt_ids(path)[0, :10].tolist()
    output = _greedy(model, prompt, 20)
    assert len(set(output)) >= 3, output


def _config(path: Path) -> dict[str, Any]:
    config: dict[str, Any] = json.loads((path / "config.json").read_text())
    return config


def test_arch_switches_are_in_the_configs(tiny_checkpoint_factory: Factory) -> None:
    llama, mistral, qwen2, qwen3 = (_config(tiny_checkpoint_factory(arch)) for arch in ARCHS)
    assert (llama["num_attention_heads"], llama["num_key_value_heads"]) == (4, 2)
    assert llama["rope_parameters"]["rope_type"] == "llama3" and not llama["tie_word_embeddings"]
    assert (mistral["num_key_value_heads"], mistral["sliding_window"]) == (1, 32)
    assert qwen2["tie_word_embeddings"] and not qwen2["use_sliding_window"]
    assert qwen3["head_dim"] * qwen3["num_attention_heads"] != qwen3["hidden_size"]
    assert qwen3["tie_word_embeddings"]


def test_llama3_rope_scaling_changes_frequencies(tiny_checkpoint_factory: Factory) -> None:
    # original_max_position_embeddings=64 is small enough for the llama3 rule to rescale some of the
    # 8 frequencies of head_dim 16 (with Meta's 8192 none would be touched at this size).
    config = _load(tiny_checkpoint_factory("llama")).config
    scaled, _ = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    head_dim = config.hidden_size // config.num_attention_heads
    theta = config.rope_parameters["rope_theta"]
    plain = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    assert not torch.allclose(scaled, plain)


def test_constant_initialized_parameters_are_randomized(tiny_checkpoint_factory: Factory) -> None:
    path = tiny_checkpoint_factory("qwen2")
    with safe_open(str(path / "model.safetensors"), framework="pt") as weights:
        bias = weights.get_tensor("model.layers.0.self_attn.q_proj.bias")
        norm = weights.get_tensor("model.layers.0.input_layernorm.weight")
        names = set(weights.keys())
    assert bias.abs().min() > 0 and not torch.allclose(norm, torch.ones_like(norm))
    assert "lm_head.weight" not in names  # tied: only the embedding is stored


def test_mistral_sliding_window_is_honoured(tiny_checkpoint_factory: Factory) -> None:
    path = tiny_checkpoint_factory("mistral")
    input_ids = _prompt_ids(path)
    assert input_ids.shape[1] > 32
    eager = _logits(_load(path, attn_implementation="eager"), input_ids)
    sdpa = _logits(_load(path, attn_implementation="sdpa"), input_ids)
    torch.testing.assert_close(eager, sdpa, atol=1e-4, rtol=1e-4)
    # Without the window, positions that see more than 32 tokens change and earlier ones do not.
    unwindowed = _logits(_load(path, sliding_window=None), input_ids)
    torch.testing.assert_close(unwindowed[:32], sdpa[:32], atol=1e-4, rtol=1e-4)
    assert (unwindowed[32:] - sdpa[32:]).abs().max() > 1e-3


@pytest.mark.parametrize("arch", ARCHS)
def test_legacy_rope_keys_load_identically(tiny_checkpoint_factory: Factory, arch: str) -> None:
    modern = tiny_checkpoint_factory(arch)
    legacy = tiny_checkpoint_factory(arch, legacy_rope_keys=True)
    config = _config(legacy)
    assert "rope_parameters" not in config and "dtype" not in config
    assert config["rope_theta"] == _config(modern)["rope_parameters"]["rope_theta"]
    assert config["torch_dtype"] == "float32"
    if arch == "llama":
        assert config["rope_scaling"]["rope_type"] == "llama3"
    else:
        assert config["rope_scaling"] is None
    modern_model, legacy_model = _load(modern), _load(legacy)
    assert legacy_model.config.rope_parameters == modern_model.config.rope_parameters
    input_ids = _prompt_ids(modern)
    torch.testing.assert_close(
        _logits(legacy_model, input_ids), _logits(modern_model, input_ids), atol=0, rtol=0
    )


def test_sharded_checkpoint(tiny_checkpoint_factory: Factory) -> None:
    whole = tiny_checkpoint_factory("llama")
    sharded = tiny_checkpoint_factory("llama", max_shard_size="300KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 2
    assert not (sharded / "model.safetensors").exists()
    input_ids = _prompt_ids(whole)
    torch.testing.assert_close(
        _logits(_load(sharded), input_ids), _logits(_load(whole), input_ids), atol=0, rtol=0
    )


def test_bfloat16_checkpoint(tiny_checkpoint_factory: Factory) -> None:
    path = tiny_checkpoint_factory("qwen3", dtype=torch.bfloat16)
    assert _config(path)["dtype"] == "bfloat16"
    with safe_open(str(path / "model.safetensors"), framework="pt") as weights:
        assert weights.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16


def test_overrides_and_determinism(tmp_path: Path) -> None:
    first = build_checkpoint(tmp_path / "a", "llama", seed=3, num_hidden_layers=1, tie_word_embeddings=True)
    second = build_checkpoint(tmp_path / "b", "llama", seed=3, num_hidden_layers=1, tie_word_embeddings=True)
    assert _config(first)["num_hidden_layers"] == 1 and _config(first)["tie_word_embeddings"]
    assert (first / "model.safetensors").read_bytes() == (second / "model.safetensors").read_bytes()
    assert (first / "tokenizer.json").read_bytes() == (second / "tokenizer.json").read_bytes()
    with pytest.raises(ValueError, match="unknown arch"):
        build_checkpoint(tmp_path / "c", "gpt2")
