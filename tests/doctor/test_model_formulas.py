"""The doctor's formulas against hand-computed values on real configs (config.json fixtures)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvflow.doctor.hardware import NAMED, probe_cpu
from kvflow.doctor.model_spec import ModelSpec
from kvflow.doctor.roofline import Roofline

CONFIGS = Path(__file__).parent / "configs"


def spec(name: str) -> ModelSpec:
    return ModelSpec.from_config(json.loads((CONFIGS / f"{name}.json").read_text()), name)


def test_parameter_counts_match_the_published_models() -> None:
    # Published parameter counts (model cards / safetensors metadata).
    assert spec("llama-2-13b").num_params == 13_015_864_320
    assert spec("llama-3-8b").num_params == 8_030_261_248
    assert spec("mistral-7b").num_params == 7_241_732_096
    qwen = spec("qwen2.5-0.5b")
    assert qwen.num_params == 494_032_768  # tied: the LM head is the embedding, stored once
    assert qwen.lm_head_params == 0 and qwen.embedding_params == 151_936 * 896


def test_kv_bytes_per_token() -> None:
    llama2 = spec("llama-2-13b")
    # 2 x 40 layers x 40 KV heads x 128 x 2 bytes (fp16): the seed's "close to 1 MB" per token.
    assert llama2.kv_bytes_per_token() == 819_200
    assert llama2.kv_bytes_per_token() * 4096 == pytest.approx(3.36e9, rel=0.01)  # about 3.3 GB
    # GQA: 8 KV heads instead of 32 -> 4x less than MHA would need.
    assert spec("llama-3-8b").kv_bytes_per_token() == 2 * 32 * 8 * 128 * 2 == 131_072
    assert spec("llama-3-8b").kv_bytes_per_token("int8") == 65_536
    assert spec("qwen2.5-0.5b").kv_bytes_per_token() == 2 * 24 * 2 * 64 * 2 == 12_288
    mistral = spec("mistral-7b")
    assert mistral.kv_tokens_held(8192) == 4096 and mistral.kv_tokens_held(1000) == 1000  # window 4096


def test_weight_bytes_count_tied_embeddings_and_quantized_layers() -> None:
    llama3 = spec("llama-3-8b")
    layers = 32 * (4096 * 4096 * 2 + 4096 * 1024 * 2 + 3 * 4096 * 14336 + 2 * 4096)
    assert llama3.layer_params == layers == 6_979_584_000
    assert llama3.weight_bytes() == pytest.approx(2 * 8_030_261_248)
    # int4 (group 128, bf16 scale + zero): layers at 0.5 + 4/128 bytes; embedding and LM head stay bf16.
    embed = 128_256 * 4096
    assert llama3.weight_bytes("int4") == pytest.approx(layers * (0.5 + 4 / 128) + 2 * embed * 2 + 4096 * 2)
    qwen = spec("qwen2.5-0.5b")
    # A decode step reads the layers and the (tied) LM head once: the whole checkpoint.
    assert qwen.decode_weight_bytes() == pytest.approx(qwen.weight_bytes())


def test_roofline_by_hand_on_h100() -> None:
    llama3 = spec("llama-3-8b")
    roof = Roofline(llama3, NAMED["h100"], "bfloat16", "bfloat16")
    weights = (6_979_584_000 + 525_336_576 + 4096) * 2  # layers + LM head + final norm, bf16
    decode = roof.decode_step(batch=1, context_len=1000)
    assert decode.memory_s == pytest.approx((weights + 1000 * 131_072) / 3.35e12)
    assert decode.bound == "memory" and decode.seconds * 1e3 == pytest.approx(4.5197, rel=1e-4)
    flops = 2 * 6_979_584_000 * 1000 + 2 * 525_336_576 + 4 * 32 * 1000 * 1000 * 32 * 128
    prefill = roof.prefill(1000)
    assert prefill.compute_s == pytest.approx(flops / 989e12)
    assert prefill.bound == "compute" and prefill.seconds * 1e3 == pytest.approx(14.6456, rel=1e-4)
    # Batch 64: compute grows with the batch, weight reads do not.
    assert roof.decode_step(64, 1000).seconds < 64 * decode.seconds / 10


def test_max_concurrency() -> None:
    llama2 = spec("llama-2-13b")
    roof = Roofline(llama2, NAMED["a100-80g"], "float16", "float16")
    assert roof.max_concurrency(10e9, 4096) == pytest.approx(10e9 / (4096 * 819_200))
    mistral = Roofline(spec("mistral-7b"), NAMED["h100"], "bfloat16", "bfloat16")
    # The sliding window caps what a long request holds: 32k tokens cost what 4k do.
    assert mistral.max_concurrency(10e9, 32_768) == mistral.max_concurrency(10e9, 4096)


def test_cpu_probe_measures_positive_figures() -> None:
    hw = probe_cpu()
    assert hw.bandwidth_bytes_s > 1e9 and hw.flops["bfloat16"] > 1e9 and hw.memory_bytes > 1e9
    assert hw.flops_for("int4") == hw.flops["bfloat16"]  # weight-only int4 computes in bf16
