"""kvflow bench end to end against a live `kvflow serve` on a tiny checkpoint."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from fixtures.live_server import LiveServer

from kvflow.bench import runner
from kvflow.bench.arrivals import LoadSpec
from kvflow.bench.datasets import DatasetSpec
from kvflow.bench.runner import BenchConfig, run_benchmark
from kvflow.cli import main
from kvflow.doctor.server_settings import settings_from_result

NUM_REQUESTS = 8
INPUT_LEN, OUTPUT_LEN = 24, 6


def test_cli_run_writes_json_and_html_whose_counts_add_up(
    server: LiveServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, html = tmp_path / "result.json", tmp_path / "report.html"
    args = ["bench", "--base-url", server.base_url + "/v1", "--num-requests", str(NUM_REQUESTS)]
    args += ["--concurrency", "3", "--input-len", str(INPUT_LEN), "--output-len", str(OUTPUT_LEN)]
    args += ["--slo", "ttft_ms=60000,tpot_ms=60000", "--output", str(out), "--html", str(html), "--quiet"]
    assert main(args) == 0
    assert "TTFT (first content chunk)" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert (result["completed"], result["failed"]) == (NUM_REQUESTS, 0)
    requests = result["requests"]
    assert len(requests) == NUM_REQUESTS
    # Exact lengths: the prompt is token ids (+ BOS the server's tokenizer adds), the output ignore_eos.
    assert {r["prompt_tokens"] for r in requests} == {INPUT_LEN}
    assert all(r["output_tokens"] == OUTPUT_LEN and r["token_count_source"] == "usage" for r in requests)
    assert result["total_output_tokens"] == NUM_REQUESTS * OUTPUT_LEN
    assert result["output_throughput"] == pytest.approx(NUM_REQUESTS * OUTPUT_LEN / result["duration_s"])
    assert result["slo_attainment_pct"] == 100.0
    assert sum(len(r["itl_ms"]) for r in requests) == NUM_REQUESTS * (OUTPUT_LEN - 1)
    server_view = result["server"]
    assert server_view["metrics_prefix"] == "kvflow:"
    assert (
        server_view["requests_finished"] == NUM_REQUESTS
        and server_view["generation_tokens"] == NUM_REQUESTS * OUTPUT_LEN
    )
    assert server_view["client_minus_server_ttft_ms"] is not None
    # The server's own steps of the measured part (kvflow/bench/server_steps.py): every prompt token
    # prefilled once, every later token one decode row.
    steps = server_view["steps"]
    assert steps["fields"] == [
        "dur_ms", "prefill_tokens", "decode_tokens", "attention", "row_prefill_tokens", "row_attention"
    ]  # fmt: skip
    assert all(dur > 0 and attention > 0 for dur, _, _, attention, _, _ in steps["rows"])
    # The prompts are longer than a query-row chunk: only the decodes are rows, and a decode-only
    # step's keys are all its rows'.
    assert all(row[4] == 0 for row in steps["rows"])
    assert all(row[5] == row[3] for row in steps["rows"] if row[1] == 0)
    assert sum(row[1] for row in steps["rows"]) == NUM_REQUESTS * INPUT_LEN
    assert sum(row[2] for row in steps["rows"]) == NUM_REQUESTS * (OUTPUT_LEN - 1)
    # The server's settings travel with the result: the doctor reads them once the server is gone.
    settings = settings_from_result(result)
    assert settings.server == "kvflow" and settings.max_num_batched_tokens is not None
    assert settings.max_model_len == server.ctx.max_model_len
    assert html.read_text().lstrip().lower().startswith("<!doctype html")


def config(server: LiveServer, dataset: DatasetSpec, endpoint: str = "completions") -> BenchConfig:
    return BenchConfig(
        base_url=server.base_url + "/v1",
        dataset=dataset,
        load=LoadSpec(concurrency=2),
        endpoint=endpoint,  # type: ignore[arg-type]
        warmup=0,
        progress=False,
    )


def test_shared_prefix_hits_the_prefix_cache(server: LiveServer) -> None:
    spec = DatasetSpec("shared-prefix", NUM_REQUESTS, input_len=8, output_len=4, prefix_len=64)
    result = run_benchmark(config(server, spec))
    assert result["failed"] == 0
    # All but the first requests find the 64-token prefix (4 blocks of 16) cached.
    assert result["server"]["prefix_cache_hit_rate"] > 0.5


def test_multi_turn_resends_history_and_chat_lengths_are_checked(server: LiveServer) -> None:
    spec = DatasetSpec("multi-turn", 4, input_len=10, output_len=4, num_turns=2)
    result = run_benchmark(config(server, spec, endpoint="chat"))
    assert (result["completed"], result["failed"]) == (4, 0)
    turns = sorted((r["conversation"], r["turn"], r["prompt_tokens"]) for r in result["requests"])
    assert [(c, t) for c, t, _ in turns] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert turns[1][2] > turns[0][2] + 10  # the second turn carries the first and its answer
    assert not any("differ from the server's /tokenize" in w for w in result["warnings"])


def test_multilingual_reports_tokens_per_character(server: LiveServer) -> None:
    spec = DatasetSpec("multilingual", 10, output_len=2)
    result = run_benchmark(config(server, spec))
    languages = result["languages"]
    assert {"en", "fr", "zh"} <= set(languages)
    assert all(row["tokens_per_char"] > 0 for row in languages.values())
    # The tiny test tokenizer was trained on English-like text: other scripts cost far more tokens
    # per character (some exceed the 256-token context and fail with 400, reported as failures).
    assert languages["zh"]["tokens_per_char"] > 2 * languages["en"]["tokens_per_char"]
    assert result["completed"] + result["failed"] == 10


def test_failed_requests_are_reported_with_their_error(server: LiveServer) -> None:
    spec = DatasetSpec("random", 3, input_len=INPUT_LEN, output_len=300)  # 24 + 300 > 256: 400 each
    result = run_benchmark(config(server, spec))
    assert (result["completed"], result["failed"]) == (0, 3)
    [(message, count)] = result["errors"].items()
    assert count == 3 and message.startswith("HTTP 400") and "maximum context length" in message


def test_without_usage_the_servers_tokenize_counts_the_output(server: LiveServer) -> None:
    spec = DatasetSpec("random", 2, input_len=INPUT_LEN, output_len=OUTPUT_LEN)
    result = run_benchmark(replace(config(server, spec), continuous_usage_stats=False, include_usage=False))
    assert result["failed"] == 0
    assert {r["token_count_source"] for r in result["requests"]} == {"tokenize"}
    # Re-tokenizing generated text need not give the generated ids back: a random model emits
    # partial UTF-8 byte tokens, decoded as U+FFFD, which re-encode as 3 bytes each. Hence usage
    # first, and the warning when the local count disagrees with it.
    assert all(r["output_tokens"] > 0 for r in result["requests"])


def test_a_kvflow_servers_gauges_come_from_its_steps_not_from_scrapes(
    server: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each /metrics scrape renders ~21 KB holding the server's GIL, and the step it lands on stalls
    (~8 ms on a 2-core VM): against a kvflow server the bench scrapes before and after only, and
    reads the running, waiting and KV usage series off the steps its window recorded."""
    scrapes: list[object] = []

    async def scrape_during_the_load(*args: object) -> None:
        scrapes.append(args)

    monkeypatch.setattr(runner, "sample_gauges", scrape_during_the_load)
    spec = DatasetSpec("random", 4, input_len=INPUT_LEN, output_len=OUTPUT_LEN)
    result = run_benchmark(replace(config(server, spec), metrics_interval=0.05))
    assert result["failed"] == 0 and not scrapes
    gauges = result["server"]["gauges"]
    assert 1.0 <= gauges["running"]["max"] <= 2.0  # two clients
    assert 0.0 < gauges["kv_usage"]["max"] <= 1.0 and gauges["kv_usage"]["samples"] >= 1
