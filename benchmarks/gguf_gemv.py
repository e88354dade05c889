"""The GGUF block types' decode GEMVs (kvflow/kernels/gemv_ggml.cpp, Q8_0 on gemv_int8.cpp's tiles)
against kvflow's own int8 / int4-g32 GEMVs and the read-bandwidth probe, on one projection shape,
at 1 and 8 rows, engines alternated per repetition, in one run.

    python benchmarks/gguf_gemv.py [--n 4864] [--k 896] [--layers 24] [--reps 30] [--types Q8_0,Q5_0,...]

`--layers` copies of each weight are cycled so the working set exceeds the caches, as a decode
step's does. GB/s = bytes the kernel reads per call (its tiles, scales, minima and super-block
scales: what llama.cpp's file holds, up to the K-quants' 6-bit fields held as bytes) / median time.
K must be a multiple of 256 for the K-quants (e.g. --k 4864, down_proj's).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "tests"))

from fixtures.ggml_quants import K_QUANTIZERS  # noqa: E402
from fp8_gemv import report_gemv_shares  # noqa: E402

from kvflow.kernels import ggml_weight_kernels  # noqa: E402
from kvflow.quant.gguf_linear import GGUFLinear, unpack_ggml  # noqa: E402
from kvflow.quant.linear import Int4Linear, Int8Linear  # noqa: E402
from kvflow.quant.weights import quantize_int4, quantize_int8  # noqa: E402


def _gguf_layer(type_name: str, w: np.ndarray) -> GGUFLinear:
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    data = K_QUANTIZERS[type_name](w) if type_name in K_QUANTIZERS else gguf.quants.quantize(w, qtype)
    kernels = ggml_weight_kernels()
    assert kernels is not None, "the native kernels did not build"
    return GGUFLinear(unpack_ggml(type_name, torch.from_numpy(np.array(data)), w.shape), None, kernels)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=4864)
    parser.add_argument("--k", type=int, default=896)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--types", default="Q8_0,Q4_0,Q4_1,Q5_0,Q5_1,Q4_K,Q5_K,Q6_K,MXFP4,NVFP4")
    args = parser.parse_args()
    n, k = args.n, args.k
    types = [t for t in args.types.split(",") if not (t.endswith("_K") and k % 256)]
    rng = np.random.default_rng(0)
    layers: dict[str, list[torch.nn.Module]] = {name: [] for name in ["int8", "int4 g32", *types]}
    for _ in range(args.layers):
        w = (rng.standard_normal((n, k)) * 0.02).astype(np.float32)
        wt = torch.from_numpy(w)
        layers["int8"].append(Int8Linear(quantize_int8(wt), None, torch.bfloat16))
        layers["int4 g32"].append(Int4Linear(quantize_int4(wt, 32), None, torch.bfloat16))
        for t in types:
            layers[t].append(_gguf_layer(t, w))
    report_gemv_shares(layers, n, k, args.reps)


if __name__ == "__main__":
    main()
