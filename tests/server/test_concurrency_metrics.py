"""Dozens of concurrent streams finish with correct, complete text; /metrics agrees with what was sent."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import openai
from fixtures.live_server import ENGINE_KWARGS, LiveServer, metric_value

from kvflow import LLM, SamplingParams

NUM_STREAMS = 32
MAX_TOKENS = 10


async def run_streams(server: LiveServer, prompts: list[str]) -> list[tuple[str, int, int]]:
    client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)

    async def one(prompt: str) -> tuple[str, int, int]:
        stream = await client.completions.create(
            model=server.model,
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        text, usage = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
            usage = chunk.usage or usage
        assert usage is not None
        return text, usage.prompt_tokens, usage.completion_tokens

    try:
        return list(await asyncio.gather(*(one(p) for p in prompts)))
    finally:
        await client.close()


def test_concurrent_streams_complete_and_metrics_agree(server: LiveServer, server_model_dir: Path) -> None:
    prompts = [f"def function_{i}(x):\n    return x * {i}" for i in range(NUM_STREAMS)]
    expected = LLM(str(server_model_dir), **ENGINE_KWARGS).generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    )
    before = server.scrape()
    results = asyncio.run(run_streams(server, prompts))
    server.wait_until_idle()
    after = server.scrape()

    assert [text for text, _, _ in results] == [e.outputs[0].text for e in expected]
    prompt_tokens = sum(p for _, p, _ in results)
    completion_tokens = sum(c for _, _, c in results)
    assert completion_tokens == NUM_STREAMS * MAX_TOKENS
    assert prompt_tokens == sum(len(e.prompt_token_ids) for e in expected)

    def delta(name: str, **labels: str) -> float:
        return metric_value(after, name, **labels) - metric_value(before, name, **labels)

    assert delta("request_success_total", finished_reason="length") == NUM_STREAMS
    assert delta("request_success_total", finished_reason="abort") == 0
    assert delta("prompt_tokens_total") == prompt_tokens
    assert delta("generation_tokens_total") == completion_tokens
    assert delta("prefix_cache_queries_total") == prompt_tokens
    for histogram in (
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
        "request_prompt_tokens",
        "request_generation_tokens",
    ):
        assert delta(histogram + "_count") == NUM_STREAMS, histogram
    assert delta("request_generation_tokens_sum") == completion_tokens
    # One ITL gap per output token after the first.
    assert delta("inter_token_latency_seconds_count") == NUM_STREAMS * (MAX_TOKENS - 1)
    # Every step that computed tokens is counted once, under the kind of tokens it computed.
    steps = sum(
        delta("engine_step_time_seconds_count", step_kind=k) for k in ("decode_only", "mixed", "prefill_only")
    )
    assert steps == delta("iteration_tokens_total_count") > 0
    assert delta("iteration_tokens_total_sum") == prompt_tokens - delta("prefix_cache_hits_total") + (
        completion_tokens - NUM_STREAMS
    )
    assert metric_value(after, "num_requests_running") == 0 == metric_value(after, "num_requests_waiting")
    assert metric_value(after, "kv_cache_usage_perc") == 0.0


def test_quality_probe_exports_quant_eval_gauges(start_server: Callable[..., LiveServer]) -> None:
    server = start_server(quality_probe_rate=1.0, engine={"quantization": "int8", "dtype": "bfloat16"})
    with server.client() as http:
        for i in range(3):
            body = {"prompt": f"def f{i}(x):", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
            assert http.post("/v1/completions", json=body).status_code == 200
    deadline = time.monotonic() + 60
    while server.metric("quality_probe_positions") < 3 * 8 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert server.metric("quality_probe_positions") >= 3 * 8
    assert 0.0 <= server.metric("quality_probe_kl_divergence") < 0.5
    assert 0.5 <= server.metric("quality_probe_top1_agreement") <= 1.0
    assert server.metric("quality_probe_perplexity_served") > 1.0
