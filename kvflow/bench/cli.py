"""`kvflow bench` and `kvflow bench sweep` flags -> BenchConfig -> run, print, write."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from kvflow.bench.arrivals import LoadSpec
from kvflow.bench.datasets import DATASETS, DatasetSpec
from kvflow.bench.metrics import parse_slo
from kvflow.bench.report import console_table, write_outputs
from kvflow.bench.runner import BenchConfig, run_benchmark
from kvflow.bench.sweep import LoadKey, find_capacity, sweep

DEFAULT_CONCURRENCY = 4
DEFAULT_CAPACITY_PERCENTILE = 90.0


def add_bench_parser(sub: Any) -> None:
    bench = sub.add_parser(
        "bench",
        help="load generator: TTFT / ITL / TPOT against any OpenAI-compatible server",
        description="Measure an OpenAI-compatible server. `kvflow bench sweep ...` runs several loads.",
    )
    bench.add_argument("mode", nargs="?", choices=("run", "sweep"), default="run")
    bench.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    bench.add_argument("--model", default=None, help="default: the first model the server lists")
    bench.add_argument("--api-key", default=None)
    bench.add_argument("--endpoint", choices=("chat", "completions"), default="completions")
    bench.add_argument("--num-requests", type=int, default=32)
    bench.add_argument(
        "--concurrency", default=None, help="closed loop: requests in flight (sweep: a list, e.g. 1,2,4,8)"
    )
    bench.add_argument("--request-rate", default=None, help="open loop: requests/s, 'inf' (sweep: a list)")
    bench.add_argument("--burstiness", type=float, default=1.0, help="open loop gamma shape; 1 = Poisson")
    bench.add_argument(
        "--max-concurrency", type=int, default=None, help="open loop: cap on requests in flight"
    )
    datasets = ", ".join(DATASETS)
    bench.add_argument("--dataset", default="random", help=f"{datasets}, or jsonl:PATH")
    bench.add_argument("--input-len", type=int, default=256)
    bench.add_argument("--output-len", type=int, default=128)
    bench.add_argument("--range-ratio", type=float, default=0.0)
    bench.add_argument("--prefix-len", type=int, default=0, help="shared-prefix: shared system prompt tokens")
    bench.add_argument("--num-turns", type=int, default=3, help="multi-turn: user turns per conversation")
    bench.add_argument(
        "--tokenizer", default=None, help="model dir (default: the server's model dir if local)"
    )
    bench.add_argument("--slo", default=None, help="e.g. ttft_ms=500,tpot_ms=50 (also itl_p99_ms, e2e_ms)")
    bench.add_argument("--warmup", type=int, default=2, help="requests sent first and excluded")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--temperature", type=float, default=0.0)
    bench.add_argument("--no-ignore-eos", action="store_true", help="let outputs stop at EOS")
    bench.add_argument(
        "--no-continuous-usage", action="store_true", help="for servers that reject stream_options extensions"
    )
    bench.add_argument("--no-usage", action="store_true", help="send no stream_options at all")
    bench.add_argument("--output", default=None, help="write the JSON result here")
    bench.add_argument("--html", default=None, help="write the HTML report here")
    bench.add_argument(
        "--find-capacity", action="store_true", help="sweep: search the highest load meeting --slo"
    )
    bench.add_argument(
        "--slo-percentile",
        type=float,
        default=DEFAULT_CAPACITY_PERCENTILE,
        help="capacity: %% of requests meeting it",
    )
    bench.add_argument("--max-load", type=float, default=256, help="capacity: the highest load tried")
    bench.add_argument("--quiet", action="store_true", help="no progress bar")
    bench.set_defaults(func=cmd_bench)


def _config(args: argparse.Namespace, load: LoadSpec) -> BenchConfig:
    dataset = DatasetSpec(
        name=args.dataset,
        num_requests=args.num_requests,
        input_len=args.input_len,
        output_len=args.output_len,
        range_ratio=args.range_ratio,
        prefix_len=args.prefix_len,
        num_turns=args.num_turns,
        seed=args.seed,
    )
    return BenchConfig(
        base_url=args.base_url,
        dataset=dataset,
        load=load,
        model=args.model,
        endpoint=args.endpoint,
        tokenizer=args.tokenizer,
        slo=parse_slo(args.slo),
        warmup=args.warmup,
        api_key=args.api_key,
        ignore_eos=not args.no_ignore_eos,
        continuous_usage_stats=not args.no_continuous_usage,
        include_usage=not args.no_usage,
        temperature=args.temperature,
        progress=not args.quiet,
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
            request_rate=loads[0],
            burstiness=args.burstiness,
            max_concurrency=args.max_concurrency,
            seed=args.seed,
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
