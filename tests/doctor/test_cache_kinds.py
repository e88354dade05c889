"""The calculator on models that mix cache kinds (gpt-oss: sliding + full; Gemma 3: 5 sliding to 1
full; Qwen3-Next: linear attention + full), from their published config.json alone: parameters
against the published totals, and the KV a request holds per kind computed by hand from the
config's heads and dims (docs/doctor.md, "Cache kinds")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvflow.cli import main
from kvflow.doctor.evidence import calculator_evidence
from kvflow.doctor.findings import Diagnosis, diagnose
from kvflow.doctor.hardware import NAMED
from kvflow.doctor.model_spec import ModelSpec
from kvflow.doctor.roofline import Roofline
from kvflow.doctor.server_settings import EngineSettings
from kvflow.doctor.text_config import text_model_config

CONFIGS = Path(__file__).parent / "configs"
BILLION = 1e9
K32 = 32_768
BF16 = 2  # bytes per K/V element of these bf16 checkpoints


def spec(name: str) -> ModelSpec:
    return ModelSpec.from_config(json.loads((CONFIGS / f"{name}.json").read_text()), name)


@pytest.mark.parametrize(
    ("name", "total_b", "active_b"),
    [
        # OpenAI's model card (Table 1): 20.91B / 3.61B and 116.83B / 5.13B. Its "active" counts the
        # unembedding but not the embedding (a gather): the calculator's matmul_params.
        ("gpt-oss-20b", 20.91, 3.61),
        ("gpt-oss-120b", 116.83, 5.13),
    ],
)
def test_gpt_oss_total_and_active_parameters(name: str, total_b: float, active_b: float) -> None:
    s = spec(name)
    assert s.num_params / BILLION == pytest.approx(total_b, rel=0.02)
    assert s.matmul_params / BILLION == pytest.approx(active_b, rel=0.02)


def test_gpt_oss_layer_by_hand() -> None:
    s, h, i = spec("gpt-oss-20b"), 2880, 2880
    attention = h * 64 * 64 + 64 * 64 + 2 * (h * 8 * 64 + 8 * 64) + 64 * 64 * h + h + 64  # biases, sinks
    expert = 2 * i * h + 2 * i + h * i + h  # gate_up [2I, H] + bias, down [H, I] + bias
    layer = attention + 32 * h + 32 + 32 * expert + 2 * h  # router with bias, 32 experts, 2 norms
    assert s.layer_params == 24 * layer
    assert s.moe_layer is not None and s.moe_layer.per_expert == expert


def test_gemma3_text_parameters_and_the_nested_config() -> None:
    s = spec("gemma-3-27b")  # Gemma3ForConditionalGeneration: the text model of text_config
    assert s.arch.architecture == "Gemma3ForCausalLM" and s.arch.tie_word_embeddings
    assert s.num_params / BILLION == pytest.approx(27.0, rel=0.02)  # the 27B without its 0.4B vision tower
    h, kv = 5376, 16 * 128
    layer = h * 4096 + 2 * h * kv + 4096 * h + 2 * 128 + 3 * h * 21504 + 4 * h  # q/k norms, 4 norms
    assert s.layer_params == 62 * layer
    assert s.embedding_params == 262_208 * h and s.lm_head_params == 0  # tied


def test_gemma3_defaults_are_transformers() -> None:
    """The released text_config leaves out what Gemma3TextConfig defaults; transformers fills the
    same values (and derives the same 5-sliding-to-1-full layer types) as text_model_config."""
    transformers = pytest.importorskip("transformers")
    released = json.loads((CONFIGS / "gemma-3-27b.json").read_text())
    theirs = transformers.Gemma3Config(
        **{k: v for k, v in released.items() if k != "architectures"}
    ).text_config
    ours = text_model_config(released)
    for key in (
        "vocab_size",
        "tie_word_embeddings",
        "hidden_activation",
        "max_position_embeddings",
        "rms_norm_eps",
    ):
        assert ours[key] == getattr(theirs, key), key
    assert list(spec("gemma-3-27b").arch.layer_types) == list(theirs.layer_types)


def test_qwen3_next_parameters() -> None:
    s = spec("qwen3-next-80b-a3b")
    assert s.num_params / BILLION == pytest.approx(80, rel=0.02)  # 79.67B
    # "3B activated" is a round figure (the A3B of the name): 3.87B with the embedding and LM head
    # (the convention of Qwen3-30B-A3B's 3.3B), 3.25B without.
    assert (
        3.0 <= (s.num_active_params - 2 * s.embedding_params) / BILLION < s.num_active_params / BILLION < 4.0
    )
    h, lin = 2048, 16 * 128  # hidden; linear key dim (value dim 32 x 128 = 4096)
    full = h * 2 * 16 * 256 + 2 * h * 2 * 256 + 16 * 256 * h  # q_proj gives a query and a gate per head
    linear = h * (2 * lin + 2 * 4096) + h * 64 + (2 * lin + 4096) * 4 + 32 + 32 + 128 + 4096 * h
    moe = 512 * h + h + 3 * h * 512 + 512 * 3 * h * 512  # router, shared gate, shared expert, experts
    assert s.layer_params == 12 * (full + 2 * h + 2 * 256) + 36 * (linear + 2 * h) + 48 * moe


def per_kind(name: str, tokens: int) -> dict[str, int]:
    return spec(name).kv_bytes_per_request_by_kind(tokens, "bfloat16")


def test_gpt_oss_32k_request_by_kind() -> None:
    token = 2 * 8 * 64 * BF16  # K and V of 8 KV heads of 64 dims, per layer
    # At L = 32,768 (a block multiple) the 128-token window is exactly the last 8 blocks.
    assert per_kind("gpt-oss-20b", K32) == {
        "full_attention": 12 * K32 * token,
        "sliding_attention": 12 * 128 * token,
    }
    assert per_kind("gpt-oss-120b", K32) == {
        "full_attention": 18 * K32 * token,
        "sliding_attention": 18 * 128 * token,
    }
    assert spec("gpt-oss-20b").kv_bytes_per_request(K32, "bfloat16") == 805_306_368 + 3_145_728


def test_gemma3_32k_request_by_kind() -> None:
    token = 2 * 16 * 128 * BF16
    # 10 full layers form one group of 10 layer slots; the 52 sliding ones 6 groups (the last holds 2
    # layers in 10 slots, padding the pool spends too), each holding the window's 1,024 tokens.
    assert per_kind("gemma-3-27b", K32) == {
        "full_attention": 10 * K32 * token,
        "sliding_attention": 6 * 10 * 1024 * token,
    }


def test_qwen3_next_32k_request_by_kind() -> None:
    token = 2 * 2 * 256 * BF16
    state = 32 * 128 * 128 * 4 + (2 * 16 * 128 + 32 * 128) * 3 * BF16  # float32 recurrent + conv
    pages = -(-state // (16 * token))  # blocks of 16 tokens' K/V per layer slot: 66
    assert per_kind("qwen3-next-80b-a3b", K32) == {
        "full_attention": 12 * K32 * token,
        "linear_attention": 36 * pages * 16 * token,  # 3 groups of 12 slots
    }


@pytest.mark.parametrize("name", ["gpt-oss-20b", "gpt-oss-120b", "gemma-3-27b", "qwen3-next-80b-a3b"])
def test_sliding_and_state_bytes_do_not_grow_with_the_request(name: str) -> None:
    short, long = per_kind(name, 8192), per_kind(name, 131_072)
    for kind in short:
        if kind == "full_attention":
            assert long[kind] == 16 * short[kind]
        else:
            assert long[kind] == short[kind] > 0


def test_decode_reads_the_window_and_the_state() -> None:
    gpt = spec("gpt-oss-20b")
    token = 2 * 8 * 64 * BF16
    assert gpt.decode_kv_bytes(K32, "bfloat16") == 12 * K32 * token + 12 * 128 * token
    qwen = spec("qwen3-next-80b-a3b")
    state = 32 * 128 * 128 * 4 + 8192 * 3 * BF16
    assert (
        qwen.decode_kv_bytes(K32, "bfloat16") == 12 * K32 * 2 * 2 * 256 * BF16 + 2 * 36 * state
    )  # read, write
    # Attention FLOPs: sliding layers stop at the window, linear layers cost the same at any context.
    grow = gpt.attention_flops(1, 2 * K32) - gpt.attention_flops(1, K32)
    assert grow == pytest.approx(12 * K32 * 4 * 64 * 64)
    grow = qwen.attention_flops(1, 2 * K32) - qwen.attention_flops(1, K32)
    assert grow == pytest.approx(12 * K32 * 4 * 16 * 256)


def test_the_doctor_and_the_engine_size_the_same_groups() -> None:
    """kvflow/attention/kv_store.py kv_cache_config_for (torch) and the doctor's torch-free copy."""
    torch = pytest.importorskip("torch")
    from kvflow.attention.kv_store import kv_cache_config_for
    from kvflow.config import CacheConfig

    names = (
        "gpt-oss-20b",
        "gemma-3-27b",
        "qwen3-next-80b-a3b",
        "deepseek-v3",
        "mistral-7b",
        "deepseek-v4-flash",
    )
    for name in names:
        s = spec(name)
        for engine_dtype, doctor_dtype in (
            ("auto", "bfloat16"),
            ("int8", "int8"),
            ("fp8_e4m3", "fp8"),
            ("int4", "int4"),
        ):
            if name.startswith("deepseek-v4") and engine_dtype == "int4":
                continue  # the engine refuses int4 for V4's compressed kinds
            engine, _ = kv_cache_config_for(s.arch, torch.bfloat16, CacheConfig(kv_cache_dtype=engine_dtype))
            assert s.kv_cache_config(doctor_dtype) == engine, (name, engine_dtype)


def test_kv_dtype_what_if_leaves_the_state_alone() -> None:
    model = spec("qwen3-next-80b-a3b")
    roof = Roofline(model, NAMED["h200"], "int4", "bfloat16")
    d = Diagnosis(model, roof, calculator_evidence(K32, 4, 256), EngineSettings(), measured=False)
    kv = next(f for f in diagnose(d) if f.id == "kv_memory")
    assert "of which" in kv.summary and "linear-attention" in kv.summary
    fp8 = next(w for w in kv.what_ifs if w.change == "fp8 KV cache")
    assert "float32 whatever the KV dtype" in fp8.effect
    length = K32 + 256
    full_only = model.kv_bytes_per_request_by_kind(length, "bfloat16")["full_attention"]
    assert model.kv_bytes_per_request(length, "fp8") > full_only / 2  # the state did not halve


def test_calculator_reports_the_split(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model_dir = tmp_path / "gemma"
    model_dir.mkdir()
    (model_dir / "config.json").write_text((CONFIGS / "gemma-3-27b.json").read_text())
    out = tmp_path / "doctor.json"
    args = ["doctor", str(model_dir), "--hardware", "h200", "--context", str(K32), "--output", str(out)]
    assert main(args) == 0
    assert "KV by cache kind: a 33,024-token request holds" in capsys.readouterr().out
    kv = json.loads(out.read_text())["kv"]
    assert kv["layers_by_kind"] == {"sliding_attention": 52, "full_attention": 10}
    assert set(kv["bytes_per_request_by_kind"]) == {"sliding_attention", "full_attention"}
    assert kv["bytes_per_request"] == sum(kv["bytes_per_request_by_kind"].values())
