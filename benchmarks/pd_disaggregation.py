"""Long prompts arriving during streaming decodes: ITL p99 of the decodes and TTFT of the long
prompts, colocated (one kvflow serve, 2 threads, chunked prefill) against disaggregated (a prefill
and a decode instance of 1 thread each behind vllm-router --vllm-pd-disaggregation). Issue 38, part 2.

    python benchmarks/pd_disaggregation.py [--seconds 40] [--streams 4] [--long-len 1536] [--rounds 2]

The Qwen2.5-0.5B-shaped random checkpoint in bf16. `--streams` clients each stream 128-token answers
to short prompts, back to back; one more client sends a `--long-len`-token prompt (8 output tokens)
every `--long-every` seconds. Both setups get the same load through the same kind of HTTP path (the
colocated server directly, the pair through the router), alternated round by round. Printed: the
streams' inter-token gaps (p50 / p99 over every gap of every stream), the long prompts' TTFT (p50),
and the decode tokens/s; then the ratios. With 2 cores, PD halves each side's compute: it wins only
where prefill chunks were what stretched the decodes' gaps.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from offline_throughput import build_checkpoint  # noqa: E402

from kvflow.server.spawn import spawn_server, spawn_vllm_router, stop_router, stop_server  # noqa: E402
from kvflow.stats import percentile  # noqa: E402

SHORT_LEN = 64
STREAM_TOKENS = 128
LONG_OUTPUT = 8
CHUNK = 256  # colocated: max_num_batched_tokens (chunked prefill: a long prompt in 256-token chunks)
TOKEN_RANGE = (1000, 150_000)  # ordinary Qwen2 tokens


async def stream_client(
    http: httpx.AsyncClient, model: str, rng: random.Random, stop: float, gaps: list[float]
) -> int:
    tokens = 0
    while time.monotonic() < stop:
        prompt = [rng.randrange(*TOKEN_RANGE) for _ in range(SHORT_LEN)]
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": STREAM_TOKENS,
            "temperature": 0,
            "stream": True,
        }
        body["ignore_eos"] = True
        last = None
        async with http.stream("POST", "/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                now = time.monotonic()
                if last is not None:
                    gaps.append(now - last)
                last = now
                tokens += 1
    return tokens


async def long_client(
    http: httpx.AsyncClient,
    model: str,
    rng: random.Random,
    stop: float,
    every: float,
    length: int,
    ttfts: list[float],
) -> None:
    await asyncio.sleep(every / 2)
    while time.monotonic() < stop:
        prompt = [rng.randrange(*TOKEN_RANGE) for _ in range(length)]
        body = {"model": model, "prompt": prompt, "max_tokens": LONG_OUTPUT, "temperature": 0, "stream": True}
        body["ignore_eos"] = True
        start = time.monotonic()
        async with http.stream("POST", "/v1/completions", json=body) as response:
            lines = response.aiter_lines()
            async for line in lines:
                if line.startswith("data: {"):
                    ttfts.append(time.monotonic() - start)
                    break
            async for _ in lines:
                pass
        await asyncio.sleep(max(0.0, every - (time.monotonic() - start)))


async def load(base: str, model: str, args: argparse.Namespace, seed: int) -> dict[str, float]:
    gaps: list[float] = []
    ttfts: list[float] = []
    stop = time.monotonic() + args.seconds
    async with httpx.AsyncClient(base_url=base, timeout=300) as http:
        streams = [
            stream_client(http, model, random.Random(seed * 100 + i), stop, gaps) for i in range(args.streams)
        ]
        longs = long_client(http, model, random.Random(seed), stop, args.long_every, args.long_len, ttfts)
        start = time.monotonic()
        results = await asyncio.gather(*streams, longs)
        elapsed = time.monotonic() - start
    tokens = sum(r for r in results if isinstance(r, int))
    return {
        "itl_p50_ms": 1e3 * percentile(gaps, 50),
        "itl_p99_ms": 1e3 * percentile(gaps, 99),
        "long_ttft_p50_ms": 1e3 * statistics.median(ttfts) if ttfts else float("nan"),
        "long_prompts": float(len(ttfts)),
        "decode_tok_s": tokens / elapsed,
    }


def start_router(prefill: str, decode: str) -> tuple[subprocess.Popen[Any], str]:
    args = ["--vllm-pd-disaggregation", "--prefill", prefill, "--decode", decode, "--policy", "round_robin"]
    return spawn_vllm_router(args)


def run_colocated(checkpoint: Path, args: argparse.Namespace, seed: int) -> dict[str, float]:
    flags = ["--max-num-batched-tokens", str(CHUNK), "--max-num-seqs", str(args.streams + 2)]
    process, base = spawn_server(checkpoint, flags, env={**os.environ, "OMP_NUM_THREADS": "2"})
    try:
        return asyncio.run(load(base, str(checkpoint), args, seed))
    finally:
        stop_server(process)


def run_pd(checkpoint: Path, args: argparse.Namespace, seed: int) -> dict[str, float]:
    one = {**os.environ, "OMP_NUM_THREADS": "1"}
    seqs = ["--max-num-seqs", str(args.streams + 2)]
    prefill, prefill_url = spawn_server(checkpoint, ["--kv-role", "prefill", *seqs], env=one)
    decode, decode_url = spawn_server(checkpoint, ["--kv-role", "decode", *seqs], env=one)
    router = None
    try:
        router, base = start_router(prefill_url, decode_url)
        return asyncio.run(load(base, str(checkpoint), args, seed))
    finally:
        if router is not None:
            stop_router(router)
        stop_server(prefill)
        stop_server(decode)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=40.0)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--long-len", type=int, default=1536)
    parser.add_argument("--long-every", type=float, default=6.0)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    checkpoint = build_checkpoint(torch.bfloat16)
    runs: dict[str, list[dict[str, float]]] = {"colocated (2 threads)": [], "PD (1 + 1 threads)": []}
    for r in range(args.rounds):
        order = list(runs) if r % 2 == 0 else list(reversed(runs))
        for name in order:
            fn = run_colocated if name.startswith("colocated") else run_pd
            runs[name].append(fn(checkpoint, args, seed=r))
            print(f"round {r + 1} {name}: {runs[name][-1]}", flush=True)
    every = f"a {args.long_len}-token prompt every {args.long_every:g} s"
    print(f"\n{args.streams} streams of {STREAM_TOKENS} tokens; {every}")
    print("| setup | ITL p50 (ms) | ITL p99 (ms) | long-prompt TTFT p50 (ms) | decode tok/s |")
    print("| --- | --- | --- | --- | --- |")
    med: dict[str, dict[str, float]] = {}
    for name, results in runs.items():
        med[name] = {k: statistics.median(x[k] for x in results) for k in results[0]}
        m = med[name]
        cells = [f"{m['itl_p50_ms']:.0f}", f"{m['itl_p99_ms']:.0f}", f"{m['long_ttft_p50_ms']:.0f}"]
        print(f"| {name} | {' | '.join(cells)} | {m['decode_tok_s']:.1f} |")
    col, pd = med["colocated (2 threads)"], med["PD (1 + 1 threads)"]
    print(
        f"ITL p99 colocated / PD: {col['itl_p99_ms'] / pd['itl_p99_ms']:.2f}x; long TTFT PD / colocated: "
        f"{pd['long_ttft_p50_ms'] / col['long_ttft_p50_ms']:.2f}x"
    )


if __name__ == "__main__":
    main()
