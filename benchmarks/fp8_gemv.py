"""The FP8 decode GEMV (kvflow/kernels/gemv_fp8.cpp) against kvflow's bf16, int8 and int4 GEMVs and
the bandwidth roofline, on one projection shape, single row and 8 rows, in one run.

    python benchmarks/fp8_gemv.py [--n 4864] [--k 896] [--layers 24] [--reps 30]

`--layers` copies of the weight are cycled so the working set (layers x N x K bytes) exceeds the
caches, as a decode step's weights do. GB/s = the bytes each kernel reads per call (weights, scales,
zero points; activations left out) / median time; the probe is a torch sum over a buffer as large
(offline_throughput's measure_bandwidth_gbs). Engines alternate per repetition.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from offline_throughput import measure_bandwidth_gbs  # noqa: E402

from kvflow.layers.linear import Linear  # noqa: E402
from kvflow.quant.fp8 import FP8_DTYPE, Fp8Linear, UnpackedFp8  # noqa: E402
from kvflow.quant.linear import Int4Linear, Int8Linear  # noqa: E402
from kvflow.quant.weights import quantize_int4, quantize_int8  # noqa: E402

BLOCK = 128  # DeepSeek / Qwen3-FP8's weight_block_size


def _bytes_read(module: torch.nn.Module) -> int:
    """Bytes of every buffer and parameter the layer's kernel streams (the bias left out)."""
    tensors = [*module.named_buffers(), *module.named_parameters()]
    return sum(b.numel() * b.element_size() for name, b in tensors if name != "bias")


def alternated_median_times(
    layers: dict[str, list[torch.nn.Module]], x: torch.Tensor, reps: int
) -> dict[str, float]:
    """Median seconds per call of each engine's layers on `x`, the engines alternated per repetition
    and each repetition cycling through all copies (a working set larger than the caches)."""
    times: dict[str, list[float]] = {name: [] for name in layers}
    for _ in range(reps):
        for name, mods in layers.items():
            start = time.perf_counter()
            for m in mods:
                m(x)
            times[name].append((time.perf_counter() - start) / len(mods))
    return {name: statistics.median(t) for name, t in times.items()}


def report_gemv_shares(layers: dict[str, list[torch.nn.Module]], n: int, k: int, reps: int) -> None:
    """Time every engine's [N, K] layers at 1 and 8 rows, alternated, and print each one's bits per
    weight, time, GB/s of the bytes its kernel reads and share of the read-bandwidth probe."""
    probe = measure_bandwidth_gbs()
    for rows in (1, 8):
        x = torch.randn(rows, k).to(torch.bfloat16)
        times = alternated_median_times(layers, x, reps)
        print(f"rows {rows} (N {n}, K {k}; read-bandwidth probe {probe:.1f} GB/s)")
        for name, mods in layers.items():
            t = times[name]
            nbytes = _bytes_read(mods[0])
            gbs = nbytes / t / 1e9
            bits = 8 * nbytes / (n * k)
            print(
                f"  {name:9s} {bits:5.2f} bits/w {t * 1e6:8.1f} us  {gbs:6.1f} GB/s  "
                f"{100 * gbs / probe:5.1f}% of the probe"
            )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=4864)
    parser.add_argument("--k", type=int, default=896)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    n, k = args.n, args.k
    gen = torch.Generator().manual_seed(0)
    layers: dict[str, list[torch.nn.Module]] = {"bf16": [], "int8": [], "int4 g32": [], "fp8": []}
    for _ in range(args.layers):
        w = torch.randn(n, k, generator=gen) * 0.02
        lin = Linear(k, n, False, torch.bfloat16)
        lin.weight.data.copy_(w.to(torch.bfloat16))
        lin.prepare_for_inference()
        layers["bf16"].append(lin)
        layers["int8"].append(Int8Linear(quantize_int8(w), None, torch.bfloat16))
        layers["int4 g32"].append(Int4Linear(quantize_int4(w, 32), None, torch.bfloat16))
        blocks = -(-k // BLOCK)
        s = torch.stack(
            [w[:, j * BLOCK : (j + 1) * BLOCK].abs().amax(dim=1) / 448 for j in range(blocks)], dim=1
        )
        q = (w / s.repeat_interleave(BLOCK, 1)[:, :k]).to(FP8_DTYPE).view(torch.uint8)
        layers["fp8"].append(Fp8Linear(UnpackedFp8(q, s, BLOCK), None, torch.bfloat16))
    report_gemv_shares(layers, n, k, args.reps)


if __name__ == "__main__":
    main()
