"""`kvflow bench` and `kvflow bench sweep` flags -> BenchConfig -> run, print, write."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from kvflow.arg_utils import FieldOverrides, add_dataclass_args, dataclass_kwargs
from kvflow.bench.arrivals import LoadSpec
from kvflow.bench.datasets import DATASETS, DatasetSpec
from kvflow.bench.metrics import parse_slo
from kvflow.bench.priority import parse_priority_mix
from kvflow.bench.report import console_table, write_outputs
from kvflow.bench.runner import BenchConfig, run_benchmark
from kvflow.bench.sweep import LoadKey, find_capacity, sweep

DEFAULT_CONCURRENCY = 4
DEFAULT_CAPACITY_PERCENTILE = 90.0

# The flags are BenchConfig's, DatasetSpec's and LoadSpec's fields (kvflow/arg_utils.py). Below: what
# those dataclasses cannot say themselves: CLI defaults for the fields they require in Python, and
# flag names and help for DatasetSpec's and LoadSpec's fields, which carry no metadata.
BENCH_FLAGS: FieldOverrides = {"base_url": {"default": "http://127.0.0.1:8000/v1"}}
# Their own flags: the groups below, --slo, --priority-mix, --quiet, --replica-metrics.
BENCH_NOT_FLAGS = ("dataset", "load", "slo", "priority_mix", "progress", "replica_metrics")
DATASET_FLAGS: FieldOverrides = {
    "name": {"flag": "--dataset", "default": "random", "help": f"{', '.join(DATASETS)}, or jsonl:PATH"},
    "num_requests": {"default": 32, "help": "requests measured"},
    "input_len": {"help": "prompt tokens"},
    "output_len": {"help": "output tokens (max_tokens)"},
    "range_ratio": {"help": "lengths uniform in [L * (1 - r), L * (1 + r)]"},
    "prefix_len": {"help": "shared-prefix: shared system prompt tokens"},
    "num_turns": {"help": "multi-turn: user turns per conversation"},
    "seed": {"help": "seed of the workload and of open-loop arrivals"},
}
DATASET_NOT_FLAGS = ("max_model_len",)  # long-context: the server's, from /v1/models
# --concurrency and --request-rate are hand-written: sweep takes a list of each (1,2,4,8).
LOAD_FLAGS: FieldOverrides = {
    "burstiness": {"help": "open loop gamma shape; 1 = Poisson"},
    "max_concurrency": {"help": "open loop: cap on requests in flight"},
}


def add_bench_parser(sub: Any) -> None:
    bench = sub.add_parser(
        "bench",
        help="load generator: TTFT / ITL / TPOT against any OpenAI-compatible server",
        description="Measure an OpenAI-compatible server. `kvflow bench sweep ...` runs several loads.",
    )
    bench.add_argument(
        "mode", nargs="?", choices=("run", "sweep"), default="run", help="sweep: several loads"
    )
    requests = bench.add_argument_group(BenchConfig.__name__)
    add_dataclass_args(requests, BenchConfig, exclude=BENCH_NOT_FLAGS, overrides=BENCH_FLAGS)
    requests.add_argument("--slo", default=None, help="e.g. ttft_ms=500,tpot_ms=50 (also itl_p99_ms, e2e_ms)")
    requests.add_argument(
        "--priority-mix",
        default=None,
        metavar="P:SHARE,...",
        help="send vLLM's `priority` field, e.g. 0:0.2,5:0.8 (20%% of requests at 0, 80%% at 5; lower is "
        "served first under --scheduling-policy priority); TTFT is reported per priority",
    )
    requests.add_argument(
        "--replica-metrics",
        nargs="+",
        default=(),
        metavar="URL",
        help="behind a router: each replica's /metrics, reported per replica (kvflow doctor names the "
        "bottleneck)",
    )
    workload = bench.add_argument_group(DatasetSpec.__name__)
    add_dataclass_args(workload, DatasetSpec, exclude=DATASET_NOT_FLAGS, overrides=DATASET_FLAGS)
    load = bench.add_argument_group(LoadSpec.__name__)
    load.add_argument(
        "--concurrency",
        default=None,
        help=f"closed loop: requests in flight (sweep: a list, e.g. 1,2,4,8); unset: {DEFAULT_CONCURRENCY}",
    )
    load.add_argument("--request-rate", default=None, help="open loop: requests/s, 'inf' (sweep: a list)")
    add_dataclass_args(load, LoadSpec, include=LOAD_FLAGS, overrides=LOAD_FLAGS)
    capacity = bench.add_argument_group("capacity search (sweep)")
    capacity.add_argument(
        "--find-capacity", action="store_true", help="sweep: search the highest load meeting --slo"
    )
    capacity.add_argument(
        "--slo-percentile",
        type=float,
        default=DEFAULT_CAPACITY_PERCENTILE,
        help="capacity: %% of requests meeting it",
    )
    capacity.add_argument("--max-load", type=float, default=256, help="capacity: the highest load tried")
    output = bench.add_argument_group("output")
    output.add_argument("--output", default=None, help="write the JSON result here")
    output.add_argument("--html", default=None, help="write the HTML report here")
    output.add_argument("--quiet", action="store_true", help="no progress bar")
    bench.set_defaults(func=cmd_bench)


def _config(args: argparse.Namespace, load: LoadSpec) -> BenchConfig:
    return BenchConfig(
        dataset=DatasetSpec(**dataclass_kwargs(args, DatasetSpec, exclude=DATASET_NOT_FLAGS)),
        load=load,
        slo=parse_slo(args.slo),
        priority_mix=parse_priority_mix(args.priority_mix),
        progress=not args.quiet,
        replica_metrics=tuple(args.replica_metrics),
        **dataclass_kwargs(args, BenchConfig, exclude=BENCH_NOT_FLAGS),
    )


def _loads(text: str | None) -> list[float]:
    return [float(part) for part in (text or "").split(",") if part.strip()]


def cmd_bench(args: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request drowns the table
    if args.concurrency is not None and args.request_rate is not None:
        raise ValueError("give --concurrency or --request-rate, not both")
    key: LoadKey = "request_rate" if args.request_rate is not None else "concurrency"
    loads = _loads(args.request_rate if key == "request_rate" else args.concurrency) or [DEFAULT_CONCURRENCY]
    seeded = LoadSpec(concurrency=1, seed=args.seed)
    if key == "request_rate":
        seeded = LoadSpec(
            request_rate=loads[0], seed=args.seed, **dataclass_kwargs(args, LoadSpec, include=LOAD_FLAGS)
        )
    config = _config(args, seeded)
    if args.mode == "run":
        if len(loads) != 1:
            raise ValueError("several loads need `kvflow bench sweep`")
        from kvflow.bench.sweep import with_load

        result = run_benchmark(with_load(config, key, loads[0]))
        print(console_table(result))
        write_outputs(result, args.output, args.html)
        return 0
    if args.find_capacity:
        outcome = find_capacity(config, key, args.slo_percentile, loads[0], args.max_load)
    else:
        outcome = sweep(config, key, loads)
    for run in outcome["runs"]:
        print(console_table(run["result"]) + "\n")
    capacity = outcome.get("capacity")
    if capacity:
        print(
            f"capacity: {key} {capacity['load']} meets {capacity['slo']} for {capacity['percentile']}% of "
            f"requests (first failing: {capacity['first_failing_load']})",
            file=sys.stdout,
        )
    write_outputs(outcome, args.output, args.html, sweep=True)
    return 0
