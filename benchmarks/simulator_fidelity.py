"""How well the doctor's simulator reproduces recorded runs: TTFT p50/p99 and ITL p50/p99, simulated
against measured, over a grid of chunk sizes, KV pool sizes and concurrencies (the table Vidur
reports for itself).

    python benchmarks/simulator_fidelity.py [--profile-steps] [--output rows.json]

For each setting: start `kvflow serve` on the tiny Llama, run a benchmark (mixed prompt lengths),
diagnose it (settings from the live server), and compare the calibrated simulator's replay of the
same requests under the same settings (kvflow/doctor/calibrate.py; client TTFT = the simulated
server TTFT + the measured client offset) with what the client measured. The step costs are fitted
to this run, so this is the simulator's scheduling, queueing and tail model reproducing a run, not a
what-if's prediction (benchmarks/doctor_verify.py measures those). Not in CI: 8 servers, ~2 min.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from fixtures.checkpoints import build_checkpoint  # noqa: E402
from fixtures.live_server import ENGINE_KWARGS  # noqa: E402

from kvflow.bench.arrivals import LoadSpec  # noqa: E402
from kvflow.bench.datasets import DatasetSpec  # noqa: E402
from kvflow.bench.metrics import percentile  # noqa: E402
from kvflow.bench.runner import BenchConfig, run_benchmark  # noqa: E402
from kvflow.cli import build_parser  # noqa: E402
from kvflow.doctor.cli import build_diagnosis  # noqa: E402
from kvflow.server.spawn import spawn_server, stop_server  # noqa: E402

CACHE = Path.home() / ".cache" / "kvflow-bench" / "simulator-fidelity"
DATASET = DatasetSpec("random", 24, input_len=96, output_len=32, range_ratio=0.5)
# (max_num_batched_tokens, num_kv_blocks or None for the default pool, concurrency)
GRID = [(budget, blocks, c) for budget in (64, 512) for blocks in (None, 20) for c in (2, 8)]
METRICS = ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")


def _p(values: list[float], q: float) -> float:
    return percentile(values, q) if values else float("nan")


def one(
    model: Path, budget: int, blocks: int | None, concurrency: int, profile: bool
) -> list[dict[str, Any]]:
    engine = {**ENGINE_KWARGS, "max_num_batched_tokens": budget, "max_model_len": 256}
    if blocks is not None:
        engine["num_kv_blocks"] = blocks
    flags = [x for k, v in engine.items() for x in ("--" + k.replace("_", "-"), str(v))]
    server, base = spawn_server(model, flags, cwd=REPO)
    try:
        config = BenchConfig(
            base_url=base + "/v1",
            dataset=DATASET,
            load=LoadSpec(concurrency=concurrency),
            warmup=1,
            metrics_interval=0.1,
            progress=False,
        )
        result = run_benchmark(config)
        path = CACHE / f"b{budget}-k{blocks}-c{concurrency}.json"
        path.write_text(json.dumps(result))
        argv = ["doctor", str(model), "--hardware", "cpu", "--bench", str(path)]
        diagnosis, _ = build_diagnosis(
            build_parser().parse_args(argv + (["--profile-steps"] if profile else []))
        )
    finally:
        stop_server(server)
    cal = diagnosis.calibration
    if cal is None:
        return []
    sim, offset = cal.baseline, cal.client_gap_ms
    simulated = {
        "ttft_p50_ms": _p(sim.ttft_ms, 50) + offset,
        "ttft_p99_ms": _p(sim.ttft_ms, 99) + offset,
        "itl_p50_ms": _p(sim.itl_ms, 50),
        "itl_p99_ms": _p(sim.itl_ms, 99),
    }
    measured = {
        "ttft_p50_ms": result["ttft_ms"]["p50"],
        "ttft_p99_ms": result["ttft_ms"]["p99"],
        "itl_p50_ms": result["itl_ms"]["p50"],
        "itl_p99_ms": result["itl_ms"]["p99"],
    }
    setting = f"budget {budget}, {'default pool' if blocks is None else f'{blocks} blocks'}, c={concurrency}"
    return [
        {
            "setting": setting,
            "metric": m,
            "measured": measured[m],
            "simulated": simulated[m],
            "error": abs(simulated[m] - measured[m]) / measured[m],
            "preemptions": result["server"].get("num_preemptions"),
        }
        for m in METRICS
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile-steps", action="store_true", help="calibrate with kvflow profile-steps")
    parser.add_argument("--output", default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    CACHE.mkdir(parents=True, exist_ok=True)
    model = CACHE / "tiny-llama"
    if not (model / "config.json").is_file():
        build_checkpoint(model, "llama")
    rows = [r for budget, blocks, c in GRID for r in one(model, budget, blocks, c, args.profile_steps)]
    print("| setting | metric | measured ms | simulated ms | error | preemptions |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['setting']} | {r['metric']} | {r['measured']:.1f} | {r['simulated']:.1f} | "
            f"{r['error']:.0%} | {r['preemptions']} |"
        )
    for metric in METRICS:
        errors = sorted(r["error"] for r in rows if r["metric"] == metric)
        if errors:
            print(f"{metric}: median error {errors[len(errors) // 2]:.0%}, worst {errors[-1]:.0%}")
    if args.output:
        Path(args.output).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
