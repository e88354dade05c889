"""The server's own view of a run: `/metrics` scraped before and after, reported as deltas.

The one Prometheus reader of kvflow (bench, doctor and the tests scrape through it): `parse_metrics`
turns the text exposition format into samples keyed by name and labels, `scrape` fetches and parses.
It keeps every sample as written, whatever the server: names with colons (`kvflow:`, `vllm:`,
`sglang:`, `llamacpp:`), counters with their `_total`, histograms as `_bucket` (label `le`), `_sum`
and `_count` series, `NaN` and `+Inf` as floats. The deltas below read kvflow's names (`kvflow:`)
and vLLM's (`vllm:`), which kvflow mirrors; other servers simply yield an empty section. Histogram
quantiles are interpolated from bucket deltas as Prometheus' `histogram_quantile` does, so they cover
exactly the requests of the run.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

PREFIXES = ("kvflow:", "vllm:")
LabelKey = tuple[tuple[str, str], ...]  # a sample's labels, sorted by name
# metric name -> {labels without model_name -> value}
Snapshot = dict[str, dict[LabelKey, float]]


def label_key(labels: Mapping[str, str]) -> LabelKey:
    """How a sample's labels key a Snapshot: sorted (name, value) pairs, `model_name` left out."""
    # One server serves one model: the label only repeats its name, and leaving it out spares every
    # lookup from spelling the model.
    return tuple(sorted((k, v) for k, v in labels.items() if k != "model_name"))


def parse_metrics(text: str) -> Snapshot:
    """The Prometheus text exposition format -> {name: {label_key(labels): value}} (ValueError when
    the text is not in that format)."""
    snapshot: Snapshot = defaultdict(dict)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            snapshot[sample.name][label_key(sample.labels)] = sample.value
    return dict(snapshot)


def scrape(metrics_url: str, headers: dict[str, str] | None = None) -> Snapshot | None:
    """Fetch and parse `/metrics`; None when the server has none (not an error: not every server
    exports it)."""
    try:
        response = httpx.get(metrics_url, headers=headers, timeout=10)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    return parse_metrics(response.text)


def _find(snapshot: Snapshot, name: str) -> tuple[str, dict[LabelKey, float]] | None:
    for prefix in PREFIXES:
        if prefix + name in snapshot:
            return prefix, snapshot[prefix + name]
    return None


def _total(snapshot: Snapshot, name: str, **labels: str) -> float | None:
    found = _find(snapshot, name)
    if found is None:
        return None
    want = set(labels.items())
    return sum(v for key, v in found[1].items() if want <= set(key))


def _delta(before: Snapshot, after: Snapshot, name: str, **labels: str) -> float | None:
    a, b = _total(after, name, **labels), _total(before, name, **labels)
    return None if a is None else a - (b or 0.0)


def _buckets(snapshot: Snapshot, name: str) -> list[tuple[float, float]]:
    found = _find(snapshot, name + "_bucket")
    if found is None:
        return []
    merged: dict[float, float] = defaultdict(float)
    for key, value in found[1].items():
        le = dict(key).get("le")
        if le is not None:
            merged[float(le)] += value
    return sorted(merged.items())


def histogram_quantile(before: Snapshot, after: Snapshot, name: str, q: float) -> float | None:
    """Quantile q in [0, 1] of the observations made between the two snapshots (linear in a bucket)."""
    after_b, before_b = _buckets(after, name), dict(_buckets(before, name))
    deltas = [(le, count - before_b.get(le, 0.0)) for le, count in after_b]
    if not deltas or deltas[-1][1] <= 0:
        return None
    rank = q * deltas[-1][1]
    prev_le, prev_count = 0.0, 0.0
    for le, count in deltas:
        if count >= rank:
            if le == float("inf"):
                return prev_le
            return prev_le + (le - prev_le) * (rank - prev_count) / max(count - prev_count, 1e-12)
        prev_le, prev_count = le, count
    return prev_le


def _mean_ms(before: Snapshot, after: Snapshot, name: str) -> float | None:
    total, count = _delta(before, after, name + "_sum"), _delta(before, after, name + "_count")
    if total is None or not count:
        return None
    return 1e3 * total / count


def _step_times(before: Snapshot, after: Snapshot) -> dict[str, dict[str, float | None]]:
    """kvflow's engine step time by what the step computed (decode_only / mixed / prefill_only)."""
    result: dict[str, dict[str, float | None]] = {}
    for kind in ("decode_only", "mixed", "prefill_only"):
        count = _delta(before, after, "engine_step_time_seconds_count", step_kind=kind)
        total = _delta(before, after, "engine_step_time_seconds_sum", step_kind=kind)
        if count:
            result[kind] = {"count": count, "mean": 1e3 * (total or 0.0) / count}
    return result


def server_section(
    before: Snapshot | None, after: Snapshot | None, client_ttft_mean_ms: float | None
) -> dict[str, Any]:
    """The JSON result's `server` object (empty when the server exports no metrics)."""
    if before is None or after is None:
        return {}
    prefix = next((p for p in PREFIXES if any(k.startswith(p) for k in after)), None)
    if prefix is None:
        return {}
    queries = _delta(before, after, "prefix_cache_queries_total")
    hits = _delta(before, after, "prefix_cache_hits_total")
    ttft_mean = _mean_ms(before, after, "time_to_first_token_seconds")

    def quantile_ms(name: str, q: float) -> float | None:
        value = histogram_quantile(before, after, name, q)
        return None if value is None else value * 1e3

    return {
        "metrics_prefix": prefix,
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
        "prefix_cache_hit_rate": (hits / queries) if queries and hits is not None else None,
        "num_preemptions": _delta(before, after, "num_preemptions_total"),
        "prompt_tokens": _delta(before, after, "prompt_tokens_total"),
        "generation_tokens": _delta(before, after, "generation_tokens_total"),
        "requests_finished": _delta(before, after, "request_success_total"),
        "ttft_ms": {
            "mean": ttft_mean,
            "p50": quantile_ms("time_to_first_token_seconds", 0.5),
            "p99": quantile_ms("time_to_first_token_seconds", 0.99),
        },
        "itl_ms": {
            "mean": _mean_ms(before, after, "inter_token_latency_seconds"),
            "p50": quantile_ms("inter_token_latency_seconds", 0.5),
            "p99": quantile_ms("inter_token_latency_seconds", 0.99),
        },
        "queue_time_ms": {"mean": _mean_ms(before, after, "request_queue_time_seconds")},
        "step_time_ms": _step_times(before, after),
        "prefill_time_ms": {"mean": _mean_ms(before, after, "request_prefill_time_seconds")},
        "client_minus_server_ttft_ms": (
            client_ttft_mean_ms - ttft_mean
            if client_ttft_mean_ms is not None and ttft_mean is not None
            else None
        ),
    }
