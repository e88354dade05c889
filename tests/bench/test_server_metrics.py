"""The one Prometheus reader (kvflow/bench/server_metrics.py) on hand-written exposition text: any
server's names, labels, histogram series and special values; and the run's deltas built on it."""

from __future__ import annotations

import math

from kvflow.bench.server_metrics import label_key, parse_metrics
from kvflow.bench.server_view import histogram_quantile, server_section

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
