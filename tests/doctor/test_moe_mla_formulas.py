"""The calculator on mixture-of-experts and latent-attention configs (config.json only, no weights)
against the published figures: total / active parameters, MLA KV bytes per token, and the weight
bytes a decode step reads as the batch grows (the experts its tokens touch)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvflow.cli import main
from kvflow.doctor.hardware import NAMED
from kvflow.doctor.model_spec import ModelSpec
from kvflow.doctor.moe_spec import expected_experts_touched
from kvflow.doctor.roofline import Roofline
from kvflow.doctor.what_ifs import moe_batch_what_if

CONFIGS = Path(__file__).parent / "configs"
BILLION = 1e9


def spec(name: str) -> ModelSpec:
    return ModelSpec.from_config(json.loads((CONFIGS / f"{name}.json").read_text()), name)


def published(count: float, figure: float, unit: float) -> bool:
    """`figure` (in billions, to `unit`) is `count` rounded or truncated to that unit: vendors do both
    (Mixtral's 12.88B active is "12.9B", Qwen3's 3.35B is "3.3B")."""
    value = count / BILLION
    return figure - unit / 2 <= value < figure + unit


@pytest.mark.parametrize(
    ("name", "total_b", "active_b"),
    [
        # Mistral and Qwen count the embedding and LM head in "active".
        ("mixtral-8x7b", 46.7, 12.9),
        ("qwen3-30b-a3b", 30.5, 3.3),
    ],
)
def test_moe_total_and_active_parameters(name: str, total_b: float, active_b: float) -> None:
    s = spec(name)
    assert published(s.num_params, total_b, 0.1)
    assert published(s.num_active_params, active_b, 0.1)


def test_deepseek_total_and_activated_parameters() -> None:
    # DeepSeek's "activated" parameters leave out the input embedding (a lookup, no multiply):
    # the calculator's matmul_params. V3's 671B excludes the multi-token-prediction layer (layer 61).
    v2_lite, v3 = spec("deepseek-v2-lite"), spec("deepseek-v3")
    assert published(v2_lite.num_params, 15.7, 0.1)
    assert published(v2_lite.matmul_params, 2.4, 0.1)  # 2.45B
    assert published(v3.num_params, 671, 1)
    assert published(v3.matmul_params, 37, 1)  # 36.6B
    assert v2_lite.num_active_params == v2_lite.matmul_params + v2_lite.embedding_params + v2_lite.norm_params


def test_moe_layer_counts_by_hand() -> None:
    mixtral = spec("mixtral-8x7b")
    expert = 3 * 4096 * 14336
    attention = 4096 * 4096 * 2 + 4096 * 1024 * 2
    layer = attention + 8 * expert + 8 * 4096 + 2 * 4096  # + router + 2 RMSNorms
    assert mixtral.layer_params == 32 * layer
    assert mixtral.active_layer_params == 32 * (layer - 6 * expert)
    v3 = spec("deepseek-v3")
    assert v3.num_moe_layers == 61 - 3  # first_k_dense_replace 3
    assert v3.moe_layer is not None and v3.moe_layer.router == 256 * 7168 + 256  # + correction bias


def test_mla_kv_bytes_per_token() -> None:
    assert spec("deepseek-v2-lite").kv_bytes_per_token() == 27 * (512 + 64) * 2 == 31_104
    assert spec("deepseek-v3").kv_bytes_per_token() == 61 * 576 * 2 == 70_272
    assert spec("deepseek-v3").kv_bytes_per_token("int8") == 61 * 576
    # MHA of V3's shape would cache K (192) and V (128) for 128 heads: 71x more.
    mha = 61 * 128 * (192 + 128) * 2
    assert mha / spec("deepseek-v3").kv_bytes_per_token() == pytest.approx(71.1, abs=0.1)


def test_expected_experts_touched() -> None:
    assert expected_experts_touched(8, 2, 1) == pytest.approx(2)
    assert expected_experts_touched(8, 2, 0) == 0
    # Batch 2: an expert escapes both tokens with probability (6/8)^2.
    assert expected_experts_touched(8, 2, 2) == pytest.approx(8 * (1 - 0.75**2))
    assert expected_experts_touched(128, 8, 10_000) == pytest.approx(128)


def test_decode_weight_bytes_grow_with_the_batch() -> None:
    qwen = spec("qwen3-30b-a3b")
    one, eight = qwen.decode_weight_bytes("bfloat16", 1), qwen.decode_weight_bytes("bfloat16", 8)
    # Batch 1 reads the active parameters less the embedding table (a gather) plus the LM head.
    assert one == pytest.approx(2 * (qwen.active_layer_params + qwen.embedding_params + qwen.norm_params))
    per_expert_bytes = 2 * 3 * 2048 * 768
    assert eight - one == pytest.approx(48 * (qwen.experts_read_per_layer(8) - 8) * per_expert_bytes)
    # A large batch reads every expert: all weights but the embedding table (gathered, not read).
    every = qwen.weight_bytes() - 2 * qwen.embedding_params
    assert qwen.decode_weight_bytes("bfloat16", 10_000) == pytest.approx(every, rel=1e-6)
    dense = spec("llama-3-8b")
    assert dense.decode_weight_bytes("bfloat16", 8) == dense.decode_weight_bytes("bfloat16", 1)


def test_roofline_decode_of_a_moe_model_reads_the_touched_experts() -> None:
    qwen = spec("qwen3-30b-a3b")
    roof = Roofline(qwen, NAMED["h100"], "bfloat16", "bfloat16")
    kv = 8 * 1000 * qwen.kv_bytes_per_token("bfloat16")
    assert roof.decode_bytes(8, 1000) == pytest.approx(qwen.decode_weight_bytes("bfloat16", 8) + kv)
    # FLOPs count the active parameters only: 2 x (active layers + LM head) per token.
    flops = 2 * (qwen.active_layer_params + qwen.embedding_params) * 8 + qwen.attention_flops(8, 1000)
    assert roof.decode_flops(8, 1000) == pytest.approx(flops)


def test_batch_8_what_if_names_the_experts_read() -> None:
    what_if = moe_batch_what_if(spec("mixtral-8x7b"), "bfloat16", 1)
    assert what_if is not None
    assert "batch 8 reads 7.2 of 8 experts per layer" in what_if.effect
    assert what_if.predicted["moe_experts_read_per_layer"] == pytest.approx(8 * (1 - 0.75**8))
    assert moe_batch_what_if(spec("llama-3-8b"), "bfloat16", 1) is None


def test_calculator_report_names_active_parameters_and_the_latent(tmp_path: Path) -> None:
    for name in ("qwen3-30b-a3b", "deepseek-v3"):
        model_dir = tmp_path / name
        model_dir.mkdir()
        (model_dir / "config.json").write_text((CONFIGS / f"{name}.json").read_text())
        out = tmp_path / f"{name}.json"
        assert main(["doctor", str(model_dir), "--hardware", "h100", "--json", "--output", str(out)]) == 0
        model = json.loads(out.read_text())["model"]
        assert model["num_active_params"] == spec(name).num_active_params < model["num_params"]
    assert model["kv_latent"] == [512, 64] and model["kv_cache_bytes_per_token"] == 70_272


def test_deepseek_v32_indexer_cost_from_its_config() -> None:
    """DeepSeek-V3.2 (config of DeepSeek-V3.2-Exp: V3 plus a lightning indexer of 64 heads x 128 at
    top 2,048): per layer the indexer adds wq_b 1536 x 64 x 128, wk 7168 x 128 with its LayerNorm,
    weights_proj 7168 x 64, and caches one 128-value key per token beside the 576-value latent."""
    v3, v32 = spec("deepseek-v3"), spec("deepseek-v32")
    per_layer = 1536 * 64 * 128 + 7168 * 128 + 2 * 128 + 7168 * 64
    assert v32.num_params - v3.num_params == 61 * per_layer
    assert published(v32.num_params, 672, 1e9)  # 671B + 0.85B of indexers (the card's 685B adds MTP)
    assert v32.kv_bytes_per_request(1) == 61 * (576 + 128) * 2 * 16  # one block of 16 tokens
    # A decode step at 128k reads every indexer key and the latents of the top 2,048 positions only.
    context = 131_072
    assert v32.decode_kv_bytes(context) == 61 * (context * 128 * 2 + 2048 * 576 * 2)
    assert v3.decode_kv_bytes(context) == 61 * context * 576 * 2
    # Attention FLOPs per decode token at 128k: V3.2's top-2,048 MLA plus its indexer over all keys.
    mla_per_key = 2 * 128 * (192 + 128)
    index_per_key = 2 * 64 * (128 + 1)
    assert v32.attention_flops(1, context) == 61 * (2048 * mla_per_key + context * index_per_key)
