"""Every what-if `kvflow doctor` offers on the planted scenarios, applied and measured: predicted gain
against measured gain, per scenario, change and metric.

    python benchmarks/doctor_verify.py [--scenarios max_num_seqs,kv_pool,...] [--output verify.json]

For each scenario of tests/doctor/planted.py (plus `quantization`: the bundled model, where the int8
and int4 what-ifs come from decode speeds measured by kvflow quant-eval): start `kvflow serve` with
the planted settings, run the scenario's benchmark, diagnose it (settings read from the live
server's /metrics), stop the server, then `--verify` (kvflow/doctor/verify.py): one fresh baseline
server, one fresh server per what-if (or the baseline settings with the workload change), the same
benchmark, and the prediction carried from the original run to the fresh baseline as a ratio.
The target is a measured gain within 25% of the predicted gain for each what-if.
Not in CI: it starts a dozen servers and takes a few minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tests" / "doctor"))

from fixtures.checkpoints import build_checkpoint  # noqa: E402
from fixtures.live_server import ENGINE_KWARGS  # noqa: E402
from planted import SCENARIOS, Scenario  # noqa: E402

from kvflow.assets import bundled_model_dir  # noqa: E402
from kvflow.bench.arrivals import LoadSpec  # noqa: E402
from kvflow.bench.datasets import DatasetSpec  # noqa: E402
from kvflow.bench.runner import BenchConfig, run_benchmark  # noqa: E402
from kvflow.cli import build_parser  # noqa: E402
from kvflow.doctor.cli import build_diagnosis  # noqa: E402
from kvflow.doctor.findings import diagnose, rank_causes  # noqa: E402
from kvflow.doctor.noise import NOISE_COVERAGE  # noqa: E402
from kvflow.doctor.repeated_runs import rediagnosis  # noqa: E402
from kvflow.doctor.verify import AGREEMENT_TOLERANCE, Verification, verify  # noqa: E402
from kvflow.server.spawn import spawn_server, stop_server  # noqa: E402

CACHE = Path.home() / ".cache" / "kvflow-bench" / "doctor-verify"
# The doctor's measured step shapes: on by default here (the servers run on this machine);
# --no-profile-steps diagnoses with the line through the run's step means instead.
PROFILE_FLAGS = [f for f in sys.argv if f in ("--profile-steps", "--no-profile-steps")]
# The bench's default: each /metrics scrape stalls a step (~8 ms on a 2-core VM), and scraping every
# 0.1 s put stalls in 2% of the planted runs' decode steps, their ITL p99 (session 26). Since session
# 27 the bench reads a kvflow server's gauges off its step window and does not scrape it during the
# load at all (kvflow/bench/gauges.py: window_gauges).
METRICS_INTERVAL_S = 0.5
VERDICT_MARK = {"agrees": "yes", "missed": "no", "within noise": "noise"}
QUANTIZATION = Scenario("quantization", {}, DatasetSpec("random", 8, input_len=32, output_len=96), 1, None)


def checkpoint(scenario: Scenario) -> Path:
    if scenario.name == "quantization":
        return bundled_model_dir("target")
    key = "tiny-llama" + "".join(f"-{k}{v}" for k, v in sorted(scenario.checkpoint.items()))
    out = CACHE / key
    if not (out / "config.json").is_file():
        out.mkdir(parents=True, exist_ok=True)
        build_checkpoint(out, "llama", **scenario.checkpoint)
    return out


def serve_flags(scenario: Scenario, dtype: str | None = None) -> list[str]:
    engine = {} if scenario.name == "quantization" else {**ENGINE_KWARGS, **scenario.engine}
    if dtype is not None:
        engine["dtype"] = dtype
    flags = []
    for key, value in engine.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        else:
            flags += [flag, str(value)]
    return flags


def planted_bench(scenario: Scenario, base: str) -> BenchConfig:
    """The scenario's benchmark against the server at `base`."""
    return BenchConfig(
        base_url=base + "/v1",
        dataset=scenario.dataset,
        load=LoadSpec(concurrency=scenario.concurrency),
        warmup=1,
        metrics_interval=METRICS_INTERVAL_S,
        progress=False,
    )


def diagnose_and_verify(
    scenario: Scenario, repeats: int, dtype: str | None, keep: Path | None = None
) -> dict[str, Any]:
    model = checkpoint(scenario)
    server, base = spawn_server(model, serve_flags(scenario, dtype), cwd=REPO)
    try:
        result = run_benchmark(planted_bench(scenario, base))
        bench_json = CACHE / f"{scenario.name}-bench.json"
        bench_json.write_text(json.dumps(result))
        argv = ["doctor", str(model), "--hardware", "cpu", "--bench", str(bench_json)]
        argv += PROFILE_FLAGS  # the simulator's step shapes measured (cached per model) unless told not to
        if scenario.name == "quantization":
            argv.append("--measure-quantization")
        diagnosis, _ = build_diagnosis(build_parser().parse_args(argv))  # settings from the live server
    finally:
        stop_server(server)
    findings = diagnose(diagnosis)
    if keep is not None:  # the diagnosed run beside the pairs' runs
        (keep / scenario.name).mkdir(parents=True, exist_ok=True)
        (keep / scenario.name / "diagnosed.json").write_text(json.dumps(result))
    checks = verify(
        str(model),
        diagnosis.settings,
        findings,
        result,
        repeats=repeats,
        rediagnose=rediagnosis(diagnosis),
        keep_dir=None if keep is None else keep / scenario.name,
    )
    causes = [(c.id, c.setting) for _, c in rank_causes(findings)]
    return {"scenario": scenario.name, "causes": causes, "checks": checks}


def row(scenario: str, check: Verification) -> dict[str, Any]:
    ratio = check.measured_gain / check.predicted_gain if check.predicted_gain else None
    return {
        "scenario": scenario,
        "change": check.change,
        "metric": check.metric,
        "baseline": check.baseline,
        "predicted": check.predicted,
        "measured": check.measured,
        "predicted_gain": check.predicted_gain,
        "measured_gain": check.measured_gain,
        "measured_over_predicted": ratio,
        "within_25pct": check.agrees,
        "value_error": check.value_error,
        "paired_value_error": check.paired_value_error,
        "interval": list(check.interval) if check.interval is not None else None,
        "covered": check.covered,
        "verdict": check.verdict,
        "baseline_spread": check.noise,
        "measured_range": list(check.measured_range) if check.measured_range is not None else None,
        "inside_measured_range": check.inside_measured_range,
        "carry": check.carry,
        "uncarried_value_error": check.uncarried_value_error,
        "repeated_predictions": list(check.repeated),
        "repeated_predicted": check.repeated_predicted,
        "repeated_value_error": check.repeated_value_error,
        "inside_repeated_range": check.inside_repeated_range,
    }


def print_table(rows: list[dict[str, Any]]) -> None:
    print(
        "| scenario | change | metric | baseline | predicted | measured | gain pred. | gain meas. "
        f"| meas/pred | within {AGREEMENT_TOLERANCE:.0%} | value error | pair by pair | baseline spread "
        "| predicted interval | changed runs' range | predicted again (repeats' range) | its error |"
    )
    print("|" + " --- |" * 17)
    for r in rows:
        ratio = "-" if r["measured_over_predicted"] is None else f"{r['measured_over_predicted']:.2f}"
        print(
            f"| {r['scenario']} | {r['change']} | {r['metric']} | {r['baseline']:,.1f} | "
            f"{r['predicted']:,.1f} | {r['measured']:,.1f} | {r['predicted_gain']:,.1f} | "
            f"{r['measured_gain']:,.1f} | {ratio} | "
            f"{VERDICT_MARK[r['verdict']]} | {r['value_error']:.0%} | {percent(r['paired_value_error'])} | "
            f"{r['baseline_spread']:.0%} | {bounds_cell(r['interval'], r['covered'])} | "
            f"{bounds_cell(r['measured_range'], r['inside_measured_range'])} | {again_cell(r)} | "
            f"{percent(r['repeated_value_error'])} |"
        )


def again_cell(r: dict[str, Any]) -> str:
    """The median of the predictions made again from each fresh baseline, with their range and
    whether the measured value fell inside it."""
    again = r["repeated_predicted"]
    if again is None:
        return "-"
    repeated = r["repeated_predictions"]
    return f"{again:,.1f} ({bounds_cell([min(repeated), max(repeated)], r['inside_repeated_range'])})"


def bounds_cell(bounds: list[float] | None, inside: bool | None) -> str:
    """A (lowest, highest) pair and whether the value it is checked against fell inside (yes) or not
    (no): the predicted interval against the measured value, the changed runs' range against the
    prediction."""
    if bounds is None:
        return "-"
    lo, hi = bounds
    return f"{lo:,.1f}-{hi:,.1f} ({'yes' if inside else 'no'})"


def percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    names = [s.name for s in SCENARIOS if s.planted] + ["quantization"]
    parser.add_argument(
        "--scenarios", default=",".join(names), help="comma-separated, of: " + ", ".join(names)
    )
    parser.add_argument("--output", default=None, help="write the rows as JSON here")
    parser.add_argument(
        "--profile-steps",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="diagnose with kvflow doctor --profile-steps / --no-profile-steps (default: the doctor's, "
        "on for servers on this machine)",
    )
    parser.add_argument("--repeats", type=int, default=5, help="benchmark pairs per what-if (medians)")
    parser.add_argument(
        "--dtype",
        default=None,
        help="serve the planted scenarios in this dtype (default: the fixtures' float32; bfloat16 is "
        "what users serve, and float32 has a slow path for a small chunk over a cached context)",
    )
    parser.add_argument(
        "--keep-runs",
        type=Path,
        default=None,
        metavar="DIR",
        help="write every bench result (the diagnosed run, each pair's baseline and changed run) to "
        "DIR/<scenario>/, to take a miss apart",
    )
    args = parser.parse_args()
    CACHE.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "kvflow.cli", "build-kernels"], check=False, cwd=REPO)
    table = {s.name: s for s in (*SCENARIOS, QUANTIZATION)}
    rows = []
    for name in args.scenarios.split(","):
        outcome = diagnose_and_verify(replace(table[name]), args.repeats, args.dtype, args.keep_runs)
        print(f"{name}: causes {outcome['causes']}", flush=True)
        rows += [row(name, c) for c in outcome["checks"]]
        for check in outcome["checks"]:
            print("  " + check.explain(), flush=True)
    print()
    print_table(rows)
    met = sum(r["within_25pct"] for r in rows)
    noise = sum(r["verdict"] == "within noise" for r in rows)
    print(
        f"\n{met} of {len(rows) - noise} predictions within {AGREEMENT_TOLERANCE:.0%} of the measured gain; "
        f"{noise} more with predicted and measured gains both within the baseline's spread"
    )
    shown = [r for r in rows if r["verdict"] != "within noise"]
    errors = sorted(r["value_error"] for r in shown)
    if errors:
        print(
            f"error on the predicted value, |predicted - measured| / measured, over the {len(errors)} "
            f"predictions whose effect exceeds the noise: median {statistics.median(errors):.0%}, "
            f"worst {errors[-1]:.0%}"
        )
    paired = sorted(r["paired_value_error"] for r in shown if r["paired_value_error"] is not None)
    if paired:
        print(
            f"the same, measured pair by pair (each changed run against its own baseline): median "
            f"{statistics.median(paired):.0%}, worst {paired[-1]:.0%}"
        )
    uncarried = sorted(r["uncarried_value_error"] for r in shown)
    if uncarried:
        print(
            f"the same, the prediction as diagnosed (not carried by the fresh baselines' ratio): median "
            f"{statistics.median(uncarried):.0%}, worst {uncarried[-1]:.0%}"
        )
    again = sorted(r["repeated_value_error"] for r in shown if r["repeated_value_error"] is not None)
    if again:
        inside = [r["inside_repeated_range"] for r in shown if r["inside_repeated_range"] is not None]
        print(
            f"the same, predicted again from each fresh baseline (the doctor re-run on each repeat, the "
            f"median of their predictions), over {len(again)}: median {statistics.median(again):.0%}, "
            f"worst {again[-1]:.0%}; measured inside the repeats' predictions' range: "
            f"{sum(inside)} of {len(inside)}"
        )
    stated = [r for r in shown if r["covered"] is not None]
    if stated:
        print(
            f"measured inside the predicted interval (the diagnosed run's {NOISE_COVERAGE:.0%} bootstrap "
            f"interval, carried): {sum(r['covered'] for r in stated)} of {len(stated)}"
        )
    ranged = [r for r in shown if r["inside_measured_range"] is not None]
    if ranged:
        outside = sorted(r["value_error"] for r in ranged if not r["inside_measured_range"])
        worst = f", worst error among those outside {outside[-1]:.0%}" if outside else ""
        print(
            f"predicted inside the changed runs' own range over the repeats (an error there is within "
            f"what the machine moves between runs): {len(ranged) - len(outside)} of {len(ranged)}{worst}"
        )
    if args.output:
        Path(args.output).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
