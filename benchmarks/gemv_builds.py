"""Two or more builds of kvflow's native kernels, side by side: GEMV GB/s of weights per format.

    python benchmarks/gemv_builds.py --rounds 3 BUILD_DIR [BUILD_DIR ...]

A build directory is one under the kernel cache (KVFLOW_KERNEL_CACHE, else
~/.cache/kvflow/kernels), holding kvflow_cpu_kernels.so: build each variant once (edit the
sources, load kvflow.kernels.native_build()), then alternate them here. Each round runs every
build in its own process, one after the other, so that a machine whose bandwidth drifts from
minute to minute (benchmarks/NOTES.md) moves every build alike; an unchanged kernel (bf16 when
only the int8 kernel changed, say) is the control. Per build, format, thread count and row count:
the median [min-max] over the rounds of the weight bytes of a head-sized matrix (151,936 x 896,
DRAM-bound) over the GEMV's time (median of 5 calls).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

# The child: load one build's module in place of kvflow's own, time the three formats' GEMVs.
CHILD = r"""
import importlib.util, json, sys, time, torch
import kvflow.kernels as kernels
spec = importlib.util.spec_from_file_location("kvflow_cpu_kernels", sys.argv[1] + "/kvflow_cpu_kernels.so")
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
kernels.native_build = lambda: kernels.NativeBuild(module, "gemv_builds", None)
from kvflow.layers.linear import Linear
from kvflow.quant.linear import Int4Linear, Int8Linear
from kvflow.quant.weights import quantize_int4, quantize_int8
torch.manual_seed(0)
N, K = 151936, 896
w = torch.randn(N, K) * 0.02
bf16 = Linear(K, N, False, torch.bfloat16)
bf16.weight.data.copy_(w)
bf16.prepare_for_inference()
layers = {
    "bf16": (bf16, N * K * 2),
    "int8": (Int8Linear(quantize_int8(w.bfloat16()), None, torch.bfloat16), N * K + N * 4),
    "int4 g32": (
        Int4Linear(quantize_int4(w.bfloat16(), 32), None, torch.bfloat16),
        N * K // 2 + N * K // 32 * 4,
    ),
}
results = {}
for threads in (1, 2):
    torch.set_num_threads(threads)
    for rows in (1, 8):
        x = torch.randn(rows, K).bfloat16()
        for name, (layer, nbytes) in layers.items():
            layer(x)
            times = []
            for _ in range(5):
                start = time.perf_counter()
                layer(x)
                times.append(time.perf_counter() - start)
            results[f"{name:8s} M={rows} threads={threads}"] = nbytes / sorted(times)[2] / 1e9
print(json.dumps(results))
"""


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("builds", nargs="+", type=Path, help="kernel build directories")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    for build in args.builds:
        if not (build / "kvflow_cpu_kernels.so").exists():
            sys.exit(f"{build}: no kvflow_cpu_kernels.so (build it first)")
    runs: dict[Path, list[dict[str, float]]] = {b: [] for b in args.builds}
    repo = Path(__file__).resolve().parent.parent
    for _ in range(args.rounds):
        for build in args.builds:
            done = subprocess.run(
                [sys.executable, "-c", CHILD, str(build)], capture_output=True, text=True, cwd=repo
            )
            if done.returncode:
                sys.exit(done.stderr[-2000:])
            runs[build].append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"GB/s of weights, median [min-max] of {args.rounds} rounds")
    for key in runs[args.builds[0]][0]:
        cells = []
        for build in args.builds:
            values = [run[key] for run in runs[build]]
            spread = f"[{min(values):.1f}-{max(values):.1f}]"
            cells.append(f"{build.name[-8:]} {statistics.median(values):5.1f} {spread}")
        print(f"{key}  " + " | ".join(cells))


if __name__ == "__main__":
    main()
