"""Mixture-of-experts decode against its active-parameter roofline, and latent attention's KV savings.

    python benchmarks/moe_mla.py [--small] [--skip-moe] [--skip-mla] [--context 4096] [--tokens 64]

MoE: a random-weight checkpoint shaped like a scaled-down Qwen3-MoE (bf16, 64 experts, top-8;
~1.5B total / ~0.3B active parameters at full size), single-stream decode (median inter-token
gap after a 128-token prompt):
    tok/s            measured
    active roofline  read bandwidth (a 1 GiB float32 sum, measured now) / the bytes one decode step
                     reads: active layers (router, attention, the 8 routed experts) + LM head + KV
                     (kvflow/doctor/model_spec.py decode_weight_bytes); target >= 60%
    dense            a Qwen3 dense checkpoint of the same total size, same hidden size and layers
                     (its MLP widened to match): it reads every parameter per token
MLA: a DeepSeek-V2-Lite-shaped attention (16 heads, kv_lora_rank 512 + qk_rope_head_dim 64,
qk_nope 128, v 128) in a few layers with small experts:
    KV bytes/token   the engine's latent pool vs MHA of the same shape (K 192 + V 128 per head),
                     and the tokens a fixed KV budget holds; also DeepSeek-V2-Lite and V3 from
                     their config.json (tests/doctor/configs, the calculator)
    decode ITL       median inter-token gap at `--context` tokens with W_UK / W_UV absorbed into
                     query and output (attention over the latents) and with the context's K/V
                     re-expanded every step
`--small` shrinks every model and the context to check that the script runs (numbers meaningless).
Checkpoints are built once into ~/.cache/kvflow-bench (a few GB at full size).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "tests"))

from fixtures.checkpoints import train_tokenizer  # noqa: E402
from offline_throughput import measure_bandwidth_gbs  # noqa: E402

from kvflow import LLM, SamplingParams  # noqa: E402
from kvflow.doctor.model_spec import ModelSpec  # noqa: E402
from kvflow.models.deepseek_v2 import DeepseekV2ForCausalLM  # noqa: E402

CACHE_DIR = Path.home() / ".cache" / "kvflow-bench"
VOCAB = 32000
KV_BUDGET_BYTES = 1 << 30  # the fixed budget the pool capacities are compared at
ROOFLINE_TARGET = 0.6

# Scaled-down Qwen3-MoE: 16 layers x 64 experts of 3 x 1024 x 448 = 1.41B expert parameters;
# a token uses 8 of them per layer (0.18B) + attention (0.04B) + embedding and head (0.07B).
MOE_FULL: dict[str, Any] = dict(
    hidden_size=1024,
    num_hidden_layers=16,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
    num_experts=64,
    num_experts_per_tok=8,
    moe_intermediate_size=448,
    intermediate_size=2048,
    norm_topk_prob=True,
)
MOE_SMALL = {**MOE_FULL, "hidden_size": 256, "num_hidden_layers": 2, "moe_intermediate_size": 64}
# DeepSeek-V2-Lite's attention; small experts (the benchmark is about attention).
MLA_FULL: dict[str, Any] = dict(
    hidden_size=2048,
    num_hidden_layers=4,
    num_attention_heads=16,
    num_key_value_heads=16,
    q_lora_rank=None,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=128,
    v_head_dim=128,
    n_routed_experts=16,
    num_experts_per_tok=2,
    n_shared_experts=1,
    moe_intermediate_size=256,
    intermediate_size=2048,
    first_k_dense_replace=1,
)
MLA_SMALL = {
    **MLA_FULL,
    "hidden_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
}


def build(name: str, config_class: str, values: dict[str, Any]) -> Path:
    """A random bf16 checkpoint of `config_class` with `values`, cached by name."""
    import transformers

    out = CACHE_DIR / name
    if (out / "config.json").exists():
        return out
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(
        vocab_size=VOCAB, max_position_embeddings=8192, tie_word_embeddings=False, **values
    )
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    train_tokenizer(out)  # any byte-level BPE will do: prompts are token ids
    del model
    gc.collect()
    return out


def decode_tok_s(llm: LLM, prompt_len: int, out_len: int, seed: int = 1) -> tuple[float, list[int]]:
    """Single-stream decode tokens/s (1 / median inter-token gap) and the prompt used."""
    prompt = [random.Random(seed).randrange(VOCAB) for _ in range(prompt_len)]
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    out = llm.generate([prompt], params)[0]
    return 1.0 / statistics.median(out.metrics.itl), prompt


def bench_moe(small: bool, tokens: int, bandwidth: float) -> None:
    shape = MOE_SMALL if small else MOE_FULL
    tag = "small" if small else "full"
    moe_path = build(f"qwen3-moe-{tag}", "Qwen3MoeConfig", shape)
    spec = ModelSpec.from_dir(moe_path)
    print(
        f"MoE model: {spec.num_params / 1e9:.2f}B total, {spec.num_active_params / 1e9:.3f}B active "
        f"({shape['num_experts']} experts, top-{shape['num_experts_per_tok']}, bf16)"
    )
    llm = LLM(str(moe_path), dtype="bfloat16", max_model_len=1024)
    decode_tok_s(llm, 16, 8)  # warm-up
    moe_tok_s, _ = decode_tok_s(llm, 128, tokens)
    step_bytes = spec.decode_weight_bytes("bfloat16", 1) + (128 + tokens) * spec.kv_bytes_per_token(
        "bfloat16"
    )
    roofline = bandwidth * 1e9 / step_bytes
    print(
        f"  decode {moe_tok_s:.1f} tok/s; active-parameter roofline {roofline:.1f} tok/s "
        f"({step_bytes / 1e9:.3f} GB/step at {bandwidth:.1f} GB/s): {moe_tok_s / roofline:.0%} "
        f"(target >= {ROOFLINE_TARGET:.0%})"
    )
    for batch in (1, 8):
        read, nbytes = spec.experts_read_per_layer(batch), spec.decode_weight_bytes("bfloat16", batch)
        print(
            f"  batch {batch} reads {read:.1f} of {shape['num_experts']} experts per layer: "
            f"{nbytes / 1e9:.3f} GB of weights per step"
        )
    del llm
    gc.collect()
    # The dense model of the same total size: same hidden size and depth, MLP widened.
    attention_and_embeddings = spec.num_params - spec.num_moe_layers * (
        spec.moe_layer.total if spec.moe_layer else 0
    )
    dense_intermediate = (
        round(
            (spec.num_params - attention_and_embeddings)
            / (3 * shape["hidden_size"] * shape["num_hidden_layers"])
            / 64
        )
        * 64
    )
    dense_shape = {
        k: v
        for k, v in shape.items()
        if k not in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob")
    }
    dense_shape["intermediate_size"] = dense_intermediate
    dense_path = build(f"qwen3-dense-{tag}", "Qwen3Config", dense_shape)
    dense_spec = ModelSpec.from_dir(dense_path)
    dense = LLM(str(dense_path), dtype="bfloat16", max_model_len=1024)
    decode_tok_s(dense, 16, 8)
    dense_tok_s, _ = decode_tok_s(dense, 128, tokens)
    bytes_ratio = dense_spec.decode_weight_bytes("bfloat16") / spec.decode_weight_bytes("bfloat16")
    print(
        f"  dense {dense_spec.num_params / 1e9:.2f}B (intermediate {dense_intermediate}): "
        f"{dense_tok_s:.1f} tok/s; MoE / dense = {moe_tok_s / dense_tok_s:.2f}x "
        f"(bytes ratio {bytes_ratio:.2f}x)"
    )
    del dense
    gc.collect()


def bench_mla(small: bool, context: int, tokens: int) -> None:
    shape = MLA_SMALL if small else MLA_FULL
    tag = "small" if small else "full"
    for name in ("deepseek-v2-lite", "deepseek-v3"):
        cfg = json.loads((REPO / "tests" / "doctor" / "configs" / f"{name}.json").read_text())
        spec = ModelSpec.from_config(cfg, name)
        mla = spec.arch.mla
        assert mla is not None
        mha = (
            spec.arch.num_hidden_layers
            * spec.arch.num_attention_heads
            * (mla.qk_head_dim + mla.v_head_dim)
            * 2
        )
        latent = spec.kv_bytes_per_token("bfloat16")
        print(
            f"{name} (config.json): MLA {latent:,.0f} bytes/token vs MHA {mha:,} ({mha / latent:.1f}x); "
            f"{KV_BUDGET_BYTES >> 30} GiB holds {KV_BUDGET_BYTES // latent:,.0f} vs "
            f"{KV_BUDGET_BYTES // mha:,} tokens"
        )
    path = build(f"deepseek-v2-mla-{tag}", "DeepseekV2Config", shape)
    llm = LLM(str(path), dtype="bfloat16", max_model_len=context + tokens + 16, max_num_batched_tokens=2048)
    engine = llm.llm_engine
    heads = shape["num_attention_heads"]
    mha = (
        shape["num_hidden_layers"]
        * heads
        * (shape["qk_nope_head_dim"] + shape["qk_rope_head_dim"] + shape["v_head_dim"])
        * 2
    )
    store = engine.model_runner.kv_store
    pool_tokens = store.num_blocks * store.block_size
    per_token = engine.kv_bytes_per_token
    print(
        f"benchmark MLA model: pool {per_token} bytes/token (allocated {store.num_bytes / pool_tokens:.0f}) "
        f"vs MHA {mha}; {KV_BUDGET_BYTES >> 30} GiB holds {KV_BUDGET_BYTES // per_token:,} vs "
        f"{KV_BUDGET_BYTES // mha:,} tokens"
    )
    model = engine.model_runner.model
    assert isinstance(model, DeepseekV2ForCausalLM)
    start = time.perf_counter()
    absorbed, _ = decode_tok_s(llm, context, tokens, seed=3)
    print(f"  prefill + decode at {context} context: {time.perf_counter() - start:.1f} s")
    model.set_weight_absorption(False)
    expanded, _ = decode_tok_s(llm, context, tokens, seed=3)  # the prompt's blocks are cached: decode only
    print(
        f"  decode ITL at {context} context: absorbed {1e3 / absorbed:.2f} ms, re-expanded "
        f"{1e3 / expanded:.2f} ms ({absorbed / expanded:.2f}x faster absorbed)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--small", action="store_true", help="tiny shapes: checks that the script runs")
    parser.add_argument("--skip-moe", action="store_true")
    parser.add_argument("--skip-mla", action="store_true")
    parser.add_argument("--context", type=int, default=4096, help="MLA decode context (tokens)")
    parser.add_argument("--tokens", type=int, default=64, help="decoded tokens per measurement")
    args = parser.parse_args()
    context = min(args.context, 256) if args.small else args.context
    print(f"torch threads: {torch.get_num_threads()}")
    if not args.skip_moe:
        bandwidth = measure_bandwidth_gbs()
        print(f"read bandwidth: {bandwidth:.1f} GB/s")
        bench_moe(args.small, args.tokens, bandwidth)
    if not args.skip_mla:
        bench_mla(args.small, context, args.tokens)


if __name__ == "__main__":
    main()
