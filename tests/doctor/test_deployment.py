"""Deployment sizing in calculator mode (kvflow/doctor/deployment.py) on published configs: the weight
bytes against the published checkpoints, the fewest devices on H100 / H200 / MI300X and the layouts
that hold them, in the JSON (`deployment.min_devices`, `deployment.layouts[]`) and the text report.

The expected device counts are the doctor's rule worked by hand: the fewest devices whose largest
share (weights of the largest pipeline stage / TP, plus the planned KV) fits 90% of one device.
Pipeline stages hold whole layers, so the count can exceed ceil(weights / usable) by one (DeepSeek-V3
on H100: 61 layers in 10 stages put 7 layers in the largest, 72.6 GB against 72 GB usable)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from kvflow.cli import main
from kvflow.doctor.deployment import NODE_DEVICES, plan_deployment
from kvflow.doctor.hardware import named_hardware
from kvflow.doctor.model_spec import ModelSpec
from kvflow.doctor.roofline import Roofline

CONFIGS = Path(__file__).parent / "configs"
GB = 1e9
CONTEXT, OUTPUT_LEN = 2048, 256  # the calculator's defaults: requests of 2,304 tokens


def spec(name: str) -> ModelSpec:
    return ModelSpec.from_config(json.loads((CONFIGS / f"{name}.json").read_text()), name)


@pytest.mark.parametrize(
    ("name", "published_gb", "tolerance"),
    [
        # DeepSeek-V3 as shipped: FP8 with 128x128 block scales; the Hub's 688.6 GB include the 14B
        # MTP module kvflow does not load (~2%).
        ("deepseek-v3", 688.6, 0.03),
        # bf16, 405B parameters (meta-llama/Llama-3.1-405B: "405B"): 2 bytes each.
        ("llama-3.1-405b", 810.0, 0.01),
        # bf16, 235B parameters, 22B active (Qwen/Qwen3-235B-A22B).
        ("qwen3-235b-a22b", 470.0, 0.01),
        # MXFP4 experts, the rest bf16 (openai/gpt-oss-120b: 65.25 GB).
        ("gpt-oss-120b", 65.25, 0.01),
    ],
)
def test_weight_bytes_against_the_published_checkpoints(
    name: str, published_gb: float, tolerance: float
) -> None:
    assert spec(name).weight_bytes() / GB == pytest.approx(published_gb, rel=tolerance)


@pytest.mark.parametrize(
    ("name", "hardware", "min_devices", "fewest_layout"),
    [
        ("deepseek-v3", "h100", 11, "TP 1 x PP 11"),
        ("deepseek-v3", "h200", 6, "TP 2 x PP 3"),
        ("deepseek-v3", "mi300x", 4, "TP 4 x PP 1"),
        ("llama-3.1-405b", "h100", 12, "TP 4 x PP 3"),
        ("llama-3.1-405b", "h200", 7, "TP 1 x PP 7"),
        ("llama-3.1-405b", "mi300x", 5, "TP 1 x PP 5"),
        ("qwen3-235b-a22b", "h100", 7, "TP 1 x PP 7"),
        ("qwen3-235b-a22b", "h200", 4, "TP 4 x PP 1"),
        ("qwen3-235b-a22b", "mi300x", 3, "TP 1 x PP 3"),
        ("gpt-oss-120b", "h100", 1, "TP 1 x PP 1"),
        ("gpt-oss-120b", "mi300x", 1, "TP 1 x PP 1"),
    ],
)
def test_min_devices_and_the_layouts_that_hold_the_model(
    name: str, hardware: str, min_devices: int, fewest_layout: str
) -> None:
    m = spec(name)
    roofline = Roofline(m, named_hardware(hardware), m.weight_dtype, m.dtype)
    plan = plan_deployment(roofline, 1, CONTEXT + OUTPUT_LEN, CONTEXT + OUTPUT_LEN // 2)
    assert plan.min_devices == min_devices
    assert plan.min_devices >= math.ceil((plan.weight_bytes + plan.kv_bytes) / plan.usable_bytes_per_device)
    assert plan.layouts[0].name == fewest_layout and plan.layouts[0].devices == min_devices
    heads, kv_heads = m.arch.num_attention_heads, m.arch.num_key_value_heads
    for layout in plan.layouts:
        assert layout.fits and layout.devices >= min_devices
        assert layout.tensor_parallel <= NODE_DEVICES and heads % layout.tensor_parallel == 0
        assert kv_heads % layout.tensor_parallel == 0 or layout.tensor_parallel % kv_heads == 0
        if layout.expert_parallel > 1:
            assert m.moe_layer is not None and m.moe_layer.num_experts % layout.expert_parallel == 0
    # Whole nodes are listed after the fewest devices; tensor parallelism cuts the decode step.
    if min_devices > 1:
        node = [layout for layout in plan.layouts if layout.devices % NODE_DEVICES == 0]
        assert node and min(layout.decode.seconds for layout in node) < plan.layouts[0].decode.seconds


def test_expert_parallel_holds_only_a_share_of_the_experts() -> None:
    m = spec("deepseek-v3")
    plan = plan_deployment(Roofline(m, named_hardware("h100"), m.weight_dtype, m.dtype), 1, 2304, 2176)
    ep = next(layout for layout in plan.layouts if layout.expert_parallel > 1)
    roles = m.weight_bytes_by_role(m.weight_dtype)
    assert ep.expert_parallel == 16 and ep.devices == 16
    dense = roles.layers_dense + roles.embedding + roles.lm_head + roles.final_norm
    assert ep.weight_bytes_per_device == pytest.approx(dense + roles.routed_experts / 16)


def test_calculator_json_and_text_say_how_many_devices(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "deepseek-v3"
    model.mkdir()
    (model / "config.json").write_text((CONFIGS / "deepseek-v3.json").read_text())
    assert main(["doctor", str(model), "--hardware", "h100", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    deployment = doc["deployment"]
    assert deployment["min_devices"] == 11 and deployment["layouts"][0]["devices"] == 11
    assert {"name", "devices", "nodes", "bytes_per_device", "decode_ms_per_step"} <= set(
        deployment["layouts"][0]
    )
    kv = next(f for f in doc["findings"] if f["id"] == "kv_memory")
    assert "11 devices at least" in kv["summary"]
    # No "0 -> 0" KV-dtype what-ifs: no dtype makes a request fit on one card that the weights overflow.
    assert not [w for w in kv["what_ifs"] if "max_concurrency_at_p95" in w["predicted"]]
    assert main(["doctor", str(model), "--hardware", "h100"]) == 0
    text = capsys.readouterr().out
    assert "deployment: weights 673.0 GB" in text and "at least 11 device(s)" in text
    assert "TP 8 x PP 2: 16 devices (2 node(s))" in text
