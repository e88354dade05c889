"""The doctor's replicas report (pure Python): the replica with the worst mean TTFT is named, with the
reasons its sections show (load share, queueing, a prefix hit rate below the others', a full pool)."""

from __future__ import annotations

from typing import Any

from kvflow.doctor.replicas import replicas_report, replicas_text


def section(
    url: str, requests: float, hit_rate: float, ttft: float, queue: float, kv_max: float
) -> dict[str, Any]:
    prompt_tokens = requests * 1000
    return {
        "metrics_url": url,
        "server": "kvflow",
        "requests_finished": requests,
        "prompt_tokens": prompt_tokens,
        "prefix_cache_queries": prompt_tokens,
        "prefix_cache_hits": prompt_tokens * hit_rate,
        "prefix_cache_hit_rate": hit_rate,
        "num_preemptions": 0.0,
        "ttft_ms": {"mean": ttft, "p50": ttft, "p99": 2 * ttft},
        "queue_time_ms": {"mean": queue, "p50": queue, "p99": queue},
        "itl_ms": {"mean": 20.0, "p50": 20.0, "p99": 30.0},
        "gauges": {"kv_usage": {"mean": kv_max / 2, "max": kv_max, "samples": 4.0}},
    }


def test_an_overloaded_replica_is_named_with_its_load_and_queue() -> None:
    report = replicas_report(
        [
            section("http://a/metrics", 30, 0.5, 900.0, 500.0, 0.6),
            section("http://b/metrics", 10, 0.5, 200.0, 5.0, 0.3),
        ],
        cumulative=False,
    )
    bottleneck = report["bottleneck"]
    assert bottleneck["metrics_url"] == "http://a/metrics"
    assert [r.split(":")[0] for r in bottleneck["reasons"]] == ["load", "queueing"]
    assert "75% of the requests" in bottleneck["reasons"][0]
    assert any("balance the load" in a for a in report["advice"])
    assert report["prefix_hit_rate"] == 0.5


def test_a_replica_missing_prefixes_is_named_with_its_hit_rate_and_kv_aware_advised() -> None:
    report = replicas_report(
        [
            section("http://a/metrics", 20, 0.9, 150.0, 2.0, 0.5),
            section("http://b/metrics", 20, 0.2, 700.0, 3.0, 0.97),
        ],
        cumulative=True,
    )
    reasons = report["bottleneck"]["reasons"]
    assert report["bottleneck"]["metrics_url"] == "http://b/metrics"
    assert [r.split(":")[0] for r in reasons] == ["cache", "KV pool"]
    assert "20%" in reasons[0] and "90%" in reasons[0]
    assert any("kv_aware" in a for a in report["advice"])
    text = replicas_text(report)
    assert "since each replica started" in text and "bottleneck: http://b/metrics" in text
    assert abs(report["prefix_hit_rate"] - 0.55) < 1e-9


def test_one_busy_replica_is_not_compared_with_an_idle_one() -> None:
    idle = section("http://b/metrics", 0, 0.0, 0.0, 0.0, 0.0)
    idle["ttft_ms"] = {"mean": None, "p50": None, "p99": None}
    report = replicas_report([section("http://a/metrics", 5, 0.1, 100.0, 1.0, 0.2), idle], cumulative=False)
    assert report["bottleneck"] is None and "nothing to compare" in report["advice"][0]
