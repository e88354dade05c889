"""kvflow bench against servers we did not write: a real llama-server run (recorded once by
tests/bench/data/record_llamacpp.py, replayed here with its timing by a small local HTTP server),
and SGLang's metric names.

llama-server streams one token per chunk and puts the request's `usage` on its last chunk, which has
no text and a `finish_reason`; it exports `llamacpp:*` metrics. Both used to be misread: every token
was booked on that last chunk (near-zero per-token gaps), and the metrics were ignored.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, StreamingResponse
from fixtures.app_server import serve_app

from kvflow.bench.arrivals import LoadSpec
from kvflow.bench.client import StreamParser
from kvflow.bench.datasets import DatasetSpec
from kvflow.bench.events import RequestRecord
from kvflow.bench.runner import BenchConfig, run_benchmark
from kvflow.bench.server_metrics import parse_metrics
from kvflow.bench.server_view import server_section

RECORDING = json.loads((Path(__file__).parent / "data" / "llamacpp_run.json").read_text())
SPEED = 2.0  # replay twice as fast as recorded: the gaps stay ~15 ms, far above loopback jitter


def replay_app(recording: dict[str, Any]) -> FastAPI:
    """Serves the recorded streams in order, each with its recorded timing; /metrics answers the
    recorded text from before the requests until every recorded stream has been served."""
    app = FastAPI()
    streams = itertools.cycle(recording["streams"])
    finished = [0]

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return recording["models"]  # type: ignore[no-any-return]

    @app.get("/props")
    async def props() -> dict[str, Any]:
        return recording["props"]  # type: ignore[no-any-return]

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        done = finished[0] >= len(recording["streams"])
        return PlainTextResponse(recording["metrics_after" if done else "metrics_before"])

    async def replay(events: list[list[Any]]) -> AsyncIterator[str]:
        start = time.perf_counter()
        for offset, data in events:
            await asyncio.sleep(max(0.0, start + offset / SPEED - time.perf_counter()))
            yield f"data: {data}\n\n"
        finished[0] += 1

    @app.post("/v1/completions")
    async def completions(request: Request) -> StreamingResponse:
        return StreamingResponse(replay(next(streams)["events"]), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def llamacpp_replay() -> Iterator[str]:
    with serve_app(replay_app(RECORDING)) as url:
        yield url


def recorded_chunk_gaps_ms() -> list[float]:
    """Gaps between the recorded text chunks, as llama-server sent them (replay speed applied)."""
    gaps = []
    for stream in RECORDING["streams"]:
        times = [
            t for t, data in stream["events"] if data != "[DONE]" and json.loads(data)["choices"][0]["text"]
        ]
        gaps += [1e3 * (b - a) / SPEED for a, b in itertools.pairwise(times)]
    return gaps


def test_per_token_itl_against_llama_server_is_the_gap_between_its_chunks(
    llamacpp_replay: str, tiny_tokenizer_dir: Path, tmp_path: Path
) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"question {i}"}) for i in range(8)))
    config = BenchConfig(
        base_url=llamacpp_replay,
        dataset=DatasetSpec(name=f"jsonl:{prompts}", num_requests=8, output_len=24),
        load=LoadSpec(concurrency=RECORDING["concurrency"]),
        # The fixture tokenizer splits llama-server's text differently from its own tokenizer: the
        # final usage (24 tokens, 24 token chunks) must still put exactly one token on each chunk.
        tokenizer=str(tiny_tokenizer_dir),
        warmup=0,
        progress=False,
    )
    result = run_benchmark(config)
    assert (result["completed"], result["failed"]) == (8, 0)
    outputs = [r["output_tokens"] for r in result["requests"]]
    assert outputs == [24] * 8 and {r["token_count_source"] for r in result["requests"]} == {"usage"}
    # One gap per token after the first: 23 per request, not 24 near-zero gaps on the last chunk.
    assert sum(len(r["itl_ms"]) for r in result["requests"]) == sum(n - 1 for n in outputs)
    # The last chunk (no text, finish_reason, the usage total) carries no token.
    assert all(r["chunks"][-1][2] == 0 for r in result["requests"])
    # Per token and per chunk agree (one token per chunk), and both match what was recorded.
    per_token, per_chunk = result["itl_ms"]["p50"], result["itl_chunk_ms"]["p50"]
    assert per_token == pytest.approx(per_chunk, rel=0.1)
    recorded = sorted(recorded_chunk_gaps_ms())[len(recorded_chunk_gaps_ms()) // 2]
    assert per_token == pytest.approx(recorded, rel=0.5)


def test_llamacpp_metrics_map_onto_the_server_view(llamacpp_replay: str, tmp_path: Path) -> None:
    before, after = parse_metrics(RECORDING["metrics_before"]), parse_metrics(RECORDING["metrics_after"])
    timings = [json.loads(s["events"][-2][1])["timings"] for s in RECORDING["streams"]]
    section = server_section(before, after, client_ttft_mean_ms=300.0, timings=timings, num_requests=8)
    assert section["server"] == "llama.cpp" and section["metrics_prefix"] == "llamacpp:"
    # 8 recorded prompts of 64 tokens, 24 tokens out each: deltas of the recorded counters.
    assert section["prompt_tokens"] == 8 * 64 and section["generation_tokens"] == 8 * 24
    assert section["prefix_cache_hits"] == 0 and section["prefix_cache_hit_rate"] == 0
    assert section["num_steps"] > 24  # llama_decode() calls: at least one per generated position
    # Its own timings: the per-request prompt time it streamed, and each slot's time per token.
    assert section["prefill_time_ms"]["mean"] == pytest.approx(
        sum(t["prompt_ms"] for t in timings) / len(timings)
    )
    assert 1 < section["decode_step_ms"] < 1000
    # What llama-server does not export is said, not printed as an empty section or zeros.
    assert {"ttft", "itl", "queue_time", "num_preemptions"} <= set(section["not_exported"])
    assert "prompt_tokens" not in section["not_exported"] and "prefill_time" not in section["not_exported"]


def test_recorded_chat_stream_books_no_token_on_the_role_or_usage_chunks() -> None:
    record = RequestRecord(index=0, send_time=0.0, prompt_tokens=0)
    parser = StreamParser(record, "chat", count_tokens=None)
    for offset, data in RECORDING["chat_stream"]["events"]:
        if not parser.feed(data, offset):
            break
    parser.finish(RECORDING["chat_stream"]["events"][-1][0])
    kinds = [(c.kind, c.num_tokens) for c in record.chunks]
    assert kinds[0] == ("role", 0) and kinds[-1] == ("usage", 0)
    assert sum(n for _, n in kinds) == record.output_tokens == 6


SGLANG = """\
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{{model_name="m"}} {prompt}
# TYPE sglang:cached_tokens_total counter
sglang:cached_tokens_total{{model_name="m"}} {cached}
# TYPE sglang:generation_tokens_total counter
sglang:generation_tokens_total{{model_name="m"}} {generated}
# TYPE sglang:num_requests_total counter
sglang:num_requests_total{{model_name="m"}} {requests}
# TYPE sglang:num_retracted_requests_total counter
sglang:num_retracted_requests_total{{model_name="m"}} {retracted}
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{{model_name="m"}} 0
# TYPE sglang:queue_time_seconds histogram
sglang:queue_time_seconds_bucket{{le="0.1",model_name="m"}} {fast}
sglang:queue_time_seconds_bucket{{le="+Inf",model_name="m"}} {requests}
sglang:queue_time_seconds_sum{{model_name="m"}} {queue_sum}
sglang:queue_time_seconds_count{{model_name="m"}} {requests}
"""


def test_sglang_names_map_onto_the_same_view() -> None:
    before = parse_metrics(
        SGLANG.format(prompt=100, cached=0, generated=10, requests=1, retracted=0, fast=1, queue_sum=0.05)
    )
    after = parse_metrics(
        SGLANG.format(
            prompt=1100, cached=600, generated=210, requests=11, retracted=3, fast=6, queue_sum=2.05
        )
    )
    section = server_section(before, after, client_ttft_mean_ms=None)
    assert section["server"] == "sglang"
    assert (section["prompt_tokens"], section["prefix_cache_hits"]) == (1000, 600)
    assert section["prefix_cache_hit_rate"] == pytest.approx(0.6)
    assert (section["generation_tokens"], section["requests_finished"]) == (200, 10)
    assert section["num_preemptions"] == 3  # SGLang calls them retractions
    assert section["queue_time_ms"]["mean"] == pytest.approx(200.0)  # 2 s over 10 requests
    assert "prefill_time" in section["not_exported"] and "queue_time" not in section["not_exported"]


def test_doctor_reads_llama_server_as_llama_server(
    llamacpp_replay: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The doctor on a llama-server run: its settings from /props and the model card (not "unknown"
    with --metrics-url given), queueing said to be unknown, no log line in the report."""
    from kvflow.cli import main

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"question {i}"}) for i in range(8)))
    config = BenchConfig(
        base_url=llamacpp_replay,
        dataset=DatasetSpec(name=f"jsonl:{prompts}", num_requests=8, output_len=24),
        load=LoadSpec(concurrency=RECORDING["concurrency"]),
        warmup=0,
        progress=False,
    )
    bench_json, model_dir = tmp_path / "bench.json", tmp_path / "qwen"
    bench_json.write_text(json.dumps(run_benchmark(config)))
    model_dir.mkdir()
    (model_dir / "config.json").write_text(
        (Path(__file__).parents[1] / "doctor/configs/qwen2.5-0.5b.json").read_text()
    )
    metrics_url = llamacpp_replay.removesuffix("/v1") + "/metrics"
    args = [
        "doctor",
        str(model_dir),
        "--hardware",
        "h100",
        "--bench",
        str(bench_json),
        "--metrics-url",
        metrics_url,
    ]
    assert main(args) == 0
    out = capsys.readouterr()
    assert "INFO" not in out.out and "HTTP Request" not in out.out + out.err
    assert "queueing unknown" in out.out and "no queueing" not in out.out
    assert main([*args, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["settings"]["server"] == "llama.cpp" and doc["settings"]["max_num_seqs"] == 4
    assert doc["model"]["weight_dtype"] == "int4" and doc["memory"]["kv_pool_known"]
    assert doc["memory"]["max_concurrency"] == 8192 // (64 + 24)  # slots x n_ctx over p95 prompt + output
