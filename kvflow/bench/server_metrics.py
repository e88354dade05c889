"""The server's own view of a run: `/metrics` scraped before and after, reported as deltas.

The one Prometheus reader of kvflow (bench, doctor and the tests scrape through it): `parse_metrics`
turns the text exposition format into samples keyed by name and labels, `scrape` fetches and parses.
It keeps every sample as written, whatever the server: names with colons (`kvflow:`, `vllm:`,
`sglang:`, `llamacpp:`), counters with their `_total`, histograms as `_bucket` (label `le`), `_sum`
and `_count` series, `NaN` and `+Inf` as floats. Which names mean what on each server is
kvflow/bench/metric_names.py; the run's deltas and quantiles over them are kvflow/bench/server_view.py.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping

import httpx
from prometheus_client.parser import text_string_to_metric_families

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
    try:
        return parse_metrics(response.text)
    except ValueError:  # something else answers at /metrics (a web UI's page): no metrics here
        return None


# vLLM's idiom, which kvflow follows: a constant-1 gauge whose labels are the engine's configuration.
ENGINE_INFO_METRICS = ("kvflow:cache_config_info", "vllm:cache_config_info")


def engine_config(snapshot: Snapshot) -> tuple[str, dict[str, str]] | None:
    """(the server kind, its configuration labels) from a scrape, when it exports them."""
    for name in ENGINE_INFO_METRICS:
        for labels in snapshot.get(name, {}):
            return name.split(":")[0], dict(labels)
    return None
