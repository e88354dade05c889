"""Serving latency: client-measured TTFT/ITL next to the server's own numbers, for the same run.

    python benchmarks/serve_latency.py [--num-requests 32] [--concurrency 4] [--input-len 256]
                                       [--output-len 64] [--dtype bfloat16]

Starts `kvflow serve` (a subprocess, as users run it) on the Qwen2.5-0.5B-shaped random checkpoint
of offline_throughput.py, sends warm-up requests, then `--num-requests` streaming completions with
`--concurrency` in flight (closed loop). Prompts are random token ids (exact lengths); outputs are
exactly `--output-len` tokens (ignore_eos). Every chunk carries its token count
(`continuous_usage_stats`), so a chunk of n tokens after a gap g counts as n gaps of g/n.

Three views of the same requests:
  client      TTFT = first content chunk - send; ITL = per-token gaps as above
  server      each request's own timeline (`kvflow.timing` in the final chunk: ttft_ms) and
              the gaps between its token times (from /metrics: no per-token export)
  /metrics    quantiles interpolated from the histogram buckets (Prometheus' histogram_quantile)
              over exactly the measured requests (bucket deltas across the run)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from offline_throughput import QWEN25_05B, REPO, build_checkpoint

from kvflow.bench.metrics import percentile
from kvflow.bench.server_metrics import Snapshot, histogram_quantile, scrape
from kvflow.server.spawn import spawn_server, stop_server

NUM_WARMUP = 2


@dataclass
class RequestRecord:
    send: float
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (arrival, tokens in the chunk)
    server_ttft_ms: float | None = None

    @property
    def ttft(self) -> float:
        return self.chunks[0][0] - self.send

    def itl_per_token(self) -> list[float]:
        gaps = []
        for (t0, _), (t1, n) in zip(self.chunks, self.chunks[1:], strict=False):
            gaps += [(t1 - t0) / n] * n
        return gaps


def start_server(model: Path, args: argparse.Namespace) -> tuple[subprocess.Popen[Any], str]:
    flags = ["--served-model-name", "bench", "--dtype", args.dtype, "--max-model-len", "2048"]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.server_threads)}
    return spawn_server(model, flags, env=env, cwd=REPO)


async def one_request(client: httpx.AsyncClient, prompt: list[int], output_len: int) -> RequestRecord:
    body = {
        "model": "bench",
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "kvflow": {"timing": True},
    }
    record = RequestRecord(send=time.perf_counter())
    seen_tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.perf_counter()
            chunk = json.loads(line[len("data: ") :])
            if not chunk["choices"]:
                continue
            tokens = chunk["usage"]["completion_tokens"] - seen_tokens
            seen_tokens = chunk["usage"]["completion_tokens"]
            if tokens > 0:
                record.chunks.append((now, tokens))
            if "kvflow" in chunk:
                record.server_ttft_ms = chunk["kvflow"]["timing"]["ttft_ms"]
    if seen_tokens != output_len:
        raise RuntimeError(f"got {seen_tokens} tokens, expected {output_len}")
    return record


async def run_load(
    base: str, prompts: list[list[int]], output_len: int, concurrency: int
) -> list[RequestRecord]:
    semaphore = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:

        async def bounded(prompt: list[int]) -> RequestRecord:
            async with semaphore:
                return await one_request(client, prompt, output_len)

        return list(await asyncio.gather(*(bounded(p) for p in prompts)))


def report(
    records: list[RequestRecord], before: Snapshot, after: Snapshot, wall: float, args: argparse.Namespace
) -> None:
    client_ttft = [r.ttft * 1e3 for r in records]
    client_itl = [g * 1e3 for r in records for g in r.itl_per_token()]
    server_ttft = [r.server_ttft_ms for r in records if r.server_ttft_ms is not None]
    ttft_name, itl_name = "time_to_first_token_seconds", "inter_token_latency_seconds"
    n_tokens = sum(n for r in records for _, n in r.chunks)
    print(
        f"\n{len(records)} requests, concurrency {args.concurrency}, {args.input_len} prompt + "
        f"{args.output_len} output tokens, {args.dtype}; {wall:.1f} s, {n_tokens / wall:.1f} output tok/s"
    )
    header = ("client", "server (exact)", "/metrics (hist)", "client - server")
    print(f"{'metric':<8}{'pct':>5}{header[0]:>12}" + "".join(f"{h:>17}" for h in header[1:]))
    for q in (0.5, 0.99):
        c, s = percentile(client_ttft, 100 * q), percentile(server_ttft, 100 * q)
        h = (histogram_quantile(before, after, ttft_name, q) or 0.0) * 1e3
        print(f"{'TTFT':<8}{f'p{int(q * 100)}':>5}{c:>10.1f}ms{s:>15.1f}ms{h:>15.1f}ms{c - s:>15.1f}ms")
    for q in (0.5, 0.99):
        c = percentile(client_itl, 100 * q)
        h = (histogram_quantile(before, after, itl_name, q) or 0.0) * 1e3
        print(f"{'ITL':<8}{f'p{int(q * 100)}':>5}{c:>10.1f}ms{'':>17}{h:>15.1f}ms{c - h:>15.1f}ms")
    count_key = "kvflow:" + itl_name + "_count"
    itl_count = sum(after[count_key].values()) - sum(before[count_key].values())
    print(f"ITL samples: client {len(client_itl)}, server histogram {itl_count:.0f}")
    diffs = [c - s for c, s in zip(client_ttft, server_ttft, strict=False)]
    print(f"TTFT client - server per request: mean {statistics.mean(diffs):.2f} ms, max {max(diffs):.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--server-threads", type=int, default=2)
    args = parser.parse_args()

    model = build_checkpoint(getattr(torch, args.dtype))
    rng = random.Random(0)
    vocab = QWEN25_05B["vocab_size"]
    prompts = [
        [rng.randrange(1000, vocab - 1000) for _ in range(args.input_len)] for _ in range(args.num_requests)
    ]
    server, base = start_server(model, args)
    try:
        warmup = [
            [rng.randrange(1000, vocab - 1000) for _ in range(args.input_len)] for _ in range(NUM_WARMUP)
        ]
        asyncio.run(run_load(base, warmup, 8, NUM_WARMUP))
        before = scrape(base + "/metrics")
        start = time.perf_counter()
        records = asyncio.run(run_load(base, prompts, args.output_len, args.concurrency))
        wall = time.perf_counter() - start
        after = scrape(base + "/metrics")
    finally:
        stop_server(server)
    assert before is not None and after is not None, "kvflow serve exports /metrics"
    report(records, before, after, wall, args)


if __name__ == "__main__":
    main()
