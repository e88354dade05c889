"""The calculator's --tensor-parallel-size against hand-computed values (kvflow/doctor/tensor_parallel.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvflow.doctor.hardware import NAMED
from kvflow.doctor.model_spec import ModelSpec
from kvflow.doctor.roofline import Roofline
from kvflow.doctor.tensor_parallel import estimate

CONFIGS = Path(__file__).parent / "configs"
LLAMA3_LAYERS = 6_979_584_000  # test_model_formulas.py
LLAMA3_NORMS = 32 * 2 * 4096


def _llama3() -> ModelSpec:
    return ModelSpec.from_config(json.loads((CONFIGS / "llama-3-8b.json").read_text()), "llama-3-8b")


def test_two_ranks_split_everything_but_the_norms() -> None:
    model = _llama3()
    roof = Roofline(model, NAMED["h100"], "bfloat16", "bfloat16")
    tp = estimate(model, roof, 2, batch=1, context_len=1000)
    embed = 128_256 * 4096  # embedding and (untied) LM head, each split by vocabulary
    want = ((LLAMA3_LAYERS - LLAMA3_NORMS) / 2 + LLAMA3_NORMS + embed + 4096) * 2
    assert tp.weight_bytes_per_rank == pytest.approx(want)
    assert tp.kv_heads_per_rank == 4 and not tp.kv_replicated
    assert tp.kv_bytes_per_token_per_rank == 131_072 / 2
    assert tp.all_reduces_per_step == 65  # 2 per layer + the embedding
    assert tp.all_reduce_bytes_per_token == 65 * 4096 * 2
    assert tp.logits_gather_bytes_per_token == 128_256 / 2 * 2
    # Decode at batch 1 reads the layers, the LM head (= embed, per rank half) and the KV it holds.
    read = ((LLAMA3_LAYERS - LLAMA3_NORMS) / 2 + LLAMA3_NORMS + embed / 2 + 4096) * 2 + 1000 * 65_536
    assert tp.decode_per_rank.memory_s == pytest.approx(read / 3.35e12)
    assert 1.9 < tp.decode_single.seconds / tp.decode_per_rank.seconds < 2.0


def test_more_ranks_than_kv_heads_replicate_them() -> None:
    model = _llama3()
    tp = estimate(model, Roofline(model, NAMED["h100"], "bfloat16", "bfloat16"), 16, batch=1, context_len=1)
    assert tp.kv_heads_per_rank == 1 and tp.kv_replicated
    kv_proj = 2 * 4096 * 8 * 128  # per layer; each rank keeps one whole head's share: 1/8, not 1/16
    linears = (LLAMA3_LAYERS - LLAMA3_NORMS - 32 * kv_proj) / 16 + 32 * kv_proj / 8
    assert tp.weight_bytes_per_rank == pytest.approx(
        (linears + LLAMA3_NORMS + 2 * 128_256 * 4096 / 16 + 4096) * 2
    )


def test_sizes_kvflow_refuses_are_refused() -> None:
    model = _llama3()
    with pytest.raises(ValueError, match="does not split"):
        estimate(model, Roofline(model, NAMED["h100"], "bfloat16", "bfloat16"), 3, batch=1, context_len=1)
