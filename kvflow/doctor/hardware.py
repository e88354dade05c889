"""Hardware figures for the roofline: memory bandwidth, dense matmul FLOP/s per dtype, memory size.

Named accelerators come from their vendors' datasheets (dense figures, no structured sparsity;
SXM/OAM parts). `auto`/`cpu` measures this machine: bandwidth by copying a large tensor (read +
write), FLOP/s by timing square matmuls per dtype, memory from the OS. One timing on a shared
machine drifts by a quarter from run to run, enough to flip "compute-bound" and "memory-bound":
each figure is the median of several short probes, and its spread ((max - min) / median) is
reported so that no verdict is drawn from a difference within it (kvflow/doctor/roofline.py).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

# A copy of this many bytes is far beyond any CPU cache, so it measures DRAM bandwidth.
BANDWIDTH_PROBE_BYTES = 256 << 20
MATMUL_PROBE_SIZE = 1024  # n x n x n matmul: compute-bound on any CPU
PROBE_REPEATS = 7  # short probes, many of them: the median resists a neighbour's burst


@dataclass(frozen=True)
class Hardware:
    name: str
    bandwidth_bytes_s: float
    flops: dict[str, float]  # dtype -> dense FLOP/s ("bfloat16", "float16", "fp8", "int8", "float32")
    memory_bytes: float
    source: str
    measured: dict[str, float] = field(default_factory=dict)
    # Relative spread of each measured figure over its probes, (max - min) / median; 0 for datasheets.
    spread: dict[str, float] = field(default_factory=dict)

    @property
    def uncertainty(self) -> float:
        """The largest relative spread of the figures a roofline verdict compares."""
        return max(self.spread.values(), default=0.0)

    def flops_for(self, dtype: str) -> float:
        """Peak matmul FLOP/s for weights of `dtype`: weight-only int8/int4 compute in bf16 (dequantized)."""
        compute = {"int4": "bfloat16", "int8": "bfloat16", "float16": "float16"}.get(dtype, dtype)
        return self.flops.get(compute) or self.flops.get("bfloat16") or max(self.flops.values())


TB = 1e12
GB = 1e9
NAMED: dict[str, Hardware] = {
    "h100": Hardware(
        "NVIDIA H100 SXM5 80GB",
        3.35 * TB,
        {"bfloat16": 989e12, "float16": 989e12, "fp8": 1979e12, "int8": 1979e12, "float32": 67e12},
        80 * GB,
        "NVIDIA H100 Tensor Core GPU datasheet (SXM): 3.35 TB/s HBM3; dense BF16 989 TFLOPS, FP8 1979",
    ),
    "h200": Hardware(
        "NVIDIA H200 SXM 141GB",
        4.8 * TB,
        {"bfloat16": 989e12, "float16": 989e12, "fp8": 1979e12, "int8": 1979e12, "float32": 67e12},
        141 * GB,
        "NVIDIA H200 Tensor Core GPU datasheet (SXM): 4.8 TB/s HBM3e; dense BF16 989 TFLOPS, FP8 1979",
    ),
    "a100-80g": Hardware(
        "NVIDIA A100 SXM4 80GB",
        2.039 * TB,
        {"bfloat16": 312e12, "float16": 312e12, "int8": 624e12, "float32": 19.5e12},
        80 * GB,
        "NVIDIA A100 Tensor Core GPU datasheet (SXM 80GB): 2,039 GB/s HBM2e; dense BF16 312 TFLOPS, INT8 624",
    ),
    "l40s": Hardware(
        "NVIDIA L40S 48GB",
        864 * GB,
        {"bfloat16": 362e12, "float16": 362e12, "fp8": 733e12, "int8": 733e12, "float32": 91.6e12},
        48 * GB,
        "NVIDIA L40S datasheet: 864 GB/s GDDR6; dense BF16 362 TFLOPS, FP8 733 (half the sparse figures)",
    ),
    "rtx4090": Hardware(
        "NVIDIA GeForce RTX 4090 24GB",
        1008 * GB,
        {"bfloat16": 165.2e12, "float16": 165.2e12, "fp8": 330.3e12, "int8": 660.6e12, "float32": 82.6e12},
        24 * GB,
        "NVIDIA Ada Lovelace architecture whitepaper (RTX 4090): 1,008 GB/s; BF16 165.2 dense (FP32 accum)",
    ),
    "mi300x": Hardware(
        "AMD Instinct MI300X 192GB",
        5.3 * TB,
        {"bfloat16": 1307e12, "float16": 1307e12, "fp8": 2615e12, "int8": 2615e12, "float32": 163.4e12},
        192 * GB,
        "AMD Instinct MI300X datasheet: 5.3 TB/s HBM3; dense BF16 1307 TFLOPS, FP8 2615",
    ),
}


def named_hardware(name: str) -> Hardware:
    key = name.lower()
    if key in ("auto", "cpu"):
        return probe_cpu()
    if key not in NAMED:
        raise ValueError(f"unknown hardware {name!r}; known: auto, cpu, {', '.join(sorted(NAMED))}")
    return NAMED[key]


def _timings(fn: Callable[[], object], repeats: int = PROBE_REPEATS) -> tuple[float, float]:
    """(median seconds, relative spread) of `repeats` timed calls after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    median = statistics.median(times)
    return median, (max(times) - min(times)) / median


def probe_cpu() -> Hardware:
    """Measure this machine (a few seconds): DRAM bandwidth, bf16/fp32 matmul FLOP/s, memory."""
    import torch

    from kvflow.layers.bf16_gemm import bf16_linear

    src = torch.empty(BANDWIDTH_PROBE_BYTES // 4, dtype=torch.float32)
    src.fill_(1.0)
    dst = torch.empty_like(src)
    copy_s, copy_spread = _timings(lambda: dst.copy_(src))
    bandwidth = 2 * BANDWIDTH_PROBE_BYTES / copy_s  # read + write
    flops: dict[str, float] = {}
    spread = {"bandwidth_bytes_s": copy_spread}
    n = MATMUL_PROBE_SIZE
    for dtype_name, dtype in (("bfloat16", torch.bfloat16), ("float32", torch.float32)):
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        # bf16 through the GEMM kvflow's prefill runs: oneDNN's bf16 one, or fp32 on CPUs without it
        # (AVX2, where torch's own bf16 matmul is ~100x slower than the fp32 one).
        matmul = partial(bf16_linear, a, b) if dtype == torch.bfloat16 else partial(torch.mm, a, b)
        mm_s, mm_spread = _timings(matmul)  # the warm-up lets oneDNN pick its kernel
        flops[dtype_name] = 2 * n**3 / mm_s
        spread[f"flops_{dtype_name}"] = mm_spread
    memory = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    threads = torch.get_num_threads()
    return Hardware(
        f"this CPU ({os.cpu_count()} cores, {threads} torch threads)",
        bandwidth,
        flops,
        memory,
        f"measured now: {BANDWIDTH_PROBE_BYTES >> 20} MiB copies and {n}^3 matmuls, median of "
        f"{PROBE_REPEATS} each (spread up to {max(spread.values()):.0%})",
        measured={"bandwidth_bytes_s": bandwidth, **{f"flops_{k}": v for k, v in flops.items()}},
        spread=spread,
    )
