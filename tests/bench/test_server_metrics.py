"""The one Prometheus reader (kvflow/bench/server_metrics.py) on hand-written exposition text: any
server's names, labels, histogram series and special values; and the run's deltas built on it."""

from __future__ import annotations

import math

from kvflow.bench.gauges import GaugeSamples, gauge_lines, records_gauges, window_gauges
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


def test_a_kvflow_windows_steps_give_the_gauges_a_scrape_would_read() -> None:
    """Each step records the running and waiting requests and the KV usage after it: at every grid
    time the gauges read the last step that ended by then, so a long step weighs as long as it ran
    (a 28 ms prefill is three samples, a 5 ms decode one)."""
    fields = ["t", "dur_ms", "prefill_tokens", "running", "waiting", "kv_usage"]
    steps = [
        [100.000, 5.0, 0, 1, 2, 0.25],  # ends at 100.005
        [100.005, 28.0, 64, 2, 1, 0.5],  # ends at 100.033
        [100.033, 14.0, 0, 1, 0, 0.4],  # ends at 100.047
    ]
    samples = window_gauges({"step_fields": fields, "steps": steps}, grid_s=0.01)
    assert samples is not None and samples.num_scrapes == 5  # 100.005, .015, .025, .035, .045 (the last
    # step still running at .045)
    assert samples.values["kvflow:num_requests_running"] == [1.0, 1.0, 1.0, 2.0, 2.0]
    assert samples.summary("kvflow:num_requests_waiting") == {"mean": 1.6, "max": 2.0, "samples": 5.0}
    assert samples.summary("kvflow:kv_cache_usage_perc")["max"] == 0.5  # type: ignore[index]
    assert window_gauges({"step_fields": fields[:3], "steps": [s[:3] for s in steps]}) is None
    assert records_gauges({"fields": {"step": fields}}) and not records_gauges({"fields": {"step": ["t"]}})
