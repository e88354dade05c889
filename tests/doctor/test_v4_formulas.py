"""The calculator on DeepSeek-V4 from config.json alone (tests/doctor/configs/deepseek-v4-*.json):
parameters against the published 1.6T / 49B (Pro) and 284B / 13B (Flash), KV bytes per cache kind,
and the model card's comparison with DeepSeek-V3.2 at a million tokens: about 10% of the KV cache
and 27% of the per-token FLOPs (docs/doctor.md, "DeepSeek-V4")."""

from __future__ import annotations

import pytest
from test_moe_mla_formulas import published, spec

MILLION = 1_048_576
BF16 = 2


def test_parameters_match_the_published_sizes() -> None:
    pro, flash = spec("deepseek-v4-pro"), spec("deepseek-v4-flash")
    # Totals without the MTP layer (the card's 1.6T and 284B include it).
    assert published(pro.num_params, 1600, 100)  # 1,573B: "1.6T"
    assert published(pro.num_active_params, 49, 1)  # 49.8B
    assert published(flash.num_params, 284, 1)  # 284.3B
    assert published(flash.num_active_params, 13, 1)  # 13.8B


def _formula_kv(name: str, context: int) -> dict[str, int]:
    """KV per kind for one request at `context`, by the formulas of docs/doctor.md (no pool padding)."""
    c = spec(name).arch.compressed
    assert c is not None
    return {
        "window": len(c.layer_types) * min(context, c.sliding_window) * c.head_dim * BF16,
        "csa_entries": c.num_csa_layers * (context // c.csa_rate) * c.head_dim * BF16,
        "csa_index_keys": c.num_csa_layers * (context // c.csa_rate) * c.index_head_dim * BF16,
        "hca_entries": c.num_hca_layers * (context // c.hca_rate) * c.head_dim * BF16,
    }


def test_v4_pro_holds_about_a_tenth_of_v32s_kv_at_a_million_tokens() -> None:
    pro, v32 = spec("deepseek-v4-pro"), spec("deepseek-v32")
    formula = _formula_kv("deepseek-v4-pro", MILLION)
    v32_bytes = 61 * (576 + 128) * BF16 * MILLION  # latent + indexer key per token and layer
    assert v32.kv_bytes_per_request(MILLION, "bfloat16") == v32_bytes
    ratio = sum(formula.values()) / v32_bytes
    assert ratio == pytest.approx(0.1148, abs=5e-4)
    # The pool adds the compressors' states and one padded slot in each group of 30 CSA layers (31 a
    # group, the HCA count): within 4% of the formula.
    held = pro.kv_bytes_per_request_by_kind(MILLION, "bfloat16")
    assert sum(held.values()) == pytest.approx(sum(formula.values()), rel=0.04)
    assert 0.09 < sum(held.values()) / v32_bytes < 0.13
    assert held["csa_entries"] > held["csa_index_keys"] > held["hca_entries"] > held["sliding_attention"]


def test_v4_pro_spends_about_27_percent_of_v32s_flops_per_token_at_a_million() -> None:
    pro, v32 = spec("deepseek-v4-pro"), spec("deepseek-v32")
    c = pro.arch.compressed
    assert c is not None
    per_key = 4 * 128 * 512  # QK^T and PV over head_dim 512, 128 heads
    csa = (c.index_topk + c.sliding_window) * per_key + (MILLION // 4) * 2 * 64 * (128 + 1)
    hca = (MILLION // 128 + c.sliding_window) * per_key
    assert pro.attention_flops(1, MILLION) == c.num_csa_layers * csa + c.num_hca_layers * hca
    v4_total = 2 * pro.matmul_params + pro.attention_flops(1, MILLION)
    v32_total = 2 * v32.matmul_params + v32.attention_flops(1, MILLION)
    assert v4_total / v32_total == pytest.approx(0.27, abs=0.01)


def test_decode_reads_only_the_selected_entries_and_every_index_key() -> None:
    pro = spec("deepseek-v4-pro")
    c = pro.arch.compressed
    assert c is not None
    context = 131_072
    from kvflow.doctor.kv_kinds import decode_step_kv_bytes_by_kind

    by_kind = decode_step_kv_bytes_by_kind(pro.arch, "bfloat16", "bfloat16", context)
    assert by_kind["csa_entries"] == c.num_csa_layers * c.index_topk * 512 * BF16
    assert by_kind["csa_index_keys"] == c.num_csa_layers * (context // 4) * 128 * BF16
    assert by_kind["hca_entries"] == c.num_hca_layers * (context // 128) * 512 * BF16
    assert by_kind["sliding_attention"] == 61 * 128 * 512 * BF16
