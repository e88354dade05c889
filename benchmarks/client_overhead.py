"""What `kvflow bench`'s client costs per streamed chunk: its transport (aiohttp,
kvflow/bench/client.py) against httpx's streaming (its transport until session 35), both feeding
the same StreamParser, against one stand-in server that streams usage-carrying chunks at a fixed gap.

On a machine whose cores the server under test shares with its load generator, every microsecond
the client spends on a chunk is taken from the engine's steps: 8 streams of a 3 ms step are 2,700
chunks a second.

    python benchmarks/client_overhead.py [--streams 8] [--requests 48] [--tokens 200] [--gap-ms 3]

Prints the client process's CPU time per chunk (time.process_time over the run; the server is
another process), per transport, alternated over --rounds, medians, and their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable

import httpx

from kvflow.bench.client import ClientConfig, Prompt, StreamParser, request_body, send_request, stream_session
from kvflow.bench.events import RequestRecord
from kvflow.server.spawn import free_port

# The stand-in server: an aiohttp app streaming `max_tokens` chunks `gap` seconds apart, each with
# a running usage total (as kvflow's and vLLM's continuous_usage_stats send them).
SERVER = """
import asyncio, json, sys
from aiohttp import web
GAP = float(sys.argv[2])
async def completions(request):
    n = (await request.json())["max_tokens"]
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for i in range(1, n + 1):
        await asyncio.sleep(GAP)
        choice = {"index": 0, "text": " tok", "logprobs": None, "finish_reason": None if i < n else "length"}
        usage = {"prompt_tokens": 16, "completion_tokens": i, "total_tokens": 16 + i}
        body = {"id": "x", "object": "text_completion", "model": "m", "choices": [choice], "usage": usage}
        await response.write(("data: " + json.dumps(body) + "\\n\\n").encode())
    await response.write(b"data: [DONE]\\n\\n")
    return response
app = web.Application()
app.router.add_post("/v1/completions", completions)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None)
"""
STARTUP_TIMEOUT_S = 30.0
HTTP_TIMEOUT_S = 60.0


def prompt(tokens: int) -> Prompt:
    return Prompt(max_tokens=tokens, prompt=[1] * 16, num_tokens=16)


async def with_aiohttp(config: ClientConfig, args: argparse.Namespace) -> None:
    async with stream_session(HTTP_TIMEOUT_S) as session:
        await run_streams(args, lambda r: send_request(session, config, prompt(args.tokens), r, None))


async def with_httpx(config: ClientConfig, args: argparse.Namespace) -> None:
    """The bench's request loop as it was on httpx: http.stream + aiter_lines into the same parser."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=config.base_url, timeout=HTTP_TIMEOUT_S, limits=limits) as http:

        async def one(record: RequestRecord) -> None:
            parser = StreamParser(record, "completions", None)
            body = request_body(config, prompt(args.tokens))
            async with http.stream("POST", "/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data:") and not parser.feed(line[5:].strip(), time.perf_counter()):
                        break
            parser.finish(time.perf_counter())

        await run_streams(args, one)


async def run_streams(args: argparse.Namespace, send: Callable[[RequestRecord], Awaitable[object]]) -> None:
    """--requests requests, --streams at a time (a closed loop, as `kvflow bench --concurrency`)."""
    gate = asyncio.Semaphore(args.streams)
    records = [RequestRecord(i, 0.0, 0) for i in range(args.requests)]

    async def one(record: RequestRecord) -> None:
        async with gate:
            await send(record)

    await asyncio.gather(*(one(r) for r in records))
    failed = [r.error for r in records if r.error is not None or r.output_tokens != args.tokens]
    if failed:
        raise SystemExit(f"{len(failed)} requests failed: {failed[0]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--gap-ms", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(port), str(args.gap_ms / 1e3)])
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            try:
                httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"max_tokens": 1}, timeout=1)
                break
            except httpx.TransportError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise SystemExit("the stand-in server did not start") from None
                time.sleep(0.1)
        config = ClientConfig(base_url=f"http://127.0.0.1:{port}/v1", model="m")
        chunks = args.requests * args.tokens
        per_chunk: dict[str, list[float]] = {"aiohttp (kvflow bench)": [], "httpx (before)": []}
        runs = {"aiohttp (kvflow bench)": with_aiohttp, "httpx (before)": with_httpx}
        for _ in range(args.rounds):
            for name, run in runs.items():  # alternated: the machine's drift falls on both
                cpu, wall = time.process_time(), time.perf_counter()
                asyncio.run(run(config, args))
                cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
                per_chunk[name].append(1e6 * cpu / chunks)
                print(f"  {name:24s} {1e6 * cpu / chunks:6.1f} us/chunk  ({cpu:.2f} s CPU in {wall:.2f} s)")
        medians = {name: statistics.median(v) for name, v in per_chunk.items()}
        rate = args.streams * 1e3 / args.gap_ms
        shape = f"{args.requests} requests of {args.tokens} chunks, {args.gap_ms} ms apart"
        print(f"{args.streams} streams, {shape}:")
        for name, us in medians.items():
            share = us * rate / 1e6
            print(f"  {name:24s} median {us:6.1f} us/chunk = {share:.0%} of a core at {rate:,.0f} chunks/s")
        ratio = medians["httpx (before)"] / medians["aiohttp (kvflow bench)"]
        print(f"  httpx / aiohttp: {ratio:.2f}x")
        print(json.dumps({"us_per_chunk": medians, "ratio": ratio}))
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
