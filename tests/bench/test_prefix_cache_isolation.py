"""No measured request may be served from a prefix cache by what another prompt left behind: not by
the warm-up, and not by an earlier run with the same seed and another shape. The server here behaves
like a caching server, by construction: a prompt whose first block it has seen is a cache hit. It
records each request's hit under the `X-Request-Id` the bench sends, so the test reads hits, not
TTFTs (a loaded CI machine can make a hit as slow as a miss)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from fixtures.app_server import serve_app

from kvflow.bench.arrivals import LoadSpec
from kvflow.bench.client import REQUEST_ID_HEADER
from kvflow.bench.datasets import DatasetSpec
from kvflow.bench.runner import BenchConfig, run_benchmark

BLOCK = 16  # tokens of the first block the fake cache keys on (kvflow's and vLLM's block size)
PREFILL_S = 0.15  # first token of a prompt the cache has not seen
CACHED_S = 0.005  # first token of a prompt whose first block is cached
OUTPUT_TOKENS = 2


def caching_app(hits: dict[str, bool]) -> FastAPI:
    """`hits` fills with each request's X-Request-Id: whether its first block was cached."""
    app = FastAPI()
    seen: set[tuple[int, ...]] = set()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "cache", "object": "model", "max_model_len": 4096}]}

    async def stream(hit: bool) -> AsyncIterator[str]:
        await asyncio.sleep(CACHED_S if hit else PREFILL_S)
        for n in range(1, OUTPUT_TOKENS + 1):
            usage = {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": 1 + n}
            yield "data: " + json.dumps({"choices": [{"index": 0, "text": "x"}], "usage": usage}) + "\n\n"
        yield "data: [DONE]\n\n"

    @app.post("/v1/completions")
    async def completions(request: Request) -> StreamingResponse:
        prompt = (await request.json())["prompt"]
        assert isinstance(prompt, list), "the random dataset sends token ids"
        key = tuple(prompt[:BLOCK])
        hit = key in seen
        seen.add(key)
        hits[request.headers[REQUEST_ID_HEADER]] = hit
        return StreamingResponse(stream(hit), media_type="text/event-stream")

    return app


@pytest.fixture()
def cache_hits() -> dict[str, bool]:
    return {}


@pytest.fixture()
def caching_server(cache_hits: dict[str, bool]) -> Iterator[str]:
    with serve_app(caching_app(cache_hits)) as url:
        yield url


def test_warmup_and_other_shapes_leave_nothing_in_the_cache(
    caching_server: str, cache_hits: dict[str, bool], tiny_tokenizer_dir: Path
) -> None:
    def uncached(result: dict[str, Any]) -> list[bool]:
        """Per measured request: was it a cache miss at the server?"""
        return [not cache_hits[r["x_request_id"]] for r in result["requests"]]

    config = BenchConfig(
        base_url=caching_server,
        dataset=DatasetSpec("random", num_requests=6, input_len=48, output_len=OUTPUT_TOKENS, seed=7),
        load=LoadSpec(concurrency=2),
        tokenizer=str(tiny_tokenizer_dir),
        warmup=2,
        progress=False,
    )
    first = run_benchmark(config)
    assert all(uncached(first)), "a measured request was served from the warm-up's cache"
    assert all(r["shared_prefix_tokens"] == 0 for r in first["requests"])
    # Same seed, another length: different prompts, so again nothing comes from the cache.
    longer = replace(config, dataset=replace(config.dataset, input_len=64))
    assert all(uncached(run_benchmark(longer)))
    # Same seed, same shape, another load (a sweep's next point): different prompts too.
    assert all(uncached(run_benchmark(replace(config, load=LoadSpec(concurrency=3)))))
    # The fake server is a cache: the same run again is served from it, which is what the above rules out.
    assert not any(uncached(run_benchmark(config)))
