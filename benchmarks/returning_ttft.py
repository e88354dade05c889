"""Returning conversations on kvflow's KV offload tier and on llama.cpp's host-memory prompt cache,
side by side in one run (issue 38's tier against a peer's mechanism for the same problem).

    python benchmarks/returning_ttft.py [--conversations 8] [--history 1024] [--rounds 2]

Four servers on the same weights (the Qwen2.5-0.5B-shaped random checkpoint in bf16; llama.cpp
reads its bf16 GGUF, converted by llama.cpp's own convert_hf_to_gguf.py via vs_llamacpp.py), 2
threads each, one request at a time, engines alternated request by request:
    kvflow, tier      pool of ~2 conversations' blocks, --kv-offload-path (evicted blocks on disk)
    kvflow, recompute the same pool, no tier
    llama.cpp, cache  one slot of --history + 512 tokens, --cache-ram 8192 (its default: a slot's
                      prompt state saved to RAM when another prompt takes the slot, restored on a
                      matching prefix)
    llama.cpp, none   the same slot, --cache-ram 0
Each conversation's first turn is a `--history`-token prompt; each returning turn is the previous
prompt plus 32 new tokens (the answer is not fed back: the servers' outputs differ, the prefixes must
not). TTFT = the wall time of a non-streamed completion of 1 token (HTTP included, the same for all).
Prints the median and p99 of returning-turn TTFT per server and the ratios within each engine.
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from offline_throughput import build_checkpoint  # noqa: E402
from vs_llamacpp import build_llamacpp, convert, runnable_llamacpp  # noqa: E402

from kvflow.server.spawn import free_port, spawn_server, stop_server  # noqa: E402
from kvflow.stats import percentile  # noqa: E402

BLOCK = 16
NEW_TOKENS = 32
THREADS = 2
TOKEN_RANGE = (1000, 150_000)  # ordinary Qwen2 tokens (the specials start at 151,643)


def _llama_server(
    bin_dir: Path, gguf: Path, ctx: int, cache_ram_mib: int
) -> tuple[subprocess.Popen[Any], str]:
    port = free_port()
    command = [str(bin_dir / "llama-server"), "-m", str(gguf), "--port", str(port), "-t", str(THREADS)]
    command += ["-np", "1", "-c", str(ctx), "--cache-ram", str(cache_ram_mib)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return process, base
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    process.kill()
    raise RuntimeError("llama-server did not become healthy")


def _ttft_ms(base: str, prompt: list[int]) -> float:
    model = httpx.get(base + "/v1/models", timeout=10).json()["data"][0]["id"]
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0}
    start = time.perf_counter()
    response = httpx.post(base + "/v1/completions", json=body, timeout=600)
    elapsed = (time.perf_counter() - start) * 1e3
    response.raise_for_status()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--history", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    checkpoint = build_checkpoint(torch.bfloat16)
    bin_dir = build_llamacpp()
    gguf = convert(checkpoint, bin_dir, "bf16")
    bin_dir = runnable_llamacpp(bin_dir, gguf, THREADS)
    longest = args.history + args.rounds * NEW_TOKENS
    per_conversation = -(-(longest + 1) // BLOCK)
    pool = per_conversation * 2
    kvflow_flags = ["--block-size", str(BLOCK), "--num-kv-blocks", str(pool), "--max-num-seqs", "1"]
    servers: dict[str, tuple[subprocess.Popen[Any], str]] = {}
    with tempfile.TemporaryDirectory() as tier_dir:
        try:
            servers["kvflow, tier"] = spawn_server(checkpoint, [*kvflow_flags, "--kv-offload-path", tier_dir])
            servers["kvflow, recompute"] = spawn_server(checkpoint, kvflow_flags)
            servers["llama.cpp, cache"] = _llama_server(bin_dir, gguf, longest + 512, 8192)
            servers["llama.cpp, none"] = _llama_server(bin_dir, gguf, longest + 512, 0)
            rng = random.Random(0)
            prompts = [
                [rng.randrange(*TOKEN_RANGE) for _ in range(args.history)] for _ in range(args.conversations)
            ]
            first: dict[str, list[float]] = {name: [] for name in servers}
            returning: dict[str, list[float]] = {name: [] for name in servers}
            for turn in range(args.rounds + 1):
                for c in range(args.conversations):
                    if turn:
                        prompts[c] = prompts[c] + [rng.randrange(*TOKEN_RANGE) for _ in range(NEW_TOKENS)]
                    for name, (_, base) in servers.items():
                        (returning if turn else first)[name].append(_ttft_ms(base, prompts[c]))
        finally:
            for name, (process, _) in servers.items():
                if name.startswith("kvflow"):
                    stop_server(process)
                else:
                    process.terminate()
                    process.wait(30)
    print(
        f"{args.conversations} conversations, {args.history}-token histories, {args.rounds} returning turns; "
        f"kvflow pool {pool} blocks of {BLOCK} (2 conversations), llama.cpp one slot of {longest + 512}"
    )
    for name in first:
        r = returning[name]
        print(
            f"  {name:18s} first TTFT p50 {statistics.median(first[name]):7.1f} ms   returning TTFT p50 "
            f"{statistics.median(r):7.1f} ms  p99 {percentile(r, 99):7.1f} ms"
        )
    for engine, cached, plain in (
        ("kvflow", "kvflow, tier", "kvflow, recompute"),
        ("llama.cpp", "llama.cpp, cache", "llama.cpp, none"),
    ):
        ratio = statistics.median(returning[plain]) / statistics.median(returning[cached])
        print(f"  {engine}: returning TTFT p50 without / with its cache: {ratio:.2f}x")
    ratio = statistics.median(returning["llama.cpp, cache"]) / statistics.median(returning["kvflow, tier"])
    print(f"  returning TTFT p50, llama.cpp's RAM cache / kvflow's disk tier: {ratio:.2f}x")


if __name__ == "__main__":
    main()
