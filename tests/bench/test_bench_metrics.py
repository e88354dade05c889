"""Metric computation on synthetic event streams with known answers (no server, no clock)."""

from __future__ import annotations

import itertools
import json

import pytest

from kvflow.bench.arrivals import LoadSpec, arrival_offsets
from kvflow.bench.client import StreamParser
from kvflow.bench.events import ChunkEvent, RequestRecord
from kvflow.bench.metrics import aggregate, meets_slo, parse_slo, percentile, request_metrics, summarize


def record(send: float, chunks: list[tuple[float, str, int]], end: float | None, out: int) -> RequestRecord:
    r = RequestRecord(index=0, send_time=send, prompt_tokens=10)
    r.chunks = [ChunkEvent(t, kind, n) for t, kind, n in chunks]  # type: ignore[arg-type]
    r.end_time, r.output_tokens = end, out
    return r


def test_multi_token_chunks_and_a_role_only_first_chunk() -> None:
    # send at 0; role chunk at 10 ms; first content (1 token) at 100 ms; a 3-token chunk 60 ms later;
    # then 1 token 20 ms later; usage chunk; end.
    r = record(
        0.0,
        [
            (0.010, "role", 0),
            (0.100, "content", 1),
            (0.160, "content", 3),
            (0.180, "content", 1),
            (0.181, "usage", 0),
        ],
        0.182,
        5,
    )
    m = request_metrics(r)
    assert m.ttft_first_chunk_ms == pytest.approx(10.0)  # vLLM's definition counts the role chunk
    assert m.ttft_ms == pytest.approx(100.0)  # ours: first content
    assert m.itl_chunk_ms == pytest.approx([60.0, 20.0])
    assert m.itl_ms == pytest.approx([20.0, 20.0, 20.0, 20.0])  # 60 ms over 3 tokens, then 20 ms
    assert m.e2e_ms == pytest.approx(180.0)  # last content chunk
    assert m.tpot_ms == pytest.approx((180.0 - 100.0) / 4)


def test_failed_requests_are_counted_not_dropped() -> None:
    ok = record(0.0, [(0.1, "content", 1), (0.2, "content", 1)], 0.2, 2)
    failed_mid_stream = record(0.0, [(0.1, "content", 1)], 0.15, 1)
    failed_mid_stream.error = "error event mid-stream: boom"
    refused = record(0.0, [], None, 0)
    refused.error = "HTTP 429: queue full"
    result = aggregate([ok, failed_mid_stream, refused], duration_s=2.0, slo={"ttft_ms": 150})
    assert (result["completed"], result["failed"]) == (1, 2)
    assert result["request_throughput"] == pytest.approx(0.5)
    assert result["output_throughput"] == pytest.approx(1.0)
    assert result["goodput"] == pytest.approx(0.5)
    assert result["slo_attainment_pct"] == pytest.approx(100 / 3)  # failures miss every SLO
    assert result["ttft_ms"]["max"] == pytest.approx(100.0)  # only the successful request's numbers


def test_summary_statistics() -> None:
    values = [float(v) for v in range(1, 101)]
    s = summarize(values)
    assert s["mean"] == pytest.approx(50.5)
    assert s["p50"] == pytest.approx(50.5) and s["p99"] == pytest.approx(99.01) and s["max"] == 100.0
    assert summarize([None, None]) == dict.fromkeys(["mean", "p50", "p90", "p95", "p99", "max"])
    assert percentile([3.0], 99) == 3.0


def test_slo_parsing_and_checks() -> None:
    slo = parse_slo("ttft_ms=500, tpot_ms=50")
    assert slo == {"ttft_ms": 500.0, "tpot_ms": 50.0}
    fast = request_metrics(record(0.0, [(0.1, "content", 1), (0.14, "content", 1)], 0.14, 2))
    slow_tpot = request_metrics(record(0.0, [(0.1, "content", 1), (0.2, "content", 1)], 0.2, 2))
    assert meets_slo(fast, slo) and not meets_slo(slow_tpot, slo)
    with pytest.raises(ValueError, match="bad SLO"):
        parse_slo("latency=3")


def sse(payload: dict) -> str:  # type: ignore[type-arg]
    return json.dumps(payload)


def test_stream_parser_uses_continuous_usage_for_token_counts() -> None:
    r = RequestRecord(index=0, send_time=0.0, prompt_tokens=0)
    parser = StreamParser(r, "chat", count_tokens=lambda text: 99)  # never used when usage is streamed
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    assert parser.feed(sse(role), 0.01)
    usage = {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}
    assert parser.feed(sse({"choices": [{"index": 0, "delta": {"content": "ab"}}], "usage": usage}), 0.1)
    usage = {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}
    assert parser.feed(sse({"choices": [{"index": 0, "delta": {"content": "cde"}}], "usage": usage}), 0.2)
    assert parser.feed(sse({"choices": [], "usage": usage}), 0.21)
    assert not parser.feed("[DONE]", 0.22)
    parser.finish(0.22)
    assert [(c.kind, c.num_tokens) for c in r.chunks] == [
        ("role", 0),
        ("content", 2),
        ("content", 3),
        ("usage", 0),
    ]
    assert (r.output_tokens, r.token_count_source, r.prompt_tokens, r.output_text) == (5, "usage", 7, "abcde")


def test_stream_parser_falls_back_to_the_tokenizer_and_records_error_events() -> None:
    r = RequestRecord(index=0, send_time=0.0, prompt_tokens=3)
    parser = StreamParser(r, "completions", count_tokens=len)  # 1 token per character, for the test
    assert parser.feed(sse({"choices": [{"index": 0, "text": "abc"}]}), 0.1)
    assert parser.feed(sse({"error": {"message": "engine failed", "code": 500}}), 0.2)
    parser.finish(0.3)
    assert r.chunks[0].num_tokens == 3 and r.output_tokens == 3 and r.token_count_source == "local"
    assert r.error is not None and "engine failed" in r.error and not r.succeeded


def test_arrival_processes() -> None:
    offsets = arrival_offsets(2000, rate=10.0, burstiness=1.0, seed=1)
    gaps = [b - a for a, b in itertools.pairwise(offsets)]
    assert offsets[0] == 0.0 and sum(gaps) / len(gaps) == pytest.approx(0.1, rel=0.1)
    bursty = arrival_offsets(2000, rate=10.0, burstiness=0.25, seed=1)
    bursty_gaps = [b - a for a, b in itertools.pairwise(bursty)]
    # Same mean rate; gamma shape 0.25 has 4x the variance of a Poisson process's gaps.
    assert sum(bursty_gaps) / len(bursty_gaps) == pytest.approx(0.1, rel=0.15)
    assert _variance(bursty_gaps) > 2 * _variance(gaps)
    assert arrival_offsets(3, rate=float("inf"), burstiness=1.0, seed=0) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="exactly one"):
        LoadSpec()


def _variance(values: list[float]) -> float:
    mean = sum(values) / len(values)
    return sum((v - mean) ** 2 for v in values) / len(values)


def test_find_capacity_doubles_then_bisects() -> None:
    from kvflow.bench.datasets import DatasetSpec
    from kvflow.bench.runner import BenchConfig
    from kvflow.bench.sweep import find_capacity

    probed: list[int] = []

    def fake_run(config: BenchConfig) -> dict[str, object]:
        assert config.load.concurrency is not None
        probed.append(config.load.concurrency)
        attainment = 100.0 if config.load.concurrency <= 5 else 50.0  # the SLO holds up to 5 in flight
        return {"slo_attainment_pct": attainment, "completed": 10}

    dataset = DatasetSpec("random", 10)
    config = BenchConfig("http://x/v1", dataset, LoadSpec(concurrency=1), slo={"ttft_ms": 100})
    outcome = find_capacity(config, "concurrency", 90.0, start=1, max_load=64, run=fake_run)
    assert outcome["capacity"]["load"] == 5 and outcome["capacity"]["first_failing_load"] == 6
    assert probed == [1, 2, 4, 8, 6, 5]
    assert [r["load"] for r in outcome["runs"]] == sorted(probed)


def feed_all(parser: StreamParser, payloads: list[dict], step: float = 0.05) -> None:  # type: ignore[type-arg]
    for i, payload in enumerate(payloads):
        parser.feed(sse(payload), (i + 1) * step)
    parser.feed("[DONE]", (len(payloads) + 1) * step)
    parser.finish((len(payloads) + 1) * step)


def test_a_final_usage_total_on_a_textless_last_chunk_books_no_token_there() -> None:
    # llama-server: one token per chunk, then a chunk with no text, a finish_reason and the total.
    r = RequestRecord(index=0, send_time=0.0, prompt_tokens=0)
    text = [{"choices": [{"index": 0, "text": t, "finish_reason": None}]} for t in ("a", "bc", "d")]
    final = {
        "choices": [{"index": 0, "text": "", "finish_reason": "length"}],
        "usage": {"completion_tokens": 3},
    }
    feed_all(StreamParser(r, "completions", count_tokens=len), [*text, final])  # "bc" would count 2
    assert [c.num_tokens for c in r.chunks] == [1, 1, 1, 0]  # the total forces one token per chunk
    m = request_metrics(r)
    assert m.itl_ms == pytest.approx([50.0, 50.0]) and m.itl_chunk_ms == pytest.approx([50.0, 50.0])


def test_a_final_total_on_a_text_chunk_is_the_difference_against_earlier_chunks() -> None:
    r = RequestRecord(index=0, send_time=0.0, prompt_tokens=0)
    chunks = [{"choices": [{"index": 0, "text": "a"}]}, {"choices": [{"index": 0, "text": "b"}]}]
    last = {
        "choices": [{"index": 0, "text": "cd", "finish_reason": "stop"}],
        "usage": {"completion_tokens": 4},
    }
    feed_all(StreamParser(r, "completions", count_tokens=None), [*chunks, last])
    assert [c.num_tokens for c in r.chunks] == [1, 1, 2] and r.output_tokens == 4


def test_a_running_total_books_a_token_whose_text_is_held_back() -> None:
    # kvflow / vLLM continuous usage: a token that is half a character arrives with no text yet.
    r = RequestRecord(index=0, send_time=0.0, prompt_tokens=0)
    payloads = [
        {"choices": [{"index": 0, "text": ""}], "usage": {"completion_tokens": 1}},
        {"choices": [{"index": 0, "text": "é"}], "usage": {"completion_tokens": 2}},
        {
            "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
            "usage": {"completion_tokens": 3},
        },
    ]
    feed_all(StreamParser(r, "completions", count_tokens=None), payloads)
    assert [c.num_tokens for c in r.chunks] == [1, 1, 1]
    assert len(request_metrics(r).itl_ms) == 2


def test_local_counts_are_reconciled_with_the_final_total() -> None:
    # llama-server sends a chunk per token, except that text held back for a whole UTF-8 character
    # arrives with the next token: 3 chunks, 4 tokens; the local tokenizer counts 5.
    r = RequestRecord(index=0, send_time=0.0, prompt_tokens=0)
    text = [{"choices": [{"index": 0, "text": t, "finish_reason": None}]} for t in ("ab", "cde", "f")]
    final = {
        "choices": [{"index": 0, "text": "", "finish_reason": "length"}],
        "usage": {"completion_tokens": 4},
    }
    feed_all(StreamParser(r, "completions", count_tokens=len), [*text, final])
    assert sum(c.num_tokens for c in r.chunks) == 4 and all(c.num_tokens >= 1 for c in r.chunks if c.text)
    assert len(request_metrics(r).itl_ms) == 4 - r.chunks[0].num_tokens
