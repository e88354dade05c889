"""Record a real llama.cpp `llama-server` run once, for tests/bench/test_foreign_servers.py to replay.

What is recorded: each streamed request's raw SSE `data:` lines with their arrival time after the
send, `/metrics` before and after the requests, `/v1/models` and `/props`. The tests replay the
streams from a small local HTTP server with the recorded timing, so CI never needs llama-server.

    llama-server -m qwen2.5-0.5b-shape-bfloat16-q4_0.gguf --port 8090 --metrics -np 4 -c 8192 -t 2
    python tests/bench/data/record_llamacpp.py --url http://127.0.0.1:8090 \
        --out tests/bench/data/llamacpp_run.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from typing import Any

import httpx


async def one_stream(http: httpx.AsyncClient, path: str, body: dict[str, Any]) -> dict[str, Any]:
    events: list[list[Any]] = []
    start = time.perf_counter()
    async with http.stream("POST", path, json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data:"):
                events.append([round(time.perf_counter() - start, 6), line[len("data:") :].strip()])
    return {"path": path, "request": body, "events": events}


def completion_body(rng: random.Random, prompt_len: int, max_tokens: int) -> dict[str, Any]:
    return {
        "model": "m",
        "prompt": [rng.randrange(1000, 50000) for _ in range(prompt_len)],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "ignore_eos": True,
        "temperature": 0.0,
    }


async def record(
    url: str, num_requests: int, concurrency: int, prompt_len: int, max_tokens: int
) -> dict[str, Any]:
    rng = random.Random(15)
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        models = (await http.get("/v1/models")).json()
        props = (await http.get("/props")).json()
        metrics_before = (await http.get("/metrics")).text
        bodies = [completion_body(rng, prompt_len, max_tokens) for _ in range(num_requests)]
        queue = list(enumerate(bodies))
        streams: list[dict[str, Any]] = [{} for _ in bodies]

        async def worker() -> None:
            while queue:
                i, body = queue.pop(0)
                streams[i] = await one_stream(http, "/v1/completions", body)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        metrics_after = (await http.get("/metrics")).text
        chat = {
            "model": "m",
            "messages": [{"role": "user", "content": "Name three rivers."}],
            "max_tokens": 6,
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": 0.0,
        }
        chat_stream = await one_stream(http, "/v1/chat/completions", chat)
    props.pop("chat_template", None)  # long and irrelevant to the tests
    return {
        "source": "llama-server (llama.cpp from the llama-cpp-python 0.3.36 sdist), "
        f"{props.get('build_info')}, {props.get('total_slots')} slots, q4_0 Qwen2.5-0.5B-shaped checkpoint",
        "concurrency": concurrency,
        "models": models,
        "props": {k: props[k] for k in ("total_slots", "model_ftype", "build_info") if k in props},
        "metrics_before": metrics_before,
        "metrics_after": metrics_after,
        "streams": streams,
        "chat_stream": chat_stream,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", default="http://127.0.0.1:8090")
    parser.add_argument("--out", required=True)
    parser.add_argument("--num-requests", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args()
    data = asyncio.run(
        record(args.url, args.num_requests, args.concurrency, args.prompt_len, args.max_tokens)
    )
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)


if __name__ == "__main__":
    main()
