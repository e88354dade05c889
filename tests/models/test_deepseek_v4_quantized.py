"""DeepSeek-V4 checkpoints as released: FP8 projections with ue8m0 block scales (`X.scale`), routed
experts in FP4 (int8 bytes of two e2m1 codes, a ue8m0 scale per 32 inputs), made in the test from the
tiny V4's weights. The dequantization is checked against transformers' own (Fp8Dequantize, which
reads both); greedy tokens in float32 identical to transformers on the dequantized weights; in bf16
the projections compute on their stored bytes (Fp8Linear, and GGUFLinear's MXFP4 for the experts)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from fixtures.checkpoints import V4_ARCH
from safetensors.torch import load_file, save_file
from test_hf_equivalence import _check, _params, hf_reference

from kvflow import LLM, SamplingParams
from kvflow.errors import ModelLoadError
from kvflow.quant.fp8 import Fp8Linear
from kvflow.quant.gguf_linear import GGUFLinear

pytest.importorskip("transformers")

BLOCK = 16  # the tiny model's FP8 block (the release's is 128): its shapes (16-256) hold whole blocks
FP4_GROUP = 32
FP8_MAX, E2M1_MAX = 448.0, 6.0
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
QUANTIZATION_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [BLOCK, BLOCK],
    "scale_fmt": "ue8m0",
    "expert_dtype": "fp4",
}


def _power_of_two_at_least(x: torch.Tensor) -> torch.Tensor:
    return torch.exp2(torch.ceil(torch.log2(x.clamp(min=2.0**-100))))


def fp8_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] -> (e4m3 [N, K], ue8m0 scales [N / 16, K / 16], the values they hold)."""
    n, k = w.shape
    blocks = w.reshape(n // BLOCK, BLOCK, k // BLOCK, BLOCK)
    scale = _power_of_two_at_least(blocks.abs().amax(dim=(1, 3)) / FP8_MAX)
    expanded = scale[:, None, :, None]
    q = (blocks / expanded).reshape(n, k).to(torch.float8_e4m3fn)
    values = (q.float().reshape(blocks.shape) * expanded).reshape(n, k)
    return q, scale.to(torch.float8_e8m0fnu), values


def fp4_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] -> (int8 [N, K / 2]: codes 2j low, 2j + 1 high; ue8m0 scales [N, K / 32]; values)."""
    n, k = w.shape
    groups = w.reshape(n, k // FP4_GROUP, FP4_GROUP)
    scale = _power_of_two_at_least(groups.abs().amax(-1) / E2M1_MAX)
    scaled = groups / scale[..., None]
    magnitude = (scaled.abs()[..., None] - E2M1).abs().argmin(-1)
    codes = (magnitude | torch.where(scaled < 0, 8, 0)).reshape(n, k)
    values = (E2M1[magnitude] * torch.where(scaled < 0, -1.0, 1.0) * scale[..., None]).reshape(n, k)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    return packed, scale.to(torch.float8_e8m0fnu), values


def _kind(name: str) -> str | None:
    if ".ffn.experts." in name and name.endswith(".weight"):
        return "fp4"
    if name.endswith(".weight") and (".attn." in name or ".shared_experts." in name) and "ape" not in name:
        return "fp8"
    return None


def write_pair(source: Path, out: Path) -> tuple[Path, Path]:
    """(the V4-format checkpoint, the same values dequantized in float32)."""
    quantized, dequantized = out / "v4-fp8-fp4", out / "dequantized"
    for d in (quantized, dequantized):
        shutil.copytree(source, d)
    q_tensors: dict[str, torch.Tensor] = {}
    d_tensors: dict[str, torch.Tensor] = {}
    for name, w in load_file(source / "model.safetensors").items():
        kind = _kind(name) if w.dim() == 2 else None
        if kind is None:
            q_tensors[name] = d_tensors[name] = w
            continue
        q, scale, values = (fp8_blocks if kind == "fp8" else fp4_rows)(w.float())
        q_tensors[name], q_tensors[name.removesuffix(".weight") + ".scale"] = q, scale
        d_tensors[name] = values
    save_file(q_tensors, quantized / "model.safetensors")
    save_file(d_tensors, dequantized / "model.safetensors")
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = QUANTIZATION_CONFIG
    (quantized / "config.json").write_text(json.dumps(config))
    return quantized, dequantized


@pytest.fixture(scope="module")
def pair(
    tiny_checkpoint_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Path]:
    return write_pair(tiny_checkpoint_factory(V4_ARCH), tmp_path_factory.mktemp("v4q"))


def test_the_formats_read_as_transformers_dequantizes_them() -> None:
    """The test's packing is the format transformers reads: its Fp8Dequantize on the FP8 block and
    FP4 tensors gives the values the fixture says they hold."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    torch.manual_seed(0)
    w = torch.randn(64, 96)
    dequantize = Fp8Dequantize(None)._dequantize_one
    for pack in (fp8_blocks, fp4_rows):
        q, scale, values = pack(w)
        assert torch.equal(dequantize(q, scale, output_dtype=torch.float32), values)


def test_greedy_matches_transformers_on_the_dequantized_weights(pair: tuple[Path, Path]) -> None:
    quantized, dequantized = pair
    reference = hf_reference(dequantized)
    llm = LLM(str(quantized), dtype="float32")
    _check(reference, llm.generate(reference["prompts"], _params()))


def test_bf16_computes_on_the_stored_bytes(pair: tuple[Path, Path]) -> None:
    from kvflow.kernels import ggml_weight_kernels

    if ggml_weight_kernels() is None:
        pytest.skip("native kernels unavailable on this machine")
    from quant.test_kv_quant import teacher_forced_agreement

    quantized, dequantized = pair
    prompts = [[5 + i, 17, 42 + i, 99, 7] * 4 for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    reference = [
        o.outputs[0].token_ids for o in LLM(str(dequantized), dtype="bfloat16").generate(prompts, params)
    ]
    llm = LLM(str(quantized), dtype="bfloat16", max_num_batched_tokens=4, enable_prefix_caching=False)
    model: Any = llm.llm_engine.model_runner.model
    fp4 = [m for m in model.modules() if isinstance(m, GGUFLinear)]
    assert fp4 and all(m.type_name == "MXFP4" for m in fp4)  # every routed expert's projections
    assert any(isinstance(m, Fp8Linear) for m in model.modules())  # the attention projections
    agree, total = teacher_forced_agreement(llm, prompts, reference)
    print(f"DeepSeek-V4 FP8 + FP4 experts vs dequantized bf16: teacher-forced agreement {agree}/{total}")
    # The FP4 GEMV rounds activations to int8 per 32 (tests/quant/test_mxfp4_checkpoints.py's floor).
    assert agree / total >= 0.75


def test_damaged_tensors_name_the_tensor(pair: tuple[Path, Path], tmp_path: Path) -> None:
    quantized, _ = pair
    broken = tmp_path / "broken"
    shutil.copytree(quantized, broken)
    tensors = load_file(broken / "model.safetensors")
    name = "model.layers.1.ffn.experts.0.w1.scale"
    tensors[name] = tensors[name][:, :1].contiguous()
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"experts\.0\.w1\.weight: FP4 weight .* needs scales"):
        LLM(str(broken), dtype="float32")
    config = json.loads((broken / "config.json").read_text())
    del config["quantization_config"]
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ModelLoadError, match=r"has a scale tensor beside it but config\.json has no quantization"
    ):
        LLM(str(broken), dtype="float32")
