"""Record what-ifs of the planted scenarios against the changed servers measured, for the tests.

    python benchmarks/record_what_ifs.py --output tests/doctor/recorded_what_ifs [--repeats 3]

For each scenario (kv_pool, max_num_seqs, prefill_chunks of tests/doctor/planted.py): serve the
planted settings and benchmark them as benchmarks/doctor_verify.py does, diagnose the run with the
step profile of this machine, then serve each setting change the doctor's simulator predicts
(not the disaggregated pair, not a workload change) and benchmark it `--repeats` times with
prompts no server has seen. Kept in OUTPUT/<scenario>/: the model's config.json, the step profile
the diagnosis used (step_profile.json), the diagnosed run (diagnosed.json.gz, the full bench
result: the calibration reads its step records and window) and the changed runs' latency sections
(changed.json: per change its setting and each run's ttft_ms / itl_ms / e2e_ms / tpot_ms).
tests/doctor/test_recorded_what_ifs.py predicts each change from the diagnosed run alone (no server,
no torch) and compares it with the changed runs' median. Not in CI: it starts a dozen servers.
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tests" / "doctor"))

from doctor_verify import checkpoint, planted_bench, serve_flags  # noqa: E402
from planted import SCENARIOS  # noqa: E402

from kvflow.bench.runner import run_benchmark  # noqa: E402
from kvflow.cli import build_parser  # noqa: E402
from kvflow.doctor.cli import build_diagnosis, served_dtypes  # noqa: E402
from kvflow.doctor.findings import diagnose  # noqa: E402
from kvflow.doctor.step_profile import profile_file  # noqa: E402
from kvflow.doctor.verify import FreshServer, engine_args, reseeded, verifiable  # noqa: E402
from kvflow.doctor.verify_pd import DISAGGREGATE  # noqa: E402
from kvflow.doctor.what_ifs import SIMULATED  # noqa: E402
from kvflow.server.spawn import spawn_server, stop_server  # noqa: E402

RECORDED = ("kv_pool", "max_num_seqs", "prefill_chunks")
LATENCY_SECTIONS = ("ttft_ms", "itl_ms", "e2e_ms", "tpot_ms")


def record(name: str, repeats: int, out: Path) -> None:
    scenario = {s.name: s for s in SCENARIOS}[name]
    model = checkpoint(scenario)
    server, base = spawn_server(model, serve_flags(scenario), cwd=REPO)
    try:
        bench = planted_bench(scenario, base)
        result = run_benchmark(bench)
        diagnosed = out / "diagnosed.json"
        out.mkdir(parents=True, exist_ok=True)
        diagnosed.write_text(json.dumps(result))
        argv = ["doctor", str(model), "--hardware", "cpu", "--bench", str(diagnosed), "--profile-steps"]
        diagnosis, _ = build_diagnosis(build_parser().parse_args(argv))  # settings from the live server
    finally:
        stop_server(server)
    (out / "diagnosed.json.gz").write_bytes(gzip.compress(diagnosed.read_bytes(), mtime=0))
    diagnosed.unlink()
    shutil.copy(model / "config.json", out / "config.json")
    settings = diagnosis.settings
    _, dtype, _ = served_dtypes(diagnosis.model, settings)
    shutil.copy(profile_file(model, dtype, settings.quantization), out / "step_profile.json")
    changes: list[dict[str, Any]] = []
    seed = bench.load.seed + 1
    for what_if in verifiable(diagnose(diagnosis)):
        if not what_if.setting or what_if.setting == {"kv_role": DISAGGREGATE} or what_if.method != SIMULATED:
            continue
        changed = FreshServer(str(model), engine_args(settings, what_if.setting))
        runs = []
        try:
            for _ in range(repeats):
                measured = changed.bench(reseeded(bench, seed))
                seed += 1
                runs.append({k: measured[k] for k in LATENCY_SECTIONS})
        finally:
            changed.stop()
        changes.append({"change": what_if.change, "setting": what_if.setting, "runs": runs})
        print(name, what_if.change, [round(r["itl_ms"]["p99"], 2) for r in runs], flush=True)
    (out / "changed.json").write_text(json.dumps(changes, indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True, help="a directory per scenario goes here")
    parser.add_argument("--scenarios", default=",".join(RECORDED))
    parser.add_argument("--repeats", type=int, default=3, help="runs of each changed server")
    args = parser.parse_args()
    for name in args.scenarios.split(","):
        record(name, args.repeats, Path(args.output) / name)


if __name__ == "__main__":
    main()
