"""Quantized prefill: the dequantized blocks (bf16 activations) against the int8 x int8 GEMV.

    python benchmarks/quantized_prefill.py [--rows 512] [--runs 4]

Where oneDNN has no bf16 GEMM (AVX2 CPUs), kvflow/quant/linear.py sends every row of an int8 / int4
linear through the native GEMV; elsewhere prefill chunks take the dequantized blocks.
KVFLOW_QUANTIZED_PREFILL=dequantize|gemv forces either, on any CPU. Two parts, each alternating the
two routings in one process so that a drifting machine moves both alike:
- layers: int8 and int4 g32 linears of the Qwen2.5-0.5B shape at --rows rows, GOP/s (2 M N K / time,
  median of 5 calls);
- model: a 512-token prefill of the Qwen2.5-0.5B-shaped checkpoint (benchmarks/offline_throughput.py
  builds it; LM head quantized too), both routings loaded side by side, a fresh prompt per run (no
  prefix-cache hits), median of --runs after the first.
Numbers in benchmarks/NOTES.md, session 14.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from offline_throughput import build_checkpoint  # noqa: E402

from kvflow import LLM, SamplingParams  # noqa: E402
from kvflow.quant.linear import (  # noqa: E402
    NATIVE_GEMV_MAX_ROWS,
    QUANTIZED_PREFILL_ENV,
    Int4Linear,
    Int8Linear,
)
from kvflow.quant.weights import quantize_int4, quantize_int8  # noqa: E402

# (out_features, in_features) of the Qwen2.5-0.5B linears (q/k/v and gate/up fused as kvflow loads them).
SHAPES = {"qkv": (1152, 896), "gate_up": (9728, 896), "down": (896, 4864)}
GROUP_SIZE = 32  # q4_0's group
PROMPT_LEN = 512
CALLS = 5
ROUTINGS = ("dequantize", "gemv")
UNBOUNDED = sys.maxsize


def time_layers(rows: int) -> None:
    torch.manual_seed(0)
    for name, (n, k) in SHAPES.items():
        w = (torch.randn(n, k) * 0.02).bfloat16()
        x = torch.randn(rows, k).bfloat16()
        layers: dict[str, Int8Linear | Int4Linear] = {
            "int8": Int8Linear(quantize_int8(w), None, torch.bfloat16),
            "int4 g32": Int4Linear(quantize_int4(w, GROUP_SIZE), None, torch.bfloat16),
        }
        for fmt, layer in layers.items():
            cells = []
            for routing in ROUTINGS:
                layer.max_gemv_rows = NATIVE_GEMV_MAX_ROWS if routing == "dequantize" else UNBOUNDED
                layer(x)
                times = []
                for _ in range(CALLS):
                    start = time.perf_counter()
                    layer(x)
                    times.append(time.perf_counter() - start)
                seconds = statistics.median(times)
                gops = 2 * rows * n * k / seconds / 1e9
                cells.append(f"{routing} {seconds * 1e3:6.1f} ms {gops:6.1f} GOP/s")
            print(f"{name:8s} {fmt:8s} M={rows}: " + " | ".join(cells), flush=True)


def time_model(runs: int) -> None:
    checkpoint = build_checkpoint(torch.bfloat16)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for fmt, extra in (("int4", {"quantization_group_size": GROUP_SIZE}), ("int8", {})):
        engines = {}
        for routing in ROUTINGS:  # read when the layers are built
            os.environ[QUANTIZED_PREFILL_ENV] = routing
            engines[routing] = LLM(
                str(checkpoint),
                max_model_len=2 * PROMPT_LEN,
                quantization=fmt,
                quantize_lm_head=True,
                **extra,
            )
        os.environ.pop(QUANTIZED_PREFILL_ENV)
        times: dict[str, list[float]] = {r: [] for r in ROUTINGS}
        first = 1000  # token ids: a fresh prompt every run, so no run hits the prefix cache
        for _ in range(runs):
            for routing, llm in engines.items():
                prompt = list(range(first, first + PROMPT_LEN))
                first += PROMPT_LEN
                start = time.perf_counter()
                llm.generate([prompt], params)
                times[routing].append(time.perf_counter() - start)
        medians = {r: statistics.median(t[1:]) for r, t in times.items()}
        print(
            f"{fmt} prefill {PROMPT_LEN}: "
            + " | ".join(f"{r} {m:.2f} s" for r, m in medians.items())
            + f" -> {medians['dequantize'] / medians['gemv']:.2f}x",
            flush=True,
        )
        del engines


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=PROMPT_LEN)
    parser.add_argument("--runs", type=int, default=4)
    args = parser.parse_args()
    time_layers(args.rows)
    time_model(args.runs)


if __name__ == "__main__":
    main()
