"""Two kvflow replicas behind vllm-router: prefix hit rate and TTFT of returning conversations under
`round_robin`, `cache_aware` and `kv_aware` (issue 38, part 3), one run, policies alternated.

    python benchmarks/kv_aware_router.py [--conversations 8] [--turns 4] [--input-len 384] [--rounds 2]

The Qwen2.5-0.5B-shaped random checkpoint in bf16 with the real Qwen2 tokenizer (the router loads
it to hash prompts), two `kvflow serve` replicas of one thread each (this machine's two cores), each
with a pool of about half the conversations' final histories and `--kv-events-config` publishing to
the router. The load is `kvflow bench`'s multi-turn dataset through the router's OpenAI endpoint
(chat, 2 conversations at a time, each turn resending its history with the answers): a returning
turn is a prefix hit only on the replica that served the conversation before. Each policy starts
from cold replicas (restarted) and a fresh router; the rounds alternate the policies' order.

Per policy: the replicas' own prefix-cache counters (hit tokens / looked-up tokens, scraped from
each replica's /metrics before and after) and kvflow bench's TTFT p50 / p99 over all turns.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from offline_throughput import build_checkpoint  # noqa: E402

from kvflow.bench import server_metrics  # noqa: E402
from kvflow.bench.arrivals import LoadSpec  # noqa: E402
from kvflow.bench.datasets import DatasetSpec  # noqa: E402
from kvflow.bench.runner import BenchConfig, run_benchmark  # noqa: E402
from kvflow.server.spawn import free_port, spawn_server, spawn_vllm_router, stop_router, stop_server  # noqa: E402

BLOCK = 16
OUTPUT_LEN = 32
POLICIES = ("round_robin", "cache_aware", "kv_aware")


def start_replica(checkpoint: Path, num_blocks: int) -> tuple[subprocess.Popen[Any], str, str]:
    """(process, base URL, KV event endpoint) of one single-threaded replica."""
    events = f"tcp://127.0.0.1:{free_port()}"
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": events.replace("127.0.0.1", "*"),
    }
    flags = [
        "--block-size",
        str(BLOCK),
        "--num-kv-blocks",
        str(num_blocks),
        "--kv-events-config",
        json.dumps(config),
    ]
    process, base = spawn_server(checkpoint, flags, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return process, base, events


def start_router(
    policy: str, replicas: list[tuple[Any, str, str]], model: str
) -> tuple[subprocess.Popen[Any], str]:
    args = ["--policy", policy, "--worker-urls", *(base for _, base, _ in replicas)]
    if policy == "kv_aware":
        for _, base, events in replicas:
            args += ["--kv-event-source", f"{base}={events}"]
        args += ["--kv-event-block-size", str(BLOCK), "--kv-event-model", model]
    return spawn_vllm_router(args)


def prefix_counters(base: str) -> tuple[float, float]:
    """(looked-up prompt tokens, hit tokens) of one replica, cumulative."""
    snapshot = server_metrics.scrape(base + "/metrics")
    assert snapshot is not None

    def total(name: str) -> float:
        return sum(snapshot.get("kvflow:" + name, {}).values())

    return total("prefix_cache_queries_total"), total("prefix_cache_hits_total")


def run_policy(policy: str, checkpoint: Path, num_blocks: int, args: argparse.Namespace) -> dict[str, Any]:
    replicas = [start_replica(checkpoint, num_blocks) for _ in range(2)]
    router = None
    try:
        router, url = start_router(policy, replicas, str(checkpoint))
        dataset = DatasetSpec(
            name="multi-turn",
            num_requests=args.conversations * args.turns,
            input_len=args.input_len,
            output_len=OUTPUT_LEN,
            num_turns=args.turns,
        )
        config = BenchConfig(
            base_url=url + "/v1",
            dataset=dataset,
            load=LoadSpec(concurrency=2),
            model=str(checkpoint),
            endpoint="chat",
            tokenizer=str(checkpoint),
            warmup=0,
            progress=False,
        )
        result = run_benchmark(config)
        per_replica = [prefix_counters(base) for _, base, _ in replicas]
    finally:
        if router is not None:
            stop_router(router)
        for process, _, _ in replicas:
            stop_server(process)
    queries = sum(q for q, _ in per_replica)
    hits = sum(h for _, h in per_replica)
    return {
        "hit_rate": hits / queries if queries else 0.0,
        "replica_hit_rates": [h / q if q else 0.0 for q, h in per_replica],
        "ttft_p50": result["ttft_ms"]["p50"],
        "ttft_p99": result["ttft_ms"]["p99"],
        "failed": result["failed"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--input-len", type=int, default=384, help="new tokens per user turn")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    checkpoint = build_checkpoint(torch.bfloat16)
    final_history = args.turns * (args.input_len + OUTPUT_LEN)
    # Half the conversations' final histories per replica: together the two hold them all, if each
    # conversation stays on one replica.
    num_blocks = -(-final_history // BLOCK) * args.conversations // 2
    print(
        f"{args.conversations} conversations x {args.turns} turns of {args.input_len} new tokens "
        f"(+{OUTPUT_LEN} answered); final history {final_history} tokens; {num_blocks} blocks per replica"
    )
    runs: dict[str, list[dict[str, Any]]] = {p: [] for p in POLICIES}
    for r in range(args.rounds):
        order = POLICIES if r % 2 == 0 else tuple(reversed(POLICIES))
        for policy in order:
            runs[policy].append(run_policy(policy, checkpoint, num_blocks, args))
            print(f"round {r + 1} {policy}: {runs[policy][-1]}", flush=True)
    print("\n| policy | prefix hit rate | per replica | TTFT p50 (ms) | TTFT p99 (ms) | failed |")
    print("| --- | --- | --- | --- | --- | --- |")
    for policy, results in runs.items():
        rate = statistics.median(x["hit_rate"] for x in results)
        replica = " / ".join(
            f"{statistics.median(x['replica_hit_rates'][i] for x in results):.0%}" for i in range(2)
        )
        p50 = statistics.median(x["ttft_p50"] for x in results)
        p99 = statistics.median(x["ttft_p99"] for x in results)
        failed = sum(x["failed"] for x in results)
        print(f"| {policy} | {rate:.1%} | {replica} | {p50:.0f} | {p99:.0f} | {failed} |")
    base = statistics.median(x["ttft_p50"] for x in runs["round_robin"])
    for policy in ("cache_aware", "kv_aware"):
        ratio = base / statistics.median(x["ttft_p50"] for x in runs[policy])
        print(f"TTFT p50, round_robin / {policy}: {ratio:.2f}x")


if __name__ == "__main__":
    main()
