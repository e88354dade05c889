"""kvflow doctor's predictions against measurement: prefill ms/token and decode ms/step.

    python benchmarks/doctor_roofline.py [--concurrency 1,16] [--num-requests 32] [--input-len 256]
                                         [--output-len 64]

Starts `kvflow serve` on the Qwen2.5-0.5B-shaped checkpoint of offline_throughput.py (bf16), runs
`kvflow bench` (random token-exact prompts) at each concurrency, then the doctor with
`--hardware cpu` (bandwidth and FLOP/s measured in the same run) on each result, and prints the
roofline's prefill ms/token and decode ms/step beside the measured ones, with their ratio.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from offline_throughput import REPO, build_checkpoint

from kvflow.server.spawn import spawn_server, stop_server

OUT_DIR = Path.home() / ".cache" / "kvflow-bench" / "doctor"


def kvflow(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "kvflow.cli", *args], cwd=REPO, check=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    args = parser.parse_args()
    model = build_checkpoint(torch.bfloat16)
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    server, base = spawn_server(model, ["--dtype", "bfloat16", "--max-model-len", "2048"], cwd=REPO)
    rows = []
    try:
        for concurrency in [int(c) for c in args.concurrency.split(",")]:
            result = OUT_DIR / f"bench-c{concurrency}.json"
            doctor = OUT_DIR / f"doctor-c{concurrency}.json"
            load = ["--concurrency", str(concurrency), "--num-requests", str(args.num_requests)]
            shape = ["--input-len", str(args.input_len), "--output-len", str(args.output_len)]
            kvflow("bench", "--base-url", base + "/v1", *load, *shape, "--quiet", "--tokenizer", str(model),
                   "--output", str(result))  # fmt: skip
            kvflow("doctor", str(model), "--hardware", "cpu", "--bench", str(result), "--metrics-url",
                   base + "/metrics", "--output", str(doctor))  # fmt: skip
            rows.append((concurrency, json.loads(doctor.read_text())))
    finally:
        stop_server(server)
    print(f"\n{'conc':>5} {'phase':<8} {'roofline':>12} {'measured':>12} {'measured/roofline':>18}  bound")
    for concurrency, doc in rows:
        roof, meas = doc["roofline"], doc["measured"]
        for phase, predicted, measured, bound in (
            ("prefill", roof["prefill_ms_per_token"], meas["prefill_ms_per_token"], roof["prefill_bound"]),
            ("decode", roof["decode_ms_per_step"], meas["decode_ms_per_step"], roof["decode_bound"]),
        ):
            ratio = measured / predicted if measured and predicted else float("nan")
            unit = "ms/token" if phase == "prefill" else "ms/step"
            print(f"{concurrency:>5} {phase:<8} {predicted:>9.3f} ms {measured:>9.3f} ms {ratio:>17.2f}x  "
                  f"{bound}-bound ({unit}, batch {roof['decode_batch']})")  # fmt: skip
        hw = doc["hardware"]
        gflops = hw["flops"]["bfloat16"] / 1e9
        print(f"      hardware: {hw['bandwidth_bytes_s'] / 1e9:.1f} GB/s, bf16 {gflops:.0f} GFLOP/s")


if __name__ == "__main__":
    main()
