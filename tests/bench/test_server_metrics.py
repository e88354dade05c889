"""The one Prometheus reader (kvflow/bench/server_metrics.py) on hand-written exposition text: any
server's names, labels, histogram series and special values; and the run's deltas built on it."""

from __future__ import annotations

import math

from kvflow.bench.gauges import GaugeSamples, gauge_lines
from kvflow.bench.server_metrics import label_key, parse_metrics
from kvflow.bench.server_view import histogram_quantile, server_section
from kvflow.server.metrics import EngineMetrics

# Names as llama.cpp and SGLang write them: the parser must not care whose they are.
FOREIGN = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 42
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{model_name="m",tp_rank="0"} NaN
# TYPE sglang:e2e_request_latency_seconds histogram
sglang:e2e_request_latency_seconds_bucket{le="0.5",model_name="m"} 3.0
sglang:e2e_request_latency_seconds_bucket{le="+Inf",model_name="m"} 5.0
sglang:e2e_request_latency_seconds_sum{model_name="m"} 4.5
sglang:e2e_request_latency_seconds_count{model_name="m"} 5.0
"""


def kvflow_text(ttft_buckets: dict[str, float], prompt_tokens: float) -> str:
    lines = [
        "# TYPE kvflow:prompt_tokens_total counter",
        f'kvflow:prompt_tokens_total{{model_name="m"}} {prompt_tokens}',
        "# TYPE kvflow:time_to_first_token_seconds histogram",
    ]
    lines += [
        f'kvflow:time_to_first_token_seconds_bucket{{le="{le}",model_name="m"}} {n}'
        for le, n in ttft_buckets.items()
    ]
    return "\n".join(lines) + "\n"


def test_parses_any_servers_names_labels_and_special_values() -> None:
    snapshot = parse_metrics(FOREIGN)
    assert snapshot["llamacpp:prompt_tokens_total"] == {(): 42}
    # model_name is left out of the labels; the others key the sample.
    [(labels, hit_rate)] = snapshot["sglang:cache_hit_rate"].items()
    assert labels == label_key({"tp_rank": "0"}) and math.isnan(hit_rate)
    buckets = snapshot["sglang:e2e_request_latency_seconds_bucket"]
    assert buckets == {(("le", "0.5"),): 3.0, (("le", "+Inf"),): 5.0}
    assert snapshot["sglang:e2e_request_latency_seconds_sum"] == {(): 4.5}
    assert snapshot["sglang:e2e_request_latency_seconds_count"] == {(): 5.0}


def test_label_key_is_order_free() -> None:
    assert label_key({"b": "2", "a": "1", "model_name": "m"}) == (("a", "1"), ("b", "2"))


def test_deltas_cover_only_the_run() -> None:
    before = parse_metrics(kvflow_text({"0.1": 10.0, "0.2": 10.0, "+Inf": 10.0}, 100.0))
    # The run: 4 first tokens between 0.1 and 0.2 s, 250 prompt tokens.
    after = parse_metrics(kvflow_text({"0.1": 10.0, "0.2": 14.0, "+Inf": 14.0}, 350.0))
    p50 = histogram_quantile(before, after, "kvflow:time_to_first_token_seconds", 0.5)
    assert p50 is not None and math.isclose(p50, 0.15)  # linear within the (0.1, 0.2] bucket
    section = server_section(before, after, client_ttft_mean_ms=None)
    assert section["metrics_prefix"] == "kvflow:" and section["prompt_tokens"] == 250.0
    assert "ttft" not in section["not_exported"] and "num_preemptions" in section["not_exported"]


def test_a_gauge_sample_parses_only_the_gauges_lines() -> None:
    """kvflow bench's sampler (kvflow/bench/gauges.py) filters the text to the gauges it samples
    before parsing (the parse of a whole kvflow /metrics stalled the streams' event loop): the
    samples are those of the whole text, from a fraction of its lines."""
    metrics = EngineMetrics("m", 256, {"max_num_seqs": "8"})
    metrics.num_running.labels("m").set(3)
    metrics.kv_usage.labels("m").set(0.25)
    sglang = "# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs 2\n"
    text = metrics.render().decode() + FOREIGN + sglang
    kept = gauge_lines(text)
    assert len(kept.splitlines()) < len(text.splitlines()) / 5
    whole, filtered = GaugeSamples(), GaugeSamples()
    whole.add(parse_metrics(text))
    filtered.add(parse_metrics(kept))
    assert filtered.values == whole.values
    assert filtered.summary("kvflow:num_requests_running") == {"mean": 3.0, "max": 3.0, "samples": 1.0}
    assert filtered.summary("kvflow:kv_cache_usage_perc") == {"mean": 0.25, "max": 0.25, "samples": 1.0}
