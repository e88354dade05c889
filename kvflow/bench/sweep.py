"""`kvflow bench sweep`: the same benchmark at several loads, and the search for the highest load that
meets an SLO for a given share of requests (`--find-capacity`)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Literal

from kvflow.bench.arrivals import LoadSpec
from kvflow.bench.runner import BenchConfig, run_benchmark

LoadKey = Literal["concurrency", "request_rate"]
# Rate search: stop bisecting when the bracket is this narrow, relative to its lower end.
RATE_RESOLUTION = 0.1
MAX_SEARCH_RUNS = 12


def with_load(config: BenchConfig, key: LoadKey, value: float) -> BenchConfig:
    base = config.load
    if key == "concurrency":
        load = LoadSpec(concurrency=int(value), seed=base.seed)
    else:
        load = LoadSpec(
            request_rate=value,
            burstiness=base.burstiness,
            max_concurrency=base.max_concurrency,
            seed=base.seed,
        )
    return replace(config, load=load)


def sweep(config: BenchConfig, key: LoadKey, loads: list[float]) -> dict[str, Any]:
    runs = []
    for value in loads:
        print(f"[kvflow bench sweep] {key} = {value:g}", file=sys.stderr)
        runs.append({"load": value, "result": run_benchmark(with_load(config, key, value))})
    return {"load_key": key, "runs": runs, "capacity": None}


def meets(result: dict[str, Any], percentile: float) -> bool:
    attainment = result.get("slo_attainment_pct")
    return attainment is not None and attainment >= percentile and result["completed"] > 0


def find_capacity(
    config: BenchConfig,
    key: LoadKey,
    percentile: float,
    start: float,
    max_load: float,
    run: Callable[[BenchConfig], dict[str, Any]] = run_benchmark,
) -> dict[str, Any]:
    """Double the load until the SLO fails (or max_load), then bisect; every probe is a full run."""
    if not config.slo:
        raise ValueError("--find-capacity needs --slo")
    runs: list[dict[str, Any]] = []

    def probe(value: float) -> bool:
        value = float(int(value)) if key == "concurrency" else value
        print(f"[kvflow bench capacity] {key} = {value:g}", file=sys.stderr)
        result = run(with_load(config, key, value))
        runs.append({"load": value, "result": result})
        return meets(result, percentile)

    good: float | None = None
    bad: float | None = None
    value = start
    while len(runs) < MAX_SEARCH_RUNS:
        if probe(value):
            good = value
            if value >= max_load:
                break
            value = min(value * 2, max_load)
        else:
            bad = value
            break
    while good is not None and bad is not None and len(runs) < MAX_SEARCH_RUNS:
        if (key == "concurrency" and bad - good <= 1) or (
            key != "concurrency" and bad - good <= RATE_RESOLUTION * good
        ):
            break
        middle = (good + bad) / 2
        middle = float(int(middle)) if key == "concurrency" else middle
        if probe(middle):
            good = middle
        else:
            bad = middle
    runs.sort(key=lambda r: r["load"])
    return {
        "load_key": key,
        "runs": runs,
        "capacity": {"load": good, "first_failing_load": bad, "slo": config.slo, "percentile": percentile},
    }
