"""Quantization on the Qwen2.5-0.5B-shaped checkpoint, in one run: speed against each format's own
ceiling, KV capacity per KV dtype, and ITL under load per KV dtype.

    python benchmarks/quantization.py [--context 2048] [--concurrency 16] [--skip-itl]

1. Single-stream decode tokens/s (median inter-token gap) and prefill tokens/s (a 512-token
   prompt) for bf16, int8 and int4 weights, with the LM head kept in bf16 and quantized. Ceiling =
   memory bandwidth (a float32 sum over 1 GiB, measured in this run) / weight bytes read per token.
2. KV pool capacity in tokens at a fixed budget per KV dtype (from the engine's own sizing).
3. ITL p50/p99 of `--concurrency` requests with `--context`-token prompts, per KV dtype.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from offline_throughput import build_checkpoint, measure_bandwidth_gbs, prefill_rate, single_stream_decode

from kvflow import LLM, SamplingParams
from kvflow.bench.metrics import percentile
from kvflow.doctor.model_spec import ModelSpec

KV_BUDGET_BYTES = 256 * 2**20
WEIGHT_FORMATS = (("bf16", "none", False), ("int8", "int8", False), ("int4", "int4", False),
                  ("int8 + head", "int8", True), ("int4 + head", "int4", True))  # fmt: skip
KV_DTYPES = ("auto", "int8", "fp8_e4m3", "int4")


def weight_bytes_per_token(spec: ModelSpec, method: str, quantize_head: bool) -> float:
    """Bytes a decode step reads: layers in the format, the (tied) head in it or in bf16."""
    if method == "none":
        return spec.decode_weight_bytes()
    layers = spec.layer_params * (1.0 if method == "int8" else 0.5 + 4 / 128)  # int4: + scale, zero
    head_bytes_per_param = (1.0 if method == "int8" else 0.5 + 4 / 128) if quantize_head else 2.0
    return layers + spec.embedding_params * head_bytes_per_param


def speed_table(path: Path, vocab: int, bandwidth: float) -> None:
    spec = ModelSpec.from_dir(path)
    print(f"\nweights ({bandwidth:.1f} GB/s read bandwidth measured now)")
    print(f"{'format':<13}{'MB/token':>10}{'ceiling':>10}{'decode':>10}{'of ceiling':>12}{'prefill':>10}")
    for label, method, head in WEIGHT_FORMATS:
        llm = LLM(str(path), dtype="bfloat16", max_model_len=2048, quantization=method, quantize_lm_head=head,
                  quantization_group_size=128)  # fmt: skip
        single_stream_decode(llm, vocab, prompt_len=16, out_len=8)  # warm-up (kernel choice, caches)
        decode = statistics.median(single_stream_decode(llm, vocab) for _ in range(3))
        prefill = prefill_rate(llm, vocab)
        nbytes = weight_bytes_per_token(spec, method, head)
        ceiling = bandwidth * 1e9 / nbytes
        print(f"{label:<13}{nbytes / 1e6:>10.1f}{ceiling:>9.1f}/s{decode:>9.1f}/s{decode / ceiling:>11.0%}"
              f"{prefill:>9.0f}/s")  # fmt: skip
        del llm


def kv_capacity_table(path: Path) -> None:
    print(f"\nKV pool at a {KV_BUDGET_BYTES >> 20} MiB budget")
    base = None
    for kv in KV_DTYPES:
        llm = LLM(str(path), dtype="bfloat16", max_model_len=2048, kv_cache_memory_bytes=KV_BUDGET_BYTES,
                  kv_cache_dtype=kv)  # fmt: skip
        engine = llm.llm_engine
        tokens = engine.num_kv_blocks * engine.config.cache_config.block_size
        base = base or tokens
        print(f"{kv:<10}{tokens:>9} tokens {engine.kv_bytes_per_token:>7} bytes/token {tokens / base:>6.2f}x")
        del llm


def itl_table(path: Path, vocab: int, context: int, concurrency: int) -> None:
    print(f"\nITL with {concurrency} requests of {context}-token prompts decoding together")
    rng = random.Random(5)
    prompts = [[rng.randrange(vocab) for _ in range(context)] for _ in range(concurrency)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    for kv in KV_DTYPES:
        llm = LLM(str(path), dtype="bfloat16", max_model_len=context + 64, kv_cache_dtype=kv,
                  max_num_seqs=concurrency)  # fmt: skip
        outs = llm.generate(prompts, params)
        # Only the gaps after every prompt is in: decode steps of the full batch.
        last_prefill = max(o.metrics.first_token_time or 0.0 for o in outs)
        gaps = [
            (b - a) * 1e3
            for o in outs
            for a, b in zip(o.metrics.token_times, o.metrics.token_times[1:], strict=False)
            if a >= last_prefill
        ]
        print(f"{kv:<10} ITL p50 {percentile(gaps, 50):7.1f} ms  p99 {percentile(gaps, 99):7.1f} ms")
        del llm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--skip-itl", action="store_true")
    args = ap.parse_args()
    path = build_checkpoint(torch.bfloat16)
    vocab = 151_936
    bandwidth = measure_bandwidth_gbs()
    speed_table(path, vocab, bandwidth)
    kv_capacity_table(path)
    if not args.skip_itl:
        itl_table(path, vocab, args.context, args.concurrency)
    print(f"\nbandwidth again at the end: {measure_bandwidth_gbs():.1f} GB/s")


if __name__ == "__main__":
    main()
