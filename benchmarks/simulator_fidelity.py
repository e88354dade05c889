"""How well the doctor's simulator reproduces recorded runs: TTFT p50/p99 and ITL p50/p99, simulated
against measured, over a grid of chunk sizes, KV pool sizes and concurrencies (the table Vidur
reports for itself).

    python benchmarks/simulator_fidelity.py [--profile-steps] [--output rows.json] [--from-cache]
        [--record tests/doctor/recorded_runs]

For each setting: start `kvflow serve` on the tiny Llama, run a benchmark (mixed prompt lengths),
diagnose it (settings from the live server), and compare the calibrated simulator's replay of the
same requests under the same settings (kvflow/doctor/calibrate.py; client TTFT = the simulated
server TTFT + the measured client offset) with what the client measured. The step costs are fitted
to this run, so this is the simulator's scheduling, queueing and tail model reproducing a run, not a
what-if's prediction (benchmarks/doctor_verify.py measures those). Not in CI: 8 servers, ~2 min.
`--record DIR` keeps the runs (trimmed, gzipped) and the model's config.json for
tests/doctor/test_simulator_fidelity.py, which asserts the errors stay under what was measured here.
"""

from __future__ import annotations

import argparse
import gzip
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
from kvflow.bench.runner import BenchConfig, run_benchmark  # noqa: E402
from kvflow.cli import build_parser  # noqa: E402
from kvflow.doctor.arrival_stalls import RECORD_KEYS  # noqa: E402
from kvflow.doctor.cli import build_diagnosis  # noqa: E402
from kvflow.doctor.fidelity import fidelity  # noqa: E402
from kvflow.doctor.step_profile import load_profile, measure_profile, profile_file  # noqa: E402
from kvflow.server.spawn import spawn_server, stop_server  # noqa: E402

CACHE = Path.home() / ".cache" / "kvflow-bench" / "simulator-fidelity"
# 64 requests: each run's ITL p99 rests on ~20 of ~2,000 gaps (24 requests left it to ~7).
DATASET = DatasetSpec("random", 64, input_len=96, output_len=32, range_ratio=0.5)
# (max_num_batched_tokens, num_kv_blocks or None for the default pool, concurrency)
GRID = [(budget, blocks, c) for budget in (64, 512) for blocks in (None, 20) for c in (2, 8)]
METRICS = ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")
MAX_MODEL_LEN = 256
PROFILE_FILE = "step_profile.json"  # beside the recorded runs (tests/doctor/test_simulator_fidelity.py)
WINDOW_KEYS = ("x_request_id", "ttft_ms", "arrival", "handed_off")  # of a request row, what the replay reads
# Of a step row, what the replay reads: its start and its record.
WINDOW_STEP_KEYS = ("t", *RECORD_KEYS)


def run_path(budget: int, blocks: int | None, concurrency: int) -> Path:
    return CACHE / f"b{budget}-k{blocks}-c{concurrency}.json"


def one(
    model: Path, budget: int, blocks: int | None, concurrency: int, profile: bool
) -> list[dict[str, Any]]:
    engine = {**ENGINE_KWARGS, "max_num_batched_tokens": budget, "max_model_len": MAX_MODEL_LEN}
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
        path = run_path(budget, blocks, concurrency)
        path.write_text(json.dumps(result))
    finally:
        stop_server(server)
    return compare(model, path, budget, blocks, concurrency, profile)


def compare(
    model: Path, path: Path, budget: int, blocks: int | None, concurrency: int, profile: bool
) -> list[dict[str, Any]]:
    """The calibrated simulator against the recorded run at `path` (a kvflow bench result)."""
    result = json.loads(path.read_text())
    argv = ["doctor", str(model), "--hardware", "cpu", "--bench", str(path)]
    flag = "--profile-steps" if profile else "--no-profile-steps"  # the line through the step means
    diagnosis, _ = build_diagnosis(build_parser().parse_args([*argv, flag]))
    if diagnosis.calibration is None:
        return []
    setting = f"budget {budget}, {'default pool' if blocks is None else f'{blocks} blocks'}, c={concurrency}"
    return [
        {
            "setting": setting,
            "metric": row.metric,
            "measured": row.measured,
            "simulated": row.simulated,
            "error": row.error,
            "preemptions": result["server"].get("num_preemptions"),
        }
        for row in fidelity(diagnosis.calibration, result)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile-steps", action="store_true", help="calibrate with kvflow profile-steps")
    parser.add_argument("--output", default=None, help="write the rows as JSON here")
    parser.add_argument("--record", default=None, help="keep the runs here for the tests (trimmed, gzipped)")
    parser.add_argument(
        "--from-cache", action="store_true", help="re-diagnose the runs last recorded (no servers)"
    )
    args = parser.parse_args()
    CACHE.mkdir(parents=True, exist_ok=True)
    model = CACHE / "tiny-llama"
    if not (model / "config.json").is_file():
        build_checkpoint(model, "llama")
    rows = []
    for budget, blocks, c in GRID:
        if args.from_cache:
            rows += compare(model, run_path(budget, blocks, c), budget, blocks, c, args.profile_steps)
        else:
            rows += one(model, budget, blocks, c, args.profile_steps)
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
    if args.record:
        record(Path(args.record), model)


def record(directory: Path, model: Path) -> None:
    """The recorded runs for the tests: what the doctor reads of each, rounded to the microsecond,
    and the step profile of the model on this machine (kvflow profile-steps, measured now if not
    cached), so that the tests replay the runs both ways."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text((model / "config.json").read_text())
    dtype = str(ENGINE_KWARGS["dtype"])
    if load_profile(model, dtype, None) is None:
        measure_profile(model, dtype, None, MAX_MODEL_LEN)
    (directory / PROFILE_FILE).write_text(profile_file(model, dtype, None).read_text())
    for budget, blocks, c in GRID:
        result = json.loads(run_path(budget, blocks, c).read_text())
        window = result["server"].pop("window", None) or {}
        for request in result["requests"]:
            for key in ("chunks", "ttft_first_chunk_ms", "conversation", "turn", "language"):
                request.pop(key, None)
        trimmed = _rounded(result)
        # Of the window's request rows, what the replay reads: each request's client gap (its TTFT
        # on the server, matched by x-request-id) and its HTTP handoff (kvflow/doctor/evidence.py),
        # timestamps in seconds kept to the microsecond (a handoff is a few ms).
        # And the steps' start times beside their records (the same steps as server.steps, in order):
        # during which a request arrived (kvflow/doctor/arrival_stalls.py).
        fields = list(window.get("step_fields") or [])
        keep = [i for i, name in enumerate(fields) if name in WINDOW_STEP_KEYS]
        trimmed["server"]["window"] = {
            "requests": [
                {k: round(v, 6) if isinstance(v, float) else v for k, v in row.items() if k in WINDOW_KEYS}
                for row in window.get("requests") or []
            ],
            "step_fields": [fields[i] for i in keep],
            "steps": [[round(row[i], 6) for i in keep] for row in window.get("steps") or []],
        }
        text = json.dumps(trimmed, separators=(",", ":"))
        name = run_path(budget, blocks, c).name + ".gz"
        (directory / name).write_bytes(gzip.compress(text.encode(), mtime=0))


def _rounded(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 3)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value


if __name__ == "__main__":
    main()
