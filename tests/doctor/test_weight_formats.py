"""The calculator reads the checkpoint's weight format (kvflow/doctor/weight_format.py): FP8 block
scales (DeepSeek-V3), MXFP4 experts (gpt-oss), GPTQ / AWQ / compressed-tensors bits and groups, and
a GGUF file's per-tensor types, against the published checkpoint sizes and the file's own bytes."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from kvflow.cli import main
from kvflow.doctor.model_spec import ModelSpec
from kvflow.doctor.weight_format import MXFP4_BYTES, weight_format_from_config

CONFIGS = Path(__file__).parent / "configs"
GB = 1e9


def spec(name: str) -> ModelSpec:
    return ModelSpec.from_config(json.loads((CONFIGS / f"{name}.json").read_text()), name)


@pytest.mark.parametrize(
    ("name", "published_gb", "tolerance"),
    [
        # The Hub repositories' safetensors: gpt-oss-120b 65.25 GB (60.77 GiB), gpt-oss-20b 13.76 GB
        # (12.82 GiB): MXFP4 experts, bf16 attention / router / embedding / head.
        ("gpt-oss-120b", 65.25, 0.01),
        ("gpt-oss-20b", 13.76, 0.01),
        # DeepSeek-V3's 688.6 GB also hold its 14B-parameter MTP module (one more layer, in FP8),
        # which kvflow neither loads nor counts: ~2% of the checkpoint.
        ("deepseek-v3", 688.6, 0.03),
    ],
)
def test_weight_bytes_of_published_quantized_checkpoints(
    name: str, published_gb: float, tolerance: float
) -> None:
    m = spec(name)
    assert m.weight_format is not None
    assert abs(m.weight_bytes() / GB - published_gb) <= tolerance * published_gb
    # Not config.json's torch_dtype times the parameters (DeepSeek-V3: 1,342 GB of bf16).
    assert m.weight_bytes() < 0.6 * m.weight_bytes("bfloat16")


def test_mxfp4_counts_only_the_experts_at_4_25_bits() -> None:
    m = spec("gpt-oss-20b")
    experts = m.routed_expert_params
    others = m.num_params - experts - m.norm_params
    assert m.weight_bytes() == pytest.approx(experts * MXFP4_BYTES + others * 2 + m.norm_params * 2)
    # A single-sequence decode step reads top-4 of 32 experts per layer.
    expected_experts = m.step_layer_params(1) - (m.layer_params - experts)
    assert m.decode_weight_bytes() == pytest.approx(
        (m.layer_params - experts) * 2
        + expected_experts * MXFP4_BYTES
        + m.embedding_params * 2
        + m.norm_params * 2
    )


@pytest.mark.parametrize(
    ("quantization_config", "name", "bytes_per_weight"),
    [
        ({"quant_method": "gptq", "bits": 4, "group_size": 128}, "gptq-int4", 0.5 + 2.5 / 128),
        ({"quant_method": "awq", "w_bit": 4, "q_group_size": 64}, "awq-int4", 0.5 + 2.5 / 64),
        ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "fp8-block", 1 + 4 / 128**2),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "float-quantized",
                "config_groups": {"g": {"weights": {"type": "float", "num_bits": 8, "strategy": "channel"}}},
            },
            "fp8-channel",
            1 + 4 / 4096,
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "pack-quantized",
                "config_groups": {"g": {"weights": {"type": "int", "num_bits": 4, "group_size": 32}}},
            },
            "int4-g32",
            0.5 + 2.5 / 32,
        ),
    ],
)
def test_formats_from_quantization_config(
    quantization_config: dict[str, object], name: str, bytes_per_weight: float
) -> None:
    fmt = weight_format_from_config({"hidden_size": 4096, "quantization_config": quantization_config})
    assert fmt is not None and fmt.name == name
    assert fmt.layer_bytes == pytest.approx(bytes_per_weight)
    assert fmt.embedding_bytes == 2.0  # the embedding stays in the float dtype


@pytest.mark.parametrize("where", ["quantization_config", "config"])  # V4.1 / V4
def test_deepseek_v4s_format_fp8_with_ue8m0_scales_and_fp4_experts(where: str) -> None:
    qc: dict[str, object] = {"quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "ue8m0"}
    config: dict[str, object] = {"hidden_size": 4096, "quantization_config": qc}
    (qc if where == "quantization_config" else config)["expert_dtype"] = "fp4"
    fmt = weight_format_from_config(config)
    assert fmt is not None and fmt.name == "fp8-block+fp4-experts"
    assert fmt.layer_bytes == pytest.approx(1 + 1 / 128**2)  # one e8m0 byte per 128 x 128 block
    assert fmt.expert_bytes == MXFP4_BYTES


def test_a_gguf_files_bytes_are_its_tensors(
    tiny_checkpoint_factory: Callable[..., Path], tmp_path: Path
) -> None:
    """The calculator on a GGUF file: its weights are the bytes of its tensors, per role (norms and
    biases, 0.2% of this tiny model's parameters, counted at the layers' average)."""
    pytest.importorskip("gguf")
    from fixtures.gguf_files import q4_k_m, write_gguf

    from kvflow.gguf.gguf_file import open_gguf

    path = tmp_path / "model.gguf"
    write_gguf(tiny_checkpoint_factory("llama", hidden_size=256, intermediate_size=512), path, q4_k_m)
    m = ModelSpec.from_dir(path)
    assert m.weight_format is not None and m.weight_dtype == "gguf" and "Q4_K" in m.weight_format.detail
    tensors = open_gguf(path).tensors.values()
    matrices = sum(t.num_bytes for t in tensors if len(t.shape) == 2)
    vectors = sum(int(t.shape[0]) for t in tensors if len(t.shape) == 1 and t.name != "rope_freqs.weight")
    assert m.weight_bytes() == pytest.approx(matrices + vectors * 2, rel=2e-3)
    out = tmp_path / "doctor.json"
    assert main(["doctor", str(path), "--hardware", "h100", "--json", "--output", str(out)]) == 0
    report = json.loads(out.read_text())["model"]
    assert report["weight_dtype"] == "gguf" and report["weight_bytes"] == pytest.approx(m.weight_bytes())


def test_calculator_sizes_deepseek_v3_in_its_fp8(tmp_path: Path) -> None:
    model_dir = tmp_path / "deepseek-v3"
    model_dir.mkdir()
    (model_dir / "config.json").write_text((CONFIGS / "deepseek-v3.json").read_text())
    out = tmp_path / "doctor.json"
    assert main(["doctor", str(model_dir), "--hardware", "h100", "--json", "--output", str(out)]) == 0
    model = json.loads(out.read_text())["model"]
    assert model["weight_dtype"] == "fp8-block"
    assert 660 * GB < model["weight_bytes"] < 690 * GB
